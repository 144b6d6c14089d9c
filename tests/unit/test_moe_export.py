"""The HF export of a Qwen3-MoE (parallel/checkpoint.py export_hf, the real transformers, PEFT and safetensors on the
tiny Qwen3-MoE, one process). Its experts are written one tensor per expert under the checkpoint's names
(models/moe_routing.py `checkpoint_expert_tensors`), which every vLLM loads (vLLM 0.24's Qwen3-MoE loader skips
transformers 5's fused names without a word, leaving its experts unloaded), and the export loads in transformers and
computes as the model exported.
Before: exported in the dtype the weights are held in (float32: model=qwen3_moe_tiny's, so +recipe=tiny_moe_cpu; bf16
under model.master_weights=optimizer), the per-expert views of the fused tensors reached safetensors, which refused them
('None is covering the entire storage'): the final export failed after the run had trained. And a LoRA run's merged
export (checkpoint.export_merged, the attention adapted) kept the fused names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from molt_hydra.models import lora
from molt_hydra.models.build import resolve_path
from molt_hydra.models.moe_routing import checkpoint_expert_tensors
from molt_hydra.parallel.checkpoint import export_hf

SPEC = dict(rank=4, alpha=8.0, dropout=0.0, init="default", target_modules=list(lora.ATTENTION))
IDS = torch.arange(3, 40).unsqueeze(0)


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_path("tiny://qwen3_moe_tiny"), dtype=torch.float32)


def _names(d) -> list[str]:
    from safetensors import safe_open

    index = d / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    return sorted(k for f in files for k in safe_open(str(d / f), "pt").keys())


def _checkpoint_names() -> list[str]:
    """The names of the tiny Qwen3-MoE's own checkpoint (models/tiny.py writes it as transformers saves it)."""
    return _names(Path(resolve_path("tiny://qwen3_moe_tiny")))


def _logits_of(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)(IDS).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_moe_exports_per_expert_tensors_in_the_dtype_it_is_held_in(tmp_path, dtype):
    from safetensors.torch import load_file

    model = _model().to(dtype)
    export_hf(tmp_path, model, dtype=dtype, to_hf=checkpoint_expert_tensors)
    assert _names(tmp_path) == _checkpoint_names()
    written = load_file(tmp_path / "model.safetensors")
    fused = model.state_dict()["model.layers.1.mlp.experts.down_proj"]
    assert written["model.layers.1.mlp.experts.6.down_proj.weight"].dtype == dtype
    assert torch.equal(written["model.layers.1.mlp.experts.6.down_proj.weight"], fused[6])
    if dtype == torch.float32:  # (bf16: the rotary buffers of the cast model differ from a reload's)
        with torch.no_grad():
            assert torch.equal(_logits_of(tmp_path), model(IDS).logits)


def test_a_merged_lora_export_of_an_moe_has_per_expert_tensors_and_computes_as_the_adapted_model(tmp_path):
    torch.manual_seed(0)
    model = lora.add_adapter(_model(), SPEC)
    with torch.no_grad():  # a trained adapter: B != 0, so the merge changes the attention weights
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    export_hf(tmp_path, model, dtype=torch.float32, to_hf=checkpoint_expert_tensors, adapter=SPEC, merged=True)
    assert _names(tmp_path / "merged") == _checkpoint_names()
    with torch.no_grad():
        want = model(IDS).logits
    assert (_logits_of(tmp_path / "merged") - want).abs().max().item() < 1e-4
