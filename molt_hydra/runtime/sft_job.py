"""`job=sft`: supervised fine-tuning on the same model / FSDP2 path as the RL trainer (parallel/sft.py)."""

from __future__ import annotations

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.trainer_options import DTYPE_NAMES, trainer_options


def run_sft_job(cfg: RunConfig) -> list[dict]:
    from molt_hydra.models.build import backend_options, resolve_path
    from molt_hydra.parallel.sft import run_sft

    d, t, o, c = cfg.data, cfg.train, cfg.train.optimizer, cfg.checkpoint
    return run_sft(
        resolve_path(c.path or cfg.model.path), d.train_path, cfg.output_dir, eval_data=cfg.eval.data_path,
        input_key=d.input_key, output_key=d.output_key, chat_template=d.chat_template,
        train_on_last_turn_only=d.train_on_last_turn_only, max_len=d.max_len, max_samples=d.max_samples,
        batch_size=t.batch_size, max_epochs=t.epochs, eval_steps=cfg.eval.every_steps, save_steps=c.save_steps,
        ckpt_path=c.dir, keep=c.max_num, resume=c.resume.value != "never", export_hf=c.export_final,
        num_ranks=cfg.parallelism.trainer_devices, seed=cfg.seed, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
        weight_decay=o.weight_decay, lr_scheduler=o.scheduler, lr_warmup_ratio=o.warmup_ratio,
        min_lr_ratio=o.min_lr_ratio, max_norm=o.max_grad_norm,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch if t.dynamic_batch else t.micro_batch_size * d.max_len,
        param_dtype=DTYPE_NAMES[cfg.model.param_dtype.value], attn_implementation=cfg.model.attn_implementation.value,
        offload=cfg.parallelism.offload.value == "full",
        optimizer_offload=cfg.parallelism.offload.value == "optimizer", timeout_s=t.timeouts.collective_s,
        image_key=d.image_key, max_images_per_prompt=d.max_images_per_prompt, max_disk_gb=c.max_disk_gb,
        load_model_only=c.load_model_only, **trainer_options(cfg, o), **backend_options(cfg))
