"""A resume on another number of trainer ranks than the checkpoint was saved on (parallel/checkpoint.py
`_restore_rng`; real FSDP2 over gloo, spawned ranks, real checkpoint files). Every rank saves its own RNG streams; on
another number of ranks no saved stream is a rank's own, so every rank seeds them from the run's seed + the step,
alike (as a fresh run's ranks start), and one line says so. Before: on more ranks, the new ones kept the streams they
were built with and the others took the saved ones; on fewer, the ranks took the first saved ones; both silently."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

import _resume_jobs as jobs
from molt_hydra.parallel.checkpoint import load_checkpoint, save_checkpoint
from molt_hydra.parallel.launch import run_ranks

pytestmark = pytest.mark.timeout(300)


def _seeded(seed: int) -> tuple:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return jobs.draw()


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_a_resume_on_another_number_of_ranks_seeds_every_rank_from_the_seed_and_the_step(tmp_path, capfd, caplog):
    root, out = tmp_path / "ckpt", tmp_path / "draws"
    torch.manual_seed(123)  # a saved stream unlike the re-seeded one
    save_checkpoint(root, 3, *_model())  # one rank (this process)
    run_ranks(jobs.resumed_on_two_ranks, 2, root, out, timeout_s=120)
    draws = [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]
    expected = _seeded(7 + 3)
    assert [d["more_ranks"] for d in draws] == [expected, expected]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("Resuming ")]
    assert lines == [f"Resuming {root / 'step_3'} on 2 trainer ranks, saved on 1: its RNG streams are one per saved "
                     "rank, so every rank's (python, numpy, torch) is seeded from seed + step = 10 instead, alike, as "
                     "at a fresh start. The run goes on reproducibly, but not as it would have on 1 ranks (each "
                     "rank's share of a batch changes too); resume on 1 ranks to continue exactly."]
    # on the ranks it was saved on, each rank goes on with its own saved streams, exactly
    assert [d["same_ranks"] for d in draws] == [d["after_save"] for d in draws]

    caplog.set_level(logging.WARNING)
    load_checkpoint(root, *_model(), step="step_5", seed=7)  # saved on 2, resumed on 1 (this process)
    assert jobs.draw() == _seeded(7 + 5) != draws[0]["after_save"]
    said = [r.getMessage().split(":")[0] for r in caplog.records if r.name == "molt_hydra.parallel.checkpoint"]
    assert said == [f"Resuming {root / 'step_5'} on 1 trainer ranks, saved on 2"]


def test_local_ranks_started_ignoring_slurms_notice_live_through_it(tmp_path):
    """job=sft's ranks (parallel/sft.py passes runtime/preemption.py's NOTICE): Slurm sends the notice to every
    process of the job step; only the driver acts on it (it tells the ranks to save). Before, each rank died of it."""
    import signal

    run_ranks(jobs.notified, 2, tmp_path / "rank", timeout_s=120, ignore=(signal.SIGUSR2,))
    assert [torch.load(tmp_path / f"rank.rank{r}", weights_only=False) for r in (0, 1)] == ["lived on"] * 2
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # this process's handler is back


def test_a_ranks_progress_bar_leaves_no_semaphore_behind(tmp_path):
    """A rank leaves by os._exit (parallel/launch.py); tqdm's default lock was a multiprocessing semaphore it left
    behind, so every job=sft ended with the resource tracker's 'UserWarning: resource_tracker: There appear to be 2
    leaked semaphore objects to clean up at shutdown', printed after the run's last line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    driver = "import _resume_jobs as jobs; from molt_hydra.parallel.launch import run_ranks; " \
             "run_ranks(jobs.progress_bar, 1); print('done')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-2000:]
    assert "Loading weights: 100%" in proc.stderr and "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
