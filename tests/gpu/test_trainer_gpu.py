"""FSDP2 over NCCL: the same training step on 2 GPUs matches 1 GPU (run on the device: `pytest -m gpu tests/gpu`).
fp32 compute must match as tightly as on CPU; bf16 compute within bf16 rounding of the loss, with the fp32 masters in
FSDP2 (master_weights=fsdp) or in the optimizer (optimizer). The CPU master-weight checks (update == torch AdamW's
fp32 update, params == rounded masters, clipping, bit-exact resume) rerun on 2 GPUs with CUDA's fused kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import _master_weight_jobs as mw_jobs  # noqa: E402
import _trainer_jobs as jobs  # noqa: E402
import test_master_weights as mw_checks  # noqa: E402

from molt_hydra.parallel.launch import run_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("param_dtype,master_weights,loss_rel,weight_atol",
                         [("fp32", "fsdp", 1e-5, 1e-5), ("bf16", "fsdp", 2e-2, None),
                          ("bf16", "optimizer", 2e-2, None)])
def test_two_gpus_match_one(tmp_path, param_dtype, master_weights, loss_rel, weight_atol):
    run_ranks(jobs.dp_step, 1, tmp_path / "r1.pt", param_dtype, master_weights, timeout_s=300)
    run_ranks(jobs.dp_step, 2, tmp_path / "r2.pt", param_dtype, master_weights, timeout_s=300)
    one, two = (torch.load(tmp_path / f, weights_only=False) for f in ("r1.pt", "r2.pt"))
    for k in ("policy_loss", "entropy_loss", "actor_grad_norm"):
        assert one["metrics"][k] == pytest.approx(two["metrics"][k], rel=loss_rel), k
    if weight_atol is not None:
        worst = max((one["model"][k] - two["model"][k]).abs().max().item() for k in one["model"])
        assert worst < weight_atol
    print(param_dtype, master_weights, {k: (one["metrics"][k], two["metrics"][k])
                                        for k in ("policy_loss", "actor_grad_norm")})


def test_master_weights_update_on_two_gpus(tmp_path):
    run_ranks(mw_jobs.update_steps, 2, tmp_path / "steps.pt", timeout_s=300)
    steps = torch.load(tmp_path / "steps.pt", weights_only=False)
    assert next(iter(steps["records"][0]["grads"].values())).is_cuda
    mw_checks.test_params_are_bf16_with_fp32_state(steps)
    mw_checks.test_unclipped_update_is_torch_adamw_fp32(steps)
    mw_checks.test_params_are_masters_rounded_after_each_step(steps)
    mw_checks.test_clipped_update_scales_grads_like_torch_clip(steps)


def test_master_weights_resume_on_two_gpus(tmp_path):
    mw_checks.test_resume_continues_bit_exactly(tmp_path, 2)
