"""Weight buckets: which tensors a sync sends, gathered full on the trainer and grouped so the extra memory of one sync
is bounded (`iter_weight_buckets`), or lent as they are when one rank holds every weight whole
(`local_full_weights`); and each bucket (un)packed as one flat uint8 buffer for the packed transports.

Every trainer rank must drive `iter_weight_buckets` (each DTensor's full_tensor() is a collective); only rank 0 gets
tensors. A tied lm_head is never sent: the engine re-ties its own. Tensors carry the checkpoint's HF names.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

Bucket = list[tuple[str, torch.Tensor]]
Metas = list[tuple[str, str, list[int]]]
ALIGN = 16  # every tensor starts on a 16-byte boundary: `view(dtype)` of a slice needs its offset aligned


def bucket_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Flush before a tensor would push the bucket past `bucket_bytes`; a tensor bigger than that goes alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0  # bytes in `bucket`
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _sent_state(model: nn.Module, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state a sync sends: all of it but a tied lm_head, and only the names `keep` accepts."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if not (tied and name == "lm_head.weight" or keep is not None and not keep(name)):
            yield name, t


def iter_weight_buckets(model: nn.Module, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", to_hf=None, keep=None) -> Iterator[Bucket]:
    """Yield lists of (hf_name, full tensor on `device`, cast to `dtype` if given), each ≤ bucket_bytes unless a
    single tensor is larger. to_hf maps a model's own (name, full tensor) to [(hf_name, tensor), ...] (AutoModel's
    grouped experts -> one per expert). keep: a predicate on the model's own names (a LoRA adapter's)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0

    def full_tensors():
        for name, t in _sent_state(model, keep):
            full = t.full_tensor() if isinstance(t, DTensor) else t  # a collective: every rank runs it
            if rank0:
                # cast where the tensor lives (GPU), then copy: a host-side fp32->bf16 cast runs at < 1 GB/s
                for hf_name, x in (to_hf(name, full.detach()) if to_hf else [(name, full.detach())]):
                    yield hf_name, x.to(dtype=dtype or x.dtype).to(device)

    yield from bucket_weights(full_tensors(), bucket_bytes)


def local_full_weights(model: nn.Module, to_hf=None) -> list[tuple[str, torch.Tensor]] | None:
    """(hf_name, tensor) of every weight as a view of this rank's own parameter storage, the one the optimizer updates
    in place, when it holds the full tensor (one rank: FSDP2 with dp=1, or no FSDP). None as soon as one weight would
    need a gather or a copy: more than one rank, a shard smaller than its tensor, an FSDP module currently holding
    unsharded (temporary) parameters, or a `to_hf` conversion that makes new tensors. Sharing a temporary would let
    the engine read memory that is later reused."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return None
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    state = list(_sent_state(model))  # first: FSDP's state-dict hook registers the sharded parameters again
    storages = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                for p in [*model.parameters(), *model.buffers()]}
    out = []
    for name, t in state:
        local = (t.to_local() if isinstance(t, DTensor) else t).detach()
        # a shard, or FSDP's unsharded parameters (freed or re-gathered by the next forward)
        if local.shape != t.shape or fsdp and not isinstance(t, DTensor):
            return None
        for hf_name, x in (to_hf(name, local) if to_hf else [(name, local)]):
            if x.untyped_storage().data_ptr() not in storages:
                return None
            out.append((hf_name, x))
    return out


def parameter_addresses(model: nn.Module) -> tuple[int, ...]:
    """Address of every parameter and buffer (a DTensor's local shard), module by module: a cheap check, each sync,
    that the tensors `local_full_weights` found (trainer side) or a replayed copy plan writes (engine side) are still
    the ones the model holds (a replaced tensor or `.data` has a new address: the old one is kept alive by whoever
    holds it). A plain walk of the module dicts: `parameters()` + `buffers()` cost ~1 ms per sync on a 4B model
    (named_modules' prefixes and de-duplication). `_local_tensor`, not `to_local()` (an autograd call)."""
    out, stack = [], [model]
    while stack:
        module = stack.pop()
        out.extend((t._local_tensor if isinstance(t, DTensor) else t).data_ptr()
                   for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)
        stack.extend(m for m in module._modules.values() if m is not None)
    return tuple(out)


def pack_bucket(bucket: Bucket, dtype: torch.dtype | None = None, out=None) -> tuple[Metas, torch.Tensor]:
    """(metas, flat): metas are (name, dtype name, shape); flat holds every tensor (16-byte aligned) on the bucket's
    device. With `dtype`, floating tensors are cast while they are packed (an fp32 master weight becomes the engine's
    bf16 on the wire without a separate cast copy); integer tensors keep their dtype. `out(nbytes)`, if given,
    returns a uint8 buffer of at least nbytes to pack into (e.g. a reused shared-memory region)."""
    metas = bucket_metas(bucket, dtype)
    nbytes = packed_nbytes(metas)
    flat = out(nbytes)[:nbytes] if out is not None else \
        torch.empty(nbytes, dtype=torch.uint8, device=bucket[0][1].device if bucket else "cpu")
    if bucket:  # one call for the whole bucket: per-tensor Python overhead dominates small tensors
        torch._foreach_copy_([slot for _, slot in unpack_bucket(metas, flat)], [t.detach() for _, t in bucket])
    return metas, flat


def bucket_metas(bucket: Bucket, dtype: torch.dtype | None = None) -> Metas:
    """(name, dtype name, shape) of each tensor as `pack_bucket` packs it (floating tensors cast to `dtype`)."""
    return [(name, str(dtype if dtype is not None and t.is_floating_point() else t.dtype).removeprefix("torch."),
             list(t.shape)) for name, t in bucket]


def _slots(metas: Metas) -> list[tuple[int, int]]:
    """(offset, nbytes) of each tensor in the flat buffer."""
    sizes = [math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in metas]
    return list(zip(itertools.accumulate((-(-n // ALIGN) * ALIGN for n in sizes), initial=0), sizes))


def packed_nbytes(metas: Metas) -> int:
    return sum(-(-n // ALIGN) * ALIGN for _, n in _slots(metas))


def unpack_bucket(metas: Metas, flat: torch.Tensor) -> Bucket:
    """Inverse of `pack_bucket`: views into `flat`, no copies."""
    if flat.numel() != packed_nbytes(metas):
        raise ValueError(f"packed buffer has {flat.numel()} bytes, metas describe {packed_nbytes(metas)}")
    return [(name, flat[o : o + n].view(getattr(torch, dtype)).view(shape))
            for (name, dtype, shape), (o, n) in zip(metas, _slots(metas))]
