"""No silent hangs: every remote call of the loop goes through `deadline(...)`. When one expires, the stacks of every
role (the driver via faulthandler, every Ray actor and its child processes via py-spy) are written into the run
directory, the role that stalled is named, and the run exits non-zero."""

from __future__ import annotations

import asyncio
import faulthandler
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

from molt_hydra.rollout.generator import RunFailed  # noqa: F401 (re-exported: raised by the generator too)

from molt_hydra.config.schema import EXIT_FAILED, EXIT_STALLED  # noqa: F401 (imported from here by the runtime)


class RoleStalled(RuntimeError):
    def __init__(self, role: str, what: str, seconds: float, message: str | None = None):
        super().__init__(message or f"{role} stalled: {what} did not finish within {seconds:g} s")
        self.role = role


def describe(error: BaseException) -> str:
    """One line for a failure: a Ray task error is reduced to the exception it carries, a dead actor to its reason."""
    import ray

    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        error = error.cause
    if isinstance(error, ray.exceptions.RayActorError) and error.actor_init_failed:
        # the actor's constructor raised: Ray keeps only its text; the exception is the traceback's last line
        raised = [line for line in str(error).splitlines() if RAISED.match(line)]
        if raised:
            return f"its start failed: {raised[-1].strip()}"
    if isinstance(error, ray.exceptions.RayActorError):
        text = " ".join(str(error).split())
        found = (re.search(r"Worker exit type: (\w+)", text), re.search(r"Worker exit detail: ([^.]*)", text))
        why = ", ".join(m.group(0) for m in found if m) or "no reason given"
        return f"the process died ({why}; killed, out of memory, or crashed)"
    return f"{type(error).__name__}: {error}".splitlines()[0]


RAISED = re.compile(r"[A-Za-z_][\w.]*(Error|Exception)\b")  # the last line of a Python traceback


async def with_logged_error(actor, cause: str) -> str:
    """`cause`, with the last error in `actor`'s log when there is one: a failed start whose own exception is
    vLLM's 'Engine core initialization failed. See root cause above' (the engine core's error, e.g. a KV cache that
    does not fit, is only in the log its process shares with the actor: Ray's worker log)."""
    with suppress(Exception):  # an actor that no longer answers: its cause alone
        found = await asyncio.wait_for(actor.__ray_call__.remote(_logged_error), 10)
        if found is not None and found[1] not in cause:
            return f"{cause}; the last error in its log ({found[0]}): {found[1].rstrip('.')}"
    return cause


def _logged_error(_actor, tail_bytes: int = 65536) -> tuple[str, str] | None:
    """In a role's process: (its stderr's file, the last exception line in that file's tail), None without one."""
    path = os.readlink("/proc/self/fd/2")
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
        raised = [line.strip() for line in f.read().decode(errors="replace").splitlines() if RAISED.match(line)]
    return (path, raised[-1]) if raised else None


async def deadline(awaitable, seconds: float, role: str, what: str):
    """Await `awaitable` (a coroutine, a future or a Ray ObjectRef) for at most `seconds`."""
    try:
        return await asyncio.wait_for(awaitable, timeout=seconds)
    except asyncio.TimeoutError:
        raise RoleStalled(role, what, seconds) from None


def descendants(pid: int) -> list[int]:
    kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return kids + [g for k in kids for g in descendants(k)]


def stopped(role_pids: dict[str, int], alone: dict[str, int] | None = None) -> list[tuple[str, int]]:
    """(role, pid) of each role's process stopped by a signal (SIGSTOP, SIGTSTP: state T): the cause of a stall the
    deadline alone told as 'did not finish' (a stopped trainer rank: 'actor stalled: train_step ...'). `alone`: roles
    whose children are not theirs (Ray's raylet: its children are the roles' workers and Ray's agents)."""
    # (an engine's vLLM engine core is its actor's child)
    pids = [(role, p) for role, pid in role_pids.items() for p in (pid, *descendants(pid))] + [*(alone or {}).items()]
    found = []
    for role, p in pids:
        with suppress(OSError, IndexError):
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                found.append((role, p))
    return found


# a role seen stopped in this many polls in a row ends the run (~60 s): without it, a stopped role was told only when a
# call's deadline passed (a trainer rank: trainer_call_s, 1800 s by default; an agent runner: step_s, 3600 s)
STOPPED_POLLS, STOPPED_POLL_S = 12, 5.0


