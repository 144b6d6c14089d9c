"""Weight buckets: group (hf_name, tensor) pairs so the extra memory of one sync is bounded, and (un)pack a bucket
into one flat uint8 buffer for broadcast transports. Pure tensor code, shared by the trainer and the vLLM worker."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def bucket_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Flush before a tensor would push the bucket past `bucket_bytes`; a tensor bigger than that goes alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


Metas = list[tuple[str, str, list[int]]]
ALIGN = 16  # every tensor starts on a 16-byte boundary: `view(dtype)` of a slice needs its offset aligned


def pack_bucket(bucket: Bucket, dtype: torch.dtype | None = None, out=None) -> tuple[Metas, torch.Tensor]:
    """(metas, flat): metas are (name, dtype name, shape); flat holds every tensor (16-byte aligned) on the bucket's
    device. With `dtype`, floating tensors are cast while they are packed (an fp32 master weight becomes the engine's
    bf16 on the wire without a separate cast copy); integer tensors keep their dtype. `out(nbytes)`, if given,
    returns a uint8 buffer of at least nbytes to pack into (e.g. a reused shared-memory region)."""
    metas = bucket_metas(bucket, dtype)
    nbytes = packed_nbytes(metas)
    if out is not None:
        flat = out(nbytes)[:nbytes]
    else:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=bucket[0][1].device if bucket else "cpu")
    if bucket:  # one call for the whole bucket: per-tensor Python overhead dominates small tensors
        torch._foreach_copy_([slot for _, slot in unpack_bucket(metas, flat)], [t.detach() for _, t in bucket])
    return metas, flat


def bucket_metas(bucket: Bucket, dtype: torch.dtype | None = None) -> Metas:
    """(name, dtype name, shape) of each tensor as `pack_bucket` packs it (floating tensors cast to `dtype`)."""
    return [(name, str(dtype if dtype is not None and t.is_floating_point() else t.dtype).removeprefix("torch."),
             list(t.shape)) for name, t in bucket]


def _slots(metas: Metas) -> list[tuple[int, int]]:
    """(offset, nbytes) of each tensor in the flat buffer."""
    out, offset = [], 0
    for _, dtype, shape in metas:
        n = math.prod(shape) * getattr(torch, dtype).itemsize
        out.append((offset, n))
        offset += -(-n // ALIGN) * ALIGN
    return out


def packed_nbytes(metas: Metas) -> int:
    return max((o + -(-n // ALIGN) * ALIGN for o, n in _slots(metas)), default=0)


def unpack_bucket(metas: Metas, flat: torch.Tensor) -> Bucket:
    """Inverse of `pack_bucket`: views into `flat`, no copies."""
    if flat.numel() != packed_nbytes(metas):
        raise ValueError(f"packed buffer has {flat.numel()} bytes, metas describe {packed_nbytes(metas)}")
    return [(name, flat[o : o + n].view(getattr(torch, dtype)).view(shape))
            for (name, dtype, shape), (o, n) in zip(metas, _slots(metas))]
