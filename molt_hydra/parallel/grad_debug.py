"""logger.debug_grad_norms (Molt's MOLT_FSDP_DEBUG_GRADS / _FILTER / _TOPK): the largest per-parameter gradient norms
of an optimizer step, before clipping, as metrics `<prefix>_grad_norm/<param name>`, plus how many parameters have a
non-finite gradient (`<prefix>_grad_nonfinite_params`). Only the parameters whose names match one of the fnmatch
patterns count (none given: all), and only the top k are logged, so a sink is not flooded with one series per
parameter. Collective under FSDP2: every rank calls it (a sharded grad's norm is reduced over its mesh)."""

from __future__ import annotations

import fnmatch
import math

import torch


def grad_norm_metrics(named_grads, patterns: tuple[str, ...], topk: int, prefix: str) -> dict[str, float]:
    """`named_grads`: (parameter name, its grad or None) in the same order on every rank."""
    norms = {}
    for name, grad in named_grads:
        if grad is None or (patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            continue
        norm = torch.linalg.vector_norm(grad.float())
        norms[name] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    # non-finite first (what one debugs), then the largest
    top = sorted(norms.items(), key=lambda kv: (math.isfinite(kv[1]), -kv[1] if math.isfinite(kv[1]) else 0))[:topk]
    out = {f"{prefix}_grad_norm/{name}": value for name, value in top}
    out[f"{prefix}_grad_nonfinite_params"] = float(sum(not math.isfinite(v) for v in norms.values()))
    return out
