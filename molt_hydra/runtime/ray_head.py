"""Ray's own processes on this node, its GCS and its raylet (started by the run's ray.init), are roles too: when one
dies, the run ends naming it. Before: after a kill -9 of gcs_server the run went on blind for 60 s, then Ray's core
ended the driver (exit 1) with its own C++ line last, no role and no checkpoint named; a dead raylet was reported as
the first call that failed with it ('actor rank 0: train_step failed: ... Owner's node has crashed')."""

from __future__ import annotations

import asyncio
import signal

from molt_hydra.compat.ray import dead_head_processes
from molt_hydra.runtime.watchdog import RunFailed

POLL_S = 1.0  # a Popen.poll per process: the run fails within a second, well before Ray's 60 s GCS timeout


def dead_head() -> RunFailed | None:
    """The failure a dead GCS or raylet is, None while both live."""
    for kind, status in dead_head_processes().items():
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        return RunFailed(f"Ray's {kind}", f"the process died ({how}); no role can go on without it")
    return None


async def watch() -> None:
    """Until the GCS or the raylet dies; then RunFailed naming it."""
    while (failed := dead_head()) is None:
        await asyncio.sleep(POLL_S)
    raise failed
