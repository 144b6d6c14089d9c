"""Policy losses (ppo / gspo / cispo), KL-as-loss and entropy: values and gradients by hand (Molt §2.5, §2.8)."""

import math

import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from molt_hydra.algorithm.loss import POLICY_LOSSES, PolicyLoss, get_policy_loss, ppo_loss, register_policy_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from test_validation import assert_fires, config_errors  # noqa: E402

LN = math.log


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def inputs(log_ratio, advantages, mask, old=-1.0):
    """Current log-probs (a leaf with grad) such that logp - old_logp = log_ratio."""
    old_logp = torch.full((1, len(log_ratio)), old)
    logp = (old_logp + torch.tensor([log_ratio])).requires_grad_()
    return logp, old_logp, torch.tensor([advantages]), torch.tensor([mask], dtype=torch.bool)


# ratios 1.5, 0.5, 1.1, 3.0 on action tokens; the 5th token is padding whose log-prob is -inf and advantage NaN
PPO_RATIOS = [1.5, 0.5, 1.1, 3.0]
PPO_ADV = [1.0, -1.0, 2.0, -1.0]


def ppo_inputs():
    logp, old, adv, mask = inputs([LN(r) for r in PPO_RATIOS] + [0.0], PPO_ADV + [float("nan")], [1, 1, 1, 1, 0])
    with torch.no_grad():
        logp[0, 4] = -float("inf")
    return logp, old, adv, mask


def test_ppo_clipped_surrogate_value_gradient_and_metrics():
    logp, old, adv, mask = ppo_inputs()
    loss, metrics = PolicyLoss("ppo", clip_eps_low=0.2, clip_eps_high=0.2)(logp, old, adv, mask)
    per_token = [
        -min(1.5 * 1, 1.2 * 1),      # clipped above: -1.2
        -min(0.5 * -1, 0.8 * -1),    # clipped below (A < 0): 0.8
        -min(1.1 * 2, 1.1 * 2),      # inside the band: -2.2
        -min(3.0 * -1, 1.2 * -1),    # A < 0 with a huge ratio: unclipped -3 is the min -> 3
    ]
    close(loss, sum(per_token) / 4)
    close(metrics["policy_loss"], sum(per_token) / 4)
    close(metrics["policy_clip_ratio"], 2 / 4)
    close(metrics["policy_kl"], -sum(LN(r) for r in PPO_RATIOS) / 4)  # mean of old - new
    close(metrics["advantage_mean"], sum(PPO_ADV) / 4)
    loss.backward()
    # d/dlogp of -r*A/N is -r*A/N on tokens whose unclipped branch is active; 0 on clipped ones and padding
    close(logp.grad, [[0.0, 0.0, -1.1 * 2 / 4, -3.0 * -1 / 4, 0.0]])


def test_ppo_dual_clip_bounds_negative_advantage_tokens():
    logp, old, adv, mask = ppo_inputs()
    loss, _ = PolicyLoss("ppo", dual_clip=2.0)(logp, old, adv, mask)
    per_token = [-1.2, -max(min(-0.5, -0.8), 2.0 * -1), -2.2, -max(min(-3.0, -1.2), 2.0 * -1)]  # last: 3 -> 2
    close(loss, sum(per_token) / 4)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -1.1 * 2 / 4, 0.0, 0.0]])  # the dual-clipped token is a constant -c*A


