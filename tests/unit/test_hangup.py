"""SIGHUP (the run's terminal closed) stops an RL run as SIGTERM does. Before: the default action ended the driver
and, as they share its process group, Ray's GCS, raylet and agents at once: the roles died with them, a save under
way was lost, the log (stdout / stderr redirected) ended without a word. Now Ray's processes start with SIGHUP
ignored (runtime/roles.py init_ray; Ray's own ray.init is imitated here) and the driver's loop takes it
(runtime/entrypoint.py _main): 'Interrupted', every role ended, exit 130. Under nohup it stays ignored."""

from __future__ import annotations

import asyncio
import os
import signal
from types import SimpleNamespace as value

import pytest
import ray
from ray._private import auto_init_hook

from molt_hydra.config.schema import EXIT_INTERRUPTED, Job, RunConfig
from molt_hydra.runtime import entrypoint, reaper, roles
from molt_hydra.runtime.preemption import PreemptionNotice
from molt_hydra.runtime.watchdog import EXIT_FAILED, RunFailed


@pytest.fixture
def hangup_default():
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, before)


def test_rays_processes_start_ignoring_sighup_and_the_driver_keeps_its_handler(monkeypatch, hangup_default):
    def ours(signum, frame):
        pass

    inherited = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", auto_init_hook.enable_auto_connect)  # (init_ray's)
    monkeypatch.setattr(ray, "init", lambda **_: inherited.append(signal.getsignal(signal.SIGHUP)))
    signal.signal(signal.SIGHUP, ours)
    try:
        roles.init_ray(RunConfig())
    finally:
        reaper.stop()
    assert inherited == [signal.SIG_IGN]  # what the processes ray.init starts inherit
    assert signal.getsignal(signal.SIGHUP) is ours


def _run_main(monkeypatch, tmp_path, job: str = "rl") -> int:
    """_main of a `job`, its roles' start sent SIGHUP (to this process), then failing 0.3 s later unless
    interrupted."""
    async def starting(cfg, record, role_pids, rows):
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.3)
        raise RunFailed("rollout", "the start went on")

    async def report(cfg, roles_, error):
        return [f"Run failed: {error.role}: {error.cause}."]

    monkeypatch.setattr(roles, "build_roles", starting)
    monkeypatch.setattr(entrypoint, "_report_failure", report)
    for name in ("descendants", "shutdown_ray", "kill"):  # (this process's children are pytest's, not a run's)
        monkeypatch.setattr(entrypoint, name, lambda *a: [])
    monkeypatch.setattr(reaper, "stop", lambda: None)
    cfg = RunConfig()
    cfg.job = Job[job]
    cfg.checkpoint.dir = str(tmp_path / "checkpoints")
    return asyncio.run(entrypoint._main(cfg, {}, None, value(stop=lambda: None), PreemptionNotice()))


def test_sighup_stops_the_run_as_sigterm_does(monkeypatch, capsys, tmp_path, hangup_default):
    assert _run_main(monkeypatch, tmp_path) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Interrupted: stopping every role; the last checkpoint is kept." in err, err
    assert err.rstrip().splitlines()[-1] == "Last checkpoint: none (the run starts from step 0 again)", err
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # (put back as it was)


def test_an_interrupted_eval_job_claims_no_checkpoint(monkeypatch, capsys, tmp_path, hangup_default):
    """job=eval saves no checkpoint. Before: 'Interrupted: stopping every role; the last checkpoint is kept.'"""
    assert _run_main(monkeypatch, tmp_path, "eval") == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == "Interrupted: stopping every role."


def test_under_nohup_sighup_stays_ignored(monkeypatch, capsys, tmp_path):
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert _run_main(monkeypatch, tmp_path) == EXIT_FAILED  # not interrupted: the start went on to its end
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == "Run failed: rollout: the start went on."
