"""Reduce a per-token loss [B, L] to the scalar one micro-batch backpropagates (Molt §2.7 `agg_loss`).

The global-token-mean contract: the optimizer step's window of micro-batches, over all data-parallel ranks, holds
N action tokens (`num_tokens`, all-reduced over DP before the window starts) and G sequences (`global_batch_size`).
Every micro-batch divides by that same N (or G) and multiplies by `dp_size` to cancel FSDP's mean over DP ranks;
losses are NOT divided by the number of micro-batches. Summed over the window and averaged over ranks this is exactly
`sum over all tokens of loss / N` (token-mean), whatever the micro-batch and sequence lengths.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` where `mask`; `where`, not `x * mask`, so NaN/inf outside the mask cannot leak into the sum."""
    x = torch.where(mask.bool(), x, 0.0)
    return x.sum() if dim is None else x.sum(dim, keepdim=True)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` (0 when the mask is empty); keeps `dim` when one is given."""
    count = mask.sum() if dim is None else mask.sum(dim, keepdim=True)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                   num_tokens: int | torch.Tensor | None = None, global_batch_size: int | torch.Tensor | None = None,
                   dp_size: int = 1, loss_scale_factor: float | None = None) -> torch.Tensor:
    """One micro-batch's share of the window loss.

    token-mean:               sum(loss*m) / N * dp_size                   (N = num_tokens; local sum(m) if dp_size == 1)
    seq-mean-token-sum:       sum_seq(sum_t loss*m) / G * dp_size         (G = global_batch_size; local #rows with a
                                                                          token if dp_size == 1)
    seq-mean-token-sum-norm:  seq-mean-token-sum / loss_scale_factor      (default: L, the mask width; the trainer
                                                                          passes a constant, data.max_len)
    seq-mean-token-mean:      sum_seq(sum_t loss*m / (sum_t m + 1e-8)) / G * dp_size
    An empty window (N or G == 0) gives 0.
    """
    if mode == "token-mean":
        if num_tokens is None:
            if dp_size > 1:
                raise ValueError("token-mean with dp_size > 1 needs num_tokens: the window's action-token count "
                                 "all-reduced over data-parallel ranks")
            num_tokens = mask.sum()
        return masked_sum(loss, mask) / torch.as_tensor(num_tokens).clamp(min=1) * dp_size
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg={mode!r} is not one of {list(LOSS_AGG_MODES)}")
    per_seq = masked_sum(loss, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (mask.sum(-1, keepdim=True) + 1e-8)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / (loss_scale_factor or mask.shape[-1])
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"{mode} with dp_size > 1 needs global_batch_size: the window's sequence count "
                             "summed over data-parallel ranks")
        global_batch_size = mask.bool().any(-1).sum()
    return per_seq.sum() / torch.as_tensor(global_batch_size).clamp(min=1) * dp_size
