"""Versioned weight sync trainer → vLLM engine actors, behind one interface; the transport follows placement.

One sync: pause every engine (mode keep: in-flight requests freeze, then continue under the new weights), push the
buckets, refresh tied heads + reset the prefix cache + stamp the new policy version on every engine, resume. The
trainer supplies an iterator of buckets, each a list of (hf_name, full CPU tensor) — `buckets.bucket_weights` bounds
them by `bucket_bytes`, which bounds the sync's extra memory.

Transports: `object_store` (safetensors bytes through Ray's object store: any host), `shm` (each bucket packed in one
reused shared-memory region the engines map: one host), `nccl` (one flat buffer per bucket broadcast from the trainer's
rank 0 over a process group opened once at start: GPU, disaggregated), `cuda_ipc` (one flat buffer per bucket on the
trainer's GPU, mapped by the engine worker through a CUDA IPC handle: GPU, colocated). Tensors travel in the engine's
dtype: GPU transports cast while packing on the trainer's GPU, host transports cast on the GPU before the copy to host.
CUDA IPC has a single-pass form (`SharedParamsTransport`) when one trainer rank holds every weight as a full tensor:
nothing is packed and nothing goes on a wire; the engine's loader casts straight from the trainer's own parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

import torch

from molt_hydra.rollout.buckets import Bucket, bucket_metas, pack_bucket, packed_nbytes

logger = logging.getLogger(__name__)


class Transport(str, Enum):
    auto = "auto"
    object_store = "object_store"
    shm = "shm"
    nccl = "nccl"
    cuda_ipc = "cuda_ipc"


def choose_transport(*, on_gpu: bool, colocated: bool, same_host: bool) -> Transport:
    """Placement → transport: GPU colocated shares memory (IPC), GPU apart broadcasts (NCCL); CPU uses /dev/shm when
    every engine shares the trainer's host, else the object store."""
    if on_gpu:
        return Transport.cuda_ipc if colocated else Transport.nccl
    return Transport.shm if same_host else Transport.object_store


class WeightCoverageError(RuntimeError):
    """Raised after a sync (engines already resumed) when some checkpoint tensors were never pushed."""

    def __init__(self, missing: list[str]):
        self.missing = missing
        super().__init__(f"{len(missing)} parameters were never pushed to vLLM: {missing[:20]}")


@dataclass
class SyncReport:
    version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    single_pass: bool = False  # the engines loaded straight from the trainer's parameters (SharedParamsTransport)
    in_place: bool = False  # the trainer wrote into the engines' parameters (SharedMemoryTransport, mapped)
    push_seconds: float = 0.0  # the buckets alone: from after every engine began the update until the last landed
    replayed: float = 0.0  # single pass: the share of engine workers that replayed their recorded copy plan


def _nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


class ObjectStoreTransport:
    async def push(self, engines: list, bucket: Bucket, call) -> int:
        import ray
        from safetensors.torch import save

        ref = ray.put(save({name: t.contiguous() for name, t in bucket}))  # one copy, read by every engine
        await asyncio.gather(*(call(e.load_weights_bytes.remote(ref)) for e in engines))
        return _nbytes(bucket)


class AdapterTransport:
    """LoRA (model.lora): the adapter's tensors, under PEFT's names and in the engine dtype, gathered over the sync's
    buckets into one safetensors blob that goes once through Ray's object store (one host or many: it is megabytes);
    each engine stages it as a PEFT directory and loads it as the new version in `finish_weight_update`
    (rollout/engine.py `stage_adapter`). Nothing of the base model moves."""

    def __init__(self, config: dict):
        self.config = config  # adapter_config.json, which vLLM's loader validates against its LoRA config
        self.tensors: dict[str, torch.Tensor] = {}
        self.send = None  # (engines, call) of this sync, for `drain`

    async def push(self, engines: list, bucket: Bucket, call) -> int:
        self.tensors.update((name, t.contiguous()) for name, t in bucket)
        self.send = (engines, call)
        return _nbytes(bucket)

    async def drain(self) -> None:
        import ray
        from safetensors.torch import save

        engines, call = self.send
        ref = ray.put(save(self.tensors))
        self.tensors = {}
        await asyncio.gather(*(call(e.stage_adapter.remote(ref, self.config)) for e in engines))


