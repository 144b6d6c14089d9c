"""torch: the one module below torch's public surface the package uses, and the releases it is checked against.

`TorchDispatchMode` (torch.utils._python_dispatch): a mode that sees every aten op run under it, with the op's schema
(`is_view_op`: mutability, alias info of its returns). The weight sync's copy plan (weight_sync/copy_plan.py) records
an engine's weight loaders with it, and proves them to be views and copies only. Written for torch 2.11 (the GPU
build) to 2.13 (CPU); tests/unit/test_compat_weight_loading.py checks what it relies on against the installed torch.
"""

from __future__ import annotations

SUPPORTED = ((2, 11), (2, 13))  # inclusive


def dispatch_mode() -> type:
    """torch's TorchDispatchMode base class; a clear error on a torch outside the range above."""
    import torch

    found = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if not SUPPORTED[0] <= found <= SUPPORTED[1]:
        raise RuntimeError(f"torch {torch.__version__} is installed; the weight sync's copy plan (compat/torch.py) is "
                           f"written for torch {'.'.join(map(str, SUPPORTED[0]))}-{'.'.join(map(str, SUPPORTED[1]))}")
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def is_view_op(func) -> bool:
    """Non-mutating, and every output aliases an input (read-only alias): narrow/slice, view, t, detach ... (the op's
    `_schema`, as a dispatch mode sees it)."""
    schema = func._schema
    if schema.is_mutable or not schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
