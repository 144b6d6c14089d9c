"""Advantage estimators: expected values derived by hand from Molt's formulas (molt_inventory.md §2.2-2.3)."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt_hydra.algorithm.advantage import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    get_advantage_estimator,
    group_rollouts,
    register_advantage_estimator,
    whiten_advantages,
)
from molt_hydra.algorithm.plugins import load_plugins

# One sample per rollout. Group "a" is mixed, "b" has zero variance, "c" is a singleton.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 3.0])
GROUPS = ["a", "a", "a", "a", "b", "b", "b", "c"]
N_ACTIONS = [1, 2, 3, 1, 2, 3, 1, 2]  # sample i: a prompt token, then N_ACTIONS[i] action tokens, then padding
MASK = torch.tensor([[False] + [True] * n + [False] * (3 - n) for n in N_ACTIONS])


def per_sample(advantages):
    """The scalar each sample carries on its action tokens (asserting it is the same on all of them, 0 elsewhere)."""
    out = []
    for row, mask in zip(advantages, MASK):
        assert torch.all(row[~mask] == 0)
        assert torch.allclose(row[mask], row[mask][0].expand(mask.sum()))
        out.append(row[mask][0].item())
    return out


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=0)


def group_adv(name, **kw):
    return compute_advantages(name, REWARDS, MASK, group_ids=GROUPS, whiten=False, **kw)


def test_rloo_leave_one_out_and_singleton_keeps_raw_reward():
    advantages, returns = group_adv("rloo")
    expected = [1 - (0 + 0 + 0) / 3, 0 - (1 + 0 + 0) / 3, 0 - 1 / 3, 0 - 1 / 3,
                2 - (2 + 2) / 2, 2 - (2 + 2) / 2, 2 - (2 + 2) / 2,
                3.0]  # singleton: no leave-one-out baseline, raw reward (Molt, deliberate)
    assert per_sample(advantages) == pytest.approx(expected, abs=1e-6)
    assert torch.equal(returns, advantages)


def test_grpo_unbiased_std_eps_singleton_and_zero_variance():
    advantages, _ = group_adv("grpo")
    mean_a = (1 + 0 + 0 + 0) / 4
    std_a = math.sqrt(((1 - mean_a) ** 2 + 3 * (0 - mean_a) ** 2) / (4 - 1))  # unbiased (n-1): 0.5, not 0.433
    expected = [(1 - mean_a) / (std_a + 1e-9)] + [(0 - mean_a) / (std_a + 1e-9)] * 3 + [0.0] * 3 + [0.0]
    assert per_sample(advantages) == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_subtracts_group_mean_only():
    advantages, _ = group_adv("dr_grpo")
    assert per_sample(advantages) == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], abs=1e-6)


def test_reinforce_baseline_centres_then_whitens_over_action_tokens():
    centred = [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]  # r - group mean; singleton -> 0
    advantages, returns = group_adv("reinforce_baseline")
    assert per_sample(advantages) == pytest.approx(centred, abs=1e-6)

    advantages, returns = compute_advantages("reinforce_baseline", REWARDS, MASK, group_ids=GROUPS, whiten=True)
    # whitening weighs each sample by its number of action tokens; population variance
    tokens = [c for c, n in zip(centred, N_ACTIONS) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens))
    assert per_sample(advantages) == pytest.approx([(c - mean) / std for c in centred], abs=1e-5)
    assert per_sample(returns) == pytest.approx(centred, abs=1e-6)  # the un-whitened target


def test_a_constant_group_of_inexact_floats_centres_to_exactly_zero():
    # in float32, mean([0.1] * 7) misses 0.1 by 7e-9 and the std is 8e-9: GRPO would give -0.82, not 0
    rewards = torch.full((7,), 0.1)
    mask = torch.ones(7, 1, dtype=torch.bool)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        advantages, _ = compute_advantages(name, rewards, mask, group_ids=[0] * 7)
        assert torch.equal(advantages, torch.zeros(7, 1)), name


def test_segments_of_one_rollout_count_once_and_share_its_advantage():
    # rollout r0 was split into two segments (compaction); group baseline = mean(1, 0) = 0.5, not mean(1, 1, 0)
    rewards = torch.tensor([1.0, 1.0, 0.0])
    mask = torch.ones(3, 2, dtype=torch.bool)
    advantages, _ = compute_advantages("dr_grpo", rewards, mask, group_ids=["g"] * 3, rollout_ids=["r0", "r0", "r1"])
    assert advantages[:, 0].tolist() == pytest.approx([0.5, 0.5, -0.5])


def test_group_rollouts_first_seen_order_and_id_fallbacks():
    first, groups, s2r = group_rollouts(5, group_ids=["x", "x", "y", "x", "y"], rollout_ids=[7, 7, 8, 9, 10])
    assert first == [0, 2, 3, 4] and groups == [[0, 2], [1, 3]] and s2r.tolist() == [0, 0, 1, 2, 3]
    first, groups, s2r = group_rollouts(3)  # no ids: every sample is its own rollout and group
    assert first == [0, 1, 2] and groups == [[0], [1], [2]] and s2r.tolist() == [0, 1, 2]
    first, groups, _ = group_rollouts(3, rollout_ids=["a", "a", "b"])  # no group ids -> group = rollout
    assert first == [0, 2] and groups == [[0], [1]]
    with pytest.raises(ValueError, match="3 samples"):
        group_rollouts(3, group_ids=[0, 0])


def test_reward_is_clipped_per_rollout_before_the_estimator():
    mask = torch.ones(2, 1, dtype=torch.bool)
    advantages, _ = compute_advantages("dr_grpo", torch.tensor([12.0, 0.0]), mask, group_ids=[0, 0])
    assert advantages[:, 0].tolist() == pytest.approx([(10 - 5), (0 - 5)])  # 12 -> 10, mean 5
    advantages, _ = compute_advantages("dr_grpo", torch.tensor([12.0, 0.0]), mask, group_ids=[0, 0],
                                       reward_clip=(-1, 1))
    assert advantages[:, 0].tolist() == pytest.approx([0.5, -0.5])


# ----------------------------------------------------------------------------------------------------- reinforce
R_MASK = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)  # row 1 has an observation gap
R_REWARDS = torch.tensor([2.0, -1.0, 5.0])  # row 2 has no action token: its reward lands nowhere
R_KL = torch.tensor([[0.3, 0.2, 0.4, 0.5], [0.1, 0.6, 0.7, 0.2], [1.0, 1.0, 1.0, 1.0]])
BETA = 0.5
# token rewards: -beta * kl on action tokens, + the reward on the last action token, 0 elsewhere
TOKEN_R0 = [0.0, -BETA * 0.2, -BETA * 0.4 + 2.0, 0.0]
TOKEN_R1 = [0.0, -BETA * 0.6, 0.0, -BETA * 0.2 - 1.0]


def discounted(rewards, gamma):
    out, g = [], 0.0
    for r in reversed(rewards):
        g = r + gamma * g
        out.append(g)
    return out[::-1]


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_reinforce_kl_penalised_discounted_returns(gamma):
    advantages, returns = compute_advantages("reinforce", R_REWARDS, R_MASK, kl=R_KL, kl_coef=BETA, gamma=gamma,
                                             whiten=False)
    expected = [discounted(TOKEN_R0, gamma), discounted(TOKEN_R1, gamma), [0.0] * 4]
    if gamma == 0.5:  # spelled out once: observation and prompt tokens are discount steps with zero reward
        assert expected[1] == pytest.approx([0.5 * (-0.3 + 0.5 * (0.5 * -1.1)), -0.3 + 0.5 * (0.5 * -1.1),
                                             0.5 * -1.1, -1.1])
    close(returns, torch.tensor(expected))  # prompt positions keep G (returns are not re-masked)
    close(advantages, returns * R_MASK)


def test_reinforce_whitens_over_action_tokens_and_zeroes_the_rest():
    advantages, returns = compute_advantages("reinforce", R_REWARDS, R_MASK, kl=R_KL, kl_coef=BETA, gamma=0.5)
    g0, g1 = discounted(TOKEN_R0, 0.5), discounted(TOKEN_R1, 0.5)
    tokens = [g0[1], g0[2], g1[1], g1[3]]
    mean = sum(tokens) / 4
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / 4)
    expected = torch.zeros(3, 4)
    for (row, col), t in zip([(0, 1), (0, 2), (1, 1), (1, 3)], tokens):
        expected[row, col] = (t - mean) / std
    assert torch.allclose(advantages, expected, atol=1e-5)


def test_non_group_estimators_ignore_group_ids():
    for name in ("reinforce", "on_policy_distill"):
        a, _ = compute_advantages(name, R_REWARDS, R_MASK, kl=R_KL, kl_coef=BETA)
        b, _ = compute_advantages(name, R_REWARDS, R_MASK, kl=R_KL, kl_coef=BETA, group_ids=[0, 0, 0])
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------------------ gae
# prompt, action, action, observation, action; the masked values 9 and 7 must be ignored
G_MASK = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.bool)
G_VALUES = torch.tensor([[9.0, 0.5, 0.4, 7.0, 0.3]])
G_KL = torch.full((1, 5), 0.2)


def test_gae_gamma_lambda_below_one_bootstraps_across_the_observation_gap():
    gamma, lam, beta = 0.9, 0.8, 0.5
    r1, r2, r4 = -beta * 0.2, -beta * 0.2, -beta * 0.2 + 1.0
    a4 = r4 + gamma * 0.0 - 0.3                     # last action token: terminal, next value 0
    a2 = (r2 + gamma * 0.3 - 0.4) + gamma * lam * a4  # the gap is transparent: next value is V4, not V3 and not 0
    a1 = (r1 + gamma * 0.4 - 0.5) + gamma * lam * a2
    advantages, returns = compute_advantages("gae", torch.tensor([1.0]), G_MASK, values=G_VALUES, kl=G_KL,
                                             kl_coef=beta, gamma=gamma, lam=lam, whiten=False)
    assert advantages[0].tolist() == pytest.approx([0, a1, a2, 0, a4], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0, a1 + 0.5, a2 + 0.4, 0, a4 + 0.3], abs=1e-6)

    whitened, returns_w = compute_advantages("gae", torch.tensor([1.0]), G_MASK, values=G_VALUES, kl=G_KL,
                                             kl_coef=beta, gamma=gamma, lam=lam, whiten=True)
    mean = (a1 + a2 + a4) / 3
    std = math.sqrt(((a1 - mean) ** 2 + (a2 - mean) ** 2 + (a4 - mean) ** 2) / 3)
    assert whitened[0].tolist() == pytest.approx([0, (a1 - mean) / std, (a2 - mean) / std, 0, (a4 - mean) / std],
                                                 abs=1e-5)
    assert torch.equal(returns_w, returns)  # returns are never whitened


def test_gae_lambda_one_returns_are_monte_carlo_whatever_the_values():
    gamma = 0.9
    r = -0.1  # -beta * kl
    mc4 = r + 1.0
    mc2 = r + gamma * mc4
    mc1 = r + gamma * mc2
    for values in (G_VALUES, torch.tensor([[0.0, -3.0, 2.0, 0.0, 5.0]])):
        _, returns = compute_advantages("gae", torch.tensor([1.0]), G_MASK, values=values, kl=G_KL, kl_coef=0.5,
                                        gamma=gamma, lam=1.0)
        assert returns[0].tolist() == pytest.approx([0, mc1, mc2, 0, mc4], abs=1e-6)


def test_gae_trailing_padding_is_terminal_and_singleton_groups_change_nothing():
    mask = torch.tensor([[0, 1, 0, 0]], dtype=torch.bool)
    _, returns = compute_advantages("gae", torch.tensor([2.0]), mask, values=torch.tensor([[0, 0.5, 8, 8]]),
                                    gamma=0.9, lam=0.9, whiten=False, group_ids=["only"])
    assert returns[0].tolist() == pytest.approx([0, 2.0, 0, 0])  # A = 2 + 0.9 * 0 - 0.5, R = A + V


def test_gae_without_critic_values_is_rejected():
    with pytest.raises(ValueError, match="algorithm.estimator=gae needs critic values"):
        compute_advantages("gae", torch.tensor([1.0]), G_MASK)


# ----------------------------------------------------------------------------------------------------- distill
def test_on_policy_distill_is_minus_beta_kl_and_ignores_the_reward():
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    kl = torch.tensor([[0.3, -0.2, 0.4]])  # k1: log pi_student - log pi_teacher
    for reward in (0.0, 100.0):
        advantages, returns = compute_advantages("on_policy_distill", torch.tensor([reward]), mask, kl=kl,
                                                 kl_coef=1.0, gamma=0.5)
        assert advantages[0].tolist() == pytest.approx([0.0, 0.2, -0.4])
        assert torch.equal(returns, advantages)
    with pytest.raises(ValueError, match="on_policy_distill needs the per-token KL"):
        compute_advantages("on_policy_distill", torch.tensor([1.0]), mask)


def test_on_policy_distill_ignores_the_reward_clip_so_the_config_refuses_it():
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from test_validation import assert_fires, config_errors

    mask, kl = torch.tensor([[0, 1, 1]], dtype=torch.bool), torch.tensor([[0.3, -0.2, 0.4]])
    for clip in ((-10.0, 10.0), (-0.1, 0.1), None):
        advantages, _ = compute_advantages("on_policy_distill", torch.tensor([5.0]), mask, kl=kl, kl_coef=1.0,
                                           reward_clip=clip)
        assert advantages[0].tolist() == pytest.approx([0.0, 0.2, -0.4])
    distill = ["algorithm=on_policy_distill", "parallelism.colocate_models=true", "model.ref_path=tiny://qwen3_tiny"]
    assert_fires([*distill, "algorithm.reward_clip=[-1,1]"], "algorithm.reward_clip", "so reward_clip=[-1.0, 1.0] "
                 "would change nothing")
    assert not [e for e in config_errors(distill) if e.startswith("algorithm.reward_clip")]
    assert not [e for e in config_errors(["algorithm.reward_clip=[-1,1]"]) if e.startswith("algorithm.reward_clip")]


def test_on_policy_distill_with_a_zero_coefficient_learns_nothing_so_the_config_refuses_it():
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from test_validation import assert_fires, config_errors

    mask, kl = torch.tensor([[0, 1, 1]], dtype=torch.bool), torch.tensor([[0.3, -0.2, 0.4]])
    advantages, _ = compute_advantages("on_policy_distill", torch.tensor([1.0]), mask, kl=kl, kl_coef=0.0)
    assert torch.equal(advantages, torch.zeros(1, 3))  # -0 * kl: no token is pushed towards the teacher
    distill = ["algorithm=on_policy_distill", "parallelism.colocate_models=true", "model.ref_path=tiny://qwen3_tiny"]
    assert_fires([*distill, "algorithm.kl.coef=0"], "algorithm.kl.coef", "coef=0 makes every advantage 0")
    assert not [e for e in config_errors(distill) if e.startswith("algorithm.kl.coef")]  # derived 1.0


# ---------------------------------------------------------------------------------------------------- whitening
def test_whitening_uses_masked_population_variance_with_floor():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mean = (1 + 2 + 3 + 4) / 4
    std = math.sqrt(((1 - mean) ** 2 + (2 - mean) ** 2 + (3 - mean) ** 2 + (4 - mean) ** 2) / 4)
    out = whiten_advantages(x, mask)
    close(out, (x - mean) / std)  # masked positions get (x - mean) / std too, as in Molt
    constant = torch.full((1, 3), 5.0)
    assert torch.equal(whiten_advantages(constant, torch.ones(1, 3, dtype=torch.bool)), torch.zeros(1, 3))
    tiny = torch.tensor([[0.0, 1e-5]])  # var 2.5e-11 < 1e-8: floored, so the spread stays small
    close(whiten_advantages(tiny, torch.ones(1, 2, dtype=torch.bool)), torch.tensor([[-0.5e-5, 0.5e-5]]) / 1e-4)
    assert torch.equal(whiten_advantages(x, torch.zeros(2, 3, dtype=torch.bool)), torch.zeros(2, 3))


# ------------------------------------------------------------------------------------------------ property test
@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-40, 40), min_size=2, max_size=6), min_size=1, max_size=4),
       st.sampled_from(["rloo", "grpo", "dr_grpo"]))
def test_group_baselines_sum_to_zero_per_group(groups, name):
    rewards = torch.tensor([r / 4 for g in groups for r in g])
    group_ids = [i for i, g in enumerate(groups) for _ in g]
    advantages, _ = compute_advantages(name, rewards, torch.ones(len(rewards), 1, dtype=torch.bool),
                                       group_ids=group_ids)
    for i in range(len(groups)):
        members = [j for j, g in enumerate(group_ids) if g == i]
        assert abs(advantages[members, 0].sum().item()) < 1e-4


# --------------------------------------------------------------------------------------------- registry & plugins
def test_builtin_estimators_declare_what_they_need():
    needs = {name: ADVANTAGE_ESTIMATORS[name].needs for name in
             ("reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae", "on_policy_distill")}
    assert needs == {"reinforce": {"kl"}, "reinforce_baseline": {"groups"}, "rloo": {"groups"}, "grpo": {"groups"},
                     "dr_grpo": {"groups"}, "gae": {"values", "kl"}, "on_policy_distill": {"kl", "reference"}}


def test_registry_rejects_duplicates_unknown_names_and_unknown_needs():
    def est(rewards, groups, ctx):
        raise AssertionError

    register_advantage_estimator("dup_test")(est)
    register_advantage_estimator("dup_test")(est)  # same function again: idempotent
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("dup_test")(lambda r, g, c: None)
    with pytest.raises(ValueError, match="unknown needs"):
        register_advantage_estimator("bad_needs_test", needs={"critic"})
    with pytest.raises(ValueError, match=r"unknown reads \['beta'\]; choose from \['gamma', 'lam', 'whiten'\]"):
        register_advantage_estimator("bad_reads_test", reads={"gamma", "beta"})


def test_an_estimator_that_does_not_say_what_it_reads_is_taken_to_read_every_knob():
    """A plugin registered without `reads` keeps every context knob settable (validation cannot tell it ignores
    one); the builtins say what they read, and validation refuses the rest (tests/config/test_inert_knobs.py)."""
    register_advantage_estimator("no_reads_test")(lambda rewards, groups, ctx: (rewards, rewards))
    try:
        assert ADVANTAGE_ESTIMATORS["no_reads_test"].reads == {"gamma", "lam", "whiten"}
    finally:  # the registry is the process's: later validation lists the estimators that read a knob
        del ADVANTAGE_ESTIMATORS["no_reads_test"]
    assert ADVANTAGE_ESTIMATORS["grpo"].reads == frozenset() and ADVANTAGE_ESTIMATORS["gae"].reads == {
        "gamma", "lam", "whiten"}
    with pytest.raises(ValueError, match=r"Unknown advantage estimator 'nope'.*algorithm.estimator.*'grpo'.*"
                                         r"algorithm.plugins"):
        get_advantage_estimator("nope")


def test_estimator_returning_the_wrong_shape_is_reported():
    register_advantage_estimator("bad_shape_test")(lambda r, g, ctx: (r, r))
    with pytest.raises(ValueError, match="bad_shape_test.*expected"):
        compute_advantages("bad_shape_test", REWARDS, MASK)


def test_plugin_estimator_selected_by_name_receives_real_groups(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ImportError, match="algorithm.plugins: cannot import 'no_such_plugin_module'"):
        load_plugins(["no_such_plugin_module"])
    (plugin,) = load_plugins(["fake_plugin_estimators"])
    plugin.SEEN_GROUPS.clear()
    rewards = torch.tensor([1.0, 5.0, 3.0, 7.0])
    advantages, _ = compute_advantages("group_median_test", rewards, torch.ones(4, 1, dtype=torch.bool),
                                       group_ids=["p", "p", "p", "q"])
    assert plugin.SEEN_GROUPS == [[[0, 1, 2], [3]]]  # Molt would have handed it [[0], [1], [2], [3]]
    assert advantages[:, 0].tolist() == [1 - 3, 5 - 3, 3 - 3, 7 - 7]  # medians 3 and 7


def test_non_finite_values_off_the_action_mask_change_nothing():
    """Masked tokens (prompt, observations, padding) carry no reward and are transparent to GAE, so a NaN / inf there
    (a KL or critic value of a token never trained on) leaves the advantages as if it were 0. Before: `x * mask` kept
    NaN * 0 = NaN, and the discounted sums carried it into every earlier action token.
    Tokens 0..5, actions at 1, 2, 4; reward 1 on token 4; gamma = lam = 1, no whitening.
      reinforce: token rewards [0, 0, 0, 0, 1, 0] -> returns G_t = [1, 1, 1, 1, 1, 0]; advantages G on the mask.
      gae, V = 0.5 on actions: A_4 = 1 - 0.5 = 0.5; A_2 = 0 + V_4 - V_2 + A_4 = 0.5; A_1 = 0 + V_2 - V_1 + A_2 = 0.5;
      returns A + V = 1 on the mask."""
    mask = torch.tensor([[False, True, True, False, True, False]])
    nan, inf = float("nan"), float("inf")
    kl = torch.tensor([[0.0, 0.0, 0.0, nan, 0.0, inf]])
    adv, ret = compute_advantages("reinforce", torch.tensor([1.0]), mask, kl=kl, kl_coef=0.1, whiten=False)
    close(adv, torch.tensor([[0.0, 1, 1, 0, 1, 0]]))
    close(ret, torch.tensor([[1.0, 1, 1, 1, 1, 0]]))
    values = torch.tensor([[nan, 0.5, 0.5, inf, 0.5, nan]])
    adv, ret = compute_advantages("gae", torch.tensor([1.0]), mask, values=values, whiten=False)
    close(adv, torch.tensor([[0.0, 0.5, 0.5, 0, 0.5, 0]]))
    close(ret, torch.tensor([[0.0, 1, 1, 0, 1, 0]]))


def test_non_finite_advantages_on_action_tokens_are_an_error():
    """The policy loss zeroes a non-finite advantage (Molt's sanitisation), so a diverged critic's NaN values, or a
    plugin's NaN, would train on nothing without a word. Before: returned as they were."""
    mask = torch.tensor([[False, True, True]])
    with pytest.raises(ValueError, match=r"'gae' gave 2 non-finite advantages on action tokens: the critic's values "
                                         r"are non-finite there"):
        compute_advantages("gae", torch.tensor([1.0]), mask, values=torch.tensor([[0.0, float("nan"), 0.0]]))
    with pytest.raises(ValueError, match=r"'grpo' gave 4 non-finite advantages on action tokens: a reward is NaN"):
        compute_advantages("grpo", torch.tensor([1.0, float("nan")]), mask.expand(2, 3), group_ids=[0, 0])
    register_advantage_estimator("nan_test")(lambda r, g, ctx: (torch.full(ctx.action_mask.shape, float("nan")),) * 2)
    try:
        with pytest.raises(ValueError, match=r"'nan_test' gave 2 non-finite advantages.*would zero them"):
            compute_advantages("nan_test", torch.tensor([1.0]), mask)
    finally:
        del ADVANTAGE_ESTIMATORS["nan_test"]
