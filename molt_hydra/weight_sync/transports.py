"""How one bucket reaches the engines: the object store (any host; LoRA's adapter too), and the pipelined packed
transports, NCCL broadcast (GPU, disaggregated) and CUDA IPC (GPU, colocated). Shared memory (one host) and the
single-pass CUDA IPC form have files of their own (shared_memory.py, shared_params.py).

`WeightSync.sync` (sender.py) drives a transport: `begin` (with what each engine's `begin_weight_update` answered),
`push` per bucket (returns the bytes it moved), `drain` at the end, `abandon` after a failure; the single pass instead
makes one `update` call per engine. Tensors travel in the
engine's dtype: the packed transports cast while packing on the trainer's device.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
from safetensors.torch import save
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from molt_hydra.weight_sync.buckets import Bucket, pack_bucket

# Ray is imported where the object store is used: engine workers never need it


class Transport:
    """The no-op defaults of what `WeightSync` calls on every transport."""

    written: frozenset[str] | set[str] = frozenset()  # names the trainer wrote into the engines' parameters itself
    replayed = 0.0  # single pass: the share of engine workers that replayed their recorded copy plan
    in_place = False  # this sync wrote into the engines' parameters (shared memory, mapped)
    single_pass = False  # the engines load straight from the trainer's parameters, one call each (shared_params.py)

    def begin(self, answers: list) -> None:
        pass

    # push(engines, bucket, call) -> bytes moved: every transport's own

    async def drain(self) -> None:
        pass

    async def abandon(self) -> None:
        pass


class ObjectStoreTransport(Transport):
    """safetensors bytes through Ray's object store, one copy read by every engine (`load_weights_bytes`): any host.
    With `adapter_config` (LoRA, whatever the placement): the adapter's tensors, under PEFT's names, gathered over the
    sync's buckets into one blob sent at `drain` (it is megabytes); each engine stages it as a PEFT directory and
    loads it as the new version in `finish_weight_update` (rollout/engine.py `stage_adapter`). `adapter_config` is
    the adapter_config.json vLLM's loader validates against its LoRA config. Nothing of the base model moves."""

    def __init__(self, adapter_config: dict | None = None):
        self.adapter_config = adapter_config
        self.tensors: dict[str, torch.Tensor] = {}
        self.send = None  # (engines, call) of this sync, for `drain`

    async def push(self, engines: list, bucket: Bucket, call) -> int:
        self.tensors.update((name, t.contiguous()) for name, t in bucket)
        self.send = (engines, call)
        if self.adapter_config is None:
            await self.drain()
        return sum(t.numel() * t.element_size() for _, t in bucket)

    async def drain(self) -> None:
        import ray

        if not self.tensors:
            return
        (engines, call), ref = self.send, ray.put(save(self.tensors))
        self.tensors = {}
        await asyncio.gather(*(call(e.load_weights_bytes.remote(ref) if self.adapter_config is None
                                    else e.stage_adapter.remote(ref, self.adapter_config)) for e in engines))

    async def abandon(self) -> None:
        self.tensors = {}


class Pipeline(Transport):
    """Packed buckets in flight: `push` packs a bucket (cast to the engine dtype), calls `method` on every engine
    worker and returns once it is sent, so bucket k+1 is gathered and packed while bucket k is on the wire / being
    loaded; at most `depth` are in flight, each one's buffer held until its engines answered (and, for a broadcast,
    its send completed). Subclasses say what a bucket's call carries (`_pack`) and how its bytes go (`_send`)."""

    depth = 2
    method = ""  # the receiver's method (receiver.py) each engine worker runs per bucket

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.in_flight: list = []  # (buffer, send work or None, engines' answers)

    async def push(self, engines: list, bucket: Bucket, call) -> int:
        while len(self.in_flight) >= self.depth:  # the buffer packed next is one no engine still reads
            await self._retire()
        flat, args = await self._pack(bucket)
        answers = asyncio.gather(*(self._load(e, call, args) for e in engines))
        self.in_flight.append((flat, self._send(flat), answers))
        return flat.numel()

    async def _pack(self, bucket: Bucket) -> tuple[torch.Tensor, tuple]:
        metas, flat = pack_bucket(bucket, self.dtype)  # where the bucket lives: the trainer's GPU
        return flat, (metas,)

    def _load(self, engine, call, args: tuple):
        """The engine's answer to come: `.remote()` submits the call now, so engines get buckets in order and at once
        (a broadcast's receivers join while the trainer gathers the next bucket)."""
        return call(engine.worker_call.remote(self.method, *args))

    def _send(self, flat: torch.Tensor):
        return None

    async def _retire(self) -> None:
        _, work, answers = self.in_flight.pop(0)  # the buffer (`_`) is freed as this returns
        await answers
        if work is not None:  # NCCL: the current stream waits for the send; gloo: blocks until sent
            await asyncio.to_thread(work.wait)

    async def drain(self) -> None:
        while self.in_flight:
            await self._retire()

    async def abandon(self) -> None:
        """After a failed sync: retire every bucket still in flight, ignoring their errors, so none of them is retired
        by (and fails) the next sync and no buffer is reused while an engine may still read it."""
        while self.in_flight:
            with contextlib.suppress(Exception):
                await self._retire()


