"""Token log-probs and entropy from logits at a sampling temperature, in fp32, chunked over tokens.

`linear_logprobs_entropy` fuses the lm_head into the same computation: chunk by chunk from the final hidden states,
so the [tokens x vocab] logits never exist at once, in the model dtype or in fp32 (the backward recomputes each chunk).

Convention used by the whole trainer (token-aligned): for a row of ids `x[0..T)`, `logprobs[t] = log p(x[t] | x[<t])`
and `logprobs[0] = 0`; the quantity for token t comes from the logits at position t-1. Action / loss masks use the
same alignment (mask[t] = 1 iff token t is trained on), so masks, rollout log-probs and advantages never shift.
"""

from __future__ import annotations

import torch

LOGPROB_CHUNK_TOKENS = 2048  # rows of logits taken at a time: bounds the fp32 working set


def _per_chunk(logits: torch.Tensor, ids: torch.Tensor, temperature: float, chunk_size: int, fn) -> torch.Tensor:
    """`fn(fp32 chunk of the shifted logits / T, the chunk's token ids)` over row chunks: [B, T], column 0 = 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # logits at t-1 predict token t; flatten rows so chunks bound the fp32 working set
    z, y = logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    parts = [fn(z[s:s + chunk_size].float() / temperature, y[s:s + chunk_size])
             for s in range(0, z.shape[0], chunk_size)]
    return _pad_first(torch.cat(parts) if parts else z.new_zeros(0, dtype=torch.float32), ids.shape)


def _pad_first(values: torch.Tensor, shape) -> torch.Tensor:
    out = values.new_zeros(shape)
    out[:, 1:] = values.view(shape[0], shape[1] - 1)
    return out


def logprobs_from_logits(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                         chunk_size: int = LOGPROB_CHUNK_TOKENS) -> torch.Tensor:
    """[B, T, V] logits, [B, T] ids -> [B, T] fp32 log p(ids[t]) under log_softmax(logits[t-1] / T); column 0 is 0."""
    # logp = z_y - logsumexp(z): never materialises the full log_softmax of the chunk
    return _per_chunk(logits, ids, temperature, chunk_size,
                      lambda zc, yc: zc.gather(-1, yc[:, None])[:, 0] - torch.logsumexp(zc, dim=-1))


def entropy_from_logits(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                        chunk_size: int = LOGPROB_CHUNK_TOKENS) -> torch.Tensor:
    """[B, T] fp32 entropy H = logsumexp(z) - sum softmax(z) z of the distribution that produced token t
    (z = logits/T)."""
    return _per_chunk(logits, ids, temperature, chunk_size,
                      lambda zc, _: torch.logsumexp(zc, dim=-1) - (torch.softmax(zc, dim=-1) * zc).sum(-1))


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """log p(y) and entropy of softmax((h @ W^T) / T) per row of h, computed in fp32 over row chunks; only h, W and
    two fp32 numbers per row (logsumexp, entropy) are kept for the backward, which recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h, weight, y, temperature, chunk, with_entropy):
        n = h.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else None
        for s in range(0, n, chunk):
            z = (h[s:s + chunk] @ weight.T).float().div_(temperature)
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            lp[s:s + chunk] = z.gather(-1, y[s:s + chunk, None])[:, 0] - lse[s:s + chunk]
            if with_entropy:  # H = lse - sum p z
                ent[s:s + chunk] = lse[s:s + chunk] - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(h, weight, y, lse, ent if with_entropy else lse)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return (lp, ent) if with_entropy else (lp, lp.new_zeros(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, y, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        use_ent = ctx.with_entropy and g_ent is not None and g_ent.numel() > 0
        for s in range(0, h.shape[0], chunk):
            hc = h[s:s + chunk]
            z = (hc @ weight.T).float().div_(t)
            logp = z.sub_(lse[s:s + chunk, None])  # log softmax, in place of z
            p = logp.exp()
            # d lp / dz = onehot(y) - p;  d H / dz = -p (log p + H)
            dz = p * (-g_lp[s:s + chunk, None]) if g_lp is not None else torch.zeros_like(p)
            if g_lp is not None:
                dz.scatter_add_(-1, y[s:s + chunk, None], g_lp[s:s + chunk, None])
            if use_ent:
                dz -= p * logp.add_(ent[s:s + chunk, None]) * g_ent[s:s + chunk, None]
            dz = dz.div_(t).to(weight.dtype)
            if grad_h is not None:
                grad_h[s:s + chunk] = dz @ weight
            if grad_w is not None:
                grad_w += (dz.T @ hc).float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None


def linear_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                            chunk_size: int = LOGPROB_CHUNK_TOKENS, with_entropy: bool = False,
                            needed: torch.Tensor | None = None, sources: torch.Tensor | None = None):
    """[B, T, H] final hidden states and the [V, H] lm_head weight -> ([B, T] fp32 log p(ids[t]), [B, T] fp32 entropy
    or None), token-aligned as `logprobs_from_logits` of `hidden @ weight.T`, never holding more than `chunk_size`
    rows of logits (fp32) at a time, forward or backward.

    `needed` ([B, T], token-aligned like the masks): only those tokens' values are computed, the others are 0. The
    head is ~a quarter of a small model's training FLOPs (4 vocab-wide matmuls per row), and an RL batch's prompts and
    padding, often half its tokens, are never in a loss.

    `sources` ([B, T] ints, with `needed`): the hidden states are laid out otherwise (parallel/batching.py
    `shared_prompt_rows`); token t of row b is predicted by the flat row `sources[b, t]` of `hidden` ([R, T', H])."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if sources is not None:
        if needed is None:
            raise ValueError("linear_logprobs_entropy: `sources` needs `needed` (token 0 has no source)")
        keep = needed.reshape(-1).nonzero()[:, 0]
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, sources.reshape(-1).index_select(0, keep))
        y = ids.reshape(-1).index_select(0, keep)
        lp, ent = _ChunkedLinearLogprobs.apply(h, weight, y, float(temperature), int(chunk_size), with_entropy)
        lp = lp.new_zeros(ids.numel()).index_copy(0, keep, lp).view(ids.shape)
        return lp, (ent.new_zeros(ids.numel()).index_copy(0, keep, ent).view(ids.shape) if with_entropy else None)
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = ids[:, 1:].reshape(-1)
    keep = None if needed is None else needed[:, 1:].reshape(-1).nonzero()[:, 0]
    if keep is not None:
        h, y = h.index_select(0, keep), y.index_select(0, keep)
    lp, ent = _ChunkedLinearLogprobs.apply(h, weight, y, float(temperature), int(chunk_size), with_entropy)
    if keep is not None:  # back to every row, 0 where not needed (index_copy passes the gradient to its source)
        n = ids.shape[0] * (ids.shape[1] - 1)
        lp = lp.new_zeros(n).index_copy(0, keep, lp)
        ent = ent.new_zeros(n).index_copy(0, keep, ent) if with_entropy else ent
    return _pad_first(lp, ids.shape), (_pad_first(ent, ids.shape) if with_entropy else None)
