"""Train/rollout importance-sampling correction (Molt §2.6).

The rollout engine and the trainer compute slightly different log-probs for the same tokens (kernels, precision, a
weight swap mid-request). Each action token's loss is weighted by r_t = pi_train / pi_rollout, gated per `level`:

    token: the token's own ratio r_t
    seq:   the product of the sequence's ratios, exp(clamp(sum_t log r_t, -30, 30))   -> one unit per row
    geo:   their geometric mean, exp(mean_t log r_t)                                  -> one unit per row

and `mode` decides what happens to a unit outside [low, high]: mask -> the unit's tokens get weight 0 (kept tokens
keep their raw r_t); clip -> weight clamp(r_t, low, high); trunc -> weight min(r_t, high). clip/trunc would replace
each token's weight with one clamped sequence weight at seq/geo level, so those combinations are rejected.
Named schemes: token/trunc = TIS, token/mask = IcePop, geo/mask = seq-mask-tis, seq/mask = product-ratio reject.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molt_hydra.algorithm.aggregation import masked_mean, masked_sum
from molt_hydra.algorithm.kl import LOG_RATIO_LIMIT, safe_log_ratio


@dataclass(frozen=True)
class ISCorrection:
    """Built from the validated config (runtime/roles.py; config/schema.py ISCorrectionConfig checks the level, the
    mode, mask-only at seq/geo and low < high)."""
    level: str = "off"
    mode: str = "mask"
    low: float = 0.5
    high: float = 5.0

    @property
    def enabled(self) -> bool:
        return self.level != "off"

    def weights(self, train_logp: torch.Tensor, rollout_logp: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token loss weights [B, L] (detached) and the bool `filtered` flag per unit ([B, L] at token level,
        [B, 1] at seq/geo): masked out (mask), clamped (clip) or capped (trunc)."""
        log_ratio = safe_log_ratio(train_logp, rollout_logp).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        token_ratio = log_ratio.exp()
        if self.level == "token":
            unit = token_ratio
        elif self.level == "seq":
            unit = masked_sum(log_ratio, mask, dim=-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
        else:
            unit = masked_mean(log_ratio, mask, dim=-1).exp()
        if self.mode == "mask":
            keep = (unit >= self.low) & (unit <= self.high)
            return torch.where(keep, token_ratio, 0.0), ~keep
        if self.mode == "clip":
            return unit.clamp(self.low, self.high), (unit < self.low) | (unit > self.high)
        return unit.clamp(max=self.high), unit > self.high

    def filter_ratio(self, filtered: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Molt's `is_filter_ratio`: share of action tokens (token level) or of rows (seq/geo) that were filtered."""
        return masked_mean(filtered.float(), mask) if self.level == "token" else filtered.float().mean()
