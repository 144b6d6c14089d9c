"""Train/rollout IS correction: every level x mode, derived by hand from Molt §2.6 and molt_overview's IS gate."""

import math

import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from molt_hydra.algorithm.is_correction import ISCorrection
from molt_hydra.algorithm.loss import PolicyLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from test_validation import assert_fires, config_errors  # noqa: E402

IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "clip", "trunc")

E = math.exp


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("mode", IS_MODES)
def test_seq_and_geo_only_allow_mask(level, mode):
    """ISCorrection is built from the validated config (runtime/roles.py), which refuses clip/trunc at seq/geo."""
    overrides = [f"algorithm.is_correction.level={level}", f"algorithm.is_correction.mode={mode}"]
    if level in ("seq", "geo") and mode != "mask":
        assert_fires(overrides, "algorithm.is_correction.mode", f"level={level} only supports mode=mask")
    elif level == "off" and mode != "mask":  # no correction: the mode changes nothing (config/validate.py)
        assert_fires(overrides, "algorithm.is_correction.mode", "it tunes IS correction, which is off")
    else:
        assert not [e for e in config_errors(overrides) if e.startswith("algorithm.is_correction.mode")]
        assert ISCorrection(level, mode).enabled == (level != "off")


def test_unknown_level_mode_and_inverted_band_are_rejected():
    for override in ("algorithm.is_correction.level=tok", "algorithm.is_correction.mode=cap"):
        with pytest.raises(ConfigCompositionException, match=override):
            config_errors([override])
    assert_fires(["algorithm.is_correction.level=token", "algorithm.is_correction.low=2.0",
                  "algorithm.is_correction.high=1.0"], "algorithm.is_correction.low", "need low < high")


# train - rollout log-ratios 0.1 (kept), 2.0 (ratio 7.39 > 5), -1.0 (ratio 0.37 < 0.5); the 4th token is padding
TOKEN_ILR = [0.1, 2.0, -1.0, 50.0]
MASK = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
ROLLOUT = torch.full((1, 4), -2.0)
TRAIN = ROLLOUT + torch.tensor([TOKEN_ILR])


@pytest.mark.parametrize("mode, weights, filtered", [
    ("mask", [E(0.1), 0.0, 0.0], [False, True, True]),       # IcePop: outside the band -> weight 0
    ("clip", [E(0.1), 5.0, 0.5], [False, True, True]),       # clamp into [0.5, 5]
    ("trunc", [E(0.1), 5.0, E(-1.0)], [False, True, False]),  # TIS: cap at 5, no floor
])
def test_token_level_modes(mode, weights, filtered):
    is_correction = ISCorrection("token", mode, low=0.5, high=5.0)
    w, f = is_correction.weights(TRAIN, ROLLOUT, MASK)
    close(w[:, :3], [weights])
    assert f[0, :3].tolist() == filtered
    close(is_correction.filter_ratio(f, MASK), sum(filtered) / 3)  # padding not counted


def test_seq_rejects_consistent_small_drift_that_geo_keeps():
    # 8 tokens, each drifted by +0.005 (ratio 1.005, inside [0.99, 1.01]); a 9th padding token drifted by 5
    rollout = torch.full((1, 9), -1.0)
    train = rollout + torch.tensor([[0.005] * 8 + [5.0]])
    mask = torch.tensor([[1] * 8 + [0]], dtype=torch.bool)
    seq = ISCorrection("seq", "mask", low=0.99, high=1.01)
    w, f = seq.weights(train, rollout, mask)
    assert E(8 * 0.005) > 1.01  # the product compounds: exp(0.04) = 1.041
    assert f.tolist() == [[True]] and torch.equal(w[:, :8], torch.zeros(1, 8))
    close(seq.filter_ratio(f, mask), 1.0)

    geo = ISCorrection("geo", "mask", low=0.99, high=1.01)
    w, f = geo.weights(train, rollout, mask)
    assert 0.99 <= E(8 * 0.005 / 8) <= 1.01  # the geometric mean stays exp(0.005)
    assert f.tolist() == [[False]]
    close(w[:, :8], [[E(0.005)] * 8])  # a kept sequence keeps each token's raw ratio
    close(geo.filter_ratio(f, mask), 0.0)

    w, f = ISCorrection("token", "mask", low=0.99, high=1.01).weights(train, rollout, mask)
    assert not f[:, :8].any()


def test_a_single_blown_up_token_is_caught_at_token_level():
    rollout = torch.full((1, 8), -1.0)
    train = rollout.clone()
    train[0, 3] += 2.0  # ratio e^2 = 7.4 (a weight-sync race)
    mask = torch.ones(1, 8, dtype=torch.bool)
    w, f = ISCorrection("token", "mask", low=0.99, high=1.01).weights(train, rollout, mask)
    assert f[0].tolist() == [False, False, False, True, False, False, False, False]
    close(w, [[1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]])


def test_geo_keeps_raw_token_weights_when_the_mean_is_in_band():
    rollout = torch.full((1, 2), -1.0)
    train = rollout + torch.tensor([[0.2, -0.2]])  # geometric mean exp(0) = 1
    w, f = ISCorrection("geo", "mask", low=0.99, high=1.01).weights(train, rollout, torch.ones(1, 2, dtype=torch.bool))
    assert not f.any()
    close(w, [[E(0.2), E(-0.2)]])


