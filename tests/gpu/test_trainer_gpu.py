"""FSDP2 over NCCL: the same training step on 2 GPUs matches 1 GPU (run on the device: `pytest -m gpu tests/gpu`).
fp32 compute must match as tightly as on CPU; bf16 compute within bf16 rounding of the loss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import _trainer_jobs as jobs  # noqa: E402

from molt_hydra.parallel.launch import run_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("param_dtype,loss_rel,weight_atol", [("fp32", 1e-5, 1e-5), ("bf16", 2e-2, None)])
def test_two_gpus_match_one(tmp_path, param_dtype, loss_rel, weight_atol):
    run_ranks(jobs.dp_step, 1, tmp_path / "r1.pt", param_dtype, timeout_s=300)
    run_ranks(jobs.dp_step, 2, tmp_path / "r2.pt", param_dtype, timeout_s=300)
    one, two = (torch.load(tmp_path / f, weights_only=False) for f in ("r1.pt", "r2.pt"))
    for k in ("policy_loss", "entropy_loss", "actor_grad_norm"):
        assert one["metrics"][k] == pytest.approx(two["metrics"][k], rel=loss_rel), k
    if weight_atol is not None:
        worst = max((one["model"][k] - two["model"][k]).abs().max().item() for k in one["model"])
        assert worst < weight_atol
    print(param_dtype, {k: (one["metrics"][k], two["metrics"][k]) for k in ("policy_loss", "actor_grad_norm")})
