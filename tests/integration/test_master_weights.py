"""model.master_weights=optimizer on CPU (gloo; FSDP2 on 2 ranks, no FSDP2 on one): the params are bf16, the
optimizer keeps fp32 masters and moments (parallel/optim.py MasterWeightAdamW). Given the grads the step received,
the master update is torch AdamW's fp32 update (and the AdamW formula), the bf16 params are the masters rounded after
every step, clipping folds in as torch's clip would scale, and a checkpoint resume continues bit-exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _master_weight_jobs as jobs  # noqa: E402

from molt_hydra.parallel.launch import run_ranks  # noqa: E402

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank_no_fsdp", "2ranks_fsdp"])
def steps(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("mw") / "steps.pt"
    run_ranks(jobs.update_steps, request.param, out, timeout_s=240)
    return torch.load(out, weights_only=False)


def adamw_formula(p, g, m, v, t, lr):
    """Loshchilov & Hutter's AdamW, float64, bias-corrected, decoupled decay."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    m = BETAS[0] * m + (1 - BETAS[0]) * g
    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    m_hat, v_hat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
    return p * (1 - lr * WD) - lr * m_hat / (v_hat.sqrt() + EPS), m, v


def test_params_are_bf16_with_fp32_state(steps):
    assert set(steps["dtypes"].values()) == {torch.bfloat16}
    after = steps["records"][0]["after"]
    for k in ("master", "exp_avg", "exp_avg_sq"):
        assert {t.dtype for t in after[k].values()} == {torch.float32}, k


def test_unclipped_update_is_torch_adamw_fp32(steps):
    rec = steps["records"][0]
    before, after = rec["before"], rec["after"]
    assert rec["lr"] > 0 and all(int(s) == 1 for s in after["step"].values())
    for name, g in rec["grads"].items():
        assert g.dtype == torch.float32  # several micro-batches: the fp32 sum of their bf16 grads
        ref_p = torch.nn.Parameter(before["master"][name].clone())
        ref = torch.optim.AdamW([ref_p], lr=rec["lr"], betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
        ref_p.grad = g.float()
        ref.step()
        assert torch.equal(after["master"][name], ref_p.detach()), name
        assert torch.equal(after["exp_avg"][name], ref.state[ref_p]["exp_avg"]), name
        assert torch.equal(after["exp_avg_sq"][name], ref.state[ref_p]["exp_avg_sq"]), name
        want, _, _ = adamw_formula(before["master"][name], g.float(), before["exp_avg"][name],
                                   before["exp_avg_sq"][name], 1, rec["lr"])
        torch.testing.assert_close(after["master"][name].double(), want, rtol=1e-6, atol=1e-9)
        assert not torch.equal(after["master"][name], before["master"][name]), name


def test_params_are_masters_rounded_after_each_step(steps):
    for rec in steps["records"]:
        for name, master in rec["after"]["master"].items():
            assert torch.equal(rec["after"]["params"][name], master.to(torch.bfloat16)), name


def test_clipped_update_scales_grads_like_torch_clip(steps):
    rec = steps["records"][1]
    grads = {n: g.double() for n, g in rec["grads"].items()}
    norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    assert steps["metrics"][1]["actor_grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    coef = min(1.0, 0.05 / (float(norm) + 1e-6))
    assert coef < 0.5  # the test exercises clipping
    before, after = rec["before"], rec["after"]
    for name, g in grads.items():
        want, m, v = adamw_formula(before["master"][name], g * coef, before["exp_avg"][name],
                                   before["exp_avg_sq"][name], 2, rec["lr"])
        torch.testing.assert_close(after["master"][name].double(), want, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(after["exp_avg"][name].double(), m, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_continues_bit_exactly(tmp_path, world):
    run_ranks(jobs.resume_run, world, str(tmp_path), tmp_path / "a.pt", False, timeout_s=240)
    run_ranks(jobs.resume_run, world, str(tmp_path), tmp_path / "b.pt", True, timeout_s=240)
    a, b = (torch.load(tmp_path / f, weights_only=False) for f in ("a.pt", "b.pt"))
    for k in ("params", "master", "exp_avg", "exp_avg_sq", "step"):
        for name, t in a["state"][k].items():
            assert t.dtype == b["state"][k][name].dtype and torch.equal(t, b["state"][k][name]), (k, name)
    assert {t.dtype for t in b["state"]["master"].values()} == {torch.float32}
    assert a["metrics"]["policy_loss"] == b["metrics"]["policy_loss"]


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank_no_fsdp", "2ranks_fsdp"])
def accumulation(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("acc") / "acc.pt"
    run_ranks(jobs.accumulation_step, request.param, out, timeout_s=240)
    return torch.load(out, weights_only=False), request.param


def test_grads_accumulate_in_fp32_over_micro_batches(accumulation):
    """The step consumes sum_i g_i taken in fp32 (g_i: micro-batch i's bf16 grad, left to right as the hooks add),
    not the bf16 running sum autograd would keep."""
    rec, world = accumulation
    bf16_worse = 0
    for name, grads in rec["per_micro"].items():
        # 8 samples of 9-19 tokens in 40-token micro-batches: >= 3 on one rank, >= 2 per rank on two
        assert len(grads) >= (3 if world == 1 else 2), (name, len(grads))
        assert {g.dtype for g in grads} == {torch.bfloat16}, name
        fp32_sum, bf16_sum = grads[0].float(), grads[0].clone()
        for g in grads[1:]:
            fp32_sum, bf16_sum = fp32_sum + g.float(), bf16_sum + g
        consumed = rec["consumed"][name]
        assert consumed.dtype == torch.float32 and torch.equal(consumed, fp32_sum), name
        exact = sum(g.double() for g in grads)
        err32, err16 = ((t.double() - exact).abs().max() for t in (consumed, bf16_sum))
        assert err32 <= 1e-6 * exact.abs().max() + 1e-30, name
        bf16_worse += bool(err16 > err32)
    # the bf16 accumulation loses bits on (nearly) every tensor; fp32 keeps them
    assert bf16_worse >= 0.5 * len(rec["per_micro"]), (bf16_worse, len(rec["per_micro"]))


@pytest.mark.parametrize("param_dtype,want", [(None, torch.float32), ("bf16", torch.bfloat16)],
                         ids=["default_fp32", "bf16_honoured"])
def test_cpu_trainer_computes_in_the_requested_dtype(tmp_path, param_dtype, want):
    """model.param_dtype is honoured on CPU (FSDP2 casts to it); only the API default is fp32 there."""
    run_ranks(jobs.compute_dtype, 1, tmp_path / "d.pt", param_dtype, timeout_s=240)
    seen = torch.load(tmp_path / "d.pt", weights_only=False)
    assert seen and set(seen) == {want}
