"""Validation of `model.master_weights` (config/validate.py): `optimizer` is refused where it cannot act (fp32
compute, host offload) with key, reason and fix, and passes with bf16 compute on a GPU cluster and on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from test_validation import assert_fires, config_errors  # noqa: E402

GPU_MW = ["cluster.device=cuda", "model.backend=hf", "model.param_dtype=bfloat16", "model.master_weights=optimizer"]


@pytest.mark.parametrize("overrides,fragment", [
    (["model.master_weights=optimizer"], "model.param_dtype=float32 leaves no lower-precision copy"),
    ([*GPU_MW, "model.param_dtype=float32"], "leaves no lower-precision copy"),
    ([*GPU_MW, "parallelism.offload=full", "parallelism.trainer_devices=2"], "parallelism.offload=full moves"),
], ids=["cpu_tiny_fp32", "fp32_compute", "offload"])
def test_master_weights_rule_fires(overrides, fragment):
    assert_fires(overrides, "model.master_weights", fragment)


def test_master_weights_optimizer_passes_on_gpu_bf16():
    lines = config_errors(GPU_MW)
    assert not [line for line in lines if "model.master_weights" in line], lines


def test_master_weights_optimizer_passes_on_cpu_bf16():
    lines = config_errors(["model.param_dtype=bfloat16", "model.master_weights=optimizer"])
    assert not [line for line in lines if "model.master_weights" in line], lines


def test_master_weights_optimizer_with_the_optimizer_offloaded_passes_on_gpu():
    """Molt's `--fsdp.offload optimizer`: bf16 params on the GPU, their fp32 masters and AdamW moments on the host."""
    lines = config_errors([*GPU_MW, "parallelism.offload=optimizer"])
    assert not [line for line in lines if "model.master_weights" in line or "parallelism.offload" in line], lines
