"""The dry-run plan's trainer memory follows `model.master_weights` (runtime/plan.py): fsdp keeps fp32 params and
grads; optimizer keeps param_dtype params, fp32 masters in AdamW, and grads in param_dtype for one micro-batch per
optimizer step or fp32 sums for several (parallel/optim.py). Bytes per parameter from those definitions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.runtime.validate import validate  # noqa: E402
from molt_hydra.runtime.plan import make_plan, model_shape  # noqa: E402

GIB = 1 << 30
GPU = ["cluster=local_gpus", "parallelism.trainer_devices=2", "model.backend=hf", "model.param_dtype=bfloat16",
       "train.dynamic_batch=false", "train.batch_size=32", "train.micro_batch_size=4"]


def actor_memory(overrides):
    cfg = validate(OmegaConf.to_object(compose_config([*GPU, *overrides])))
    return make_plan(cfg).memory["actor"], model_shape(cfg.model.path).params, cfg


@pytest.mark.parametrize("mode,micro,want", [
    # bytes per parameter of: weights, grads, fp32 masters (AdamW moments: 8 in every mode)
    ("fsdp", 4, {"weights fp32": 4, "grads fp32": 4}),
    ("optimizer", 4, {"weights bfloat16": 2, "grads fp32 (accumulated)": 4, "fp32 master weights": 4}),
    ("optimizer", 16, {"weights bfloat16": 2, "grads bfloat16": 2, "fp32 master weights": 4}),
], ids=["fsdp", "optimizer_accumulating", "optimizer_one_micro_batch"])
def test_trainer_state_bytes_per_param(mode, micro, want):
    # 32 samples over dp=2 ranks: micro_batch_size 4 -> 4 micro-batches per optimizer step, 16 -> 1
    mem, params, cfg = actor_memory([f"model.master_weights={mode}", f"train.micro_batch_size={micro}"])
    shard = cfg.parallelism.trainer_devices
    for key, nbytes in {**want, "adamw moments": 8}.items():
        assert mem[key] == pytest.approx(nbytes * params / shard / GIB), key
    states = {k for k in mem if k.startswith(("weights", "grads", "fp32 master"))}
    assert states == set(want)


@pytest.mark.parametrize("devices,mode,want", [
    (1, "fsdp", "model"),  # one rank keeps every unsharded bf16 param from forward to backward
    (1, "optimizer", None),  # no FSDP2 at all: the bf16 params are the model's own
    (2, "fsdp", "layer"),  # resharded after forward: one decoder block's bf16 params at a time
    (2, "optimizer", "layer"),
], ids=["one_rank_fsdp", "one_rank_optimizer", "two_ranks_fsdp", "two_ranks_optimizer"])
def test_gathered_params_follow_how_the_rank_wraps_the_model(devices, mode, want):
    mem, params, cfg = actor_memory([f"parallelism.trainer_devices={devices}", f"model.master_weights={mode}"])
    shape = model_shape(cfg.model.path)
    if devices == 1:
        expected = 0.0 if want is None else 2 * params / GIB
        assert mem["gathered model"] == pytest.approx(expected) and "gathered layer" not in mem
    else:
        expected = 2 * (params - shape.vocab * shape.hidden) / shape.layers / GIB
        assert mem["gathered layer"] == pytest.approx(expected) and "gathered model" not in mem
