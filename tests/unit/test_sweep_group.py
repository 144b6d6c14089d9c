"""A multirun point's W&B group is the sweep's name; a single run and an explicit group are left alone."""

from __future__ import annotations

import hashlib

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


def _digest(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()[:8]


def test_sweep_group_is_name_time_and_where(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    where = _digest(str(tmp_path / "multirun" / "sweep_x" / "2026-01-02_03-04-05"))
    assert sweep_group("multirun/sweep_x/2026-01-02_03-04-05") == f"sweep_x_2026-01-02_03-04-05_{where}"
    assert sweep_group(str(tmp_path / "multirun" / "sweep_x" / "2026-01-02_03-04-05")) == \
        f"sweep_x_2026-01-02_03-04-05_{where}"  # the same directory, however it is written: one group


def test_two_sweeps_whose_directories_end_alike_get_their_own_groups():
    """Before: both were `exp_sweep` (the directory's last two parts), so the points of two sweeps logged into one
    W&B group, compared as one sweep's."""
    assert sweep_group("/a/exp/sweep") == f"exp_sweep_{_digest('/a/exp/sweep')}"
    assert sweep_group("/b/exp/sweep") == f"exp_sweep_{_digest('/b/exp/sweep')}"
    assert _digest("/a/exp/sweep") != _digest("/b/exp/sweep")


def test_multirun_point_gets_the_sweep_group():
    cfg = _cfg(RunMode.MULTIRUN)
    assert cfg.logger.wandb.group is None
    set_wandb_group(cfg)
    assert cfg.logger.wandb.group == sweep_group("multirun/sweep_x/2026-01-02_03-04-05")
    assert cfg.logger.wandb.group.startswith("sweep_x_2026-01-02_03-04-05_")


def test_single_run_and_explicit_group_unchanged():
    cfg = _cfg(RunMode.RUN)
    set_wandb_group(cfg)
    assert cfg.logger.wandb.group is None
    cfg = _cfg(RunMode.MULTIRUN, ["logger.wandb.group=mine"])
    set_wandb_group(cfg)
    assert cfg.logger.wandb.group == "mine"
