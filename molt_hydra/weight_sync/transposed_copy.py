"""A tiled copy for a destination whose rows are a source's columns: the copy of a MoE's experts from a trainer
that keeps them transposed (NeMo AutoModel's grouped experts are [E, hidden, 2I] / [E, I, hidden], vLLM's `w13` /
`w2` are [E, 2I, hidden] / [E, hidden, I]).

torch's elementwise `copy_` walks such a pair in the destination's order, reading the source across its rows. In the
colocated runs the engine's load of AutoModel's experts, one transposed copy per expert and projection, ran at
0.15-0.19 of a device copy (bench/RESULTS.md, sessions 26 and 34); merged one per layer and projection and copied by
this kernel, at 0.92 (session 35; in one process, bench/expert_copy.py, the per-expert copies already ran at 0.92,
so which of the two mattered in the run is not separated). The kernel moves a tile at a time, read along the
source's contiguous dimension and written along the destination's (Triton stages the tile through shared memory), as
a transpose kernel does. CUDA only (Triton); bit-equal to `copy_`, casts included (round to nearest even).
"""

from __future__ import annotations

import functools

import torch

TILE = 64


def is_transposed(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """[B,] R, C views where the destination's rows are contiguous and the source's columns are: the case the tiled
    kernel serves (else torch's `copy_` reads or writes along a contiguous dimension already)."""
    return (dst.is_cuda and src.is_cuda and src.shape == dst.shape and dst.dim() in (2, 3) and dst.shape[-1] > 1
            and dst.shape[-2] > 1 and dst.stride(-1) == 1 and src.stride(-2) == 1 and src.stride(-1) != 1)


def transposed_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for a pair `is_transposed` accepts, tile by tile (capturable in a CUDA graph once compiled:
    `CopyPlan` runs its copies once before the capture)."""
    d, s = (dst, src) if dst.dim() == 3 else (dst.unsqueeze(0), src.unsqueeze(0))
    batch, rows, cols = d.shape
    grid = (-(-rows // TILE), -(-cols // TILE), batch)
    _kernel()[grid](s, d, rows, cols, *s.stride(), *d.stride(), TILE=TILE)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_tiles(src, dst, rows, cols, s_b, s_r, s_c, d_b, d_r, d_c, TILE: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        r = (tl.program_id(0) * TILE + tl.arange(0, TILE)).to(tl.int64)[:, None]
        c = (tl.program_id(1) * TILE + tl.arange(0, TILE)).to(tl.int64)[None, :]
        inside = (r < rows) & (c < cols)
        tile = tl.load(src + b * s_b + r * s_r + c * s_c, mask=inside)
        tl.store(dst + b * d_b + r * d_r + c * d_c, tile.to(dst.dtype.element_ty), mask=inside)

    return copy_tiles
