"""runtime/preemption.py: Slurm's SIGUSR2 notice marks the run for a save at its step's end, cuts a step that does not
end within the grace, and hands over to submitit's requeue (or exits 130) after the teardown. Real signals to this
process; submitit's handler is stood in for by a function of the name submitit's bound method has (its real one
needs a Slurm job: tests/integration/test_launchers_slurm.py runs it)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from molt_hydra.config.schema import EXIT_INTERRUPTED
from molt_hydra.runtime import preemption
from molt_hydra.runtime.preemption import PreemptionNotice


def _run_with_notice(notice: PreemptionNotice, body) -> object:
    async def main():
        notice.install(asyncio.get_running_loop(), asyncio.current_task())
        try:
            return await body()
        finally:
            notice.uninstall(asyncio.get_running_loop())

    return asyncio.run(main())


def test_the_notice_is_received_without_ending_the_step():
    notice = PreemptionNotice()

    async def step():
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.wait_for(notice.received.wait(), 5)
        await asyncio.sleep(0.2)  # the step goes on: nothing was cancelled
        return "step done"

    assert _run_with_notice(notice, step) == "step done"


def test_a_step_that_outlasts_the_grace_is_cut_short(monkeypatch):
    monkeypatch.setattr(preemption, "GRACE_S", 0.3)
    notice = PreemptionNotice()

    async def endless_step():
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.sleep(30)

    with pytest.raises(asyncio.CancelledError):
        _run_with_notice(notice, endless_step)


@pytest.fixture
def usr2_handler():
    """Sets this process's SIGUSR2 handler for the test, the one before it restored after."""
    before = signal.getsignal(signal.SIGUSR2)
    yield lambda handler: signal.signal(signal.SIGUSR2, handler)
    signal.signal(signal.SIGUSR2, before)


def test_once_the_step_is_saved_the_teardown_is_not_cut_short_and_the_previous_handler_is_back(monkeypatch,
                                                                                                usr2_handler):
    monkeypatch.setattr(preemption, "GRACE_S", 0.3)

    def previous(signum, frame):
        pass

    usr2_handler(previous)
    notice = PreemptionNotice()

    async def step_then_teardown():
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.wait_for(notice.received.wait(), 5)
        notice.saved(3)
        await asyncio.sleep(0.6)  # a teardown longer than the grace
        return "torn down"

    assert _run_with_notice(notice, step_then_teardown) == "torn down"
    assert notice.saved_step == 3 and signal.getsignal(signal.SIGUSR2) is previous


def test_handover_calls_submitits_requeue_else_exits_130(capsys, usr2_handler):
    calls = []

    def checkpoint_and_try_requeue(signum, frame):  # the name of submitit's SignalHandler method
        calls.append(signum)
        raise SystemExit(-1)  # as submitit's does after `scontrol requeue`

    usr2_handler(checkpoint_and_try_requeue)
    notice = PreemptionNotice()

    async def step():
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.wait_for(notice.received.wait(), 5)

    _run_with_notice(notice, step)
    notice.saved(7)
    with pytest.raises(SystemExit) as e:
        notice.handover()
    assert e.value.code == -1 and calls == [signal.SIGUSR2]
    assert "checkpoint saved at step 7; requeueing" in capsys.readouterr().err

    plain = PreemptionNotice()  # no submitit (a plain sbatch script): stop, naming the step to resume from
    with pytest.raises(SystemExit) as e:
        plain.handover()
    assert e.value.code == EXIT_INTERRUPTED
    assert "no checkpoint saved; resume with checkpoint.resume=auto" in capsys.readouterr().err
