"""Validation rules of the metric sinks that need W&B's own knowledge: whether an online W&B run would find its
credentials. Run by runtime/validate.py beside config/validate.py's rules (which check the logger's other knobs)."""

from __future__ import annotations

from molt_hydra.compat.wandb import api_key
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import Problems


def check_logger(cfg: RunConfig, problems: Problems) -> None:
    """logger.wandb.mode=online (or auto, which logging/sinks.py makes online where W&B finds credentials) without
    credentials W&B accepts: was accepted, and the run failed at wandb.init (or waited at its login prompt) after the
    engines and trainer had started. job=sft starts no W&B run (config/job_ignores.py)."""
    mode = cfg.logger.wandb.mode.value
    if cfg.job.value == "sft" or mode not in ("online", "auto"):
        return
    found, reason = api_key()
    if reason is not None and (found or mode == "online"):  # (auto without credentials: offline files)
        how = "online" if mode == "online" else "auto, online as W&B finds credentials"
        problems.check(False, "logger.wandb.mode", f"{how}, but {reason} The run would fail (or wait at W&B's login "
                       "prompt) once its engines and trainer are up.", "export WANDB_API_KEY=<your key> "
                       "(wandb.ai/authorize), run `wandb login`, or set logger.wandb.mode=offline (`wandb sync` "
                       "uploads it later)")
