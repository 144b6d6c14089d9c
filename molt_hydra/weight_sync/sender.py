"""The trainer's side of a sync: pick the transport from the config, open what it needs once, and push each sync.

One sync: pause every engine (mode keep: in-flight requests freeze, then continue under the new weights), push the
buckets, refresh tied heads + reset the prefix cache + stamp the new policy version on every engine, resume; the
single pass (shared_params.py) does all of it in one call per engine. Every trainer rank runs `push_from_rank` (the
gathers are collectives); rank 0 pushes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import torch

from molt_hydra.parallel.launch import held_store
from molt_hydra.weight_sync.buckets import Bucket
from molt_hydra.weight_sync.shared_memory import SharedMemoryTransport
from molt_hydra.weight_sync.shared_params import SharedParamsPush, rank_shared_params
from molt_hydra.weight_sync.transports import (BroadcastGroup, BroadcastTransport, CudaIpcTransport,
                                               ObjectStoreTransport, Transport)

# Ray is imported where the trainer's rank 0 needs it (its address): the package imports without it


class WeightCoverageError(RuntimeError):
    """Raised after a sync (engines already resumed) when some checkpoint tensors were never pushed."""

    def __init__(self, missing: list[str]):
        self.missing = missing
        super().__init__(f"{len(missing)} parameters were never pushed to vLLM: {missing[:20]}")


class WeightSync:
    """Pushes weights to engine actors (Ray handles of `VLLMEngine`); `sync` bumps the policy version."""

    def __init__(self, engines: list, transport: Transport, *, check_coverage: bool = False, timeout_s: float = 600.0,
                 version: int = 0):
        self.engines = engines
        self.transport = transport
        self.check_coverage = check_coverage
        self.timeout_s = timeout_s
        self.version = version

    async def _call(self, ref):
        return await asyncio.wait_for(ref, self.timeout_s)  # a dead or stuck engine fails the sync, never hangs it

    async def _all(self, method: str, *args) -> list:
        return await asyncio.gather(*(self._call(getattr(e, method).remote(*args)) for e in self.engines))

    async def sync(self, buckets: Iterable[Bucket], version: int | None = None) -> dict[str, float]:
        """Pushes `buckets` stamped `version` (default: the next). Returns the sync's metrics: `weight_sync/single_pass`
        says which CUDA IPC path ran (1: straight from the rank's own parameters, one call per engine),
        `weight_sync/in_place` whether shared memory wrote into the engines' parameters (1) or went through their
        loaders, `weight_sync/push_seconds` the buckets alone (from after every engine began the update until the last
        landed; single pass: the one call), `weight_sync/replayed` the share of engine workers that replayed their
        recorded copy plan; in a single pass `weight_sync/engine_load_seconds`, the slowest worker's own load, and
        `weight_sync/engine_call_seconds`, the slowest engine's own time in the call, wakes excluded (its vLLM calls:
        push_seconds less it is the round trip), whose legs are `weight_sync/to_engine_seconds` (the call until the
        engine began it) and `weight_sync/from_engine_seconds` (its end until the answer), wall clock; else
        `weight_sync/begin_seconds` and `weight_sync/finish_seconds`, the calls before and after the buckets (pause
        and begin; finish, caches reset, version stamped, resume)."""
        version = self.version + 1 if version is None else version
        start = time.perf_counter()
        if self.transport.single_pass:
            missing = await self.transport.update(self.engines, version, self.check_coverage, self._call)
            num_tensors, num_bytes = self.transport.tensors, self.transport.nbytes
            timings = {"weight_sync/push_seconds": time.perf_counter() - start,
                       "weight_sync/engine_load_seconds": self.transport.engine_seconds,
                       "weight_sync/engine_call_seconds": self.transport.engine_call_seconds,
                       "weight_sync/to_engine_seconds": self.transport.to_engine_seconds,
                       "weight_sync/from_engine_seconds": self.transport.from_engine_seconds}
        else:
            missing, num_tensors, num_bytes, timings = await self._begin_push_finish(buckets, version)
        self.version = version
        missing_names = sorted({name for per_worker in missing if per_worker for name in per_worker})
        if missing_names:
            raise WeightCoverageError(missing_names)
        return {"weight_sync/bytes": float(num_bytes), "weight_sync/tensors": float(num_tensors),
                "weight_sync/seconds": time.perf_counter() - start, **timings,
                "weight_sync/single_pass": float(self.transport.single_pass),
                "weight_sync/in_place": float(self.transport.in_place), "weight_sync/replayed": self.transport.replayed}

    async def _begin_push_finish(self, buckets: Iterable[Bucket], version: int) -> tuple[list, int, int, dict]:
        """One call per engine before the buckets (pause + begin) and one after (finish + resume + the coverage
        check): the round trips to the engines are what a sync costs beyond its copies. Returns each worker's missing
        names (None unless checked), the tensors and bytes pushed, and the phases' seconds."""
        start = time.perf_counter()
        num_tensors = num_bytes = 0
        done = False
        try:
            self.transport.begin(await self._all("begin_weight_update"))  # shm: whether it writes in place
            pushing = time.perf_counter()
            for bucket in buckets:
                num_bytes += await self.transport.push(self.engines, bucket, self._call)  # bytes on the wire
                num_tensors += len(bucket)
            await self.transport.drain()  # pipelined transports: the last buckets are still in flight
            pushed = time.perf_counter()
            done = True
        finally:
            if not done:
                await self.transport.abandon()
            # also after a failure (version None): layers left mid-reload would break generation, and the engine
            # must know its weights are mixed; the check (every load landed) counts what the trainer wrote in place
            check = sorted(self.transport.written) if done and self.check_coverage else None
            finishing = time.perf_counter()
            missing = await self._all("finish_weight_update", version if done else None, check)
        timings = {"weight_sync/begin_seconds": pushing - start, "weight_sync/push_seconds": pushed - pushing,
                   "weight_sync/finish_seconds": time.perf_counter() - finishing}
        return [w for per_engine in missing if per_engine for w in per_engine], num_tensors, num_bytes, timings


