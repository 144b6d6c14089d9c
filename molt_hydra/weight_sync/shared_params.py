"""CUDA IPC in one pass: the engines load straight from the trainer's own parameters; nothing is packed or sent.

For one trainer rank whose parameters are full tensors (FSDP2 with dp=1, or no FSDP): the trainer shares IPC handles
of its OWN parameter storages, which the optimizer updates in place, and each engine worker opens them once and keeps
the views for every later sync; a sync is then one call per engine (begin, load, finish, stamp and resume together:
one round trip) whose loader reads the trainer's parameters and casts while it copies into the engine's own (fp32 ->
bf16: 6 bytes of traffic per parameter against 10 for pack + load). So the wire-dtype rule of the packed transports
does not apply: the loader receives the trainer's dtype.

Two halves, so that whoever drives the sync calls the engines itself: `SharedParams` lives on the trainer rank (its
tensors, their token, their handles, made once) and answers `offer` (stream synchronized, then the token, with names
and handles only for a caller that does not hold that token yet); `SharedParamsPush` takes offers and makes the
engine calls. Colocated, the driver holds the push and takes its offer with the call that releases the trainer's
cached memory before every sync (runtime/calls.py), so a sync is one round trip driver -> engine. `push_from_rank`
drives the same two halves from trainer rank 0 itself (one more hop), as the GPU stand-in tests and bench call it.

The views are keyed by `token`, a fingerprint of the storages (address, layout, dtype of every tensor) and of the
trainer's process: if the trainer's storages change (a reload, a new process), the token changes, the offer carries the
new handles and every engine gets them with its next call (as does an engine the push has not reached before).
Ordering: the trainer's stream is synchronized by the offer (the engines' reads start after the last optimizer write;
nothing runs on the trainer between the offer and the engine calls: colocated training is synchronous), and every
worker synchronizes its stream before answering (the trainer cannot step again before the copies are done). On the
engine side, the loaders of a token's first sync are recorded and, proven to be plain copies, replayed as one CUDA
graph on later syncs (copy_plan.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass

import torch

from molt_hydra.weight_sync.buckets import parameter_addresses
from molt_hydra.weight_sync.transports import Transport, ipc_handle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Offer:
    """What the trainer's rank tells a push: its storages' token; their names and IPC handles unless the push already
    holds that token (`known`); the bytes written into each engine and the tensor count (metrics)."""

    token: str
    names: list[str] | None
    handles: list[bytes] | None
    nbytes: int
    tensors: int


class SharedParams:
    """The trainer rank's half: its own parameter tensors, their token and their IPC handles (made at the first offer
    that needs them, kept for the token's life)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None):
        self.tensors = tensors
        layout = [(n, t.data_ptr(), tuple(t.shape), t.stride(), str(t.dtype), str(t.device)) for n, t in tensors]
        self.token = hashlib.sha1(repr((os.getpid(), layout)).encode()).hexdigest()
        self.handles: list[bytes] | None = None
        self.device = next((t.device for _, t in tensors if t.is_cuda), None)
        # bytes written into each engine: floating tensors in the engine dtype
        self.nbytes = sum(t.numel() * (dtype.itemsize if dtype and t.is_floating_point() else t.element_size())
                          for _, t in tensors)

    def offer(self, known: str | None) -> Offer:
        if self.device is not None:  # the optimizer's last writes land before any engine reads
            torch.cuda.current_stream(self.device).synchronize()
        if self.token == known:
            return Offer(self.token, None, None, self.nbytes, len(self.tensors))
        if self.handles is None:
            self.handles = [ipc_handle(t.detach()) for _, t in self.tensors]
        return Offer(self.token, [n for n, _ in self.tensors], self.handles, self.nbytes, len(self.tensors))


