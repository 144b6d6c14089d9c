"""A multirun point's W&B group is the sweep's name; a single run and an explicit group are left alone."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import open_dict

from molt_hydra.config.store import CONF_DIR, register
from molt_hydra.runtime.sweep import set_wandb_group, sweep_group


def _cfg(mode: RunMode, overrides=()):
    register()
    GlobalHydra.instance().clear()  # other test modules may leave Hydra initialised for speed
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra.sweep.dir=multirun/sweep_x/2026-01-02_03-04-05", *overrides],
                      return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = mode
    HydraConfig.instance().set_config(cfg)
    return cfg


def test_sweep_group_is_name_and_time():
    assert sweep_group("multirun/sweep_x/2026-01-02_03-04-05") == "sweep_x_2026-01-02_03-04-05"


def test_multirun_point_gets_the_sweep_group():
    cfg = _cfg(RunMode.MULTIRUN)
    assert cfg.logger.wandb.group is None
    set_wandb_group(cfg)
    assert cfg.logger.wandb.group == "sweep_x_2026-01-02_03-04-05"


def test_single_run_and_explicit_group_unchanged():
    cfg = _cfg(RunMode.RUN)
    set_wandb_group(cfg)
    assert cfg.logger.wandb.group is None
    cfg = _cfg(RunMode.MULTIRUN, ["logger.wandb.group=mine"])
    set_wandb_group(cfg)
    assert cfg.logger.wandb.group == "mine"
