"""Weight-sync send side: gather full (unsharded) tensors bucket by bucket, with HF parameter names.

Every rank must drive the generator (each DTensor's full_tensor() is a collective); only rank 0 yields buckets.
The receive side and transports live in molt_hydra/rollout/weight_sync.py.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from molt_hydra.rollout.buckets import bucket_weights


def iter_weight_buckets(model: nn.Module, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", to_hf=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (hf_name, full tensor on `device`, cast to `dtype` if given), each ≤ bucket_bytes unless a
    single tensor is larger. A tied lm_head is skipped (the receiver re-ties it to the embedding). to_hf maps a
    model's own (name, full tensor) to [(hf_name, tensor), ...] (AutoModel's grouped experts -> one per expert)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))

    def full_tensors():
        for name, t in model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            full = t.full_tensor() if isinstance(t, DTensor) else t  # a collective: every rank runs it
            if rank0:
                # cast where the tensor lives (GPU), then copy: a host-side fp32->bf16 cast runs at < 1 GB/s
                for hf_name, x in (to_hf(name, full.detach()) if to_hf else [(name, full.detach())]):
                    yield hf_name, x.to(dtype=dtype or x.dtype).to(device)

    yield from bucket_weights(full_tensors(), bucket_bytes)
