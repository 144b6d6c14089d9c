"""Experience assembly (algorithm/experience.py) without Ray or a trainer: trajectories -> experiences (cut, masks,
versions, drops), the step's selection (order, staleness, DP remainder) and the trainer's rows, each checked against
values worked out by hand."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from molt_hydra.agents.base import Trajectory
from molt_hydra.algorithm.experience import (action_mask, collate, experience_metrics, routing_tensor,
                                             select_trainable, stack_padded, staleness, to_experience, trainer_rows)


def traj(n_prompt=2, generated=(5, 6, 7), version=3, rollout="g-0", **kw) -> Trajectory:
    """`n_prompt` prompt tokens (ids 1..), then the generated ones at log-prob -0.5 each, from policy `version`."""
    ids = list(range(1, n_prompt + 1)) + list(generated)
    return Trajectory(token_ids=ids, logprobs=[0.0] * n_prompt + [-0.5] * len(generated),
                      versions=[-1] * n_prompt + [version] * len(generated),
                      action_ranges=[(n_prompt, len(ids))], reward=1.0, group_id="g", rollout_id=rollout, **kw)


def test_action_mask_marks_the_ranges_cut_at_max_len():
    # tokens 0..7; generated [2, 4) and [5, 8); cut at 6: 2, 3 and 5 remain generated
    assert action_mask([(2, 4), (5, 8)], 8, 6) == [False, False, True, True, False, True]
    assert action_mask([(7, 8)], 8, 6) == [False] * 6  # wholly past the cut
    with pytest.raises(ValueError, match="invalid action range"):
        action_mask([(0, 2)], 8, 8)  # token 0 has no context


def test_to_experience_cuts_masks_and_counts_lengths():
    # numpy / 0-d torch numbers are numbers too (before: dropped unseen); a bool, a string, a vector are not
    t = traj(generated=(5, 6, 7, 8), info={"turns": 2, "ok": True, "name": "x", "acc": np.float32(0.5),
                                           "calls": np.int64(3), "gap": torch.tensor(0.25), "flag": np.bool_(True),
                                           "vec": torch.ones(2)})
    exp, reason = to_experience(t, max_len=4)  # 2 prompt + 2 of the 4 generated tokens survive
    assert reason is None
    assert exp.token_ids.tolist() == [1, 2, 5, 6]
    assert exp.action_mask.tolist() == [False, False, True, True]
    assert exp.rollout_log_probs.tolist() == [0.0, 0.0, -0.5, -0.5]
    assert exp.policy_versions.tolist() == [-1, -1, 3, 3]
    # numeric info only (a bool is not a number here); lengths after the cut; 6 tokens >= 4: clipped and truncated
    assert exp.info == {"turns": 2.0, "acc": 0.5, "calls": 3.0, "gap": 0.25, "response_length": 2.0,
                        "total_length": 4.0, "response_clip_ratio": 1.0, "truncated": 1.0}
    assert exp.reward == 1.0 and exp.score == 1.0 and exp.routed_experts is None


def test_to_experience_drop_reasons():
    assert to_experience(Trajectory(token_ids=[1, 2], logprobs=[0.0], versions=[-1, 0]), 8) == (None,
                                                                                                "logprob_misalign")
    assert to_experience(Trajectory(), 8) == (None, "empty_tokens")
    assert to_experience(traj(n_prompt=3), 3) == (None, "no_action_tokens")  # every generated token is cut
    assert to_experience(traj(images=["img"]), 8) == (None, "images_for_text_model")


def test_routing_tensor_fills_unknown_tokens_with_minus_one():
    rows = [None, [[1, 2], [3, 4]], None]  # 3 tokens, 2 layers, top-2; only token 1 known
    out = routing_tensor(rows, 4)
    assert out.dtype == torch.int16 and out.shape == (4, 2, 2)
    assert out[1].tolist() == [[1, 2], [3, 4]]
    assert (out[[0, 2, 3]] == -1).all()
    assert routing_tensor([None, None], 2) is None and routing_tensor(None, 2) is None


def test_staleness_is_the_oldest_generated_tokens_lag():
    exp, _ = to_experience(Trajectory(token_ids=[1, 2, 3, 4], logprobs=[0.0] * 4, versions=[-1, 2, 4, 5],
                                      action_ranges=[(1, 4)], reward=0.0, group_id="g", rollout_id="g-0"), 8)
    assert staleness(exp, 6) == 4  # 6 - min(2, 4, 5)
    exp.policy_versions[:] = -1
    assert staleness(exp, 6) == 0  # no known version


def test_select_trainable_orders_drops_and_evens_out_dp():
    group = SimpleNamespace(trajectories=[
        traj(rollout="g-2", version=3), traj(rollout="g-0", version=1), traj(rollout="g-1", version=3),
        traj(rollout="g-10", version=3, segment_index=1), traj(rollout="g-10", version=3, segment_index=0),
        Trajectory(token_ids=[1], logprobs=[0.0], versions=[-1], rollout_id="g-3")])
    # version 3, max staleness 1: g-0 (version 1) is 2 behind; g-3 has no generated token
    exps, drops = select_trainable([group], 16, None, version=3, max_staleness=1, drop_stale=True, dp_size=2)
    # kept in rollout-index order (10 after 2, as a number) then segment: g-1, g-2, g-10/0, g-10/1 -> 4, even
    assert [e.rollout_id for e in exps] == ["g-1", "g-2", "g-10", "g-10"]
    assert drops == {"stale": 1, "no_action_tokens": 1}
    exps, drops = select_trainable([group], 16, None, version=3, max_staleness=1, drop_stale=False, dp_size=3)
    assert len(exps) == 3 and drops == {"no_action_tokens": 1, "dp_remainder": 2}  # 5 kept, 5 % 3 dropped


def test_trainer_rows_cut_per_token_tensors_to_each_sample():
    a, _ = to_experience(traj(generated=(5, 6, 7)), 16)  # 5 tokens
    b, _ = to_experience(traj(generated=(8,)), 16)  # 3 tokens
    batch = collate([a, b])
    adv = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    rows = trainer_rows(batch, [a, b], advantages=adv, values=None)
    assert [sorted(r) for r in rows] == [["action_mask", "advantages", "input_ids"]] * 2  # None is left out
    assert rows[1]["input_ids"].tolist() == [1, 2, 8]
    assert rows[0]["advantages"].tolist() == [0, 1, 2, 3, 4] and rows[1]["advantages"].tolist() == [5, 6, 7]
    assert rows[1]["action_mask"].tolist() == [False, False, True]


def test_trainer_rows_carry_routing_and_stack_padded_inverts_them():
    routed = [[[1]], [[2]], [[3]]]
    a, _ = to_experience(traj(generated=(5,), routed_experts=routed), 16)  # 3 tokens, 1 layer, top-1
    b, _ = to_experience(traj(generated=(6, 7)), 16)  # 4 tokens, no routing: -1 rows
    batch = collate([a, b])
    rows = trainer_rows(batch, [a, b])
    assert rows[0]["routed_experts"].flatten().tolist() == [1, 2, 3]
    assert rows[1]["routed_experts"].flatten().tolist() == [-1] * 4
    out = stack_padded([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0, 7.0])], (2, 4))
    assert out.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]


def test_nonfinite_info_values_are_left_out_of_their_mean_and_counted():
    """Before: one rollout's info {"acc": nan} made the step's acc metric NaN (and inf made it inf)."""
    nan, inf = float("nan"), float("inf")
    exps = [to_experience(traj(generated=(5,), info=info), 16)[0]
            for info in ({"acc": 1.0, "f1": nan}, {"acc": nan, "f1": inf}, {"acc": 0.5, "f1": np.float32("nan")})]
    batch = collate(exps)
    m = experience_metrics(exps, torch.ones(batch.action_mask.shape), batch.action_mask)
    assert m["acc"] == (1.0 + 0.5) / 2 and m["acc_nonfinite"] == 1.0
    assert "f1" not in m and m["f1_nonfinite"] == 3.0  # no finite value: no mean, only the count
    assert "turns_nonfinite" not in m and not any(k.startswith("response_length_") for k in m)


def test_experience_metrics_are_sample_and_token_means():
    a, _ = to_experience(traj(generated=(5, 6), info={"turns": 1}), 16)
    b, _ = to_experience(traj(generated=(7,), info={"turns": 3}), 16)
    b.reward, b.score = -1.0, 0.0
    batch = collate([a, b])
    returns = torch.tensor([[9.0, 9.0, 1.0, 2.0], [9.0, float("nan"), 6.0, 9.0]])  # off-mask values must not count
    m = experience_metrics([a, b], returns, batch.action_mask)
    assert m["turns"] == 2.0 and m["reward"] == 0.0 and m["score"] == 0.5
    assert m["return"] == pytest.approx(((1 + 2) / 2 + 6) / 2)  # each sample's token mean, then over samples (Molt)
    assert m["response_length"] == 1.5 and m["total_length"] == 3.5


def test_group_reward_std_is_each_groups_unbiased_std_of_its_rollouts_clipped_rewards_over_the_samples():
    """Molt's group_reward_std (inventory 2.6 step 7): per group, the unbiased std of its rollouts' rewards after the
    reward clip (a rollout's segments count once), 0 for a group of one, broadcast to the samples and averaged."""
    from molt_hydra.algorithm.advantage import group_reward_std

    # group g: rollouts r0 (two segments, reward 1), r1 (reward 30, clipped to 10), r2 (reward 4); group h: one rollout
    rewards = torch.tensor([1.0, 1.0, 30.0, 4.0, 7.0])
    got = group_reward_std(rewards, ["g", "g", "g", "g", "h"], ["r0", "r0", "r1", "r2", "r3"], (-10.0, 10.0))
    mean = (1 + 10 + 4) / 3
    std_g = (((1 - mean) ** 2 + (10 - mean) ** 2 + (4 - mean) ** 2) / 2) ** 0.5
    assert got.tolist() == pytest.approx([std_g] * 4 + [0.0])
    assert float(got.mean()) == pytest.approx((4 * std_g + 0.0) / 5)  # the metric


def test_an_info_key_named_reward_score_or_return_is_logged_under_info():
    """docs/metrics.md: an agent's Result.info key named as one of the step's own metrics is logged as `info/<key>`.
    Before: an info `reward`, `score` or `return` was overwritten by the step's own mean and lost without a word."""
    a, _ = to_experience(traj(generated=(5,), info={"reward": 0.25, "score": 7.0, "return": 3.0}), 16)
    b, _ = to_experience(traj(generated=(6,), info={"reward": 0.75, "score": float("nan")}), 16)
    a.reward, b.reward, a.score, b.score = 1.0, 0.0, 1.0, 0.0
    batch = collate([a, b])
    m = experience_metrics([a, b], torch.full(batch.action_mask.shape, 2.0), batch.action_mask)
    assert (m["reward"], m["score"], m["return"]) == (0.5, 0.5, 2.0)  # the samples' own
    assert (m["info/reward"], m["info/score"], m["info/return"]) == ((0.25 + 0.75) / 2, 7.0, 3.0)  # the agent's
    assert m["info/score_nonfinite"] == 1.0 and "score_nonfinite" not in m
