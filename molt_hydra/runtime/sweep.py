"""What a multirun point takes from its sweep: the W&B group. Every point of one `molt-run -m` logs into one W&B
group named after the sweep (its directory: `<name>_<time>_<hash>` for multirun/<name>/<time>), so the points of a
sweep are compared side by side; each point's run is named after its own output directory. The hash is of the sweep
directory's absolute path: the last two parts alone were the same for two sweeps in different places
(/a/exp/sweep, /b/exp/sweep), whose points then shared one group. A sweep resumed in its directory keeps its group."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict


def sweep_group(sweep_dir: str) -> str:
    digest = hashlib.sha256(os.path.abspath(sweep_dir).encode()).hexdigest()[:8]
    return "_".join([*Path(sweep_dir).parts[-2:], digest])


def set_wandb_group(cfg: DictConfig) -> None:
    """In a multirun point, set logger.wandb.group to the sweep's name unless the command line set one."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN and cfg.logger.wandb.group is None:
        with open_dict(cfg):
            cfg.logger.wandb.group = sweep_group(HydraConfig.get().sweep.dir)
