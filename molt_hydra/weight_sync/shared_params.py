"""CUDA IPC in one pass: the engines load straight from the trainer's own parameters; nothing is packed or sent.

For one trainer rank whose parameters are full tensors (FSDP2 with dp=1, or no FSDP): the trainer shares IPC handles
of its OWN parameter storages, which the optimizer updates in place, and each engine worker opens them once and keeps
the views for every later sync; a sync is then one call per engine (begin, load, finish, stamp and resume together:
one round trip) whose loader reads the trainer's parameters and casts while it copies into the engine's own (fp32 ->
bf16: 6 bytes of traffic per parameter against 10 for pack + load). So the wire-dtype rule of the packed transports
does not apply: the loader receives the trainer's dtype.

The views are keyed by `token`, a fingerprint of the storages (address, layout, dtype of every tensor) and of this
process: if the trainer's storages change (a reload, a new process), the token changes, a new transport is made and
every engine gets the new handles with its first call (as does an engine the transport has not reached before).
Ordering: the trainer's stream is synchronized before the engines are called (their reads start after the last
optimizer write), and every worker synchronizes its stream before answering (the trainer cannot step again before the
copies are done). On the engine side, the loaders of a token's first sync are recorded and, proven to be plain
copies, replayed as one CUDA graph on later syncs (copy_plan.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os

import torch

from molt_hydra.weight_sync.buckets import parameter_addresses
from molt_hydra.weight_sync.transports import Transport, ipc_handle

logger = logging.getLogger(__name__)


class SharedParamsTransport(Transport):
    single_pass = True  # `WeightSync.sync` calls `update` (one call per engine) instead of begin / push / finish

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None):
        self.tensors = tensors
        layout = [(n, t.data_ptr(), tuple(t.shape), t.stride(), str(t.dtype), str(t.device)) for n, t in tensors]
        self.token = hashlib.sha1(repr((os.getpid(), layout)).encode()).hexdigest()
        self.handles: list | None = None  # made for the first engine not yet reached, kept for the token's life
        self.refusals: set[str] = set()  # why a worker's loaders could not be recorded: each said once
        self.mapped: set = set()  # the engines (Ray handles) whose workers hold this token's views
        self.engine_seconds = 0.0  # the slowest engine worker's own load in the last update
        self.engine_call_seconds = 0.0  # the slowest engine's own seconds in the last update (wakes excluded)
        self.device = next((t.device for _, t in tensors if t.is_cuda), None)
        # bytes written into each engine: floating tensors in the engine dtype
        self.nbytes = sum(t.numel() * (dtype.itemsize if dtype and t.is_floating_point() else t.element_size())
                          for _, t in tensors)

    async def update(self, engines: list, version: int, check: bool, call) -> list:
        """The whole update, one call per engine (`VLLMEngine.update_from_shared_params`): an engine this transport has
        not reached yet gets the names and handles with it (its workers map them once; a replaced engine is a new
        handle), the others the token alone. Returns each worker's missing names (None unless `check`)."""
        if self.device is not None:  # the optimizer's last writes land before any engine reads
            torch.cuda.current_stream(self.device).synchronize()
        self.mapped &= set(engines)  # a replaced engine's handle is not kept
        names = [n for n, _ in self.tensors]

        async def update(engine) -> tuple[list, float]:
            first = engine not in self.mapped
            if first and self.handles is None:
                self.handles = [ipc_handle(t.detach()) for _, t in self.tensors]
            args = (self.token, names, self.handles) if first else (self.token, None, None)
            answer = await call(engine.update_from_shared_params.remote(args, version, check))
            self.mapped.add(engine)
            return answer

        replies = await asyncio.gather(*(update(e) for e in engines))
        self.engine_call_seconds = max((seconds for _, seconds in replies), default=0.0)
        answers = [a for per_engine, _ in replies for a in per_engine]
        loads = [load for load, _ in answers]
        self.replayed = sum(path == "replay" for _, path, _, _ in loads) / max(len(loads), 1)
        self.engine_seconds = max((seconds for *_, seconds in loads), default=0.0)  # the slowest worker's own load
        for why in {why for _, _, why, _ in loads if why} - self.refusals:
            logger.warning("weight sync: the engine's loaders run on every sync (no copy plan): %s", why)
            self.refusals.add(why)
        return [missing for _, missing in answers]


def single_pass_transport(worker, transport: str, dtype: torch.dtype) -> SharedParamsTransport | None:
    """The single-pass carrier when it applies: CUDA IPC, one trainer rank, and `worker.local_weights()` finds every
    weight whole in a parameter storage of its own; else None (the bucketed path: dp > 1, offload, converted names
    ...). The answer is kept on the worker while its parameter storages stay where they are (a cheap check each sync):
    the weights are looked up, and their handles made, once per change, not once per sync."""
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
