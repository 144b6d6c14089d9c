"""The critic's clipped value loss (Molt §2.9): PPO's trust region, applied to the value head.

    unclipped = (V - R)^2
    clipped   = (V_old + clamp(V - V_old, -c, c) - R)^2
    loss      = token_mean(0.5 * max(unclipped, clipped))     (0.5 * unclipped when c is None)
"""

from __future__ import annotations

import torch

from molt_hydra.algorithm.aggregation import aggregate_loss, masked_mean


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor, *,
               value_clip: float | None = 0.2, num_tokens: int | torch.Tensor | None = None,
               dp_size: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss to backpropagate, metrics). `old_values` are the critic's values at collection, `returns` the GAE
    targets; `num_tokens` / `dp_size` follow aggregation.py's global-window contract (token-mean)."""
    # off the mask every input is 0: a NaN / inf there (padding) left the loss alone but made its gradient 0 * NaN
    m = action_mask.bool()
    values, old_values, returns = (torch.where(m, x, 0.0) for x in (values, old_values, returns))
    loss_mat = 0.5 * (values - returns).square()
    metrics = {}
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss_mat = torch.max(loss_mat, 0.5 * (clipped - returns).square())
        metrics["value_clip_frac"] = masked_mean(((values - old_values).abs() > value_clip).float(), action_mask)
    loss = aggregate_loss(loss_mat, action_mask, "token-mean", num_tokens=num_tokens, dp_size=dp_size)
    metrics["value_loss"] = masked_mean(loss_mat.detach(), action_mask)
    return loss, metrics
