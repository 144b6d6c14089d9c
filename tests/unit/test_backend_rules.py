"""Validation of `model.backend` and the knobs NeMo AutoModel owns: every combination the chosen backend cannot run is
refused with key, reason and fix before anything starts (config/validate.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from test_validation import assert_fires, config_errors  # noqa: E402

GPU_AM = ["cluster.device=cuda", "model.backend=automodel"]


@pytest.mark.parametrize("overrides,key,fragment", [
    (["model.backend=automodel"], "model.backend", "builds its models on CUDA devices only"),
    (["model.backend=hf", "model.rms_norm=te"], "model.rms_norm", "selects a NeMo AutoModel module"),
    (["model.experts_backend=te"], "model.experts_backend", "trains on the HF backend"),  # CPU: HF path
    (["model.linear_backend=te"], "model.linear_backend", "trains on the HF backend"),
    (["model.moe_dispatcher=deepep"], "model.moe_dispatcher", "trains on the HF backend"),
    ([*GPU_AM, "parallelism.packing=true", "model.attn_implementation=te"], "parallelism.packing",
     "right-padded rows"),
    ([*GPU_AM, "model.aux_loss_coef=0.01"], "model.aux_loss_coef", "load-balancing loss"),
    ([*GPU_AM, "model.attn_implementation=flash_attention_2"], "model.attn_implementation",
     "not a value the automodel trainer backend accepts"),
    ([*GPU_AM, "model.moe_dispatcher=alltoall"], "model.moe_dispatcher", "AutoModel's dispatchers"),
    ([*GPU_AM, "model.experts_backend=gmm"], "model.experts_backend", "AutoModel's expert GEMMs"),
    ([*GPU_AM, "model.rms_norm=quack"], "model.rms_norm", "AutoModel's RMSNorm backends"),
    ([*GPU_AM, "model.moe_experts_impl=loop"], "model.moe_experts_impl", "AutoModel's are model.experts_backend's"),
    (["model.moe_experts_impl=grouped", "model.param_dtype=bfloat16"], "model.moe_experts_impl",
     "on cpu run torch's grouped GEMM in float32"),
    (["cluster.device=cuda", "model.backend=hf", "model.moe_experts_impl=grouped", "model.param_dtype=float32"],
     "model.moe_experts_impl", "on cuda run torch's grouped GEMM in bfloat16"),
    # the critic is built with HF transformers on an AutoModel run too
    ([*GPU_AM, "algorithm.estimator=gae", "model.gradient_checkpointing=selective"], "model.gradient_checkpointing",
     "critic of estimator gae is built with HF transformers"),
    ([*GPU_AM, "algorithm.estimator=gae", "parallelism.tp=2"], "parallelism.tp", "shards with FSDP only"),
    # nemo-automodel 0.7 raises building a tied MoE (seen on the device, after the engine had started)
    ([*GPU_AM, "model=qwen3_moe_tiny", "model.aux_loss_coef=0"], "model.path", "tied input and output embeddings"),
], ids=["automodel_needs_gpu", "hf_rms_norm", "cpu_experts", "cpu_linear", "cpu_dispatcher", "am_packing",
        "am_aux_loss", "am_attn", "am_dispatcher", "am_experts", "am_rms_norm", "am_hf_experts_impl",
        "cpu_grouped_bf16", "gpu_grouped_fp32", "am_critic_selective", "am_critic_tp", "am_moe_tied"])
def test_backend_rule_fires(overrides, key, fragment):
    assert_fires(overrides, key, fragment)


def test_automodel_knobs_pass_on_the_automodel_path():
    """The MoE knobs on an MoE model (a dense one refuses them: tests/config/test_handoff_rules.py)."""
    lines = config_errors([*GPU_AM, "model=qwen3_moe_tiny", "model.path=tiny://qwen3_moe_30b_a3b_2l",
                           "model.moe_dispatcher=torch",
                           "model.experts_backend=torch_mm", "model.rms_norm=te",
                           "model.gradient_checkpointing=selective", "parallelism.ep=1"])
    assert not [l for l in lines if l.startswith(("model.", "parallelism.packing", "parallelism.ep"))], lines


def test_grouped_experts_pass_where_their_kernel_runs():
    for overrides in (["model=qwen3_moe_tiny", "model.moe_experts_impl=grouped", "model.param_dtype=float32"],
                      ["model=qwen3_moe_tiny", "cluster.device=cuda", "model.backend=hf",
                       "model.moe_experts_impl=grouped", "model.param_dtype=bfloat16"]):
        lines = config_errors(overrides)
        assert not [line for line in lines if "moe_experts_impl" in line], lines


@pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is not None, reason="auto resolves to automodel here")
def test_auto_without_automodel_is_the_hf_backend_even_on_gpu():
    # backend=auto resolves as the trainer will: no nemo_automodel -> HF, whose FSDP-only sharding refuses tp
    assert_fires(["cluster.device=cuda", "parallelism.tp=2"], "parallelism.tp", "needs NeMo AutoModel's meshes")
    assert_fires(["cluster.device=cuda", "model.gradient_checkpointing=selective"], "model.gradient_checkpointing",
                 "selective (per-op) checkpointing needs NeMo AutoModel")
