"""ray.init replaces the driver's SIGTERM handler (Python: sys.exit; its C++ core: a stack dump, then the process
aborts): runtime/roles.py `init_ray` puts the run's own back, so SIGTERM stops a run as Ctrl-C does (every role ended,
exit 130) instead of 'SIGTERM received ... PC: @ epoll_wait' and exit -6 (SIGABRT). Ray's replacement is imitated
here; the real one is tests/integration/test_interrupts.py."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

import ray
from ray._private import auto_init_hook

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime import roles


@pytest.fixture
def run_handler(monkeypatch):
    """The run's own SIGTERM handler in place, and ray.init left to each test (an imitation of Ray's); init_ray's
    reaper watcher and its auto-init switch are put back after."""
    def ours(signum, frame):
        pass

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", auto_init_hook.enable_auto_connect)  # (init_ray's)
    before = signal.signal(signal.SIGTERM, ours)
    try:
        yield ours
    finally:
        signal.signal(signal.SIGTERM, before)
        roles.reaper.stop()


def test_init_ray_keeps_the_runs_sigterm_handler(monkeypatch, run_handler):
    def ray_like_init(**_):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    monkeypatch.setattr(ray, "init", ray_like_init)
    roles.init_ray(RunConfig())
    assert signal.getsignal(signal.SIGTERM) is run_handler


def test_a_sigterm_during_ray_init_stops_the_run_as_a_later_one_does(monkeypatch, run_handler):
    """The SIGTERM comes while ray.init runs, after it put its handler in (sys.exit(15)). Before: SystemExit ended
    the run with exit 15 and not a word; now init_ray raises what the run's own handler makes of a SIGTERM, a
    cancellation (one line, exit 130: the real run is tests/integration/test_faults.py, slow)."""
    def ray_like_init(**_):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ray, "init", ray_like_init)
    with pytest.raises(asyncio.CancelledError):
        roles.init_ray(RunConfig())
    assert signal.getsignal(signal.SIGTERM) is run_handler