class BroadcastGroup:
    """A torch process group of its own (NCCL on GPU, gloo on CPU) built from a TCPStore hosted by rank 0: no default
    group, no vLLM, so the trainer (already in its FSDP group) and every engine worker (already in vLLM's) can join it.
    The same pattern as vLLM's StatelessProcessGroup + PyNcclCommunicator, on torch alone. Construction blocks until
    all `world_size` ranks joined, then proves the group with a one-element broadcast."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device | str,
                 timeout_s: float = 600.0):
        timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        # multi-tenant: rank 0 reuses the store it opened on a port of its choice (weight_sync/sender.py)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.broadcast(torch.zeros(1, device=self.device), src=0).wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Queue the broadcast; `.wait()` on the result makes the current stream (NCCL) / the caller (gloo) wait."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        return self.group.broadcast([tensor], options)


class BroadcastTransport(Pipeline):
    """Rank 0 of a `BroadcastGroup` every engine worker joined (`init_weight_broadcast`): per bucket, the engines are
    told the bucket's layout, then its flat buffer is broadcast. The send is queued (NCCL orders it after the packing
    on the GPU) without waiting for it, so the next bucket's packing overlaps this one's transfer."""

    method = "receive_broadcast"

    def __init__(self, group: BroadcastGroup, dtype: torch.dtype | None = None):
        super().__init__(dtype)
        self.group = group

    def _send(self, flat: torch.Tensor):
        return self.group.broadcast(flat, 0)  # engines join as their calls arrive: it waits on the wire


def ipc_handle(tensor: torch.Tensor) -> bytes:
    """A tensor's IPC handle (torch's `reduce_tensor`: its rebuild function and arguments) as bytes: vLLM's
    collective_rpc serializes with msgspec, which refuses the function and the classes inside (vLLM 0.24). Pickled
    by the multiprocessing pickler torch registers its sharing with, so a CPU tensor's storage travels as its shared
    memory (the CPU stand-ins of the tests), not as a copy."""
    return bytes(ForkingPickler.dumps(reduce_tensor(tensor)))


def open_ipc_handle(handle: bytes, device: torch.device) -> torch.Tensor:
    """The engine's end of `ipc_handle`: the trainer's tensor mapped on `device` (colocated: the trainer's GPU)."""
    rebuild, args = pickle.loads(handle)
    if rebuild is rebuild_cuda_tensor:  # the trainer's device index; colocated, it is this worker's device
        args = (*args[:6], device.index, *args[7:])
    return rebuild(*args)


class CudaIpcTransport(Pipeline):
    """Per bucket one flat buffer on the trainer's GPU; every engine worker maps it through its CUDA IPC handle, loads
    from it and unmaps it before answering, so the buffer is freed (`ipc_collect`) as soon as the bucket is retired.
    The handle carries an IPC event recorded after the packing, which the engine's stream waits on: no host sync on
    this side. (One buffer shared once per sync and kept mapped was tried: no faster at 0.6B on an H200, and torch's
    IPC ref-counting then kept it allocated after the sync.)"""

    method = "receive_ipc"

    async def _pack(self, bucket: Bucket) -> tuple[torch.Tensor, tuple]:
        flat, (metas,) = await super()._pack(bucket)
        return flat, (metas, ipc_handle(flat))

    async def _retire(self) -> None:
        await super()._retire()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free the buffer now that every engine dropped its mapping

    async def drain(self) -> None:
        await super().drain()
        if torch.cuda.is_available():  # colocated: the packed buckets' memory goes back before the KV cache wakes
            torch.cuda.empty_cache()
