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
from molt_hydra.runtime.preemption import NOTICE, PreemptionNotice
from molt_hydra.runtime.watchdog import EXIT_FAILED, RunFailed


@pytest.fixture
def hangup_default():
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, before)


def _ignored(pid: int) -> set[int]:
    mask = int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("SigIgn:")).split()[1], 16)
    return {sig for sig in range(1, 64) if mask >> (sig - 1) & 1}


def test_rays_processes_start_ignoring_sighup_and_the_driver_keeps_its_handler(monkeypatch, hangup_default):
    """A process started as ray.init starts its GCS and raylet (Ray's own start_ray_process) ignores SIGHUP and Slurm's
    notice; the driver keeps its handlers all through ray.init. Before: the driver ignored both for the whole
    ray.init, and a SIGHUP that came then was lost (the run went on to its end, exit 0)."""
    from ray._private import services

    def ours(signum, frame):
        pass

    during, started = [], []

    def init(**_):  # (Ray's own ray.init is imitated: it starts its processes through start_ray_process)
        during.append(signal.getsignal(signal.SIGHUP))
        started.append(services.start_ray_process(["sleep", "30"], "test", fate_share=False))

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", auto_init_hook.enable_auto_connect)  # (init_ray's)
    monkeypatch.setattr(ray, "init", init)
    signal.signal(signal.SIGHUP, ours)
    try:
        roles.init_ray(RunConfig())
        ignored = _ignored(started[0].process.pid)
    finally:
        reaper.stop()
        for info in started:
            info.process.kill()
            info.process.wait()
    assert during == [ours] and signal.getsignal(signal.SIGHUP) is ours
    assert {signal.SIGHUP, NOTICE} <= ignored, ignored
    assert signal.SIGHUP not in _ignored(os.getpid())


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


def test_molt_runs_own_hangup_handler_is_put_back_after_the_run(hangup_default):
    """molt-run takes SIGHUP before the run (cli.main); the run's event loop, on its close, resets it to the default.
    Before: _stoppable took and put back SIGHUP only from the default, so after a run its handler was gone, and a
    hangup while a local sweep's next point was checked ended molt-run by the default action, without a word."""
    def ours(signum, frame):
        pass

    signal.signal(signal.SIGHUP, ours)
    with entrypoint._stoppable(PreemptionNotice(), saves=True):
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as asyncio's remove_signal_handler leaves it
    assert signal.getsignal(signal.SIGHUP) is ours


@pytest.mark.parametrize("saves, said", [(True, "Interrupted: the run stopped; the last checkpoint is kept."),
                                         (False, "Interrupted: the run stopped.")])
def test_an_interruption_before_the_loop_names_a_checkpoint_only_where_the_job_saves(capsys, saves, said):
    """job=eval saves no checkpoint. Before: an eval interrupted in its resume check or model build said one was
    kept."""
    with pytest.raises(SystemExit) as stopped, entrypoint._stoppable(PreemptionNotice(), saves=saves):
        raise KeyboardInterrupt
    assert stopped.value.code == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == said


def test_a_ctrl_c_ignored_when_the_run_started_stays_ignored_in_its_loop():
    """A script's `molt-run ... &` starts with SIGINT ignored (its shell's, so that a Ctrl-C meant for the foreground
    does not reach it); Python leaves it ignored before the loop. Before: the loop took it, so that Ctrl-C stopped the
    run once its roles had started, and not before."""
    async def taken():
        return entrypoint._stop_signals(asyncio.get_running_loop())

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignored = asyncio.run(taken())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # (never taken, so never reset by the loop's close)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's job has it: Ctrl-C stops the run
        default = asyncio.run(taken())
    finally:
        signal.signal(signal.SIGINT, before)
    assert signal.SIGINT not in ignored and signal.SIGTERM in ignored and signal.SIGINT in default
