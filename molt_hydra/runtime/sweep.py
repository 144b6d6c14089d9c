"""What a multirun point takes from its sweep: the W&B group, and (run here by Hydra's basic launcher) a failure that
leaves the other points to run. Every point of one `molt-run -m` logs into one W&B
group named after the sweep (its directory: `<name>_<time>_<hash>` for multirun/<name>/<time>), so the points of a
sweep are compared side by side; each point's run is named after its own output directory. The hash is of the sweep
directory's absolute path: the last two parts alone were the same for two sweeps in different places
(/a/exp/sweep, /b/exp/sweep), whose points then shared one group. A sweep resumed in its directory keeps its group."""

from __future__ import annotations

import hashlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from molt_hydra.config.schema import EXIT_INTERRUPTED


def sweep_group(sweep_dir: str) -> str:
    digest = hashlib.sha256(os.path.abspath(sweep_dir).encode()).hexdigest()[:8]
    return "_".join([*Path(sweep_dir).parts[-2:], digest])


def set_wandb_group(cfg: DictConfig) -> None:
    """In a multirun point, set logger.wandb.group to the sweep's name unless the command line set one."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN and cfg.logger.wandb.group is None:
        with open_dict(cfg):
            cfg.logger.wandb.group = sweep_group(HydraConfig.get().sweep.dir)


# the points of this process's multirun that Hydra's basic launcher ran: ("sweep point #N (overrides)", the sweep
# directory, exit code: 0 = ran to its end)
_LOCAL_POINTS: list[tuple[str, str, int]] = []


@contextmanager
def going_on_after_a_failure():
    """Runs a point of a multirun that Hydra's basic launcher runs here, one after another: a point that fails (its
    `Run failed: ...` printed, exit 4) is recorded and the sweep goes on with the next; `exit_if_points_failed` lists
    the failed ones at the end. Before, the first failed point ended the process: the points after it never ran, and
    no line named the point that failed. Elsewhere (one run; a Slurm or submitit point, in a process of its own) the
    exit is the process's. Ctrl-C (exit 130) ends the sweep; so does a stalled role (exit 3, at once: a thread of it
    may be blocked in Ray)."""
    hc = HydraConfig.get() if HydraConfig.initialized() else None
    if hc is None or hc.mode != RunMode.MULTIRUN or not hc.launcher._target_.endswith(".BasicLauncher"):
        yield
        return
    point, code = f"sweep point #{hc.job.num} ({' '.join(hc.overrides.task)})", 0
    try:
        yield
    except SystemExit as e:
        if e.code in (None, 0, EXIT_INTERRUPTED):
            raise
        code = e.code if isinstance(e.code, int) else 1
        print(f"{point}: failed (exit {code}), for the reason above; the sweep goes on.", file=sys.stderr, flush=True)
    _LOCAL_POINTS.append((point, os.path.abspath(hc.sweep.dir), code))


def exit_if_points_failed() -> None:
    """Once a local multirun has run every point: the failed ones listed, and the exit code of the first."""
    points, _LOCAL_POINTS[:] = list(_LOCAL_POINTS), []
    failed = [(point, code) for point, _, code in points if code]
    if not failed:
        return
    others = "; the others completed" if len(failed) < len(points) else ""
    print("\n".join(f"{point}: failed (exit {code})" for point, code in failed) + f"\nRun failed: sweep "
          f"{points[0][1]}: {len(failed)} of {len(points)} point(s) failed (listed above){others}. Fix: "
          "see each point's reason above (the `Run failed:` line before its own), then run those points again.",
          file=sys.stderr, flush=True)
    sys.exit(failed[0][1])
