"""A run whose output cannot be written fails before anything starts, with one message naming the directory and the
key that sets it; never a traceback from Hydra's, Ray's or the trainer's first write. As a Hydra callback it checks
the run (or sweep) directory before Hydra creates it; `check_outputs` checks the resolved config's own directories."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback

from molt_hydra.runtime.run_lock import BESIDE
from molt_hydra.runtime.watchdog import EXIT_FAILED


def not_writable(path: str | Path) -> str | None:
    """Why `path` cannot hold new files (None when it can): a probe directory, holding a byte, is made and removed in
    the path, or in its nearest existing parent when the path does not exist yet. Permission bits are not enough: root
    ignores them, not a read-only mount or an immutable directory; nor is a directory alone (a full disk makes one)."""
    probe, missing = Path(path).absolute(), []
    while not os.path.exists(probe):  # (False for a name past the disk's limit, where Path.exists raises on 3.11)
        probe, missing = probe.parent, [probe.name, *missing]
    limit = os.pathconf(probe, "PC_NAME_MAX")  # each directory still to be made must be a name the disk takes
    if too_long := [name for name in missing if len(os.fsencode(name)) > limit]:
        return f"the name {too_long[0][:40]!r}... is {len(os.fsencode(too_long[0]))} bytes, over this disk's {limit}"
    try:
        with tempfile.TemporaryDirectory(dir=probe, prefix=".molt-write-probe-") as made:
            Path(made, "byte").write_bytes(b"\0")
            return None
    except OSError as e:
        return f"{e.strerror or e} ({probe})"


def fail_unless_writable(dirs: dict[str, str | Path], fixes: dict[str, str] | None = None) -> None:
    """`dirs`: config key (or output_dir/<sub>) -> directory; `fixes`: a key's fix where it is not "point it at a
    writable directory".
    Prints one message per unwritable directory and exits non-zero."""
    fixes = fixes or {}
    lines = [f"- {key}={path}: not writable: {why}. Fix: {fixes.get(key, f'point {key} at a writable directory')}."
             for key, path in dirs.items() if (why := not_writable(path)) is not None]
    if lines:
        print("Run not started: output directory not writable.\n" + "\n".join(lines), file=sys.stderr)
        sys.exit(EXIT_FAILED)


def run_dirs(cfg) -> dict[str, str]:
    """The directories the run writes, by the key that sets them (the resolved RunConfig): checked writable before it
    starts (`check_outputs`), and locked while it runs (runtime/run_lock.py)."""
    dirs = {"output_dir": cfg.output_dir}
    c, job = cfg.checkpoint, cfg.job.value
    if writes_checkpoint_dir(cfg):
        dirs["checkpoint.dir"] = c.dir
    if job != "eval" and c.export_final:
        dirs["checkpoint.export_dir"] = c.export_dir
    if cfg.train.rollout_dump_dir:  # (was: the first dump failed the run, after every role had started)
        dirs["train.rollout_dump_dir"] = cfg.train.rollout_dump_dir
    return dirs


def writes_checkpoint_dir(cfg) -> bool:
    """Whether the run writes checkpoint.dir: its checkpoints, or `best` (an RL run's eval). Not where it only resumes
    from there (a warm start, checkpoint.save_steps=0: was refused as not writable)."""
    c, job = cfg.checkpoint, cfg.job.value
    return job != "eval" and (c.save_steps != 0 or job == "rl" and bool(cfg.eval.data_path)
                              and c.best_metric_key != "none")


def check_outputs(cfg) -> None:
    """The run's own directories (`run_dirs`), and the metric sinks' own directories under output_dir (an RL or eval
    run's: job=sft writes neither), which were first written after the engines had started."""
    dirs, fixes = run_dirs(cfg), {}
    for key in BESIDE:  # replaced whole: its copies and its lock go in its parent (was: a PermissionError traceback)
        if key in dirs:
            label = f"the directory holding {key}"
            dirs[label], fixes[label] = Path(dirs[key]).resolve().parent, f"point {key} into a writable directory"
    sinks = (("logger.wandb.mode", "wandb", cfg.logger.wandb.mode.value != "disabled", "disabled"),
             ("logger.tensorboard", "tensorboard", cfg.logger.tensorboard, "false"))
    for key, name, used, off in sinks:
        if used and cfg.job.value != "sft":
            label = f"output_dir/{name}"
            dirs[label] = Path(cfg.output_dir) / name
            fixes[label] = f"make it a writable directory, point output_dir elsewhere, or set {key}={off}"
    fail_unless_writable(dirs, fixes)


class OutputWritable(Callback):
    """Checks hydra.run.dir / hydra.sweep.dir before Hydra makes them."""

    def on_run_start(self, config, **kwargs) -> None:
        fail_unless_writable({"hydra.run.dir": config.hydra.run.dir})

    def on_multirun_start(self, config, **kwargs) -> None:
        fail_unless_writable({"hydra.sweep.dir": config.hydra.sweep.dir})
