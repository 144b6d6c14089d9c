"""A recorded copy plan for the single-pass weight sync: the engine's own loaders run once, and are then replayed.

In the single pass (shared_params.py) the engine worker holds views of the trainer's parameters for
as long as the trainer's storages stay put, and every sync loads the same views into the same engine parameters. The
first sync of a token runs the engine's weight loaders as usual under `record_copy_plan`, a TorchDispatchMode that
sees every aten op the loaders run. The plan is kept only when it is proven to be nothing but copies:

- every op is a view (a non-mutating op whose outputs alias its inputs: narrow, view, t, detach ...), a `copy_`, or a
  constant `fill_` into an engine tensor (vLLM's vocab-padding rows);
- every `copy_` reads a view of one of the shared (trainer) tensors and writes a view of an engine parameter or
  buffer storage that is not itself shared;
- nothing else runs: an allocation (a loader that casts into a temporary, `.to()`, `torch.cat`), arithmetic (a loader
  that scales or quantizes), a write anywhere else refuses the plan, and the loaders keep running on every sync.

Replaying the recorded copies and fills, with the same source and destination views, repeats exactly the work the
loaders did (copy_ is deterministic: the same bits). Fills are replayed too: a colocated engine's level-2 sleep
discards its weights' memory, padding rows included. On CUDA the copies are captured once in a CUDA graph, so a
sync is one graph launch instead of the Python loader loop (same-dtype copies become memcpy nodes), spread over a few
streams when no two destinations overlap (the order of disjoint copies cannot change a bit); on CPU they run one by
one, in order. Disjoint copies are also merged before a replay (`merged`): a MoE's per-expert copies, 3 per expert
and layer, become one per layer and projection, and a pair of transposed views (AutoModel's experts) goes through a
tiled kernel (transposed_copy.py) instead of torch's strided reads. The plan holds while the engine's parameter
addresses are those it was recorded against (the worker checks before each replay); the worker drops it with the
trainer views it reads (a new token).

The recorder is torch's dispatch mode (compat/torch.py). What is proven where: on the GPU stand-in of vLLM's model
runner (tests/gpu/_weight_sync_standin.py: loaders copy in place by name) and on CPU unit tests with vLLM-style fused
loaders (narrowed copies into a qkv parameter). Real vLLM on CUDA: unquantized layers load in place through their
`weight_loader`s (narrow + copy_), which this records, once the worker has left vLLM's layerwise reload (receiver.py
`load_in_place_on_cuda`, where compat.vllm finds every layer keeps the loaders' layout). Under the layerwise reload a
layer is first materialized into fresh tensors, loaded there, processed and copied into its kernel tensors: the
recorder sees that allocation and refuses, and the loaders run on every sync (quantized models, re-laid MoE
backends).
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch

from molt_hydra.compat.torch import dispatch_mode, is_view_op
from molt_hydra.weight_sync.transposed_copy import is_transposed, transposed_copy

CANDIDATE_STEPS = 8  # how many next copies `merged` tries as the second of a run


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(dispatch_mode()):
    def __init__(self, sources: set[int], destinations: set[int]):
        super().__init__()
        self.sources, self.destinations = sources, destinations
        self.copies: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        self.fills: list[tuple[torch.Tensor, float]] = []
        self.refusal: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refusal is None:
            self.refusal = self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs) -> str | None:
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if not isinstance(src, torch.Tensor) or _storage(src) not in self.sources:
                return "a copy from a tensor that is not a shared trainer view (the loader computed it)"
            if _storage(dst) not in self.destinations or _storage(dst) in self.sources:
                return "a copy into a tensor that is not an engine parameter or buffer"
            self.copies.append((dst, src, bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))))
            return None
        if is_view_op(func):
            return None
        if func is torch.ops.aten.fill_.Scalar and _storage(args[0]) in self.destinations:
            self.fills.append((args[0], args[1]))  # a constant into an engine tensor (vocab padding rows)
            return None
        return f"the loaders ran {func} (not a view or a copy)"


def disjoint(views: list[torch.Tensor]) -> bool:
    """No two views may touch the same byte (each judged by the span from its first to its last element)."""
    spans = []
    for t in views:
        if t.numel() == 0:
            continue
        if any(stride < 0 for stride in t.stride()):
            return False
        last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
        spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()))
    spans.sort()
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def merged(copies: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """The copies as fewer, larger ones, for destinations proven disjoint (their order is then free): copies of one
    shape and layout between the same two storages whose two addresses advance by constant steps (a MoE's
    per-expert copies: one projection of expert 0, 1, 2 ...) become one copy of views with one more dimension, the
    steps its strides. Each merged view holds exactly its copies' elements, so the same bytes are written from the
    same bytes; 3,072 copies of a 128-expert, 8-layer MoE become 24."""
    groups: dict[tuple, dict[int, tuple]] = {}
    for copy in copies:
        dst, src, non_blocking = copy
        key = (_storage(dst), _storage(src), dst.dtype, src.dtype, dst.shape, dst.stride(), src.stride(), non_blocking)
        # a broadcast source (copy_ takes one) stays alone: stacked, its shape would not be its copies' elements
        alone = not dst.numel() or src.shape != dst.shape
        groups.setdefault((id(copy),) if alone else key, {})[dst.data_ptr()] = copy
    out = []
    for group in groups.values():
        free = dict(sorted(group.items()))
        while free:
            first, *after = itertools.islice(free.values(), CANDIDATE_STEPS + 1)
            run = max((_progression(first, second, free) for second in after), key=len, default=[first])
            for dst, _, _ in run:
                del free[dst.data_ptr()]
            out.append(run[0] if len(run) == 1 else _stacked(run))
    return out


def _progression(first: tuple, second: tuple, free: dict[int, tuple]) -> list[tuple]:
    """`first`, `second` and the copies after them in `free` whose destination and source both go on by the steps
    from `first` to `second` (a step that is not a positive whole number of elements: `first` alone)."""
    steps = [b.data_ptr() - a.data_ptr() for a, b in zip(first[:2], second[:2])]
    if any(step <= 0 or step % t.element_size() for step, t in zip(steps, first[:2])):
        return [first]
    run = [first]
    while (nxt := free.get(first[0].data_ptr() + len(run) * steps[0])) is not None and \
            nxt[1].data_ptr() == first[1].data_ptr() + len(run) * steps[1]:
        run.append(nxt)
    return run


def _stacked(run: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A run of `_progression` as one copy: each side's first view with a leading dimension of the run's length."""
    def stack(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        step = (second.data_ptr() - first.data_ptr()) // first.element_size()
        return first.as_strided((len(run), *first.shape), (step, *first.stride()), first.storage_offset())

    (dst0, src0, non_blocking), (dst1, src1, _) = run[0], run[1]
    return stack(dst0, dst1), stack(src0, src1), non_blocking


class CopyPlan:
    """The copies a recorded load made, in order, as (destination view, source view); `names`: what was loaded;
    `addresses`: where the engine's parameters were at the recording (the plan holds while they stay there)."""

    BRANCHES = 4

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor, bool]], names: list[str],
                 addresses: tuple[int, ...], fills: list[tuple[torch.Tensor, float]] = ()):
        self.copies = copies
        self.names = names
        self.addresses = addresses
        self.fills = list(fills)  # (destination, value): replayed before the copies (`record_copy_plan` proves it)
        # copies into disjoint destinations may run in any order: spread over a few streams in the graph, so the many
        # small ones (norms) and each copy's launch gap hide behind the large ones; else one stream, recorded order
        self.streams = self.BRANCHES if disjoint([dst for dst, _, _ in copies]) else 1
        self.graph = None  # CUDA: captured on the first replay

    @functools.cached_property
    def replayed(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """What a replay runs: the copies merged where their order is free (made at the first replay)."""
        return merged(self.copies) if self.streams > 1 else self.copies

    def replay(self) -> None:
        if self.copies and self.copies[0][0].is_cuda:
            if self.graph is None:
                self._run([None])  # once outside the graph: the tiled kernel compiles before the capture
                self.graph = self._capture()
            self.graph.replay()
        else:
            self._run([None])  # CPU: one by one, in order

    def _run(self, branches: list) -> None:
        """The fills, then the copies spread over `branches`: CUDA streams, forked from the first after the fills and
        joined back by `_capture`; [None]: no stream of their own (CPU)."""
        with torch.no_grad():
            for dst, value in self.fills:
                dst.fill_(value)
            for branch in branches[1:]:
                branch.wait_stream(branches[0])
            for i, (dst, src, non_blocking) in enumerate(self.replayed):
                branch = branches[i % len(branches)]  # None: no stream of its own (on a CPU worker, no CUDA call)
                with torch.cuda.stream(branch) if branch is not None else contextlib.nullcontext():
                    if is_transposed(dst, src):  # AutoModel's experts: torch's copy reads them strided
                        transposed_copy(dst, src)
                    else:
                        dst.copy_(src, non_blocking=non_blocking)

    def _capture(self):
        """One CUDA graph of every copy (no allocation: copies between existing tensors). The capture records the
        copies without running them; the stream that replays it is ordered after the capture's side stream."""
        device = self.copies[0][0].device
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            capture = torch.cuda.current_stream(device)
            branches = [capture, *(torch.cuda.Stream(device) for _ in range(self.streams - 1))]
            self._run(branches)
            for branch in branches[1:]:  # joined back before the capture ends
                capture.wait_stream(branch)
        torch.cuda.current_stream(device).synchronize()
        return graph


def record_copy_plan(load, weights: list[tuple[str, torch.Tensor]], engine_tensors: list[torch.Tensor],
                     addresses: tuple[int, ...], allow_empty: bool = False) -> CopyPlan | str:
    """Run `load()` (the engine's loaders over `weights`, views of the trainer's tensors) and watch it: a `CopyPlan`
    when it only copied shared views into `engine_tensors`' storages, else the reason it is refused. The load itself
    runs in full either way."""
    recorder = _Recorder({_storage(t) for _, t in weights}, {_storage(t) for t in engine_tensors})
    with recorder:
        load()
    if recorder.refusal is not None:
        return recorder.refusal
    if not recorder.copies and not allow_empty:  # a part of a load (one bucket) may copy nothing: a tied head
        return "the loaders copied nothing"
    if recorder.fills and not disjoint([dst for dst, _ in recorder.fills] + [dst for dst, _, _ in recorder.copies]):
        return "a fill overlaps a copy (their order would matter)"
    return CopyPlan(recorder.copies, [n for n, _ in weights], addresses, recorder.fills)
