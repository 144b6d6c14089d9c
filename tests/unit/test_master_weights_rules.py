"""Validation of `model.master_weights` (config/validate.py): `optimizer` is refused where it cannot act (fp32
compute, host offload) with key, reason and fix, and passes with bf16 compute on a GPU cluster and on CPU; `auto`
(the default) resolves to optimizer on one GPU trainer rank and to fsdp elsewhere or where a rule refuses it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402
from test_validation import assert_fires, config_errors  # noqa: E402

from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.runtime.validate import validate  # noqa: E402

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


# one GPU for the trainer (the engines on the others); bf16 compute: what auto needs for optimizer masters
ONE_GPU_RANK = ["cluster=local_gpus", "parallelism.trainer_devices=1", "model.param_dtype=bfloat16", "model.backend=hf"]


def resolved(overrides: list[str]) -> str:
    return validate(to_run_config(compose_config(overrides))).model.master_weights.value


@pytest.mark.parametrize("overrides,want", [
    ([], "fsdp"),  # the CPU default: nothing to save on a host without a cast-and-copy per micro-batch
    (ONE_GPU_RANK, "optimizer"),
    ([*ONE_GPU_RANK, "parallelism.trainer_devices=2"], "fsdp"),  # several ranks: not measured faster
    ([*ONE_GPU_RANK, "model.param_dtype=float32"], "fsdp"),  # no lower-precision copy to keep masters for
    ([*ONE_GPU_RANK, "train.optimizer.name=muon"], "fsdp"),  # Muon steps the params themselves
    ([*ONE_GPU_RANK, "algorithm=ppo_gae", "train.critic.optimizer.name=muon"], "fsdp"),  # the critic's block too
    ([*ONE_GPU_RANK, "model.lora.rank=8"], "fsdp"),  # optimizer masters are not wired to a frozen base
    ([*ONE_GPU_RANK, "model.master_weights=fsdp"], "fsdp"),  # an explicit choice stays
], ids=["cpu", "one_gpu_rank", "two_ranks", "fp32", "muon", "critic_muon", "lora", "explicit_fsdp"])
def test_auto_master_weights_resolves(overrides, want):
    assert resolved([*overrides, "model.master_weights=auto"] if "model.master_weights=fsdp" not in overrides
                    else overrides) == want


def test_auto_is_the_default():
    assert compose_config([]).model.master_weights == "auto"
