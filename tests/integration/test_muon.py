"""train.optimizer.name=muon (parallel/muon.py) on CPU: FSDP2 over gloo on 2 ranks. Given the grads a step received,
each 2-D weight moves as torch.optim.Muon moves the whole matrix (so the sharded momentum + gather/orthogonalise/keep
own shard is exact), which is not AdamW's move; norms and embeddings move as AdamW's first step (+-lr); grouped MoE
experts go to Muon, or to AdamW under muon_experts_adamw; a checkpoint resume continues bit-exactly."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _muon_jobs as jobs  # noqa: E402

from molt_hydra.parallel.launch import run_ranks  # noqa: E402
from molt_hydra.parallel.muon import orthogonalised  # noqa: E402

pytestmark = pytest.mark.timeout(400)
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("muon")
    run_ranks(jobs.muon_run, 2, str(d), d / "straight.pt", False, timeout_s=240)
    run_ranks(jobs.muon_run, 2, str(d), d / "resumed.pt", True, timeout_s=240)
    return torch.load(d / "straight.pt", weights_only=False), torch.load(d / "resumed.pt", weights_only=False)


def _group_of(rec, name):
    return next(g for g in rec["groups"] if name in g["names"])


def test_orthogonalised_has_unit_singular_values():
    """Newton-Schulz makes a well-conditioned matrix's singular values ~1 (torch's quintic: within [0.5, 1.5]),
    scaled by sqrt(max(1, rows / cols)); the input's spread is ~6x."""
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(orthogonalised(g))
    assert s.min() > 0.5 and s.max() < 1.5
    tall = torch.linalg.svdvals(orthogonalised(g.T.contiguous()))  # 128 x 64: scaled by sqrt(2)
    assert tall.min() > 0.5 * math.sqrt(2) and tall.max() < 1.5 * math.sqrt(2)
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 4


def test_sharded_matrix_update_is_torch_muon_on_the_whole_matrix(runs):
    rec = runs[0]["records"][0]
    for name in (Q, K):  # square and 64 x 128 (two shards of 32 rows)
        group = _group_of(rec, name)
        assert group["muon"] and group["lr"] == 0.02 and group["weight_decay"] == 0.1
        ref_p = torch.nn.Parameter(rec["before"]["params"][name].clone())
        ref = torch.optim.Muon([ref_p], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
        ref_p.grad = rec["grads"][name]
        ref.step()
        after = rec["after"]["params"][name]
        torch.testing.assert_close(after, ref_p.detach(), rtol=0, atol=1e-7)
        torch.testing.assert_close(rec["after"]["state"][name]["momentum_buffer"],
                                   ref.state[ref_p]["momentum_buffer"], rtol=0, atol=0)
        # not AdamW: its first step moves every element by ~lr; Muon's move is orthogonal-shaped
        adam_p = torch.nn.Parameter(rec["before"]["params"][name].clone())
        adam = torch.optim.AdamW([adam_p], lr=0.02, weight_decay=0.1, betas=(0.9, 0.95))
        adam_p.grad = rec["grads"][name]
        adam.step()
        assert (after - adam_p.detach()).abs().max() > 1e-3


def test_norms_and_embeddings_step_with_adamw(runs):
    """AdamW's first bias-corrected step moves each element with a nonzero grad by lr (the moments' ratio is ~1)."""
    rec = runs[0]["records"][0]
    for name, wd in (("model.layers.0.input_layernorm.weight", 0.1), ("model.embed_tokens.weight", 0.0)):
        group = _group_of(rec, name)
        assert not group["muon"] and group["lr"] == 1e-3 and group["weight_decay"] == wd
        before, after, g = (rec[k]["params"][name] if k != "grads" else rec[k][name]
                            for k in ("before", "after", "grads"))
        step = before * (1 - 1e-3 * wd) - after
        live = g.abs() > 1e-4  # |g| >> eps: |m / (sqrt(v) + eps)| = 1
        torch.testing.assert_close(step[live], 1e-3 * g[live].sign(), rtol=1e-3, atol=0)


def test_resume_continues_bit_exactly(runs):
    straight, resumed = runs
    assert straight["metrics"]["policy_loss"] == resumed["metrics"]["policy_loss"]
    for name, p in straight["state"]["params"].items():
        assert torch.equal(p, resumed["state"]["params"][name]), name
    for name, st in straight["state"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, resumed["state"]["state"][name][k]), (name, k)


def test_experts_on_muon_or_adamw(tmp_path):
    run_ranks(jobs.moe_experts, 1, tmp_path / "moe.pt", timeout_s=240)
    res = torch.load(tmp_path / "moe.pt", weights_only=False)
    name = "model.layers.0.mlp.experts.down_proj"
    for experts_adamw, rec in res.items():
        group = _group_of(rec, name)
        assert group["muon"] is (not experts_adamw)
        before, after, g = rec["before"]["params"][name], rec["after"]["params"][name], rec["grads"][name]
        used = [e for e in range(g.shape[0]) if g[e].abs().max() > 1e-6]
        assert used
        for e in used:
            if experts_adamw:  # AdamW's first step: +-lr (1e-3) on every element with a grad
                live = g[e].abs() > 1e-4
                torch.testing.assert_close((before[e] * (1 - 1e-4) - after[e])[live], 1e-3 * g[e][live].sign(),
                                           rtol=1e-3, atol=0)
            else:  # each expert's own matrix through torch Muon (first step: momentum (1 - mu) g, Nesterov blend)
                blend = g[e].lerp(torch.zeros_like(g[e]).lerp_(g[e], 1 - 0.95), 0.95)
                want = before[e] * (1 - 0.02 * 0.1) - 0.02 * orthogonalised(blend)
                torch.testing.assert_close(after[e], want, rtol=0, atol=1e-6)


def test_bench_muon_cost_runs_on_cpu(tmp_path):
    """bench/muon_cost.py's CPU smoke shape: one row, its ratios from its own times, Muon over exactly the tiny
    model's 2-D decoder weights (2 layers x q 128x128, k and v 64x128, o 128x128, gate and up 256x128, down 128x256;
    the tied embedding stays on AdamW)."""
    import json
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "muon.json"
    subprocess.run([sys.executable, "bench/muon_cost.py", "--device", "cpu", "--shape", "tiny", "--seq", "64",
                    "--mbs", "2", "--steps", "1", "--opt-steps", "1", "--out", str(out)], check=True, cwd=repo,
                   env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, timeout=300)
    row = json.loads(out.read_text())
    assert row["optimizer_step_ratio"] == row["muon_optimizer_step_s"] / row["adamw_optimizer_step_s"]
    assert row["train_step_ratio"] == row["muon_train_step_s"] / row["adamw_train_step_s"]
    per_layer = 128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 256 * 128
    assert row["muon_params_b"] * 1e9 == pytest.approx(2 * per_layer)
