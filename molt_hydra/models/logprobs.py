"""Token log-probs and entropy from logits at a sampling temperature, in fp32, chunked over tokens.

Convention used by the whole trainer (token-aligned): for a row of ids `x[0..T)`, `logprobs[t] = log p(x[t] | x[<t])`
and `logprobs[0] = 0`; the quantity for token t comes from the logits at position t-1. Action / loss masks use the
same alignment (mask[t] = 1 iff token t is trained on), so masks, rollout log-probs and advantages never shift.
"""

from __future__ import annotations

import torch


def _shifted(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # logits at t-1 predict token t; flatten rows so chunks bound the fp32 working set
    return logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)


def _pad_first(values: torch.Tensor, shape) -> torch.Tensor:
    out = values.new_zeros(shape)
    out[:, 1:] = values.view(shape[0], shape[1] - 1)
    return out


def logprobs_from_logits(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                         chunk_size: int = 2048) -> torch.Tensor:
    """[B, T, V] logits, [B, T] ids -> [B, T] fp32 log p(ids[t]) under log_softmax(logits[t-1] / T); column 0 is 0."""
    z, y = _shifted(logits, ids, temperature)
    parts = []
    for s in range(0, z.shape[0], chunk_size):
        zc = z[s:s + chunk_size].float() / temperature
        # logp = z_y - logsumexp(z): never materialises the full log_softmax of the chunk
        parts.append(zc.gather(-1, y[s:s + chunk_size, None])[:, 0] - torch.logsumexp(zc, dim=-1))
    return _pad_first(torch.cat(parts) if parts else z.new_zeros(0, dtype=torch.float32), ids.shape)


def entropy_from_logits(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                        chunk_size: int = 2048) -> torch.Tensor:
    """[B, T] fp32 entropy H = logsumexp(z) - sum softmax(z) z of the distribution that produced token t (z = logits/T)."""
    z, _ = _shifted(logits, ids, temperature)
    parts = []
    for s in range(0, z.shape[0], chunk_size):
        zc = z[s:s + chunk_size].float() / temperature
        parts.append(torch.logsumexp(zc, dim=-1) - (torch.softmax(zc, dim=-1) * zc).sum(-1))
    return _pad_first(torch.cat(parts) if parts else z.new_zeros(0, dtype=torch.float32), ids.shape)
