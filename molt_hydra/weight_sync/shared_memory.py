"""The shared-memory transport: engines on the trainer's host map one reused region, or are written into in place.

Each bucket is packed (cast to the engine dtype while copying: the one copy on this side) into a shared-memory region
that every engine worker maps once and hands to vLLM's weight loader as views, with no serialisation. The region is a
memfd (nothing left in /dev/shm if the trainer is killed; workers open it as /proc/<pid>/fd/<fd>), kept for every
later bucket and sync, replaced only when a bucket outgrows it. It has two slots, so bucket k+1 is packed while the
engines load bucket k; a slot is reused once the engines answered for the bucket it held.

Mapped in place (CPU engines with plain weights): such a worker moves its parameters into a shared region of its own
on the first sync and records what its loaders copied from each bucket (`MappedCopy`); from the next sync
on, when every worker's region is one this transport holds a plan for, the trainer writes each bucket's tensors
straight into the engines' parameters (`MappedPlan`: one copy, the engines paused) and no bucket goes to an
engine. A tensor the plan does not know goes through the loaders (and is recorded) as before.
"""

from __future__ import annotations

import logging
import os
import uuid

import torch

from molt_hydra.weight_sync.buckets import Bucket, bucket_metas, pack_bucket, packed_nbytes, unpack_bucket
from molt_hydra.weight_sync.copy_plan import CopyPlan, disjoint
from molt_hydra.weight_sync.transports import Pipeline

logger = logging.getLogger(__name__)


def new_region(name: str, nbytes: int) -> tuple[torch.Tensor, tuple[str, int, str], int]:
    """A memfd of `nbytes` mapped here (nothing is left in /dev/shm if this process dies), its handle for other
    processes (path, bytes, token) and its fd."""
    fd = os.memfd_create(name)
    os.ftruncate(fd, nbytes)
    region = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    return region, (f"/proc/{os.getpid()}/fd/{fd}", nbytes, uuid.uuid4().hex), fd


def open_region(handle: tuple[str, int, str]) -> torch.Tensor:
    """Another process's `new_region`, mapped here."""
    return torch.from_file(handle[0], shared=True, size=handle[1], dtype=torch.uint8)


