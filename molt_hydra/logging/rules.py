"""Validation rules of the metric sinks that need W&B's own knowledge: whether an online W&B run would find its
credentials. Run by runtime/validate.py beside config/validate.py's rules (which check the logger's other knobs)."""

from __future__ import annotations

import os

from molt_hydra.compat.wandb import missing_api_key
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import Problems


def check_logger(cfg: RunConfig, problems: Problems) -> None:
    """logger.wandb.mode=online (or auto, which logging/sinks.py makes online when WANDB_API_KEY is set) without
    credentials W&B accepts: was accepted, and the run failed at wandb.init (or waited at its login prompt) after the
    engines and trainer had started. job=sft starts no W&B run (config/validate.py SFT_IGNORES)."""
    mode = cfg.logger.wandb.mode.value
    if cfg.job.value == "sft" or not (mode == "online" or mode == "auto" and os.environ.get("WANDB_API_KEY")):
        return
    if (reason := missing_api_key()) is not None:
        how = "online" if mode == "online" else "auto, online with WANDB_API_KEY set"
        problems.check(False, "logger.wandb.mode", f"{how}, but {reason} The run would fail (or wait at W&B's login "
                       "prompt) once its engines and trainer are up.", "export WANDB_API_KEY=<your key> "
                       "(wandb.ai/authorize), run `wandb login`, or set logger.wandb.mode=offline (`wandb sync` "
                       "uploads it later)")