def resolve_transport(transport: str, *, lora: bool, device: str, colocate: bool, nodes: int) -> str:
    """`rollout.weight_sync.transport` with `auto` resolved from placement: GPU colocated shares memory (cuda_ipc), GPU
    apart broadcasts (nccl); CPU uses shared_memory when every engine shares the trainer's host, else object_store.
    (config/validate.py refuses the GPU ones on CPU, and cuda_ipc unless trainer and engines share GPUs.)"""
    if lora:  # the adapter goes through the object store (ObjectStoreTransport): nothing to open
        return "object_store"
    if transport != "auto":
        return transport
    if device == "cuda":
        return "cuda_ipc" if colocate else "nccl"
    return "shared_memory" if nodes == 1 else "object_store"


def _rendezvous_address(_worker) -> tuple[str, int]:
    """Run on the trainer's rank 0 (`__ray_call__`): its node's IP and the port of the group's store, which it opens
    now and holds (launch.held_store; its BroadcastGroup reuses it). Before, a port probed free and closed, which
    another process could take before rank 0 bound it."""
    import ray

    return ray.util.get_node_ip_address(), held_store()


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


async def setup_weight_sync(transport: str, actor, engines: list, *, workers_per_engine: int, timeout_s: float) -> None:
    """Once, after engines and trainer ranks are up: open what the resolved transport needs (the NCCL group for
    `nccl`; the others need nothing opened)."""
    if transport == "nccl" and actor is not None:
        await open_broadcast(actor.workers[0], engines, workers_per_engine=workers_per_engine, timeout_s=timeout_s)


def _buckets_and_carrier(worker, transport: str, bucket_bytes: int, wire: torch.dtype):
    """This rank's buckets and, on rank 0, the transport that carries them (None elsewhere)."""
    if getattr(worker, "lora", None):  # the adapter alone (trainer.weight_buckets), cast on the trainer's device
        carrier = ObjectStoreTransport(worker.adapter_config()) if worker.rank == 0 else None
        return worker.weight_buckets(bucket_bytes, wire, "cpu"), carrier
    shared = rank_shared_params(worker, transport, wire)
    if shared is not None:  # one rank holds every weight whole: the engines load from it, mapped once per token
        worker.shared_params_push = getattr(worker, "shared_params_push", None) or SharedParamsPush()
        worker.shared_params_push.take(shared.offer(worker.shared_params_push.token))
        return [], worker.shared_params_push
    # GPU transports cast while packing (one pass on the trainer's GPU); so does shared memory from a CPU rank (it
    # packs into its region: no cast copy before it); the host transports get tensors cast on the GPU
    on_device = transport in ("nccl", "cuda_ipc") or transport == "shared_memory" and worker.device.type == "cpu"
    buckets = worker.weight_buckets(bucket_bytes, None if on_device else wire, worker.device if on_device else "cpu")
    if worker.rank != 0:
        return buckets, None
    if transport == "shared_memory":  # one region, mapped by the engines once, reused by every sync of this rank
        worker.shm_weight_transport = getattr(worker, "shm_weight_transport", None) or SharedMemoryTransport(wire)
        return buckets, worker.shm_weight_transport
    return buckets, {"object_store": ObjectStoreTransport, "cuda_ipc": lambda: CudaIpcTransport(wire),
                     "nccl": lambda: BroadcastTransport(worker.weight_broadcast_group, wire)}[transport]()


def push_from_rank(worker, engines: list, transport: str, version: int, *, bucket_bytes: int, check_coverage: bool,
                   timeout_s: float, dtype: str) -> dict:
    """One sync, run on every trainer rank (`worker`: a TrainerWorker): all ranks drive the gathers (FSDP
    collectives), rank 0 pushes each bucket in the engine's `dtype` and stamps `version`. A LoRA actor pushes its
    adapter alone, over the object store whatever the transport passed. Metrics (`WeightSync.sync`'s)
    from rank 0."""
    buckets, carrier = _buckets_and_carrier(worker, transport, bucket_bytes, getattr(torch, dtype))
    if carrier is None:
        for _ in buckets:  # take part in the gathers; only rank 0 receives tensors
            pass
        return {}
    sync = WeightSync(engines, carrier, check_coverage=check_coverage, timeout_s=timeout_s, version=version - 1)
    try:
        return asyncio.run(sync.sync(buckets, version))
    except Exception:  # a push that failed (an engine died mid-sync): the other ranks gather every bucket, each a
        for _ in buckets:  # collective; before, they waited on this rank until the collective timeout (the run
            pass  # stalled, its engine not replaced)
        raise
