"""Token-budget micro-batching: right-padded [B, L] rows (the default) or packed [1, T] streams.

Rows: samples sorted by length fill a bin while B·L_max fits the budget (`partition_padded`), then `pad_rows`
right-pads them; causal attention makes padding invisible to real tokens, so no attention mask is needed.
Packed streams (`parallelism.packing`): count = the fewest bins of capacity `max_tokens` by first-fit-decreasing (a
sample longer than the budget gets its own bin); partition = greedy LPT (longest sample first into the currently
lightest bin) into exactly k bins, within 4/3 of the optimal makespan; samples of a bin are concatenated into one
[1, T] row with position_ids restarting at 0 per sample, which HF turns into a block-diagonal causal mask.
"""

from __future__ import annotations

import heapq

import torch


def count_micro_batches(lengths: list[int], max_tokens: int) -> int:
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be > 0, got {max_tokens}")
    bins: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, used in enumerate(bins):
            if used + n <= max_tokens:
                bins[i] += n
                break
        else:
            bins.append(n)
    return max(1, len(bins))


def partition_balanced(lengths: list[int], k: int) -> list[list[int]]:
    """Split sample indices into k bins with near-equal token sums (LPT); bins may be empty when k > len."""
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins]


def pack(samples: list[dict], keys: tuple[str, ...] | None = None) -> dict:
    """Concatenate token-aligned tensors of each sample into [1, T, ...]; add position_ids and seq_index."""
    # token-aligned tensors: [T] or [T, ...] (e.g. R3's routed experts [T, layers, top_k])
    keys = keys or tuple(k for k, v in samples[0].items() if torch.is_tensor(v) and v.dim() >= 1)
    out = {k: torch.cat([s[k] for s in samples])[None] for k in keys}
    out["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None]
    out["seq_index"] = torch.cat([torch.full((len(s["input_ids"]),), i) for i, s in enumerate(samples)])[None]
    return out


def unpack(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[1, T] packed row -> [S, max(lengths)] right-padded with 0 (the inverse of `pack` for one key)."""
    rows = torch.split(x[0], lengths)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def partition_padded(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Bins for right-padded [B, L] micro-batches: samples sorted by length, a bin grows while B·L_max (padding
    included) fits `max_tokens`, so neighbours of similar length share a bin and little compute is padding."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be > 0, got {max_tokens}")
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def pad_rows(samples: list[dict], keys: tuple[str, ...] | None = None) -> dict:
    """Right-pad each key's per-sample tensors (first dim = tokens) into [B, L_max, ...] rows, with position_ids.

    Causal attention never looks right, so real tokens see exactly what they see unpadded and the model runs
    without any attention mask (the fused is_causal kernels); padded positions carry mask 0 in every loss."""
    keys = keys or tuple(k for k, v in samples[0].items() if torch.is_tensor(v) and v.dim() >= 1)
    # routed experts pad with -1 ("engine routing unknown"), which routers and routing statistics skip
    out = {k: torch.nn.utils.rnn.pad_sequence([s[k] for s in samples], batch_first=True,
                                              padding_value=-1 if k == "routed_experts" else 0) for k in keys}
    n = out["input_ids"].shape[1]
    out["position_ids"] = torch.arange(n).expand(len(samples), n).contiguous()
    return out
