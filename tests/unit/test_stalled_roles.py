"""runtime/watchdog.py `stopped`: a stall names the role whose process a signal stopped (SIGSTOP), a role's child
too (a vLLM engine core under its engine actor). Before: a stopped trainer rank was told as 'actor stalled: train_step
did not finish within 30 s', no rank and no cause named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as value

from molt_hydra.runtime.entrypoint import _stalled
from molt_hydra.runtime.watchdog import EXIT_STALLED, descendants, stopped


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_stall_names_the_roles_whose_process_is_stopped(tmp_path):
    rank = subprocess.Popen(["sleep", "60"])
    engine = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"])
    runner = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not descendants(engine.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (core,) = descendants(engine.pid)
        for pid in (rank.pid, core):
            os.kill(pid, signal.SIGSTOP)
        while {_state(rank.pid), _state(core)} != {"T"}:
            time.sleep(0.01)
        pids = {"rollout engine 0": engine.pid, "actor rank 0": rank.pid, "agent runner 0": runner.pid}
        assert stopped(pids) == [f"rollout engine 0 (pid {core})", f"actor rank 0 (pid {rank.pid})"]
        last_words: list[str] = []
        code = _stalled(value(output_dir=str(tmp_path)), value(role_pids=pids),
                        "actor stalled: train_step did not finish within 30 s", [], last_words)
        assert code == EXIT_STALLED
        assert last_words[0] == "Run stopped: actor stalled: train_step did not finish within 30 s; stopped by a " \
            f"signal (SIGSTOP; SIGCONT resumes it): rollout engine 0 (pid {core}), actor rank 0 (pid {rank.pid}).", \
            last_words
        os.kill(rank.pid, signal.SIGCONT)
        while _state(rank.pid) == "T":
            time.sleep(0.01)
        assert stopped(pids) == [f"rollout engine 0 (pid {core})"]
    finally:
        for pid in descendants(engine.pid):
            os.kill(pid, signal.SIGKILL)
        for p in (rank, engine, runner):
            p.kill()
