"""`job=sft`: supervised fine-tuning on the same model / FSDP2 path as the RL trainer (parallel/sft.py)."""

from __future__ import annotations

from pathlib import Path

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.trainer_options import trainer_options


def run_sft_job(cfg: RunConfig, resume_from: Path | None = None) -> list[dict]:
    """`resume_from`: the checkpoint the run's resume check chose (every rank loads that one)."""
    from molt_hydra.models.build import resolve_path
    from molt_hydra.parallel.sft import run_sft

    d, t, c = cfg.data, cfg.train, cfg.checkpoint
    return run_sft(
        resolve_path(c.path or cfg.model.path), d.train_path, cfg.output_dir, eval_data=cfg.eval.data_path,
        input_key=d.input_key, output_key=d.output_key, chat_template=d.chat_template,
        train_on_last_turn_only=d.train_on_last_turn_only, max_len=d.max_len, max_samples=d.max_samples,
        batch_size=t.batch_size, max_epochs=t.epochs, eval_steps=cfg.eval.every_steps, save_steps=c.save_steps,
        ckpt_path=c.dir, keep=c.max_num, resume=c.resume.value != "never", export_hf=c.export_final,
        num_ranks=cfg.parallelism.trainer_devices, seed=cfg.seed, image_key=d.image_key,
        max_images_per_prompt=d.max_images_per_prompt, max_disk_gb=c.max_disk_gb, load_model_only=c.load_model_only,
        resume_step=resume_from.name if resume_from is not None else None,
        **trainer_options(cfg, t.optimizer))
