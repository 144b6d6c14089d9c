"""Weight-sync send side: gather full (unsharded) tensors bucket by bucket, with HF parameter names; or, when one rank
holds every weight whole, hand out its own parameter tensors (the single-pass GPU sync shares them, no gather, no copy).

Every rank must drive the generator (each DTensor's full_tensor() is a collective); only rank 0 yields buckets.
The receive side and transports live in molt_hydra/rollout/weight_sync.py.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from molt_hydra.rollout.buckets import bucket_weights


def iter_weight_buckets(model: nn.Module, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", to_hf=None,
                       keep=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (hf_name, full tensor on `device`, cast to `dtype` if given), each ≤ bucket_bytes unless a
    single tensor is larger. A tied lm_head is skipped (the receiver re-ties it to the embedding). to_hf maps a
    model's own (name, full tensor) to [(hf_name, tensor), ...] (AutoModel's grouped experts -> one per expert).
    keep: a predicate on the model's own names; only those tensors are gathered (a LoRA adapter's)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))

    def full_tensors():
        for name, t in model.state_dict().items():
            if tied and name == "lm_head.weight" or keep is not None and not keep(name):
                continue
            full = t.full_tensor() if isinstance(t, DTensor) else t  # a collective: every rank runs it
            if rank0:
                # cast where the tensor lives (GPU), then copy: a host-side fp32->bf16 cast runs at < 1 GB/s
                for hf_name, x in (to_hf(name, full.detach()) if to_hf else [(name, full.detach())]):
                    yield hf_name, x.to(dtype=dtype or x.dtype).to(device)

    yield from bucket_weights(full_tensors(), bucket_bytes)


def local_full_weights(model: nn.Module, to_hf=None) -> list[tuple[str, torch.Tensor]] | None:
    """(hf_name, tensor) of every weight as a view of this rank's own parameter storage, the one the optimizer updates
    in place, when it holds the full tensor (one rank: FSDP2 with dp=1, or no FSDP); a tied lm_head is skipped as in
    `iter_weight_buckets`. None as soon as one weight would need a gather or a copy: more than one rank, a shard
    smaller than its tensor, an FSDP module currently holding unsharded (temporary) parameters, or a `to_hf`
    conversion that makes new tensors. Sharing a temporary would let the engine read memory that is later reused."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return None
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    state = model.state_dict()  # first: FSDP's state-dict hook registers the sharded parameters again
    storages = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                for p in [*model.parameters(), *model.buffers()]}
    out = []
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue
        if fsdp and not isinstance(t, DTensor):
            return None  # FSDP's unsharded parameters: freed or re-gathered by the next forward
        local = (t.to_local() if isinstance(t, DTensor) else t).detach()
        if local.shape != t.shape:
            return None
        for hf_name, x in (to_hf(name, local) if to_hf else [(name, local)]):
            if x.untyped_storage().data_ptr() not in storages:
                return None
            out.append((hf_name, x))
    return out


def parameter_addresses(model: nn.Module) -> tuple[int, ...]:
    """Address of every parameter and buffer (a DTensor's local shard), module by module: a cheap check, each sync,
    that the tensors `local_full_weights` found (or a replayed copy plan writes) are still the ones the model holds
    (a replaced tensor or `.data` has a new address: the old one is kept alive by whoever holds it). A plain walk of
    the module dicts: `parameters()` + `buffers()` cost ~1 ms per sync on a 4B model (named_modules' prefixes and
    de-duplication; a tied tensor is simply listed twice here). `_local_tensor`, not `to_local()` (an autograd call)."""
    out, stack = [], [model]
    while stack:
        module = stack.pop()
        if module is None:
            continue
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                out.append((t._local_tensor if isinstance(t, DTensor) else t).data_ptr())
        stack.extend(module._modules.values())
    return tuple(out)
