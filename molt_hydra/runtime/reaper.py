"""The Ray processes a run starts end with its driver, also when the driver is killed (kill -9, the OOM killer): a
watcher process, started before ray.init, reads a pipe only the driver writes to; the driver's death closes it, and
the watcher SIGKILLs the processes the driver started that are still there after a grace. Before: Ray's agents
(DashboardAgent, RuntimeEnvAgent) saw their raylet die within 2 s, then spent 60 s trying to report it to the GCS,
dead too, before they exited (gcs_server and the raylet die with the driver, Ray starts them with PR_SET_PDEATHSIG;
the workers die with the raylet). The agents are the raylet's children, orphaned when it dies: the watcher lists the
driver's descendants itself while ray.init runs (a kill during it left them too), then once more when told
`settled`, and stops listing (what Ray starts later ends with the raylet). The watcher runs in its own session: a
Ctrl-C or a SIGTERM to the run's process group leaves it to do its work; the run's own teardown, which ends every
process it started, ends it (`stop`)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

GRACE_S = 5.0  # after the driver's end, for what ray.init started to end on its own (a Ray worker: within 2 s)
POLL_S = 0.05  # how often the watcher lists the driver's descendants until `settled` (~100 processes: ~2 ms each)
KEEP_S = 1.0  # how often the run checks that its watcher lives (`keep`)
STOP = b"stop\n"  # the driver's last words on a clean end
SETTLED = b"settled\n"  # ray.init has returned
_watcher: subprocess.Popen | None = None


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, start time) of a process (/proc/<pid>/stat's 4th and 22nd fields: a pid reused by a later
    process has another start time); None when no such process, or a dead one not yet reaped (a zombie)."""
    try:
        state, ppid, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if state == "Z" else (int(ppid), fields[17])
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """Every live process under `root` (but this one), with its start time."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (found := _stat(entry.name)) is not None and int(entry.name) != os.getpid():
            children.setdefault(found[0], []).append((int(entry.name), found[1]))
    listed, todo = {}, [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            listed[pid] = started
            todo.append(pid)
    return listed


def watch() -> None:
    """From now on, the processes this one starts, and all they start, end with it however it ends (until `stop`)."""
    global _watcher
    stop()
    _watcher = subprocess.Popen([sys.executable, "-m", "molt_hydra.runtime.reaper", str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    _watcher.stdout.readline()  # its first listing is done: nothing started from here on is missed


def settled() -> None:
    """ray.init has returned: the watcher lists this process's descendants a last time, then stops listing."""
    with suppress(OSError):
        _watcher.stdin.write(SETTLED)
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
    _watcher.stdout.close()
    _watcher = None


async def keep() -> None:
    """Until cancelled: a watcher that died (a kill -9 of it, the OOM killer) is started again, in one line naming it.
    Before: its death went unseen, and a kill -9 of the driver then left Ray's agents behind for 60 s. The new one
    lists this process's descendants at once (Ray's agents are its raylet's children)."""
    while True:
        await asyncio.sleep(KEEP_S)
        if _watcher is None or (status := _watcher.poll()) is None:
            continue
        dead = _watcher.pid
        await asyncio.to_thread(watch)
        settled()
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        print(f"The run's reaper (pid {dead}), which ends Ray's processes if the driver is killed, died ({how}): "
              f"started again (pid {_watcher.pid}).", file=sys.stderr, flush=True)


def _main(driver: int) -> None:
    # Slurm's notice (runtime/preemption.py NOTICE) reaches every process of the job step, and a SIGHUP the run's
    # session: the watcher outlives neither by default (it died at each notice, a kill -9 of the driver then unwatched)
    for sig in (signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    listed, said, listing = _descendants(driver), b"", True
    print("listed", flush=True)
    while True:
        readable = select.select([sys.stdin.buffer], [], [], POLL_S if listing else None)[0]
        if listing:
            listed.update(_descendants(driver))
        if readable and not (chunk := os.read(sys.stdin.fileno(), 64)):
            break  # the pipe closed: the driver died (its own end says STOP first)
        said += chunk if readable else b""
        if said.endswith(STOP):
            return
        listing = listing and SETTLED not in said
    _reap(listed)


def _reap(listed: dict[int, str]) -> None:
    # A Ray worker ends on its own once its raylet is gone, and ends the processes it started (a SIGKILL would leave
    # them); what is still there after the grace is stuck (the agents' 60 s report to a dead GCS).
    until = time.monotonic() + GRACE_S
    while (left := [pid for pid, started in listed.items() if (_stat(str(pid)) or (0, None))[1] == started]) \
            and time.monotonic() < until:
        time.sleep(0.1)
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
