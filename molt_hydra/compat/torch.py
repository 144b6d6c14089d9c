"""torch: what the package uses below torch's public surface, and the releases it is checked against.

- `TorchDispatchMode` (torch.utils._python_dispatch): a mode that sees every aten op run under it, with the op's
  schema (`is_view_op`: mutability, alias info of its returns). The weight sync's copy plan (weight_sync/copy_plan.py)
  records an engine's weight loaders with it, and proves them to be views and copies only.
- A DTensor built from its spec (`DTensor(local, spec)`, torch.distributed.tensor._dtensor_spec): a host-memory shard
  placed like a GPU parameter, as FSDP2's own CPU offload holds them (parallel/optim.py, parallelism.offload=optimizer);
  the public `DTensor.from_local` moves the shard to the mesh's device.
- torch.compile's counters (torch._dynamo.utils.counters["stats"]["unique_graphs"]): the graphs built so far in this
  process, so a recompile (a new shape, a failed guard) shows as a step's `perf/compiled_graphs` rising; and the
  graphs one function holds (torch._dynamo.eval_frame._debug_get_cache_entry_list: its code's cache entries).
Written for torch 2.11 (the GPU build) to 2.13 (CPU); tests/unit/test_compat_weight_loading.py and
tests/unit/test_torch_compat.py check what they rely on against the installed torch.
"""

from __future__ import annotations

from molt_hydra.compat import written_for

SUPPORTED = {"torch": ("2.11", "2.12", "2.13")}


def _check(what: str) -> None:
    import torch  # the imported build's version: free to read, where the package metadata costs ms (once a param)

    written_for(what, "torch", SUPPORTED, ("torch", torch.__version__))


def dispatch_mode() -> type:
    """torch's TorchDispatchMode base class; a clear error on a torch outside the range above."""
    _check("the weight sync's copy plan")
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def dtensor_in_place(local, template):
    """`local` (e.g. an fp32 copy in host memory of `template`'s shard) as a DTensor of `local`'s dtype placed like
    `template`, `local` kept where it is (no move to the mesh's device)."""
    _check("the host-memory optimizer state")
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = template._spec
    meta = TensorMeta(template.shape, template.stride(), local.dtype)
    return DTensor(local, DTensorSpec(spec.mesh, spec.placements, meta), requires_grad=False)


def is_view_op(func) -> bool:
    """Non-mutating, and every output aliases an input (read-only alias): narrow/slice, view, t, detach ... (the op's
    `_schema`, as a dispatch mode sees it)."""
    schema = func._schema
    if schema.is_mutable or not schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def compiled_graphs() -> int:
    """The graphs torch.compile has built in this process (each recompile adds one)."""
    _check("the compiled-graph count")
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graphs_of(fn) -> int:
    """The graphs torch.compile holds for the plain Python function `fn` (one per recompile), of any device."""
    _check("the compiled-graph count")
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))