class BroadcastGroup:
    """A torch process group of its own (NCCL on GPU, gloo on CPU) built from a TCPStore hosted by rank 0: no default
    group, no vLLM, so the trainer (already in its FSDP group) and every engine worker (already in vLLM's) can join it.
    The same pattern as vLLM's StatelessProcessGroup + PyNcclCommunicator, on torch alone. Construction blocks until
    all `world_size` ranks joined, then proves the group with a one-element broadcast."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device | str,
                 timeout_s: float = 600.0):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.broadcast(torch.zeros(1, device=self.device), src=0)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0):
        """Queue the broadcast; `.wait()` on the result makes the current stream (NCCL) / the caller (gloo) wait."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        return self.group.broadcast([tensor], options)


class _Pipeline:
    """Buckets in flight: `push` returns once a bucket is packed and sent, so bucket k+1 is gathered and packed while
    bucket k is on the wire / being loaded by the engines; at most `depth` are in flight, each one's buffer held until
    its engines answered (and, for a broadcast, its send completed). `drain` retires them all (end of a sync)."""

    depth = 2

    def __init__(self):
        self.in_flight: list = []  # (buffer, send work or None, engines' answers)

    async def _admit(self) -> None:
        while len(self.in_flight) >= self.depth:
            await self._retire()

    async def _retire(self) -> None:
        flat, work, answers = self.in_flight.pop(0)
        await answers
        if work is not None:  # NCCL: the current stream waits for the send; gloo: blocks until sent
            await asyncio.to_thread(work.wait)
        del flat

    async def drain(self) -> None:
        while self.in_flight:
            await self._retire()

    async def abandon(self) -> None:
        """After a failed sync: retire every bucket still in flight, ignoring their errors, so none of them is retired
        by (and fails) the next sync and no buffer is reused while an engine may still read it."""
        while self.in_flight:
            with contextlib.suppress(Exception):
                await self._retire()


