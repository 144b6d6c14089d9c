"""Train/rollout drift metrics, computed whenever rollout log-probs exist (Molt computes `vllm_kl` only with IS on).

Call once per step on the step's batch, with `train_logp` = the trainer's log-probs at collection (the IS
numerator): percentiles and maxima do not average across micro-batches. Names and definitions: docs/metrics.md.
"""

from __future__ import annotations

import torch

from molt_hydra.algorithm.aggregation import masked_mean
from molt_hydra.algorithm.is_correction import ISCorrection
from molt_hydra.algorithm.kl import LOG_RATIO_LIMIT, approx_kl, safe_log_ratio


@torch.no_grad()
def drift_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, action_mask: torch.Tensor, *,
                  is_correction: ISCorrection | None = None, policy_versions: torch.Tensor | None = None,
                  current_version: int | None = None) -> dict[str, torch.Tensor]:
    """Scalar metrics over the action tokens of a [B, L] batch; {} when there is no action token.

    IS filtering fractions need an enabled `is_correction`; staleness needs `policy_versions` [B, L] (the weight
    version that generated each token, < 0 = unknown) and `current_version`, the version being trained.
    """
    mask = action_mask.bool()
    if not mask.any():
        return {}
    rollout_minus_train = safe_log_ratio(rollout_logp, train_logp)
    abs_diff = rollout_minus_train[mask].abs().sort().values
    is_ratio = (-rollout_minus_train[mask]).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    metrics = {
        "vllm_kl": masked_mean(rollout_minus_train, mask),
        # k3 estimate of KL(pi_rollout || pi_train) on rollout samples: same direction as vllm_kl, but >= 0 per token
        "drift/k3_kl": masked_mean(approx_kl(rollout_logp, train_logp, "k3"), mask),
        "drift/abs_logp_diff_mean": abs_diff.mean(),
        "drift/abs_logp_diff_max": abs_diff[-1],
        "drift/is_ratio_min": is_ratio.min(),
        "drift/is_ratio_mean": is_ratio.mean(),
        "drift/is_ratio_max": is_ratio.max(),
    }
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        # linear interpolation between order statistics (numpy's default); torch.quantile caps the input at 2^24
        pos = q * (len(abs_diff) - 1)
        lo, hi = int(pos), min(int(pos) + 1, len(abs_diff) - 1)
        metrics[f"drift/abs_logp_diff_{name}"] = abs_diff[lo] + (abs_diff[hi] - abs_diff[lo]) * (pos - lo)
    if is_correction is not None and is_correction.enabled:
        _, filtered = is_correction.weights(train_logp, rollout_logp, mask)
        filtered = filtered.expand_as(mask) & mask
        metrics["drift/is_filtered_token_frac"] = masked_mean(filtered.float(), mask)
        metrics["drift/is_filtered_seq_frac"] = filtered.any(-1)[mask.any(-1)].float().mean()
    if policy_versions is not None and current_version is not None:
        if (versioned := mask & (policy_versions >= 0)).any():
            lag = (current_version - policy_versions[versioned]).float()
            metrics["drift/staleness_mean"] = lag.mean()
            metrics["drift/staleness_max"] = lag.max()
    return metrics
