"""Drift metrics between the rollout engine's and the trainer's log-probs, derived by hand."""

import math

import pytest
import torch

from molt_hydra.algorithm.drift import drift_metrics
from molt_hydra.algorithm.is_correction import ISCorrection

TRAIN = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -3.0, -1.0]])
ROLLOUT = torch.tensor([[-1.1, -1.5, -0.5, 99.0], [-1.0, -1.2, -3.0, -0.7]])  # row 0's last token is padding
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
D = [-0.1, 0.5, 0.0, 0.0, -0.2, 0.0, 0.3]  # rollout - train on the 7 action tokens


def test_always_on_metrics_without_is_correction():
    m = {k: v.item() for k, v in drift_metrics(TRAIN, ROLLOUT, MASK).items()}
    assert m["vllm_kl"] == pytest.approx(sum(D) / 7, abs=1e-6)  # Molt: masked mean of rollout - train
    assert m["drift/k3_kl"] == pytest.approx(sum(math.exp(-d) - 1 + d for d in D) / 7, abs=1e-6)
    abs_sorted = sorted(abs(d) for d in D)  # 0, 0, 0, 0.1, 0.2, 0.3, 0.5
    assert m["drift/abs_logp_diff_mean"] == pytest.approx(sum(abs_sorted) / 7, abs=1e-6)
    assert m["drift/abs_logp_diff_p50"] == pytest.approx(abs_sorted[3], abs=1e-6)  # position 0.5 * 6 = 3
    assert m["drift/abs_logp_diff_p99"] == pytest.approx(abs_sorted[5] + (abs_sorted[6] - abs_sorted[5]) * 0.94,
                                                         abs=1e-6)  # position 0.99 * 6 = 5.94
    assert m["drift/abs_logp_diff_max"] == pytest.approx(0.5, abs=1e-6)
    ratios = [math.exp(-d) for d in D]  # pi_train / pi_rollout
    assert m["drift/is_ratio_min"] == pytest.approx(min(ratios), abs=1e-6)
    assert m["drift/is_ratio_mean"] == pytest.approx(sum(ratios) / 7, abs=1e-6)
    assert m["drift/is_ratio_max"] == pytest.approx(max(ratios), abs=1e-6)
    assert not any("is_filtered" in k or "staleness" in k for k in m)
    assert drift_metrics(TRAIN, ROLLOUT, MASK, is_correction=ISCorrection("off")).keys() == m.keys()


def test_is_filtered_fractions_token_and_geo():
    # token ratios e^0.1, e^-0.5, 1 | 1, e^0.2, 1, e^-0.3 against [0.9, 1.1]: 4 of 7 tokens, both rows filtered
    m = drift_metrics(TRAIN, ROLLOUT, MASK, is_correction=ISCorrection("token", "mask", low=0.9, high=1.1))
    assert m["drift/is_filtered_token_frac"].item() == pytest.approx(4 / 7)
    assert m["drift/is_filtered_seq_frac"].item() == pytest.approx(1.0)
    # geo: row 0 exp((0.1 - 0.5 + 0) / 3) = 0.875 is filtered (3 tokens); row 1 exp((0 + 0.2 + 0 - 0.3) / 4) kept
    assert math.exp((0.1 - 0.5) / 3) < 0.9 < math.exp(-0.1 / 4)
    m = drift_metrics(TRAIN, ROLLOUT, MASK, is_correction=ISCorrection("geo", "mask", low=0.9, high=1.1))
    assert m["drift/is_filtered_token_frac"].item() == pytest.approx(3 / 7)
    assert m["drift/is_filtered_seq_frac"].item() == pytest.approx(1 / 2)


def test_staleness_counts_versions_behind_on_versioned_action_tokens():
    versions = torch.tensor([[-1, 3, 4, 9], [5, 5, 4, -1]])  # -1: unknown; row 0's last token is padding
    m = drift_metrics(TRAIN, ROLLOUT, MASK, policy_versions=versions, current_version=5)
    lags = [5 - 3, 5 - 4, 5 - 5, 5 - 5, 5 - 4]
    assert m["drift/staleness_mean"].item() == pytest.approx(sum(lags) / len(lags))
    assert m["drift/staleness_max"].item() == 2
    unversioned = drift_metrics(TRAIN, ROLLOUT, MASK, policy_versions=torch.full((2, 4), -1), current_version=5)
    assert "drift/staleness_mean" not in unversioned


def test_non_finite_log_probs_are_clamped_and_empty_mask_gives_nothing():
    train = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-float("inf"), float("nan"), -1.0]])  # difference -inf -> -30, NaN -> 0
    m = drift_metrics(train, rollout, torch.ones(1, 3, dtype=torch.bool))
    assert m["vllm_kl"].item() == pytest.approx(-30 / 3)
    assert m["drift/abs_logp_diff_max"].item() == pytest.approx(30.0)
    assert m["drift/is_ratio_max"].item() == pytest.approx(math.exp(30), rel=1e-5)
    assert m["drift/k3_kl"].item() == pytest.approx(10 / 3)  # k3 saturates at 10
    assert all(torch.isfinite(v) for v in m.values())
    assert drift_metrics(train, rollout, torch.zeros(1, 3, dtype=torch.bool)) == {}