def test_non_finite_log_probs_are_clamped_not_propagated():
    # rollout -inf -> log-ratio +inf -> 30; NaN -> 0 (ratio 1); a sequence sum of 60 is clamped to 30 before exp
    rollout = torch.tensor([[-float("inf"), float("nan"), -1.0]])
    train = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, f = ISCorrection("token", "trunc", high=5.0).weights(train, rollout, mask)
    close(w, [[5.0, 1.0, 1.0]])
    assert f[0].tolist() == [True, False, False]
    w, f = ISCorrection("seq", "mask").weights(torch.tensor([[29.0, 31.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert torch.isfinite(w).all() and f.tolist() == [[True]]  # exp(clamp(30 + 30, 30)) = e^30 > 5


def test_policy_loss_applies_the_weights_and_reports_the_filter_ratio():
    logp = TRAIN.clone().requires_grad_()  # current = old: ratio 1, so the PPO per-token loss is -A
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    policy = PolicyLoss("ppo", is_correction=ISCorrection("token", "trunc", low=0.5, high=5.0))
    loss, metrics = policy(logp, TRAIN, adv, MASK, rollout_log_probs=ROLLOUT)
    close(loss, (-1 * E(0.1) - 2 * 5.0 - 3 * E(-1.0)) / 3)
    close(metrics["is_filter_ratio"], 1 / 3)
    loss.backward()
    close(logp.grad, [[-1 * E(0.1) / 3, -2 * 5.0 / 3, -3 * E(-1.0) / 3, 0.0]])  # weights are constants

    with pytest.raises(ValueError, match="algorithm.is_correction.level=token needs rollout log-probs"):
        policy(logp, TRAIN, adv, MASK)

    off_loss, off_metrics = PolicyLoss("ppo")(logp, TRAIN, adv, MASK, rollout_log_probs=ROLLOUT)
    close(off_loss, (-1 - 2 - 3) / 3)  # level off ignores rollout log-probs
    assert "is_filter_ratio" not in off_metrics


def test_seq_level_filter_ratio_counts_rows():
    rollout = torch.zeros(2, 2)
    train = torch.tensor([[0.0, 0.0], [2.0, 2.0]])  # row 1 product e^4 > 5
    policy = PolicyLoss("ppo", is_correction=ISCorrection("seq", "mask", low=0.5, high=5.0))
    loss, metrics = policy(train, train, torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool),
                           rollout_log_probs=rollout)
    close(metrics["is_filter_ratio"], 1 / 2)
    close(loss, (-1 - 1 + 0 + 0) / 4)  # row 0 kept with weight e^0 = 1, row 1 zeroed


@pytest.mark.parametrize("overrides, key, fragment", [
    (["algorithm.is_correction.low=0.3"], "algorithm.is_correction.low", "it tunes IS correction, which is off"),
    (["algorithm.is_correction.high=3.0"], "algorithm.is_correction.high", "it tunes IS correction, which is off"),
    (["algorithm.is_correction.level=token", "algorithm.is_correction.mode=trunc", "algorithm.is_correction.low=0.3"],
     "algorithm.is_correction.low", "mode=trunc only caps the weight at high"),
])
def test_band_knobs_that_weigh_nothing_are_refused(overrides, key, fragment):
    assert_fires(overrides, key, fragment)
    # trunc reads no floor: low=0.3 and the default 0.5 give the same weights
    weights = [ISCorrection("token", "trunc", low=low).weights(TRAIN, ROLLOUT, MASK)[0] for low in (0.3, 0.5)]
    assert torch.equal(*weights)
    accepted = ["algorithm.is_correction.level=token", "algorithm.is_correction.mode=clip",
                "algorithm.is_correction.low=0.3", "algorithm.is_correction.high=3.0"]
    assert not [e for e in config_errors(accepted) if e.startswith("algorithm.is_correction")]


@pytest.mark.parametrize("mode, low, high, key", [("mask", 1.5, 5.0, "low"), ("clip", 0.2, 0.8, "high"),
                                                  ("mask", 0.5, 0.9, "high"), ("trunc", 0.5, 0.8, "high")])
def test_a_band_without_ratio_1_is_refused(mode, low, high, key):
    # trainer == engine on every token (ratio 1): mask drops all of them, clip rescales all of them
    logp = torch.full((1, 3), -1.0)
    w, f = ISCorrection("token", mode, low=low, high=high).weights(logp, logp, torch.ones(1, 3, dtype=torch.bool))
    assert f.all() and not torch.equal(w, torch.ones(1, 3))
    overrides = ["algorithm.is_correction.level=token", f"algorithm.is_correction.mode={mode}",
                 f"algorithm.is_correction.high={high}", *([f"algorithm.is_correction.low={low}"] * (mode != "trunc"))]
    assert_fires(overrides, f"algorithm.is_correction.{key}", f"the band [{low}, {high}] excludes 1")
    ok = ["algorithm.is_correction.level=token", "algorithm.is_correction.low=0.9", "algorithm.is_correction.high=1.1"]
    assert not [e for e in config_errors(ok) if "excludes 1" in e]
