"""runtime/watchdog.py's shutdown_ray: Ray's shutdown waited forever on a stopped raylet (the driver's core worker
waits for its answer); past SHUTDOWN_S, the run's processes are killed, which ends the wait. A `sleep` stands for the
stopped raylet, ray.shutdown for the core worker waiting on it; the real run: tests/integration/test_faults.py
(slow)."""

from __future__ import annotations

import signal
import subprocess

import ray

from molt_hydra.runtime import watchdog


def test_a_shutdown_waiting_on_a_stopped_raylet_ends_once_its_processes_are_killed(monkeypatch, capsys):
    raylet = subprocess.Popen(["sleep", "60"])
    raylet.send_signal(signal.SIGSTOP)
    monkeypatch.setattr(ray, "shutdown", raylet.wait)  # returns once the raylet is gone
    monkeypatch.setattr(watchdog, "SHUTDOWN_S", 0.5)
    try:
        watchdog.shutdown_ray([raylet.pid])
        assert raylet.poll() == -signal.SIGKILL  # (unkilled, the shutdown would still wait: the raylet never ends)
    finally:
        raylet.kill()
        raylet.wait()
    assert capsys.readouterr().err == ("Ray's shutdown did not end within 0.5 s (its raylet or GCS stopped or hung): "
                                       "killing its processes.\n")


def test_a_shutdown_in_time_kills_nothing(monkeypatch, capsys):
    other = subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    try:
        watchdog.shutdown_ray([other.pid])
        assert other.poll() is None and capsys.readouterr().err == ""
    finally:
        other.kill()
        other.wait()
