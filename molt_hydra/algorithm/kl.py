"""KL between two policies from per-token log-probs (k1/k2/k3) and the KL-coefficient controllers (Molt §2.4).

Every log-ratio in the algorithm layer goes through `safe_log_ratio`, Molt's sanitisation: NaN -> 0 and
+-inf -> +-30 (a probability ratio of ~1e13; nothing larger carries information, anything larger overflows).
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 30.0
KL_CLAMP = 10.0  # k2/k3 are clamped to [-10, 10]; k1 deliberately is not
KL_ESTIMATORS = ("k1", "k2", "k3")


def safe_log_ratio(logp: torch.Tensor, logp_base: torch.Tensor) -> torch.Tensor:
    """`logp - logp_base` with NaN -> 0 and +-inf -> +-30 (the gradient through a replaced entry is 0)."""
    return torch.nan_to_num(logp - logp_base, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)


def approx_kl(logp: torch.Tensor, logp_base: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_base) from tokens sampled from pi (`logp` = log pi, `logp_base` = log pi_base).

    k1 = log r; k2 = (log r)^2 / 2; k3 = exp(-log r) - 1 + log r, with log r = logp - logp_base.
    """
    log_ratio = safe_log_ratio(logp, logp_base)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return (log_ratio.square() / 2).clamp(-KL_CLAMP, KL_CLAMP)
    if estimator == "k3":
        # Clamping the exponent changes no value (k3 already saturates at 10 once |log r| > ~12) but keeps exp()
        # finite, so a saturated token (e.g. a -100 log-prob) gets gradient 0 instead of 0 * inf = NaN.
        log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"algorithm.kl.estimator={estimator!r} is not one of {list(KL_ESTIMATORS)}")


class KLController:
    """The KL coefficient `value`: constant without a `target`; with one, a proportional controller steering the
    measured KL towards it (Ziegler et al.; Molt's update rule). Per training step: e = clip(current / target - 1,
    -0.2, 0.2); value *= 1 + e * n_steps / horizon, where n_steps is the number of rollout samples in the step and
    horizon is measured in samples."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.target:  # adaptive iff `target` is truthy (Molt: `kl.target` set and non-zero)
            error = min(max(current_kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon
