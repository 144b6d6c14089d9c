"""runtime/entrypoint.py `_main`: once the run has failed or stalled, its report awaits (the stall's probe of every
engine and agent runner, up to 10 s when one is stuck; the wait for a raylet still ending). A Ctrl-C or SIGTERM
then, as a user seeing the run hang would send, is the teardown's: 'Already stopping ...', and the failure is still
the last thing printed. Before: the signal cancelled the report; the CancelledError escaped `_main` (its own except
clause, a sibling, does not catch it) and the run ended in an asyncio traceback, its failure never told. The roles
stand in (none start); the signal is real, sent to this process."""

from __future__ import annotations

import asyncio
import os
import signal
from types import SimpleNamespace as value

import pytest

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime import entrypoint, reaper, roles
from molt_hydra.runtime.preemption import PreemptionNotice
from molt_hydra.runtime.watchdog import EXIT_FAILED, RunFailed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_failure_is_reported_keeps_the_failure_last(monkeypatch, capsys, sig):
    async def failing_build(cfg, record, role_pids, rows):
        raise RunFailed("rollout", "every group failed")

    async def slow_report(cfg, roles_, error):
        os.kill(os.getpid(), sig)  # handled by the loop at the next await, as the user's Ctrl-C would be
        await asyncio.sleep(0.2)
        return [f"Run failed: {error.role}: {error.cause}."]

    monkeypatch.setattr(roles, "build_roles", failing_build)
    monkeypatch.setattr(entrypoint, "_report_failure", slow_report)
    for name in ("descendants", "shutdown_ray", "kill"):  # (this process's children are pytest's, not a run's)
        monkeypatch.setattr(entrypoint, name, lambda *a: [])
    monkeypatch.setattr(reaper, "stop", lambda: None)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's (a `make test &` ignores it)
    try:
        code = asyncio.run(entrypoint._main(RunConfig(), {}, None, value(stop=lambda: None), PreemptionNotice()))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == EXIT_FAILED
    err = capsys.readouterr().err
    assert "Already stopping every role; please wait.\n" in err, err
    assert err.rstrip().splitlines()[-1] == "Run failed: rollout: every group failed.", err


def test_slurms_notice_cuts_no_report_or_teardown_short(monkeypatch, capsys):
    """Slurm's notice (SIGUSR2) schedules a cut of the step under way GRACE_S later (preemption.py). The run failing
    in that time, its report and teardown were cut instead: the CancelledError escaped `_main` (a traceback last,
    the failure untold; in the teardown, Ray's shutdown and the kill of what it missed were skipped). Now the cut is
    off once the run's body is over."""
    from molt_hydra.runtime import preemption

    monkeypatch.setattr(preemption, "GRACE_S", 0.05)

    async def failing_build(cfg, record, role_pids, rows):  # (_main has installed the notice's handler)
        os.kill(os.getpid(), preemption.NOTICE)
        await asyncio.sleep(0.01)  # the notice is taken: its cut is due in GRACE_S
        raise RunFailed("rollout", "every group failed")

    async def slow_report(cfg, roles_, error):
        await asyncio.sleep(0.2)  # past the cut
        return [f"Run failed: {error.role}: {error.cause}."]

    monkeypatch.setattr(roles, "build_roles", failing_build)
    monkeypatch.setattr(entrypoint, "_report_failure", slow_report)
    for name in ("descendants", "shutdown_ray", "kill"):
        monkeypatch.setattr(entrypoint, name, lambda *a: [])
    monkeypatch.setattr(reaper, "stop", lambda: None)
    notice = PreemptionNotice()
    code = asyncio.run(entrypoint._main(RunConfig(), {}, None, value(stop=lambda: None), notice))
    assert code == EXIT_FAILED
    err = capsys.readouterr().err
    assert "SIGUSR2: Slurm's notice" in err, err  # (taken)
    assert err.rstrip().splitlines()[-1] == "Run failed: rollout: every group failed.", err
    assert signal.getsignal(preemption.NOTICE) is signal.SIG_DFL  # (put back as it was)
