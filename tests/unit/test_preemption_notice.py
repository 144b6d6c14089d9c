"""runtime/preemption.py: Slurm's SIGUSR2 notice marks the run for a save at its step's end, cuts a step that does not
end within the grace, and hands over to submitit's requeue (or exits 130) after the teardown. Real signals to this
process; submitit's handler is stood in for by a function of the name submitit's bound method has (its real one
needs a Slurm job: tests/integration/test_launchers_slurm.py runs it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace as value

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
            notice.uninstall()

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

    plain = PreemptionNotice("/runs/a")  # no submitit (a plain sbatch script): stop, naming the step to resume from
    with pytest.raises(SystemExit) as e:  # and the run's directory (the default hydra.run.dir is new per command)
        plain.handover()
    assert e.value.code == EXIT_INTERRUPTED
    assert "no checkpoint saved; resume with checkpoint.resume=auto hydra.run.dir=/runs/a." in capsys.readouterr().err


@pytest.mark.parametrize("sigint", [signal.default_int_handler, signal.SIG_IGN], ids=["terminal", "background"])
def test_without_an_event_loop_the_notice_tells_the_ranks_and_its_cut_is_a_keyboard_interrupt(monkeypatch,
                                                                                               usr2_handler, sigint):
    """job=sft: the main thread waits on its ranks, no event loop runs. The notice sets the flag the ranks read
    (`also`) at once; a step past the grace is cut by a KeyboardInterrupt in the main thread, which ends the ranks as
    Ctrl-C does; after `uninstall` the previous handler is back. Before, install needed a loop: job=sft took no
    notice. Also where SIGINT was ignored at the start (a run started in the background): before, no cut came."""
    monkeypatch.setattr(preemption, "GRACE_S", 0.3)
    before = signal.signal(signal.SIGINT, sigint)

    def previous(signum, frame):
        pass

    usr2_handler(previous)
    told, notice = [], PreemptionNotice()
    notice.install(also=lambda: told.append("stop"))
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert notice.received.is_set() and told == ["stop"]
        os.kill(os.getpid(), signal.SIGUSR2)  # a second notice changes nothing
        assert told == ["stop"]
        with pytest.raises(KeyboardInterrupt):
            for _ in range(100):  # a step that outlasts the grace (job=sft's driver polls its ranks: short waits)
                time.sleep(0.05)
    finally:
        notice.uninstall()
        signal.signal(signal.SIGINT, before)
    assert signal.getsignal(signal.SIGUSR2) is previous


def test_without_an_event_loop_a_saved_step_or_the_uninstall_stops_the_cut(monkeypatch, usr2_handler):
    """The cut is a timer in this process: once the ranks saved, or after the run (a sweep's next point, a notebook),
    it must not interrupt what runs next."""
    monkeypatch.setattr(preemption, "GRACE_S", 0.3)
    usr2_handler(signal.SIG_DFL)
    for end in ("saved", "uninstall"):
        notice = PreemptionNotice()
        notice.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        notice.saved(4) if end == "saved" else notice.uninstall()
        time.sleep(0.6)  # no KeyboardInterrupt
        notice.uninstall()
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_job_sft_hands_over_once_its_ranks_stopped_on_the_notice(tmp_path, monkeypatch, capsys, usr2_handler):
    """runtime/entrypoint.py `_run_sft` and runtime/sft_job.py: the notice reaches the ranks through `stop`; once they
    report that they stopped on it, the step they saved is named and the run exits 130 (or submitit requeues). The ranks
    are stood in for by a function here (the real ones: tests/integration/test_sft_resume_faults.py, whose slow test
    runs the whole job)."""
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    import molt_hydra.parallel.sft as sft
    from molt_hydra.runtime import entrypoint

    def ranks(*args, stop, ignore_signals, **kw):
        assert ignore_signals == (signal.SIGUSR2,) and stop.value == 0
        os.kill(os.getpid(), signal.SIGUSR2)  # Slurm's notice while step 3 trains
        assert stop.value == sft.STOP
        stop.value = sft.STOPPED  # step 3 saved, the ranks returned
        return [{"global_step": 3, "sft_loss": 1.0}]

    usr2_handler(signal.SIG_DFL)
    monkeypatch.setattr(sft, "run_sft", ranks)
    cfg = OmegaConf.to_object(compose_config(["job=sft", "data.train_path=chats.jsonl", "data.input_key=messages",
                                              f"checkpoint.dir={tmp_path / 'ckpt'}"], output_dir=str(tmp_path)))
    with pytest.raises(SystemExit) as e:
        entrypoint._run_sft(cfg, None, PreemptionNotice(cfg.output_dir), {})
    assert e.value.code == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "Run stopped on SIGUSR2 (a time limit or a preemption): checkpoint saved at step 3; resume with "
        f"checkpoint.resume=auto hydra.run.dir={tmp_path}.")
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the run's handler is gone with it


def test_job_sft_cut_past_the_grace_still_hands_over(tmp_path, monkeypatch, capsys, usr2_handler):
    """The ranks outlast the grace after the notice: the cut (a KeyboardInterrupt) ends them, and the run still hands
    over, naming the kept checkpoint. Was, for a few hours of session 30: a NameError there (the cut's line)."""
    from molt_hydra.runtime import entrypoint, sft_job

    def outlasting(cfg, resume_from, notice, record):
        notice.received.set()  # (the notice came; the cut is due)
        raise KeyboardInterrupt

    usr2_handler(signal.SIG_DFL)
    monkeypatch.setattr(sft_job, "run_sft_job", outlasting)
    with pytest.raises(SystemExit) as e:
        entrypoint._run_sft(value(output_dir=str(tmp_path)), None, PreemptionNotice(str(tmp_path)), {})
    assert e.value.code == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Interrupted: the run stopped; the last checkpoint is kept." in err, err
    assert err.strip().splitlines()[-1].startswith("Run stopped on SIGUSR2 (a time limit or a preemption)"), err


def test_the_handler_from_before_the_run_comes_back_when_the_runs_loop_closed_first():
    """installed at once (before the run's body), taken over by the run's loop, whose teardown failed before its own
    uninstall: asyncio.run closed the loop, which reset SIGUSR2 to the default. The run's last uninstall then found no
    loop handler to remove and returned, the handler from before the run (submitit's) lost. Now it is put back."""
    def before(signum, frame):
        pass

    previous = signal.signal(signal.SIGUSR2, before)
    try:
        notice = PreemptionNotice()
        notice.install(at_once=True)

        async def body():
            notice.install(asyncio.get_running_loop(), asyncio.current_task())  # (no uninstall: a failed teardown)

        asyncio.run(body())
        notice.uninstall()
        assert signal.getsignal(signal.SIGUSR2) is before
    finally:
        signal.signal(signal.SIGUSR2, previous)
