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
