"""The Ray processes a run starts end with its driver, also when the driver is killed (kill -9, the OOM killer): a
watcher process, started after ray.init, reads a pipe only the driver writes to; the driver's death closes it, and
the watcher SIGKILLs the processes that ray.init started that are still there after a grace. Before: Ray's agents
(DashboardAgent, RuntimeEnvAgent) saw their raylet die within 2 s, then spent 60 s trying to report it to the GCS,
dead too, before they exited (gcs_server and the raylet die with the driver, Ray starts them with PR_SET_PDEATHSIG;
the workers die with the raylet). The watcher runs in its own session: a Ctrl-C or a SIGTERM to the run's process
group leaves it to do its work; the run's own teardown, which ends every process it started, ends it (`stop`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

GRACE_S = 5.0  # after the driver's end, for what ray.init started to end on its own (a Ray worker: within 2 s)
STOP = b"stop\n"  # the driver's last words on a clean end
_watcher: subprocess.Popen | None = None


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat's 22nd field): a pid reused by a later
    process has another. None when no such process, or a dead one not yet reaped (a zombie)."""
    try:
        state, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if state == "Z" else fields[18]
    except (OSError, IndexError):
        return None


def watch(pids: list[int]) -> None:
    """From now on, `pids` end with this process, however it ends (until `stop`)."""
    global _watcher
    stop()
    listed = [(pid, started) for pid in pids if (started := _start_time(pid)) is not None]
    _watcher = subprocess.Popen([sys.executable, "-m", "molt_hydra.runtime.reaper"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, start_new_session=True)
    _watcher.stdin.write(json.dumps(listed).encode() + b"\n")
    _watcher.stdin.flush()


def stop() -> None:
    """The run's own teardown has ended its processes: the watcher ends, leaving every process as it is."""
    global _watcher
    if _watcher is None:
        return
    with suppress(OSError):  # (a watcher the teardown already killed: its pipe is broken)
        _watcher.stdin.write(STOP)
        _watcher.stdin.close()
    with suppress(subprocess.TimeoutExpired):
        _watcher.wait(10)
    _watcher = None


def _main() -> None:
    listed = json.loads(sys.stdin.buffer.readline())
    if sys.stdin.buffer.read() == STOP:  # (read() returns at EOF: the driver closed the pipe, or died)
        return
    # A Ray worker ends on its own once its raylet is gone, and ends the processes it started (a SIGKILL would leave
    # them); what is still there after the grace is stuck (the agents' 60 s report to a dead GCS).
    until = time.monotonic() + GRACE_S
    while (left := [pid for pid, started in listed if _start_time(pid) == started]) and time.monotonic() < until:
        time.sleep(0.1)
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _main()
