"""Versioned weight sync trainer → vLLM engine actors, behind one interface; the transport follows placement.

One sync: pause every engine (mode keep: in-flight requests freeze, then continue under the new weights), push the
buckets, refresh tied heads + reset the prefix cache + stamp the new policy version on every engine, resume. The
trainer supplies an iterator of buckets, each a list of (hf_name, full CPU tensor) — `buckets.bucket_weights` bounds
them by `bucket_bytes`, which bounds the sync's extra memory.

Transports: `object_store` (safetensors bytes through Ray's object store: any host), `shm` (a safetensors file per
bucket under /dev/shm: engines on the trainer's host), `nccl` (one flat buffer broadcast from the trainer's rank 0:
GPU, disaggregated), `cuda_ipc` (the trainer's GPU memory mapped by the engine: GPU, colocated).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from molt_hydra.rollout.buckets import Bucket, pack_bucket


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


class ObjectStoreTransport:
    async def push(self, engines: list, bucket: Bucket, call) -> None:
        import ray
        from safetensors.torch import save

        ref = ray.put(save({name: t.contiguous() for name, t in bucket}))  # one copy, read by every engine
        await asyncio.gather(*(call(e.load_weights_bytes.remote(ref)) for e in engines))


class SharedMemoryTransport:
    def __init__(self, directory: str = "/dev/shm"):
        self.directory = directory

    async def push(self, engines: list, bucket: Bucket, call) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.directory, f"molt_weights_{uuid.uuid4().hex}.safetensors")
        save_file({name: t.contiguous() for name, t in bucket}, path)
        try:
            await asyncio.gather(*(call(e.load_weights_file.remote(path)) for e in engines))
        finally:
            os.unlink(path)


class BroadcastTransport:
    """`communicator.broadcast(tensor, src=0)` as rank 0 of the group the engines joined via `init_weight_broadcast`
    (vLLM's PyNcclCommunicator on GPU; tests use a fake)."""

    def __init__(self, communicator, device: str = "cuda"):
        self.communicator = communicator
        self.device = device

    async def push(self, engines: list, bucket: Bucket, call) -> None:
        metas, flat = pack_bucket(bucket)
        receives = [call(e.worker_call.remote("receive_broadcast", metas)) for e in engines]
        gathered = asyncio.gather(*receives)  # engines must be waiting in the collective before we send
        await asyncio.to_thread(self.communicator.broadcast, flat.to(self.device), 0)
        await gathered


class CudaIpcTransport:
    async def push(self, engines: list, bucket: Bucket, call) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        handles = [(name, reduce_tensor(t.detach().contiguous())) for name, t in bucket]
        await asyncio.gather(*(call(e.worker_call.remote("receive_ipc", handles)) for e in engines))


class WeightSync:
    """Pushes weights to engine actors (Ray handles of `VLLMEngine`); `sync` bumps the policy version."""

    def __init__(
        self,
        engines: list,
        transport: ObjectStoreTransport | SharedMemoryTransport | BroadcastTransport | CudaIpcTransport,
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
        version = self.version + 1 if version is None else version
        start = time.perf_counter()
        num_tensors = num_bytes = 0
        await self._all("pause")
        done = False
        try:
            await self._all("begin_weight_update")
            for bucket in buckets:
                await self.transport.push(self.engines, bucket, self._call)
                num_tensors += len(bucket)
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            done = True
        finally:
            try:  # also after a failure: layers left mid-reload would break generation
                await self._all("finish_weight_update", version if done else None)
            finally:
                await self._all("resume")
        self.version = version
        missing = await self._all("worker_call", "missing_weights") if self.check_coverage else []
        missing_names = sorted({name for per_engine in missing for per_worker in per_engine for name in per_worker})
        if missing_names:
            raise WeightCoverageError(missing_names)
        return SyncReport(version, num_tensors, num_bytes, time.perf_counter() - start)


async def connect_broadcast(engines: list, *, master_address: str, master_port: int, workers_per_engine: int,
                            device: str = "cuda"):
    """Form the NCCL group {trainer rank 0} ∪ {every engine worker}; returns the trainer's communicator (GPU only)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    world = 1 + len(engines) * workers_per_engine
    joins = [
        e.worker_call.remote("init_weight_broadcast", master_address, master_port, 1 + i * workers_per_engine, world)
        for i, e in enumerate(engines)
    ]

    def trainer_side():
        group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=0, world_size=world)
        return PyNcclCommunicator(group, device=device)

    communicator = await asyncio.to_thread(trainer_side)
    await asyncio.gather(*joins)
    return communicator
