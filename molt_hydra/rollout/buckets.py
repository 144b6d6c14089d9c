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


def pack_bucket(bucket: Bucket) -> tuple[list[tuple[str, str, list[int]]], torch.Tensor]:
    """(metas, flat): metas are (name, dtype name, shape); flat is every tensor's bytes back to back."""
    metas = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]) if bucket else (
        torch.empty(0, dtype=torch.uint8))
    return metas, flat


def packed_nbytes(metas: list[tuple[str, str, list[int]]]) -> int:
    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in metas)


def unpack_bucket(metas: list[tuple[str, str, list[int]]], flat: torch.Tensor) -> Bucket:
    """Inverse of `pack_bucket`: views into `flat`, no copies."""
    if flat.numel() != packed_nbytes(metas):
        raise ValueError(f"packed buffer has {flat.numel()} bytes, metas describe {packed_nbytes(metas)}")
    out: Bucket = []
    offset = 0
    for name, dtype, shape in metas:
        dt = getattr(torch, dtype)
        n = math.prod(shape) * dt.itemsize
        out.append((name, flat[offset : offset + n].view(dt).view(shape)))
        offset += n
    return out