class SharedMemoryTransport(Pipeline):
    method = "load_shared_bucket_recorded"

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__(dtype)
        self.region: torch.Tensor | None = None  # uint8, mapped on the memfd: two slots of `region.numel() // 2`
        self.handle: tuple[str, int, str] | None = None  # (path for other processes, bytes, token)
        self.fd = -1
        self.slot = 0  # the slot the next bucket is packed into
        self.plans: dict[str, MappedPlan] = {}  # parameter-region token -> its plan
        self.recorded: dict[str, list] = {}  # this sync's recordings: token -> [handle, copies or refusal, names]
        self.mapped: list[MappedPlan] | None = None  # this sync's plans (one per engine worker), when in place

    def begin(self, answers: list) -> None:
        """`answers`: per engine, what each worker's `begin_layerwise_reload` returned (its parameter region's handle
        or None). Picks this sync's path: in place when every worker has a region this transport holds a plan for."""
        handles = [h for per_engine in answers for h in (per_engine or [])]
        live = {h[2]: h for h in handles if h is not None}
        self.plans = {token: plan for token, plan in self.plans.items() if token in live}  # unmap gone engines
        for token, (handle, copies, names) in self.recorded.items():  # the last sync's recordings (it succeeded)
            if token not in live or isinstance(copies, str):
                self.plans.pop(token, None)  # a load that was not copies only: this worker keeps its loaders
                continue
            if token in self.plans and self.mapped is not None:  # an in-place sync's loads: names new to the plan
                old = self.plans.pop(token)
                copies, names = old.copies + copies, old.names | names
            try:
                self.plans[token] = MappedPlan(handle, copies, names)
            except ValueError as e:  # overlapping writes: the order of names could matter; keep the loaders
                logger.info("weight sync: the loaders stay on, %s", e)
        self.recorded = {}
        self.written = set()  # names written in place this sync (the engines' coverage check gets them)
        self.mapped = [self.plans[h[2]] for h in handles] if handles and all(
            h is not None and h[2] in self.plans for h in handles) else None
        self.in_place = self.mapped is not None

    async def push(self, engines: list, bucket: Bucket, call) -> int:
        written = 0
        if self.mapped is not None:
            known = [(n, t) for n, t in bucket if all(n in plan.names for plan in self.mapped)]
            for plan in self.mapped:  # the engines are paused: nothing reads their parameters meanwhile
                plan.write(known)
            self.written.update(n for n, _ in known)
            written = packed_nbytes(bucket_metas(known, self.dtype))
            bucket = [(n, t) for n, t in bucket if not all(n in plan.names for plan in self.mapped)]
            if not bucket:
                return written
        return written + await super().push(engines, bucket, call)

    async def _pack(self, bucket: Bucket) -> tuple[torch.Tensor, tuple]:
        region = await self._region(packed_nbytes(bucket_metas(bucket, self.dtype)))
        offset = self.slot * (region.numel() // 2)
        metas, flat = pack_bucket(bucket, self.dtype, out=lambda n: region[offset:offset + n])
        self.slot ^= 1
        return flat, (self.handle, metas, offset)

    def _load(self, engine, call, args: tuple):
        answer, names = super()._load(engine, call, args), {name for name, _, _ in args[1]}

        async def record() -> None:
            """Each worker's recording of this bucket (`copies`: a reason instead when its loaders did more than
            copy), added to its region's entry in `recorded`."""
            for _, handle, copies in await answer:
                if handle is None:
                    continue
                entry = self.recorded.setdefault(handle[2], [handle, [], set()])
                if not isinstance(entry[1], str):  # a refusal stands for the whole sync
                    entry[1] = copies if isinstance(copies, str) else entry[1] + copies
                entry[2] |= names

        return record()

    async def abandon(self) -> None:
        await super().abandon()
        self.recorded = {}  # a failed sync's recordings may be partial

    async def _region(self, nbytes: int) -> torch.Tensor:
        if self.region is None or self.region.numel() < 2 * nbytes:
            await self.drain()  # the engines still map the old region by its path until they loaded from it
            # drop this side's mapping first; the memory is freed once every engine worker dropped its own
            self.region = None
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1  # should new_region raise, a later call must not close a number reused by then
            self.region, self.handle, self.fd = new_region("molt_weights", 2 * nbytes)
        return self.region


# --- mapped in place: the trainer writes the recorded copies into the engine's parameters itself ---
#
# A CPU engine with plain weights keeps its parameters in one shared region (receiver.map_parameters). The
# loaders of one bucket, recorded (copy_plan.py) while they load from the trainer's packed shared-memory buckets, become
# `MappedCopy`s that name their source by tensor name and element offset and their destination by byte offset in that
# region; the trainer maps the region (`MappedPlan`) and replays them from its own tensors: an update is then one copy,
# on the trainer's side, and nothing goes to the engine but a pause, a resume and the names written.

MappedCopy = tuple  # (source name, source element offset, shape, stride, dest dtype, dest byte offset, shape, stride)


def mapped_copies(plan: CopyPlan, metas: list, flat: torch.Tensor, region: torch.Tensor) -> list[MappedCopy] | str:
    """A recorded bucket's copies in terms any process can replay: each source as (name, element offset, shape,
    stride) inside that name's tensor of the packed bucket `flat` (laid out by `metas`), each destination as (dtype,
    byte offset, shape, stride) in `region`; or why they cannot be (a source that reinterprets its tensor's dtype).
    A recorded constant fill is (None, value, [], [], destination...): `MappedPlan` proves it need not be replayed."""
    tensors = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name, t.dtype)
               for name, t in unpack_bucket(metas, flat)]
    out: list[MappedCopy] = [(None, value, [], [], str(dst.dtype).removeprefix("torch."), dst.data_ptr()
                              - region.data_ptr(), list(dst.shape), list(dst.stride()))
                             for dst, value in plan.fills if dst.numel()]  # an empty one has no address
    for dst, src, _ in plan.copies:
        if not dst.numel():
            continue
        hit = next((t for t in tensors if t[0] <= src.data_ptr() < t[1]), None)
        if hit is None or src.dtype != hit[3]:
            return "a copy from a view that is not one of the bucket's tensors in its own dtype"
        out.append((hit[2], (src.data_ptr() - hit[0]) // src.element_size(), list(src.shape), list(src.stride()),
                    str(dst.dtype).removeprefix("torch."), dst.data_ptr() - region.data_ptr(), list(dst.shape),
                    list(dst.stride())))
    return out


class MappedPlan:
    """The trainer's end of one engine worker's parameter region: mapped here once, with the copies recorded into it
    grouped by source name. `names`: every tensor the recording loaded (some load nothing, e.g. a tied head).

    Every destination must be disjoint from every other (`ValueError` otherwise): then the order in which names come
    cannot change a byte, and a recorded constant fill (vocab padding) holds its value from the recording on, as
    nothing else writes there, so it is not replayed."""

    def __init__(self, handle: tuple, copies: list[MappedCopy], names: set[str]):
        self.region = open_region(handle)
        self.names, self.copies = set(names), list(copies)
        self.by_name: dict[str, list] = {}
        destinations = []
        for name, offset, shape, stride, dtype, at, dst_shape, dst_stride in copies:
            dtype = getattr(torch, dtype)
            dst = torch.empty(0, dtype=dtype).set_(self.region.untyped_storage(), at // dtype.itemsize, dst_shape,
                                                   dst_stride)
            destinations.append(dst)
            if name is not None:
                self.by_name.setdefault(name, []).append((dst, offset, shape, stride))
        if not disjoint(destinations):
            raise ValueError("recorded copies write overlapping parts of the engine's parameters")

    def write(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """The bucket's recorded copies, from the trainer's own tensors (cast to each destination's dtype while they
        copy; every name must be in `names`)."""
        dsts, srcs = [], []
        for name, t in bucket:
            t = t.detach() if t.is_contiguous() else t.detach().contiguous()  # offsets are those of a packed tensor
            for dst, offset, shape, stride in self.by_name.get(name, ()):
                dsts.append(dst)
                srcs.append(t.as_strided(shape, stride, t.storage_offset() + offset))
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
