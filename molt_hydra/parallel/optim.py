"""AdamW + HF LR schedule with warmup (Molt's optimizer block, AdamW only)."""

from __future__ import annotations

import math

import torch


def build_optimizer(model, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    # multi-tensor (foreach) kernels: a per-parameter loop over hundreds of DTensors costs ~1 s of CPU per step;
    # on GPU the fused kernel does the whole update in a few launches
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             **({"fused": True} if fused else {}))


def build_scheduler(optimizer, *, name: str = "constant", total_steps: int = 1, warmup_ratio: float = 0.0,
                    min_lr_ratio: float = 0.1):
    from transformers import get_scheduler

    if total_steps < 1:
        raise ValueError(f"scheduler total_steps must be >= 1, got {total_steps}")
    warmup = math.ceil(total_steps * warmup_ratio)
    extra = {"min_lr_rate": min_lr_ratio} if name == "cosine_with_min_lr" else None
    # as in HF: "constant" ignores the warmup, "constant_with_warmup" uses it
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs=extra)
