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
    """First-fit-decreasing bins of `max_tokens` (>= 1: parallelism.max_tokens_per_micro_batch's bound)."""
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
    """Concatenate token-aligned tensors of each sample into [1, T, ...]; add position_ids."""
    # token-aligned tensors: [T] or [T, ...] (e.g. R3's routed experts [T, layers, top_k])
    keys = keys or tuple(k for k, v in samples[0].items() if torch.is_tensor(v) and v.dim() >= 1)
    out = {k: torch.cat([s[k] for s in samples])[None] for k in keys}
    out["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None]
    return out


def unpack(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[1, T] packed row -> [S, max(lengths)] right-padded with 0 (the inverse of `pack` for one key)."""
    return torch.nn.utils.rnn.pad_sequence(torch.split(x[0], lengths), batch_first=True)


def partition_padded(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Bins for right-padded [B, L] micro-batches: samples sorted by length, a bin grows while B·L_max (padding
    included) fits `max_tokens`, so neighbours of similar length share a bin and little compute is padding."""
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
    without any attention mask (the fused is_causal kernels); padded positions carry mask 0 in every loss, and
    `real_tokens` 0, which MoE routers read (the load-balancing loss and routing statistics skip padding)."""
    keys = keys or tuple(k for k, v in samples[0].items() if torch.is_tensor(v) and v.dim() >= 1)
    # routed experts pad with -1 ("engine routing unknown"), which routers and routing statistics skip
    out = {k: torch.nn.utils.rnn.pad_sequence([s[k] for s in samples], batch_first=True,
                                              padding_value=-1 if k == "routed_experts" else 0) for k in keys}
    n = out["input_ids"].shape[1]
    out["position_ids"] = torch.arange(n).expand(len(samples), n).contiguous()
    out["real_tokens"] = torch.arange(n) < torch.tensor([len(s["input_ids"]) for s in samples])[:, None]
    return out


def prompt_groups(samples: list[dict], mask_key: str) -> list[list[int]]:
    """Sample indices grouped by their prompt, the tokens before the first `mask_key` token (a GRPO group's samples
    share it), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s["input_ids"][:_prompt_len(s, mask_key)].tolist()), []).append(i)
    return list(groups.values())


def shared_prompt_tokens(samples: list[dict], mask_key: str) -> list[int]:
    """Per prompt group (`prompt_groups` order): the tokens of its shared-prompt row, prompt once + every response."""
    # the group's samples share their first p tokens: every sample's tokens, less p for all samples but one
    return [sum(len(samples[i]["input_ids"]) for i in g) - (len(g) - 1) * _prompt_len(samples[g[0]], mask_key)
            for g in prompt_groups(samples, mask_key)]


def _prompt_len(s: dict, mask_key: str) -> int:
    """The tokens before the first `mask_key` token (all of them when none is set)."""
    m = s[mask_key].bool()
    return int(m.int().argmax()) if m.any() else len(m)


def shared_prompt_rows(samples: list[dict], mask_key: str) -> dict:
    """One row per prompt group: its prompt once, then each sample's tokens from its first `mask_key` token on
    (its response), with an attention mask that lets a response see the prompt and itself only, and position ids
    that continue the prompt's in every response. A response token's hidden state is then exactly the one of its
    own sample's row (causal attention over the same tokens at the same positions), while the prompt, often most
    of an RL sample, is computed once per group. Rows right-padded; padding sees the prompt and the padding. The mask
    is [T x T] per row and sdpa runs it with a masked kernel: meant for short rows (small models, CPU).

    Returns the model inputs `input_ids`, `position_ids` [R, T], `attention_mask` [R, 1, T, T] bool (True = may
    attend), and `sources` [S, L]: for token t of sample s (L = the longest sample), the flat index into the rows'
    [R * T] hidden states at token t-1, whose logits predict token t (0 at t = 0 and on padding)."""
    groups = prompt_groups(samples, mask_key)
    rows, width = [], max(shared_prompt_tokens(samples, mask_key))
    sources = torch.zeros(len(samples), max(len(s["input_ids"]) for s in samples), dtype=torch.long)
    for r, g in enumerate(groups):
        ids = samples[g[0]]["input_ids"]
        p = _prompt_len(samples[g[0]], mask_key)
        parts, pos, seg, end = [ids[:p]], [torch.arange(p)], [torch.zeros(p, dtype=torch.long)], p
        for j, i in enumerate(g):
            x = samples[i]["input_ids"]
            parts.append(x[p:])
            pos.append(torch.arange(p, len(x)))
            seg.append(torch.full((len(x) - p,), j + 1))
            before = torch.arange(len(x) - 1)  # token t-1 for t = 1..n-1: in the prompt, or in this response
            sources[i, 1:len(x)] = r * width + torch.where(before < p, before, before - p + end)
            end += len(x) - p
        pad = width - end
        rows.append((torch.cat(parts + [ids.new_zeros(pad)]), torch.cat(pos + [torch.arange(pad)]),
                     torch.cat(seg + [torch.full((pad,), -1)])))
    seg = torch.stack([s for _, _, s in rows])
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    visible = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # [R, query, key]
    return {"input_ids": torch.stack([x for x, _, _ in rows]), "position_ids": torch.stack([q for _, q, _ in rows]),
            "attention_mask": (visible & causal)[:, None], "sources": sources}
