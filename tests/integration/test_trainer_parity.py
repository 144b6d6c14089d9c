"""Trainer knobs of Molt parity on real FSDP2 over gloo: checkpoint.load_model_only (warm start: the weights, not the
optimizer, scheduler or step), parallelism.defer_grad_sync (one gradient reduce-scatter per optimizer step instead of
one per micro-batch, same update) and logger.debug_grad_norms (the top-k per-parameter grad norms of the matching
names, before clipping)."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _parity_jobs as jobs  # noqa: E402

from molt_hydra.parallel.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    run_ranks(jobs.warm_start, 1, str(d / "ckpt"), d / "w.pt", timeout_s=240)
    return torch.load(d / "w.pt", weights_only=False)


def test_warm_start_loads_weights_but_not_the_optimizer(warm):
    res = warm
    from molt_hydra.models.build import build_model
    init = build_model("tiny://qwen3_tiny").state_dict()
    for name, p in res["trained"].items():
        assert torch.equal(res["warm"]["params"][name], p), name
    assert max((res["trained"][k] - init[k]).abs().max().item() for k in res["trained"]) > 1e-4  # the step moved them
    warm, resumed = res["warm"], res["resumed"]
    # fresh AdamW (no moments), scheduler at its start (linear warmup of 10 steps: lr 0 at step 0), step 0
    assert warm["optim_state"] == {} and warm["step"] == 0 and warm["sched_epoch"] == 0 and warm["lr"] == 0.0
    # linear over 10 steps, warmup 1: after 2 steps lr = 1e-3 * (10 - 2) / (10 - 1)
    assert resumed["step"] == 2 and resumed["sched_epoch"] == 2
    assert resumed["lr"] == res["lr_trained"] == pytest.approx(1e-3 * 8 / 9)
    assert all(s["exp_avg"].abs().max() > 0 for s in resumed["optim_state"].values())


def test_full_determinism_turns_on_deterministic_kernels(warm):
    """train.full_determinism: transformers' enable_full_determinism (Molt's call) in the trainer rank."""
    res = warm
    assert res["deterministic_before"] is False and res["deterministic_after"] is True


@pytest.fixture(scope="module")
def deferred(tmp_path_factory):
    d = tmp_path_factory.mktemp("defer")
    for defer in (False, True):
        run_ranks(jobs.deferred_sync, 2, d / f"{defer}.pt", defer, timeout_s=240)
    return {defer: torch.load(d / f"{defer}.pt", weights_only=False) for defer in (False, True)}


def test_deferred_grad_sync_reduces_once_per_step_with_the_same_update(deferred):
    every, once = deferred[False], deferred[True]
    assert every["arrivals"] > 1  # several micro-batches, each reduce-scattered
    assert once["arrivals"] == 1
    for name, p in every["params"].items():
        torch.testing.assert_close(once["params"][name], p, rtol=0, atol=1e-6)


def test_debug_grad_norms_are_the_top_k_matching_norms_before_the_step(deferred):
    run = deferred[False]
    norms = {n: float(g.norm()) for n, g in run["grads"].items()
             if fnmatch.fnmatchcase(n, "*self_attn.*_proj.weight")}
    top = sorted(norms, key=lambda n: -norms[n])[:3]
    logged = {k.removeprefix("actor_grad_norm/"): v for k, v in run["metrics"].items()
              if k.startswith("actor_grad_norm/")}
    assert sorted(logged) == sorted(top)
    for name in top:
        assert logged[name] == pytest.approx(norms[name], rel=1e-5)
    assert run["metrics"]["actor_grad_nonfinite_params"] == 0.0
