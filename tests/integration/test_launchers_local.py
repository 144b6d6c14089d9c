"""The same sweep through submitit_local: each point a local process, no Slurm involved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

MOLT_RUN = str(Path(sys.executable).with_name("molt-run"))
MOLT_REPORT = str(Path(sys.executable).with_name("molt-report"))


def _sweep(tmp_path: Path, *extra: str, timeout: float) -> Path:
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run([MOLT_RUN, "-m", "+recipe=tiny_cpu", "hydra/launcher=submitit_local",
                        "algorithm.estimator=grpo,rloo", f"hydra.sweep.dir={sweep}", *extra],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return sweep


def _report(sweep: Path) -> list[list[str]]:
    rep = subprocess.run([MOLT_REPORT, str(sweep)], capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert (sweep / "report_train_reward.png").read_bytes()[:4] == b"\x89PNG"
    return [ln.split() for ln in rep.stdout.splitlines()[2:4]]


def test_submitit_local_sweep_runs_each_point_as_a_process(tmp_path):
    sweep = _sweep(tmp_path, "dry_run=true", timeout=300)
    results = sorted((sweep / ".submitit").glob("*/*_0_result.pkl"))
    assert len(results) == 2
    assert len({p.parent.name for p in results}) == 2  # two jobs (local: pid-based ids), not one process
    dirs = sorted(p.parent.parent for p in sweep.glob("*/.hydra/overrides.yaml"))
    assert [OmegaConf.load(d / ".hydra" / "config.yaml").algorithm.estimator for d in dirs] == ["grpo", "rloo"]
    rows = _report(sweep)
    assert [r[:3] for r in rows] == [["0", "algorithm.estimator=grpo", "completed"],
                                     ["1", "algorithm.estimator=rloo", "completed"]]


@pytest.mark.slow
def test_submitit_local_sweep_trains(tmp_path):
    """Needs the RL loop: both points train to the last step."""
    sweep = _sweep(tmp_path, "train.max_steps=3", timeout=1200)
    for d in sorted(p.parent.parent for p in sweep.glob("*/.hydra/overrides.yaml")):
        assert json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
    assert [r[:4] for r in _report(sweep)] == [["0", "algorithm.estimator=grpo", "completed", "3"],
                                               ["1", "algorithm.estimator=rloo", "completed", "3"]]


@pytest.mark.slow  # (make test's budget) the sweep: test_submitit_local_sweep_runs_each_point_as_a_process
def test_failed_points_of_a_submitit_local_sweep_are_each_named(tmp_path):
    """Before: the first failed point ended `molt-run -m hydra/launcher=submitit_local` with submitit's
    UncompletedJobError traceback (exit 1), and the points still running were cancelled as it exited. Both points
    fail in the real runtime, before Ray starts (checkpoint.resume=never over an earlier run's checkpoints)."""
    old_a, old_b, sweep = tmp_path / "old_a", tmp_path / "old_b", tmp_path / "sweep"
    (old_a / "step_1").mkdir(parents=True)
    (old_b / "step_2").mkdir(parents=True)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run([MOLT_RUN, "-m", "hydra/launcher=submitit_local", f"checkpoint.dir={old_a},{old_b}",
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 4 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for number, root in enumerate((old_a, old_b)):
        start = r.stderr.index(f"sweep point #{number} (checkpoint.dir={root}): process ")
        assert f"    Run failed: checkpoint.resume=never, but {root} holds an earlier run's checkpoints" in \
            r.stderr[start:], r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"Run failed: sweep {sweep}: 2 of 2 point(s) failed (listed above). Fix: see each point's log; then run "
        "those points again.")
