"""Slurm's notice (SIGUSR2) while the roles start (runtime/entrypoint.py `_main`): the engines load, minutes on GPU.
Before, its handler was installed only as the training loop was about to start, so a notice there met SIGUSR2's
default action: the driver ended at once (exit -12), without a word and without the notice's handover. Now it is
taken from the roles' start on: the start is cut short past the grace, and the run stops (exit 130), to hand over."""

import asyncio
import os
import signal
from types import SimpleNamespace as value

import pytest

from molt_hydra.config.schema import EXIT_INTERRUPTED
from molt_hydra.runtime import entrypoint, preemption
from molt_hydra.runtime.preemption import PreemptionNotice


@pytest.fixture
def default_action():
    """SIGUSR2's default action (ending this process) stood in for by a handler that records it."""
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append("the default action"))
    yield seen
    signal.signal(signal.SIGUSR2, before)


def test_the_notice_while_the_roles_start_cuts_the_start_short_and_stops_the_run(monkeypatch, tmp_path, capsys,
                                                                                default_action):
    from molt_hydra.runtime import roles

    async def build_roles(cfg, record, role_pids):  # the notice comes while the engines load
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.sleep(3)
        raise AssertionError("the start was not cut short")

    monkeypatch.setattr(preemption, "GRACE_S", 0.5)
    monkeypatch.setattr(roles, "build_roles", build_roles)
    monkeypatch.setattr(entrypoint, "descendants", lambda pid: [])  # (no process of this test is the run's to end)
    monkeypatch.setattr(entrypoint, "shutdown_ray", lambda started: None)
    cfg = value(output_dir=str(tmp_path), job=value(value="rl"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    notice = PreemptionNotice()
    code = asyncio.run(entrypoint._main(cfg, {}, None, value(stop=lambda: None), notice))
    assert (code, default_action, notice.received.is_set()) == (EXIT_INTERRUPTED, [], True)
    err = capsys.readouterr().err
    assert "SIGUSR2: Slurm's notice of a time limit or a preemption" in err
    assert "Interrupted: stopping every role; the last checkpoint is kept." in err
    with pytest.raises(SystemExit) as stop:  # what entrypoint._run does then, without submitit
        notice.handover()
    assert stop.value.code == EXIT_INTERRUPTED
    assert "Run stopped on SIGUSR2 (a time limit or a preemption): no checkpoint saved" in capsys.readouterr().err