def test_ppo_asymmetric_clip_per_token():
    ratio = torch.tensor([[1.5, 0.5, 1.25, 0.85]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    per_token, clip_ratio = ppo_loss(ratio, adv, None, mask, clip_eps_low=0.1, clip_eps_high=0.3)
    # band [0.9, 1.3]: 1.5 -> 1.3; 0.5 -> 0.9 (A<0: min(-0.5, -0.9)); 1.25 inside; 0.85 -> 0.9 (min(-0.85, -0.9))
    close(per_token, [[-1.3, 0.9, -1.25, 0.9]])
    close(clip_ratio, 3 / 4)


def test_gspo_clips_the_sequence_ratio_and_keeps_per_token_gradients():
    # row 0: token log-ratios ln2 and 0 -> sequence ratio exp(ln2 / 2) = 1.414 > 1.2: both tokens clipped
    # row 1: token ratios e^0.5 and e^-0.5 are far outside [0.8, 1.2] but the sequence ratio is exactly 1: no clip
    old = torch.full((2, 3), -1.0)
    logp = (old + torch.tensor([[LN(2), 0.0, 0.0], [0.5, -0.5, 0.0]])).requires_grad_()
    with torch.no_grad():
        logp[0, 2] = -float("inf")  # padding: excluded from the sequence mean, NaN-safe
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    loss, metrics = PolicyLoss("gspo")(logp, old, adv, mask)
    s0 = math.exp(LN(2) / 2)
    per_token = [-min(s0 * 1, 1.2 * 1)] * 2 + [-min(1.0 * -1, 1.0 * -1)] * 3
    close(loss, sum(per_token) / 5)
    close(metrics["policy_clip_ratio"], 2 / 5)
    loss.backward()
    # row 1: d(-s_t * A)/dlogp_t = -s_t * A = 1 per token (through its own logp only; PPO would give -r_t * A)
    close(logp.grad, [[0.0, 0.0, 0.0], [1 / 5, 1 / 5, 1 / 5]])


def test_cispo_caps_the_weight_and_passes_gradient_through_logp():
    logp = torch.tensor([[-0.5, -2.0, -1.0, -float("inf")]], requires_grad=True)
    old = logp.detach() - torch.tensor([[LN(2.0), LN(0.5), 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, metrics = PolicyLoss("cispo", clip_eps_high=1.2)(logp, old, adv, mask)
    weights = [min(2.0, 1.2), min(0.5, 1.2), min(1.0, 1.2)]
    per_token = [-w * a * lp for w, a, lp in zip(weights, [1.0, -1.0, 2.0], [-0.5, -2.0, -1.0])]
    close(loss, sum(per_token) / 3)
    close(metrics["policy_clip_ratio"], 1 / 3)  # only ratio 2.0 exceeds the 1.2 ceiling
    loss.backward()
    close(logp.grad, [[-1.2 * 1 / 3, -0.5 * -1 / 3, -1.0 * 2 / 3, 0.0]])  # capped, never zeroed


@pytest.mark.parametrize("overrides,key,fragment", [
    (["algorithm.policy_loss=gspo", "algorithm.dual_clip=3.0"], "algorithm.dual_clip", "dual clip is a PPO-only"),
    (["algorithm.policy_loss=cispo", "algorithm.clip_eps_high=1.2", "algorithm.dual_clip=3.0"], "algorithm.dual_clip",
     "dual clip is a PPO-only"),
    (["algorithm.dual_clip=1.0"], "algorithm.dual_clip", "must be > 1.0"),
    (["algorithm.policy_loss=cispo", "algorithm.clip_eps_high=0.2"], "algorithm.clip_eps_high",
     "cispo reads it as an absolute ratio ceiling"),
])
def test_config_rejects_what_molt_rejects_naming_the_key(overrides, key, fragment):
    """PolicyLoss is built from the validated config (runtime/roles.py), which refuses these combinations."""
    assert_fires(overrides, key, fragment)


@pytest.mark.parametrize("override", ["algorithm.loss_agg=mean", "algorithm.kl.estimator=k4"])
def test_config_rejects_unknown_loss_agg_and_kl_estimator(override):
    with pytest.raises(ConfigCompositionException, match=override):
        config_errors([override])


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_non_finite_old_log_probs_and_advantages_are_clamped(name):
    # t0: old = -inf -> log-ratio +inf -> +30; t1: advantage +inf -> 0; t2: padding with NaN everywhere
    logp = torch.tensor([[-1.0, -1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-float("inf"), -1.0, float("nan")]])
    adv = torch.tensor([[1.0, float("inf"), float("nan")]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, metrics = PolicyLoss(name, clip_eps_high=1.2 if name == "cispo" else 0.2)(logp, old, adv, mask)
    expected = {
        "ppo": (-1.2 + 0.0) / 2,               # ratio e^30 clipped to 1.2 with A = 1
        "gspo": (-1.2 + 0.0) / 2,              # sequence log-ratio (30 + 0) / 2 = 15: clipped to 1.2
        "cispo": (-1.2 * 1.0 * -1.0 + 0) / 2,  # weight min(e^30, 1.2); -w * A * logp
    }[name]
    close(loss, expected)
    close(metrics["policy_kl"], (-30.0 + 0.0) / 2)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("a", [1.0, 0.0])
def test_non_finite_current_log_probs_do_not_poison_loss_or_gradient(name, a):
    # -inf current log-prob on an action token: log-ratio -30, ratio ~ 0; NaN: log-ratio 0, ratio 1. cispo's
    # -w * A * logp was -inf there (NaN with A = 0: a group whose rewards were all equal)
    logp = torch.tensor([[-float("inf"), float("nan"), -1.0]], requires_grad=True)
    old = torch.full((1, 3), -1.0)
    adv = torch.tensor([[a, a, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = PolicyLoss(name, clip_eps_high=1.2 if name == "cispo" else 0.2)(logp, old, adv, mask)
    assert torch.isfinite(loss) and torch.isfinite(metrics["policy_loss"])
    if name == "ppo":
        close(loss, (-math.exp(-30) * a - a - 1.0) / 3)
    if name == "cispo":  # the non-finite tokens' terms are 0 (exp(logp) * logp -> 0); t2: -min(1, 1.2) * 1 * -1
        close(loss, 1.0 / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    if name == "cispo":  # d/dlogp = -w * A on the finite token only
        close(logp.grad, [[0.0, 0.0, -1.0 / 3]])


def test_empty_mask_gives_zero_loss_and_metrics():
    logp, old, adv, _ = ppo_inputs()
    loss, metrics = PolicyLoss("ppo")(logp, old, adv, torch.zeros(1, 5, dtype=torch.bool))
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 5))


def test_loss_agg_is_selectable():
    logp, old, adv, mask = inputs([0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [1, 1, 0])
    logp2 = torch.cat([logp, logp]).detach()
    adv2 = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mask2 = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, _ = PolicyLoss(loss_agg="seq-mean-token-mean")(logp2, torch.cat([old, old]), adv2, mask2)
    close(loss, ((-1 - 2) / 2 + (-4) / 1) / 2, atol=1e-6)  # ratio 1: per-token loss = -A
    loss, _ = PolicyLoss(loss_agg="token-mean")(logp2, torch.cat([old, old]), adv2, mask2)
    close(loss, (-1 - 2 - 4) / 3)


def test_kl_as_loss_adds_coef_times_token_mean_of_k3():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    zero_adv = torch.zeros(1, 2)  # policy term is -min(0, 0) = 0, so the loss is the KL term alone
    mask = torch.ones(1, 2, dtype=torch.bool)
    policy = PolicyLoss("ppo", kl_use_loss=True, kl_estimator="k3")
    loss, metrics = policy(logp, logp.detach(), zero_adv, mask, ref_log_probs=ref, kl_coef=0.1)
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]  # log r = logp - ref = 0.5, -1
    close(loss, 0.1 * sum(k3) / 2)
    close(metrics["kl"], sum(k3) / 2)
    close(metrics["logprobs_diff"], (0.5 - 1.0) / 2)
    loss.backward()
    # d k3 / d log r = 1 - exp(-log r)
    close(logp.grad, [[0.1 * (1 - math.exp(-0.5)) / 2, 0.1 * (1 - math.exp(1.0)) / 2]])

    _, metrics = policy(logp, logp.detach(), zero_adv, mask, ref_log_probs=ref, kl_coef=0.0)
    assert "kl" not in metrics  # coefficient 0: no KL term (Molt: only if init_coef > 0)
    with pytest.raises(ValueError, match="algorithm.kl.use_loss=true .* needs reference log-probs"):
        policy(logp, logp.detach(), zero_adv, mask, kl_coef=0.1)


def test_entropy_bonus_is_subtracted():
    logp = torch.zeros(1, 3, requires_grad=True)
    entropy = torch.tensor([[0.5, 1.5, 99.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, metrics = PolicyLoss("ppo", entropy_coef=0.01)(logp, logp.detach(), torch.zeros(1, 3), mask,
                                                         entropy=entropy)
    close(loss, -0.01 * (0.5 + 1.5) / 2)
    close(metrics["entropy_loss"], 1.0)
    with pytest.raises(ValueError, match="algorithm.entropy_coef"):
        PolicyLoss("ppo", entropy_coef=0.01)(logp, logp.detach(), torch.zeros(1, 3), mask)
    _, metrics = PolicyLoss("ppo")(logp, logp.detach(), torch.zeros(1, 3), mask, entropy=entropy)
    assert "entropy_loss" not in metrics


def test_policy_loss_registry():
    assert {"ppo", "gspo", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match=r"Unknown policy loss 'nope' \(algorithm.policy_loss\).*'cispo'"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="Unknown policy loss"):
        PolicyLoss("nope")
    with pytest.raises(ValueError, match="'ppo' already registered"):
        register_policy_loss("ppo")(lambda *a, **k: None)
    register_policy_loss("ppo")(ppo_loss)  # the same function again is fine


def test_config_enum_values_are_accepted():
    from enum import Enum

    LossAgg = Enum("LossAgg", {"seq-mean-token-sum": "seq-mean-token-sum"}, type=str)
    assert PolicyLoss(loss_agg=LossAgg["seq-mean-token-sum"]).loss_agg == "seq-mean-token-sum"


def test_seq_mean_token_sum_norm_divides_by_a_constant_not_the_micro_batch_width():
    """Dr. GRPO: sum_seq(sum_t loss) / (G * C) with one constant C; a sequence's weight must not depend on the padded
    width of the micro-batch it lands in. The run passes C = data.max_len (runtime/roles.py)."""
    from _config_helpers import compose_config
    from molt_hydra.cli import to_run_config
    from molt_hydra.runtime.roles import _policy_loss
    from molt_hydra.runtime.validate import validate

    cfg = validate(to_run_config(compose_config(["algorithm.loss_agg=seq-mean-token-sum-norm", "data.max_len=64"])))
    policy = _policy_loss(cfg)
    # ratio 1: per-token loss = -A. Sequence a has 2 action tokens, b has 4; G = 2 sequences in the window
    a_adv, b_adv = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0, 5.0, 6.0]])
    expected = -(1 + 2 + 3 + 4 + 5 + 6) / 2 / 64

    def loss(adv):
        logp = torch.zeros_like(adv)
        return policy(logp, logp, adv, adv != 0, global_batch_size=2)[0]
    apart = loss(a_adv) + loss(b_adv)  # two micro-batches of widths 2 and 4
    together = loss(torch.cat([torch.cat([a_adv, torch.zeros(1, 2)], -1), b_adv]))  # one of width 4
    close(apart, expected)
    close(together, expected)


def test_gspo_sequence_ratio_is_clamped_at_e30_like_ppo_token_ratio():
    # finite log-probs 99 apart: the sequence log-ratio 99 is clamped to 30 (exp(99) overflows float32 to inf)
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.full((1, 2), -100.0)
    adv = torch.tensor([[-1.0, -1.0]])  # A < 0: the unclipped branch -s * A wins
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = PolicyLoss("gspo")(logp, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(math.exp(30)), rtol=1e-5, atol=0)
    ppo, _ = PolicyLoss("ppo")(logp, old, adv, mask)
    torch.testing.assert_close(loss, ppo, rtol=1e-5, atol=0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), math.exp(30) / 2), rtol=1e-5, atol=0)  # -s_t*A/N


def test_cispo_has_no_lower_bound_so_clip_eps_low_is_refused():
    logp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    old = logp.detach() - torch.tensor([[LN(0.1), LN(3.0)]])  # ratios 0.1 (below any 1 - eps_low) and 3.0
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    losses = [PolicyLoss("cispo", clip_eps_low=low, clip_eps_high=1.2)(logp, old, adv, mask)[0] for low in (0.1, 0.9)]
    close(losses[0], (-0.1 * 1.0 * -0.5 - 1.2 * -1.0 * -2.0) / 2)
    close(losses[1], losses[0].item())
    cispo = ["algorithm.policy_loss=cispo", "algorithm.clip_eps_high=1.2"]
    assert_fires([*cispo, "algorithm.clip_eps_low=0.1"], "algorithm.clip_eps_low", "cispo caps its importance weight")
    assert not [e for e in config_errors(cispo) if e.startswith("algorithm.clip_eps_low")]
    assert not [e for e in config_errors(["algorithm.clip_eps_low=0.1"]) if e.startswith("algorithm.clip_eps_low")]
