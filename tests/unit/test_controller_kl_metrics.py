"""The KL to the reference as a reward penalty (algorithm.kl.use_loss=false): runtime/controller.py `_advantages`
logs `kl` and `logprobs_diff` as Molt does (inventory 2.6 step 3): each sample's mean over its action tokens, then
the mean over the samples. Before, `logprobs_diff` was logged only where the KL is a loss term."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402


def test_a_reward_kl_logs_kl_and_logprobs_diff_as_per_sample_means():
    cfg = to_run_config(compose_config(["algorithm=reinforce", "algorithm.kl.use_loss=false",
                                        "algorithm.kl.estimator=k1"]))
    mask = torch.tensor([[False, True, True, True], [False, False, True, False]])
    old = torch.tensor([[9.0, -1.0, -2.0, -3.0], [9.0, 9.0, -0.5, 9.0]])  # off the mask: must not count
    ref = torch.tensor([[0.0, -1.5, -1.0, -3.0], [0.0, 0.0, -2.5, 0.0]])
    b = SimpleNamespace(action_mask=mask, rewards=torch.tensor([1.0, 0.0]), group_ids=[0, 1], rollout_ids=[0, 1])
    this = SimpleNamespace(cfg=cfg, kl_ctl=SimpleNamespace(value=0.01))
    metrics = {}
    RLController._advantages(this, b, old, ref, None, metrics)
    first, second = (0.5 - 1.0 + 0.0) / 3, 2.0  # old - ref over each sample's action tokens (k1: the same)
    assert metrics["logprobs_diff"] == pytest.approx((first + second) / 2)
    assert metrics["kl"] == pytest.approx((first + second) / 2)


def test_a_step_with_nothing_to_train_logs_actor_frozen():
    """docs/metrics.md: `actor_frozen` is 1 when a step had nothing to train. Before: such a step logged no
    `actor_frozen` at all (a chart or filter on it skipped exactly the steps that trained nothing)."""
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from _old_logprob_jobs import batch

    from molt_hydra.runtime.validate import validate

    cfg = validate(to_run_config(compose_config(["rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
                                                 "train.batch_size=8", "train.micro_batch_size=8"])))
    group = SimpleNamespace(num_ranks=1, dp_size=1, per_shard=list)
    ctl = RLController(cfg, SimpleNamespace(actor=group, ref=None, critic=None, pad_token_id=0, calls=None), log=None)
    nothing = batch("tiny://qwen3_tiny")
    for g in nothing.groups:
        for t in g.trajectories:
            t.action_ranges = []  # no action token: every sample dropped
    metrics = asyncio.run(ctl.train_step(nothing, {"timing/generation": 1.0}))
    assert metrics["rollout/dropped/no_action_tokens"] == 8.0 and metrics["num_samples_trained"] == 0.0
    assert metrics["actor_frozen"] == 1.0 and metrics["_frozen"] is True
