"""Ray's own processes on this node, its GCS and its raylet (started by the run's ray.init), are roles too: when one
dies, the run ends naming it. Before: after a kill -9 of gcs_server the run went on blind for 60 s, then Ray's core
ended the driver (exit 1) with its own C++ line last, no role and no checkpoint named; a dead raylet was reported as
the first call that failed with it ('actor rank 0: train_step failed: ... Owner's node has crashed'), and still was
where the raylet ended on its own after its workers (it fate-shares with its agents: a kill of one ends
it gracefully, its workers first, so their deaths reached the driver while the raylet still lived)."""

from __future__ import annotations

import asyncio
import signal
import sys

from molt_hydra.compat.ray import dead_head_processes, live_head_processes
from molt_hydra.runtime import reaper
from molt_hydra.runtime.watchdog import RunFailed, stopped, watch_stopped

POLL_S = 1.0  # a Popen.poll per process: the run fails within a second, well before Ray's 60 s GCS timeout
EXIT_S = 5.0  # a raylet's graceful end, once its workers died (~0.1 s quiet; loaded, 2 cores: seconds)


def dead_head() -> RunFailed | None:
    """The failure a dead GCS or raylet is, None while both live."""
    for kind, status in dead_head_processes().items():
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        if kind == "raylet" and status == 0:  # its own graceful end, which the driver did not ask for
            how += ", as Ray ends it when its dashboard or runtime-env agent dies"
        return RunFailed(f"Ray's {kind}", f"the process died ({how}); no role can go on without it")
    return None


async def dead_head_within(seconds: float) -> RunFailed | None:
    """dead_head, waiting up to `seconds` for the GCS or the raylet to end (a role's process died: its raylet may be
    ending behind it)."""
    until = asyncio.get_running_loop().time() + seconds
    while (failed := dead_head()) is None and asyncio.get_running_loop().time() < until:
        await asyncio.sleep(0.1)
    return failed


def pids() -> dict[str, int]:
    """The live GCS and raylet by role name, for watchdog.stopped: one stopped by a signal (SIGSTOP) is a stall of the
    run's, named (before: the run went on blind, with no new actor, no engine restart, until its teardown's ray.shutdown
    waited on it)."""
    if "ray" not in sys.modules:  # nothing in this process started Ray (job=sft)
        return {}
    return {f"Ray's {kind}": pid for kind, pid in live_head_processes().items()}


def stopped_head() -> RunFailed | None:
    """The failure a GCS or raylet stopped by a signal is, None while neither is: Ray's health check may take a stopped
    raylet's node for dead before the watcher's polls end the run, and every actor on it (before, the run was reported
    as the first role whose call failed: 'actor rank 0: train_step failed: ... Owner's node has crashed')."""
    for role, pid in stopped({}, pids()):
        return RunFailed(role, f"its process (pid {pid}) is stopped by a signal (SIGSTOP; SIGCONT resumes it); no "
                               "role can go on without it")
    return None


async def watch() -> None:
    """Until the GCS or the raylet dies; then RunFailed naming it."""
    while (failed := dead_head()) is None:
        await asyncio.sleep(POLL_S)
    raise failed


def watchers(role_pids: dict[str, int], local: bool) -> list:
    """The watchers that run beside every phase of a run with roles (watchdog.beside): the roles' start, the RL loop,
    job=eval. A dead GCS or raylet (`watch`), a role or either of them stopped by a signal (watchdog.watch_stopped; a
    role's pid is read in this node's /proc: `local`, one node only; `role_pids` is read at each poll, so a dict filled
    as the roles start is watched as it fills), and the reaper's death (reaper.keep). Before, none ran while the roles
    started nor during job=eval: a kill -9 of the GCS then ended the run 60 s later with Ray's C++ line, no role
    named, Ray's processes left behind; a stopped engine hung it until train.timeouts.startup_s / step_s."""
    return [watch(), watch_stopped(role_pids if local else {}, pids()), reaper.keep()]
