"""The one table of keys a job has no use for, read by the command line's checks (cli.py: refused there, or set aside
from a recipe) and by a resume's (runtime/entrypoint.py: a key the job never reads cannot change what it learns)."""

from __future__ import annotations

# job -> {key or group: why it changes nothing there}. The longest entry a key falls under decides; None marks a key
# the job reads inside a group it ignores. On the command line each is refused (cli.py `job_ignored`); set by the
# composed defaults or a recipe, the job's JOB_SETS_ASIDE keys are reset to the schema's (cli.py `_set_aside`), so
# `+recipe=NAME job=eval` scores a recipe's model. cli.py `validated` does both, for every caller.
_NO_ENGINE = "starts no rollout engine and runs no agent"
_NO_TRAINER = "starts no trainer (it scores the model with the rollout engines only)"
JOB_IGNORES: dict[str, dict[str, str | None]] = {
    "sft": {"rollout": _NO_ENGINE, "agent": _NO_ENGINE,
            "train.max_steps": "trains train.epochs over its data (set those instead)",
            "train.max_staleness": "generates no rollouts (no sample is ever stale)",
            # (a multirun point sets this one itself)
            "logger.wandb.group": "writes its metrics to <output_dir>/sft_metrics.jsonl only (no W&B run)",
            "algorithm": "computes no advantage and no RL loss (its loss is the replies' cross-entropy)",
            **{key: "trains one model, with no reference, teacher or critic beside it" for key in (
                "model.ref_path", "model.critic_path", "train.critic")},
            **{f"eval.{name}": "scores its eval data by the loss on its replies, sampling nothing" for name in (
                "batch_size", "n_samples_per_prompt", "temperature", "top_p", "max_new_tokens")},
            "data.split": "reads the default split only", "data.train_probs": "reads one dataset",
            "data.blank_images": "trains on its rows' images as they are",
            "eval.split": "reads the default split of its eval data",
            **{f"{group}.config_name": "reads .jsonl / .json files, which have no configs" for group in (
                "data", "eval")},
            **{f"data.{name}": "renders its rows' messages with the chat template as they are" for name in (
                "label_key", "tools_key", "apply_chat_template")},
            "model.tokenizer_path": "tokenizes with the tokenizer saved beside the model it trains",
            "model.trust_remote_code": "starts no rollout engine, the only part that runs a model directory's own code",
            "cluster.ray_address": "starts no Ray: its ranks are processes of this machine (parallel/sft.py)",
            **{f"train.{name}": "generates no rollouts (it passes over its data train.epochs times)" for name in (
                "num_episodes", "mode", "queue_depth", "partial_rollout", "stale_samples", "force_on_policy",
                "rollout_dump_dir", "rollout_replay_dir", "max_untrainable_steps")},
            **{f"train.timeouts.{name}": "bounds its ranks by train.timeouts.collective_s only" for name in (
                "startup_s", "engine_call_s", "trainer_call_s", "step_s")},
            **{f"parallelism.{name}": "trains one model, with no engine or other role beside it" for name in (
                "colocate", "colocate_models", "borrow_idle_cpus")},
            # (parallel/sft.py builds each rank's TrainerSpec without them: every rank a data-parallel FSDP rank)
            **{f"parallelism.{name}": "shards its model with FSDP over its ranks only, with no tensor-, context- or "
               "expert-parallel mesh" for name in ("tp", "cp", "ep")},
            "checkpoint.save_hf": "saves resumable checkpoints only; its HF export is the final one",
            "checkpoint.best_metric_key": "keeps the newest checkpoints (checkpoint.max_num), never a best one",
            "eval.at_start": "evaluates every eval.every_steps steps (or at each epoch's end) and at the last step",
            **{f"logger.{name}": "writes its metrics to <output_dir>/sft_metrics.jsonl only (no W&B, TensorBoard or "
               "progress line)" for name in ("every_steps", "tensorboard", "progress", "sample_table_every",
                                             "dump_trajectories", "debug_rollout", "wandb.mode", "wandb.project",
                                             "wandb.entity", "wandb.run_name")}},
    "eval": {
        "train": _NO_TRAINER, "parallelism": _NO_TRAINER,
        **{f"train.timeouts.{name}": None for name in ("startup_s", "engine_call_s", "step_s")},
        "train.full_determinism": None,  # GPU engines run batch-invariant (config/validate.py refuses it on CPU)
        **{f"model.{name}": _NO_TRAINER for name in (
            "ref_path", "critic_path", "backend", "param_dtype", "master_weights", "attn_implementation",
            "gradient_checkpointing", "compile_blocks", "aux_loss_coef", "freeze_visual_encoder", "freeze_moe_router",
            "moe_dispatcher", "linear_backend", "experts_backend", "rms_norm", "gate_precision", "moe_experts_impl")},
        "algorithm": "computes no advantage and no loss",
        "checkpoint": "saves no checkpoint (it scores checkpoint.path, else model.path)", "checkpoint.path": None,
        **{f"data.{name}": "scores the rows of eval.data_path only" for name in (
            "train_path", "train_probs", "split", "config_name", "max_samples")},
        **{f"data.{name}": "samples its replies from the engines (no SFT target)" for name in (
            "output_key", "train_on_last_turn_only")},
        "data.chat_template": "renders prompts with the tokenizer's own chat template (the override is SFT's)",
        **{f"eval.{name}": "evaluates once, when its engines are up" for name in ("every_steps", "at_start")},
        "rollout.n_samples_per_prompt": "samples eval.n_samples_per_prompt per prompt (null = 1)",
        "rollout.top_k": "samples without top-k (as every evaluation does)",
        **{f"rollout.{name}": "generates no training batch" for name in ("max_inflight_groups", "incomplete_groups")},
        # (plain_cpu_weights: plain linear layers make a sync one copy, and only slow decoding where none comes)
        **{f"rollout.{name}": "starts no trainer, so no weights reach the engines" for name in (
            "weight_sync", "routing_replay", "plain_cpu_weights")},
        **{f"logger.{name}": "logs its one evaluation only (this shapes the per-step training log)" for name in (
            "every_steps", "sample_table_every", "dump_trajectories", "debug_rollout")},
        "logger.debug_grad_norms": _NO_TRAINER,
    },
}


def ignored_by(job: str, key: str) -> str | None:
    """Why `job` has no use for `key` (the longest entry it falls under decides), or None: the job reads it."""
    table = JOB_IGNORES.get(job, {})
    entries = [entry for entry in table if key == entry or key.startswith(entry + ".")]
    return table[max(entries, key=len)] if entries else None