class SharedMemoryTransport(_Pipeline):
    """Engines on the trainer's host: each bucket is packed (cast to the engine dtype while copying: the one copy on
    this side) into a shared-memory region that every engine worker maps once and hands to vLLM's weight loader as
    views, with no serialisation. The region is a memfd (nothing left in /dev/shm if the trainer is killed; workers
    open it as /proc/<pid>/fd/<fd>), kept for every later bucket and sync, replaced only when a bucket outgrows it.
    It has two slots, so bucket k+1 is packed while the engines load bucket k (the trainer's copy and the engine's
    run side by side); a slot is reused once the engines answered for the bucket it held.

    Mapped in place (CPU engines with plain weights): such a worker moves its parameters into a shared region of its
    own on the first sync and records what its loaders copied from each bucket (`copy_plan.MappedCopy`); from the next
    sync on, when every worker's region is one this transport holds a plan for, the trainer writes each bucket's
    tensors straight into the engines' parameters (`copy_plan.MappedPlan`: one copy, the engines paused) and no bucket
    goes to an engine. A tensor the plan does not know goes through the loaders (and is recorded) as before."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype
        self.region: torch.Tensor | None = None  # uint8, mapped on the memfd: two slots of `region.numel() // 2`
        self.handle: tuple[str, int, str] | None = None  # (path for other processes, bytes, token)
        self.fd = -1
        self.slot = 0  # the slot the next bucket is packed into
        self.plans: dict[str, object] = {}  # parameter-region token -> copy_plan.MappedPlan
        self.recorded: dict[str, list] = {}  # this sync's recordings: token -> [handle, copies or refusal, names]
        self.mapped: list | None = None  # this sync's plans (one per engine worker), when it writes in place
        self.written: set[str] = set()  # names written in place this sync (the engines' coverage check gets them)

    def begin(self, answers: list) -> None:
        """`answers`: per engine, what each worker's `begin_layerwise_reload` returned (its parameter region's handle
        or None). Picks this sync's path: in place when every worker has a region this transport holds a plan for."""
        from molt_hydra.rollout.copy_plan import MappedPlan

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
        self.written = set()
        self.mapped = [self.plans[h[2]] for h in handles] if handles and all(
            h is not None and h[2] in self.plans for h in handles) else None

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
        await self._admit()  # the slot packed next holds no bucket the engines still read
        region = await self._region(packed_nbytes(bucket_metas(bucket, self.dtype)))
        offset = self.slot * (region.numel() // 2)
        metas, flat = pack_bucket(bucket, self.dtype, out=lambda n: region[offset:offset + n])
        names = {n for n, _ in bucket}

        async def load(engine) -> None:
            answers = await call(engine.worker_call.remote("load_shared_bucket_recorded", self.handle, metas, offset))
            for _, handle, copies in answers:
                if handle is not None:
                    self._record(handle, copies, names)

        self.in_flight.append((flat, None, asyncio.gather(*(load(e) for e in engines))))
        self.slot ^= 1
        return written + flat.numel()

    def _record(self, handle: tuple, copies: list | str, names: set[str]) -> None:
        """One worker's recording of one bucket (`copies`: a reason instead when its loaders did more than copy)."""
        entry = self.recorded.setdefault(handle[2], [handle, [], set()])
        if not isinstance(entry[1], str):  # a refusal stands for the whole sync
            entry[1] = copies if isinstance(copies, str) else entry[1] + copies
        entry[2] |= names

    async def abandon(self) -> None:
        await super().abandon()
        self.recorded = {}  # a failed sync's recordings may be partial

    async def _region(self, nbytes: int) -> torch.Tensor:
        if self.region is None or self.region.numel() < 2 * nbytes:
            await self.drain()  # the engines still map the old region by its path until they loaded from it
            self.close()
            self.fd = os.memfd_create("molt_weights")
            os.ftruncate(self.fd, 2 * nbytes)
            self.region = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=2 * nbytes, dtype=torch.uint8)
            self.handle = (f"/proc/{os.getpid()}/fd/{self.fd}", 2 * nbytes, uuid.uuid4().hex)
        return self.region

    def close(self) -> None:
        """Drop this side's mapping; the memory is freed once every engine worker dropped its own (next region)."""
        self.region = self.handle = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BroadcastTransport(_Pipeline):
    """Rank 0 of a `BroadcastGroup` every engine worker joined (`init_weight_broadcast`): per bucket, the engines are
    told the bucket's layout, then one flat buffer (cast to the engine dtype while packing) is broadcast. Pipelined:
    the send is queued (NCCL orders it after the packing on the GPU) without waiting for it, so the next bucket's
    packing on the GPU overlaps this one's transfer."""

    def __init__(self, group, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = group
        self.dtype = dtype

    async def push(self, engines: list, bucket: Bucket, call) -> int:
        await self._admit()
        metas, flat = pack_bucket(bucket, self.dtype)  # on the trainer's GPU, where the bucket lives
        # engines join the collective as their calls arrive; the send waits for them on the wire, not here
        answers = asyncio.gather(*(call(e.worker_call.remote("receive_broadcast", metas)) for e in engines))
        self.in_flight.append((flat, self.group.broadcast_async(flat, 0), answers))
        return flat.numel()


def ipc_handle(tensor: torch.Tensor) -> bytes:
    """A tensor's IPC handle (torch's `reduce_tensor`: its rebuild function and arguments) as bytes: vLLM's
    collective_rpc serializes with msgspec, which refuses the function and the classes inside (vLLM 0.24). Pickled
    by the multiprocessing pickler torch registers its sharing with, so a CPU tensor's storage travels as its shared
    memory (the CPU stand-ins of the tests), not as a copy."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    return bytes(ForkingPickler.dumps(reduce_tensor(tensor)))


class CudaIpcTransport(_Pipeline):
    """Per bucket one flat buffer (cast to the engine dtype while packing) on the trainer's GPU; every engine worker
    maps it through its CUDA IPC handle, loads from it and unmaps it before answering, so the buffer is freed
    (`ipc_collect`) as soon as the bucket is retired. The handle carries an IPC event recorded after the packing,
    which the engine's stream waits on: no host sync on this side, and the next bucket is packed while the engine
    loads this one. (One buffer shared once per sync and kept mapped was tried: no faster at 0.6B on an H200, and
    torch's IPC ref-counting then kept it allocated after the sync.)"""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype

    async def push(self, engines: list, bucket: Bucket, call) -> int:
        await self._admit()
        metas, flat = pack_bucket(bucket, self.dtype)
        handle = ipc_handle(flat)
        answers = asyncio.gather(*(call(e.worker_call.remote("receive_ipc", metas, handle)) for e in engines))
        self.in_flight.append((flat, None, answers))
        return flat.numel()

    async def _retire(self) -> None:
        await super()._retire()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free the buffer now that every engine dropped its mapping

    async def drain(self) -> None:
        await super().drain()
        if torch.cuda.is_available():  # colocated: the packed buckets' memory goes back before the KV cache wakes
            torch.cuda.empty_cache()


class SharedParamsTransport:
    """CUDA IPC in one pass, for one trainer rank whose parameters are full tensors (FSDP2 with dp=1, or no FSDP): the
    trainer shares IPC handles of its OWN parameter storages, which the optimizer updates in place, and each engine
    worker opens them once and keeps the views for every later sync; a sync is then one call per engine whose loader
    reads the trainer's parameters and casts while it copies into the engine's own (fp32 -> bf16: 6 bytes of traffic
    per parameter against 10 for pack + load). Nothing is packed and nothing goes on a wire, so the wire-dtype rule
    of the bucketed transports does not apply: the loader receives the trainer's dtype and writes the engine's.

    The views are keyed by `token`, a fingerprint of the storages (address, layout, dtype of every tensor) and of this
    process: if the trainer's storages change (a reload, a new process), the token changes and engines open the new
    handles; an engine that does not know the token answers None and gets the handles in a second call.
    Ordering: the trainer's stream is synchronized before the engines are called (their reads start after the last
    optimizer write), and every worker synchronizes its stream before answering (the trainer cannot step again
    before the copies are done). On the engine side, the loaders of a token's first sync are recorded and, proven to
    be plain copies, replayed as one CUDA graph on later syncs (rollout/copy_plan.py)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None):
        self.tensors = tensors
        self.token = self.fingerprint(tensors)
        self.handles: list | None = None  # made on the first engine that asks for them, kept for the token's life
        self.replayed = 0.0  # of the last sync's engine workers, the share that replayed their copy plan
        self.refusals: set[str] = set()  # why a worker's loaders could not be recorded: each said once
        self.device = next((t.device for _, t in tensors if t.is_cuda), None)
        # bytes written into each engine: floating tensors in the engine dtype
        self.nbytes = sum(t.numel() * (dtype.itemsize if dtype and t.is_floating_point() else t.element_size())
                          for _, t in tensors)

    @staticmethod
    def fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> str:
        import hashlib

        layout = [(n, t.data_ptr(), tuple(t.shape), t.stride(), str(t.dtype), str(t.device)) for n, t in tensors]
        return hashlib.sha1(repr((os.getpid(), layout)).encode()).hexdigest()

    async def push(self, engines: list, bucket: Bucket, call) -> int:
        if self.device is not None:  # the optimizer's last writes land before any engine reads
            torch.cuda.current_stream(self.device).synchronize()

        async def load(engine) -> list:
            answers = await call(engine.worker_call.remote("load_shared_params", self.token, None, None))
            if any(a is None for a in answers):  # a worker has not mapped this token's storages yet
                if self.handles is None:
                    self.handles = [ipc_handle(t.detach()) for _, t in self.tensors]
                names = [n for n, _ in self.tensors]
                answers = await call(engine.worker_call.remote("load_shared_params", self.token, names, self.handles))
            return answers

        answers = [a for per_engine in await asyncio.gather(*(load(e) for e in engines)) for a in per_engine]
        self.replayed = sum(path == "replay" for _, path, _ in answers) / max(len(answers), 1)
        for why in {why for _, _, why in answers if why} - self.refusals:
            logger.warning("weight sync: the engine's loaders run on every sync (no copy plan): %s", why)
            self.refusals.add(why)
        return self.nbytes


def single_pass_transport(worker, transport: str, dtype: torch.dtype) -> SharedParamsTransport | None:
    """The single-pass carrier when it applies: CUDA IPC, one trainer rank, and `worker.local_weights()` finds every
    weight whole in a parameter storage of its own; else None (the bucketed path: dp > 1, offload, converted names
    ...). The answer is kept on the worker while its parameter storages stay where they are (a cheap check each sync):
    the weights are looked up, and their handles made, once per change, not once per sync."""
    from molt_hydra.parallel.weight_buckets import parameter_addresses

    if transport != "cuda_ipc" or getattr(worker, "world_size", 1) != 1 or not hasattr(worker, "local_weights"):
        return None
    cached = getattr(worker, "shared_params_transport", None)
    if cached is not None and cached[0] == (parameter_addresses(worker.model), dtype):
        return cached[1]
    shared = worker.local_weights()  # after it: FSDP's state-dict hook may have put the sharded parameters back
    carrier = None if shared is None else SharedParamsTransport(shared, dtype)
    worker.shared_params_transport = ((parameter_addresses(worker.model), dtype), carrier)
    logger.info("weight sync over CUDA IPC: %s", "bucketed (the rank's weights need a gather or a copy)"
                if carrier is None else f"single pass from the trainer's own {len(shared)} parameters")
    return carrier


class WeightSync:
    """Pushes weights to engine actors (Ray handles of `VLLMEngine`); `sync` bumps the policy version."""

    def __init__(
        self,
        engines: list,
        transport: (ObjectStoreTransport | SharedMemoryTransport | BroadcastTransport | CudaIpcTransport
                    | SharedParamsTransport),
        *,
        check_coverage: bool = False,
        timeout_s: float = 600.0,
        version: int = 0,
    ):
        if not engines:
            raise ValueError("WeightSync needs at least one engine")
        self.engines = engines
        self.transport = transport
        self.check_coverage = check_coverage
        self.timeout_s = timeout_s
        self.version = version

    async def _call(self, ref):
        return await asyncio.wait_for(ref, self.timeout_s)  # a dead or stuck engine fails the sync, never hangs it

    async def _all(self, method: str, *args) -> list:
        return await asyncio.gather(*(self._call(getattr(e, method).remote(*args)) for e in self.engines))

    async def sync(self, buckets: Iterable[Bucket], version: int | None = None) -> SyncReport:
        """One call per engine before the buckets (pause + begin) and one after (finish + resume + the coverage
        check): the round trips to the engines are what a sync costs beyond its one copy."""
        version = self.version + 1 if version is None else version
        start = time.perf_counter()
        num_tensors = num_bytes = 0
        done = False
        try:
            begun = await self._all("begin_weight_update")
            if hasattr(self.transport, "begin"):  # shm: whether this sync writes into the engines' parameters
                self.transport.begin(begun)
            pushing = time.perf_counter()
            for bucket in buckets:
                num_bytes += await self.transport.push(self.engines, bucket, self._call)  # bytes on the wire
                num_tensors += len(bucket)
            if hasattr(self.transport, "drain"):  # pipelined transports: the last buckets are still in flight
                await self.transport.drain()
            pushed = time.perf_counter() - pushing
            done = True
        finally:
            if not done and hasattr(self.transport, "abandon"):
                await self.transport.abandon()
            # also after a failure (version None): layers left mid-reload would break generation, and the engine
            # must know its weights are mixed; the check (every load landed) counts what the trainer wrote in place
            check = sorted(getattr(self.transport, "written", ())) if done and self.check_coverage else None
            missing = await self._all("finish_weight_update", version if done else None, check)
        self.version = version
        missing_names = sorted({name for per_engine in missing if per_engine for per_worker in per_engine
                                for name in per_worker})
        if missing_names:
            raise WeightCoverageError(missing_names)
        return SyncReport(version, num_tensors, num_bytes, time.perf_counter() - start,
                          isinstance(self.transport, SharedParamsTransport),
                          getattr(self.transport, "mapped", None) is not None, pushed,
                          getattr(self.transport, "replayed", 0.0))


def _rendezvous_address(_worker) -> tuple[str, int]:
    """This host's address and a free port on it (run on the trainer's rank 0, which hosts the group's store)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def _join_as_sender(worker, host: str, port: int, world_size: int, timeout_s: float) -> None:
    worker.weight_broadcast_group = BroadcastGroup(host, port, 0, world_size, worker.device, timeout_s)


async def open_broadcast(rank0, engines: list, *, workers_per_engine: int, timeout_s: float) -> None:
    """Form the group {trainer rank 0} ∪ {every worker of every engine}: rank 0 is the trainer (it hosts the store),
    engine i's worker w is rank 1 + i * workers_per_engine + w. Every member joins concurrently (the store waits for
    all of them); the trainer rank keeps its end as `weight_broadcast_group`."""
    host, port = await rank0.__ray_call__.remote(_rendezvous_address)
    world = 1 + len(engines) * workers_per_engine
    joins = [e.worker_call.remote("init_weight_broadcast", host, port, 1 + i * workers_per_engine, world, timeout_s)
             for i, e in enumerate(engines)]
    await asyncio.gather(rank0.__ray_call__.remote(_join_as_sender, host, port, world, timeout_s), *joins)


def resolve_transport(cfg) -> str:
    """`rollout.weight_sync.transport` with `auto` resolved from placement; one of shm, object_store, nccl, cuda_ipc
    (config/validate.py refuses the GPU ones on CPU, and cuda_ipc unless trainer and engines share GPUs)."""
    on_gpu = cfg.cluster.device.value == "cuda"
    transport = cfg.rollout.weight_sync.transport.value
    if cfg.model.lora.rank:  # the adapter goes through the object store (AdapterTransport): nothing to open
        return "object_store"
    if transport == "auto":
        transport = choose_transport(on_gpu=on_gpu, colocated=cfg.parallelism.colocate,
                                     same_host=cfg.cluster.nodes == 1).value
    return {"shared_memory": "shm"}.get(transport, transport)


async def setup_weight_sync(cfg, actor, engines: list) -> str:
    """Once, after engines and trainer ranks are up: resolve the transport and open what it needs (the NCCL group for
    `nccl`; CUDA IPC and the host transports need nothing opened). Returns the transport name for `push_from_rank`."""
    transport = resolve_transport(cfg)
    if transport == "nccl" and actor is not None:
        r = cfg.rollout
        per_engine = r.tensor_parallel_size * r.data_parallel_size * r.pipeline_parallel_size  # vLLM workers
        await open_broadcast(actor.workers[0], engines, workers_per_engine=per_engine,
                             timeout_s=cfg.train.timeouts.startup_s)
    return transport


def push_from_rank(worker, engines: list, transport: str, version: int, *, bucket_bytes: int, check_coverage: bool,
                   timeout_s: float, dtype: str) -> dict:
    """One sync, run on every trainer rank (`worker`: a TrainerWorker): all ranks drive the gathers (FSDP
    collectives), rank 0 pushes each bucket in the engine's `dtype` and stamps `version`. A LoRA actor pushes its
    adapter alone, whatever the placement's transport (`AdapterTransport`). Metrics from rank 0; their
    `weight_sync/single_pass` says which CUDA IPC path ran (1: straight from the rank's own parameters), and
    `weight_sync/in_place` whether shm wrote into the engines' parameters (1) or went through their loaders."""
    wire = getattr(torch, dtype)
    lora = getattr(worker, "lora", None)
    carrier = None if lora else single_pass_transport(worker, transport, wire)
    if lora:  # the adapter alone (trainer.weight_buckets), cast on the trainer's device
        buckets = worker.weight_buckets(bucket_bytes, wire, "cpu")
        if worker.rank != 0:
            for _ in buckets:  # take part in the gathers
                pass
            return {}
        carrier = AdapterTransport(worker.adapter_config())
    elif carrier is not None:  # one rank holds every weight whole: the engines load from it, mapped once per token
        buckets = [carrier.tensors]
    else:
        # shm packs into its region: it casts while packing too, instead of casting into a copy and then packing it
        on_device = transport in ("nccl", "cuda_ipc") or transport == "shm" and worker.device.type == "cpu"
        # GPU transports cast while packing (one pass on the trainer's GPU); host ones get tensors cast on the GPU
        buckets = worker.weight_buckets(bucket_bytes, None if on_device else wire,
                                        worker.device if on_device else "cpu")
        if worker.rank != 0:
            for _ in buckets:  # take part in the gathers; only rank 0 receives tensors
                pass
            return {}
        if transport == "shm":  # one region, mapped by the engines once, reused by every sync of this rank
            worker.shm_weight_transport = getattr(worker, "shm_weight_transport", None) or SharedMemoryTransport(wire)
        carrier = {"shm": lambda: worker.shm_weight_transport, "object_store": ObjectStoreTransport,
                   "cuda_ipc": lambda: CudaIpcTransport(wire),
                   "nccl": lambda: BroadcastTransport(worker.weight_broadcast_group, wire)}[transport]()
    sync = WeightSync(engines, carrier, check_coverage=check_coverage, timeout_s=timeout_s, version=version - 1)
    report = asyncio.run(sync.sync(buckets, version))
    return {"weight_sync/bytes": float(report.num_bytes), "weight_sync/tensors": float(report.num_tensors),
            "weight_sync/seconds": report.seconds, "weight_sync/single_pass": float(report.single_pass),
            "weight_sync/in_place": float(report.in_place), "weight_sync/push_seconds": report.push_seconds,
            "weight_sync/replayed": report.replayed}