class SharedParamsPush(Transport):
    """The engine calls of a single pass, driven from wherever `take` got its offer (the driver, or trainer rank 0 in
    `push_from_rank`): an engine this push has not reached with the current token gets the names and handles with its
    call (its workers map them once; a replaced engine is a new handle), the others the token alone."""

    single_pass = True  # `WeightSync.sync` calls `update` (one call per engine) instead of begin / push / finish

    def __init__(self):
        self.token: str | None = None
        self.names: list[str] | None = None
        self.handles: list[bytes] | None = None
        self.mapped: set = set()  # the engines (Ray handles) whose workers hold this token's views
        self.refusals: set[str] = set()  # why a worker's loaders could not be recorded: each said once
        self.nbytes = self.tensors = 0
        self.engine_seconds = 0.0  # the slowest engine worker's own load in the last update
        self.engine_call_seconds = 0.0  # the slowest engine's own seconds in the last update (wakes excluded)
        # the last update's slowest legs: from the call to the engine's start of it, from its end to the answer
        self.to_engine_seconds = self.from_engine_seconds = 0.0

    def take(self, offer: Offer) -> None:
        if offer.token != self.token:
            if offer.handles is None:
                raise RuntimeError(f"the trainer's parameter token {offer.token[:12]} came without its handles")
            self.token, self.names, self.handles, self.mapped = offer.token, offer.names, offer.handles, set()
        self.nbytes, self.tensors = offer.nbytes, offer.tensors

    async def update(self, engines: list, version: int, check: bool, call) -> list:
        """The whole update, one call per engine (`VLLMEngine.update_from_shared_params`). Returns each worker's missing
        names (None unless `check`)."""
        async def update(engine) -> tuple:
            first = engine not in self.mapped
            args = (self.token, self.names, self.handles) if first else (self.token, None, None)
            sent = time.time()  # wall clock, as the engine's stamps: the round trip's two legs
            per_engine, seconds, (entered, left) = await call(engine.update_from_shared_params.remote(args, version,
                                                                                                      check))
            self.mapped.add(engine)
            return per_engine, seconds, entered - sent, time.time() - left

        replies = await asyncio.gather(*(update(e) for e in engines))
        self.engine_call_seconds = max((seconds for _, seconds, _, _ in replies), default=0.0)
        self.to_engine_seconds = max((leg for _, _, leg, _ in replies), default=0.0)
        self.from_engine_seconds = max((leg for *_, leg in replies), default=0.0)
        answers = [a for per_engine, *_ in replies for a in per_engine]
        loads = [load for load, _ in answers]
        self.replayed = sum(path == "replay" for _, path, _, _ in loads) / max(len(loads), 1)
        self.engine_seconds = max((seconds for *_, seconds in loads), default=0.0)  # the slowest worker's own load
        for why in {why for _, _, why, _ in loads if why} - self.refusals:
            logger.warning("weight sync: the engine's loaders run on every sync (no copy plan): %s", why)
            self.refusals.add(why)
        return [missing for _, missing in answers]


def rank_shared_params(worker, transport: str, dtype: torch.dtype) -> SharedParams | None:
    """The rank's half of the single pass when it applies: CUDA IPC (never LoRA's transport), one trainer rank, and
    `worker.local_weights()` finds every weight whole in a parameter storage of its own; else None (the bucketed
    path: dp > 1, offload, converted names ...). The answer is kept on the worker while its parameter storages stay
    where they are (a cheap check each sync): the weights are looked up, and their handles made, once per change."""
    if transport != "cuda_ipc" or getattr(worker, "world_size", 1) != 1 or not hasattr(worker, "local_weights"):
        return None
    cached = getattr(worker, "shared_params", None)
    if cached is not None and cached[0] == (parameter_addresses(worker.model), dtype):
        return cached[1]
    weights = worker.local_weights()  # after it: FSDP's state-dict hook may have put the sharded parameters back
    shared = None if weights is None else SharedParams(weights, dtype)
    worker.shared_params = ((parameter_addresses(worker.model), dtype), shared)
    logger.info("weight sync over CUDA IPC: %s", "bucketed (the rank's weights need a gather or a copy)"
                if shared is None else f"single pass from the trainer's own {len(weights)} parameters")
    return shared


def offer_shared_params(worker, transport: str, dtype: str, known: str | None) -> Offer | None:
    """On the trainer rank (a Ray call): its offer for a push holding token `known`, or None (the bucketed path)."""
    shared = rank_shared_params(worker, transport, getattr(torch, dtype))
    return None if shared is None else shared.offer(known)
