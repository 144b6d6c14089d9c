"""job=sft: a rank stopped by a signal (SIGSTOP) ends the run after watchdog's polls, naming the rank (runtime/
sft_job.py, the RL loop's watch_stopped). Before: the other ranks waited on it in their collective and run_ranks waited
3600 s at least; a one-rank run hung that long. Real ranks (parallel/launch.py's run_ranks, spawned) stand for the
trainer's; the real job: tests/integration/test_faults.py (slow)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _config_helpers import compose_config  # noqa: E402
from _sft_waiting_rank import waiting_rank  # noqa: E402
from molt_hydra.runtime import entrypoint, watchdog  # noqa: E402
from molt_hydra.runtime.preemption import PreemptionNotice  # noqa: E402
from molt_hydra.runtime.watchdog import EXIT_STALLED  # noqa: E402


def _stop_rank_1(path: Path, pids: list[int], ended: threading.Event) -> None:
    while not (path / "rank1").exists() or not (path / "rank1").read_text():
        time.sleep(0.05)
    pids.append(int((path / "rank1").read_text()))
    os.kill(pids[0], signal.SIGSTOP)
    # stopped until the test ends, or for 60 s: the old code's job then ends as if nothing happened, instead of waiting
    # on it for an hour (was: 15 s for the watcher's polls however loaded the box, and a SIGCONT sent after the test
    # to a pid by then maybe another's)
    if not ended.wait(60):
        with suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGCONT)


def test_a_stopped_sft_rank_ends_the_run_naming_it(tmp_path, monkeypatch, capsys):
    from molt_hydra.parallel import launch, sft

    monkeypatch.setattr(watchdog, "STOPPED_POLLS", 3)
    monkeypatch.setattr(watchdog, "STOPPED_POLL_S", 0.2)
    monkeypatch.setattr(sft, "run_sft", lambda *a, **kw: launch.run_ranks(waiting_rank, 2, str(tmp_path)))
    cfg = OmegaConf.to_object(compose_config(["job=sft", "parallelism.trainer_devices=2",
                                              f"checkpoint.dir={tmp_path / 'ckpt'}"], output_dir=str(tmp_path)))
    pids: list[int] = []
    ended = threading.Event()
    threading.Thread(target=_stop_rank_1, args=(tmp_path, pids, ended), daemon=True).start()
    try:
        with pytest.raises(SystemExit) as e:
            entrypoint._run_sft(cfg, None, PreemptionNotice(cfg.output_dir), {})
    finally:
        ended.set()
        for pid in pids:  # (never left stopped)
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert e.value.code == EXIT_STALLED
    lines = capsys.readouterr().err.strip().splitlines()[-3:]  # (torch's own lines before: the ranks it ended)
    stacks = next(tmp_path.glob("stacks-*.txt"))
    assert lines == [f"Run stopped: sft trainer rank 1 stalled: its process has made no progress for {3 * 0.2:g} s; "
                     f"stopped by a signal (SIGSTOP; SIGCONT resumes it): sft trainer rank 1 (pid {pids[0]}).",
                     f"Stacks of every role: {stacks}",
                     "Last checkpoint: none (the run starts from step 0 again)"]
    assert not Path(f"/proc/{pids[0]}").exists() or "Z" in Path(f"/proc/{pids[0]}/stat").read_text().split()[2]
