"""model.lora.target_modules in the trainer (models/lora.py `add_adapter`, the real PEFT on the tiny Qwen3): a name that
matches no module of the model is refused, naming it and the model's linear modules. The config checks the names of
the families it knows (models/rules.py); for any other family this is the only check. Before: PEFT skipped such a
name where another matched, and the adapter trained the others alone, without a word."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.models import lora
from molt_hydra.models.build import resolve_path

LINEARS = ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]


def _adapt(targets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_path("tiny://qwen3_tiny"), dtype=torch.float32)
    return lora.add_adapter(model, dict(rank=4, alpha=8.0, dropout=0.0, init="default", target_modules=targets))


@pytest.mark.parametrize("targets,unmatched", [(["q_proj", "v_prj"], ["v_prj"]), (["nope"], ["nope"])])
def test_a_target_matching_no_module_is_refused_naming_it_and_the_models_linears(targets, unmatched):
    with pytest.raises(ValueError) as e:
        _adapt(targets)
    assert str(e.value) == (f"model.lora.target_modules={targets}: {unmatched} match no module of Qwen3ForCausalLM; "
                            f"this model's linear modules are {LINEARS}. Fix: set model.lora.target_modules to names "
                            "from those")


def test_names_as_peft_matches_them_adapt_those_modules():
    """A last name part, or several (PEFT's suffix match): each adapts what it names, in every layer."""
    model = _adapt(["q_proj", "mlp.down_proj"])
    adapted = sorted({n.split(".lora_")[0].split("layers.")[1] for n, p in model.named_parameters() if p.requires_grad})
    layers = model.config.num_hidden_layers
    assert adapted == sorted(f"{i}.{m}" for i in range(layers) for m in ("self_attn.q_proj", "mlp.down_proj"))


def test_a_target_naming_a_non_linear_module_is_refused():
    """PEFT wraps an Embedding too (lora_embedding_A / _B, other names and layout than a Linear's lora_A / lora_B).
    Before: its adapter stayed frozen (trained nothing), and the export's merge failed at the run's end
    (KeyError '...embed_tokens.lora_A.default.weight'); the config checks names only for the families it knows."""
    with pytest.raises(ValueError) as e:
        _adapt(["embed_tokens", "q_proj"])
    assert str(e.value) == ("model.lora.target_modules=['embed_tokens', 'q_proj']: ['embed_tokens'] name ['Embedding'] "
                            "modules; an adapter is trained, synced and merged here for linear ones (nn.Linear) "
                            f"alone; this model's linear modules are {LINEARS}. Fix: set model.lora.target_modules "
                            "to names from those")


def test_every_module_the_trainer_adapts_is_wrapped_by_the_engines_lora_filter():
    """vLLM wraps a module for LoRA where its last name part (or whole name) is a target, or a packed module
    (qkv_proj, gate_up_proj) one of whose parts is; PEFT matches any suffix of parts. Before: the engines took the
    trainer's targets as they are, so `self_attn.q_proj` / `mlp.down_proj` (which the trainer adapts, and a family the
    config has no names for lets through) wrapped nothing there: the engines served the base where the trainer's
    policy had an adapter. vLLM's own filter and Qwen3's packing decide here."""
    from vllm.lora.utils import is_in_target_modules
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    packed = Qwen3ForCausalLM.packed_modules_mapping
    parent = {child: name for name, children in packed.items() for child in children}
    targets = ["self_attn.q_proj", "mlp.down_proj", "lm_head"]
    model = _adapt(targets)
    adapted = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    served = {n.rsplit(".", 1)[0] + "." + parent.get(n.rsplit(".", 1)[-1], n.rsplit(".", 1)[-1]) if "." in n else n
              for n in adapted}  # vLLM's names of those modules
    assert len(served) == 2 * model.config.num_hidden_layers + 1
    assert [n for n in served if not is_in_target_modules(n, targets, packed)] != []  # (the trainer's names as is)
    assert [n for n in served if not is_in_target_modules(n, lora.engine_targets(targets), packed)] == []