async def watch_stopped(role_pids: dict[str, int], alone: dict[str, int] | None = None) -> None:
    """Until a role's process (or its child: a vLLM engine core) stays stopped by a signal for STOPPED_POLLS polls in a
    row; then RoleStalled naming it. Polls further apart than 3 x STOPPED_POLL_S start the count again: the driver
    was stopped itself (a Slurm suspend, ^Z), and its roles with it, all resumed together. `alone`: as `stopped`'s."""
    seen: dict[tuple[str, int], int] = {}
    last = time.monotonic()
    while True:
        await asyncio.sleep(STOPPED_POLL_S)
        now, previous = time.monotonic(), seen
        # (a copy: the dict grows as roles start, and a restarted engine's pid replaces its old one, meanwhile)
        held = await asyncio.to_thread(stopped, dict(role_pids), alone) if now - last < 3 * STOPPED_POLL_S else []
        last, seen = now, {who: previous.get(who, 0) + 1 for who in held}
        for (role, _), polls in seen.items():
            if polls >= STOPPED_POLLS:
                raise RoleStalled(role, "", 0, f"{role} stalled: its process has made no progress for "
                                               f"{polls * STOPPED_POLL_S:g} s")


async def beside(work, *watchers):
    """`work`'s result, with `watchers` (coroutines that run until cancelled, or raise the run's failure) running
    beside it: a watcher's failure ends `work` wherever it waits, and is raised; every task is cancelled and awaited
    when this returns. A watcher that returns is simply done."""
    work = asyncio.ensure_future(work)
    background = {asyncio.ensure_future(w) for w in watchers}
    every = [work, *background]
    try:
        while True:
            done, _ = await asyncio.wait({work, *background}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            for task in done:
                background.discard(task)
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
    finally:
        for task in every:
            task.cancel()
        await asyncio.gather(*every, return_exceptions=True)


def stall_report(run_dir: str | Path, role_pids: dict[str, int], reason: str, not_answering: list[str],
                 alone: dict[str, int] | None = None) -> list[str]:
    """A stall's last words: the reason, the roles not answering and those stopped by a signal, and the file of every
    role's stacks (written now). `alone`: as `stopped`'s."""
    reason += f"; not answering: {', '.join(not_answering)}" if not_answering else ""
    held = stopped(role_pids, alone)
    reason += f"; stopped by a signal (SIGSTOP; SIGCONT resumes it): {', '.join(f'{r} (pid {p})' for r, p in held)}" \
        if held else ""
    try:
        stacks = dump_stacks(run_dir, role_pids, reason)
    except OSError as e:  # a full disk, a read-only output_dir: the stall is still told (was: a traceback, untold)
        stacks = f"not written ({describe(e)})"
    return [f"Run stopped: {reason}.", f"Stacks of every role: {stacks}"]


def kill(pids: list[int]) -> None:
    """SIGKILL each process that is still there."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def dump_stacks(run_dir: str | Path, role_pids: dict[str, int], reason: str) -> Path:
    """Write every role's Python stacks into <run_dir>/stacks-<time>.txt and return its path."""
    path = Path(run_dir) / f"stacks-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    # the venv's, when its bin/ is not on PATH
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    with open(path, "w") as f:
        f.write(f"# {reason}\n\n## driver (this process)\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        for role, pid in role_pids.items():
            for p in [pid, *descendants(pid)]:
                f.write(f"\n## {role} (pid {p})\n")
                if py_spy is None:
                    f.write("py-spy is not installed; no stack\n")
                    continue
                try:
                    dump = subprocess.run([py_spy, "dump", "--pid", str(p)], capture_output=True, text=True, timeout=15)
                    f.write(dump.stdout or dump.stderr)
                except subprocess.TimeoutExpired:  # a process stopped hard enough that py-spy cannot read it
                    f.write("py-spy timed out reading this process\n")
    return path


SHUTDOWN_S = 30.0  # Ray's shutdown: a few seconds on 2 cores


def shutdown_ray(started: list[int]) -> None:
    """ray.shutdown, which waited forever on a stopped (SIGSTOP) or hung raylet (the driver's core worker waits for
    its answer): past SHUTDOWN_S, `started` (this process's descendants, Ray's own among them) are killed, which
    ends the wait."""
    import ray

    stopping = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    stopping.start()
    stopping.join(SHUTDOWN_S)
    if stopping.is_alive():
        print(f"Ray's shutdown did not end within {SHUTDOWN_S:g} s (its raylet or GCS stopped or hung): killing its "
              "processes.", file=sys.stderr, flush=True)
        kill(started)
        stopping.join(10)
