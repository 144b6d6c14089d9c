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

    async def build_roles(cfg, record, role_pids, rows):  # the notice comes while the engines load
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


def _config(tmp_path):
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    return OmegaConf.to_object(compose_config([f"checkpoint.dir={tmp_path / 'ckpt'}"], output_dir=str(tmp_path)))


@pytest.mark.parametrize("handler", ["default", "submitit"])
def test_the_notice_before_the_roles_start_stops_the_run_at_once_through_its_handover(handler, monkeypatch, tmp_path,
                                                                                     capsys, default_action):
    """The notice while the models are built (entrypoint._build_models; the resume check and Ray forming over the
    nodes are in the same stretch): nothing to save yet, so the run stops at once, Ray never started, and hands over:
    exit 130 naming the run's directory, or submitit's requeue. Before, the default action ended the driver without a
    word (exit -12), and submitit's handler was never reached."""
    import molt_hydra.models.build as build

    requeued = []

    def checkpoint_and_try_requeue(signum, frame):  # submitit's handler's name (preemption.py hands over to it)
        requeued.append(signum)
        raise SystemExit(-1)

    if handler == "submitit":
        signal.signal(signal.SIGUSR2, checkpoint_and_try_requeue)
    monkeypatch.setattr(build, "resolve_path", lambda path, weights=True: os.kill(os.getpid(), signal.SIGUSR2) or path)
    monkeypatch.setattr(entrypoint, "ray_cluster", lambda *a: pytest.fail("Ray was started"))
    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(SystemExit) as stop:
        entrypoint.run(_config(tmp_path))
    err = capsys.readouterr().err
    assert "SIGUSR2: Slurm's notice of a time limit or a preemption: the run has not started, nothing to save: it " \
           f"stops now, then {'is requeued' if requeued else 'stops'}." in err
    if handler == "submitit":
        assert (stop.value.code, requeued, default_action) == (-1, [signal.SIGUSR2], [])
    else:
        assert (stop.value.code, default_action) == (EXIT_INTERRUPTED, [])
        assert err.strip().splitlines()[-1] == ("Run stopped on SIGUSR2 (a time limit or a preemption): no checkpoint "
                                                f"saved; resume with checkpoint.resume=auto hydra.run.dir={tmp_path}.")
    assert signal.getsignal(signal.SIGUSR2) is before  # the handler from before the run is back


def _train_after_notice(monkeypatch, notice: PreemptionNotice, came: str) -> list[str]:
    """entrypoint._train of a resumed run (its step-3 checkpoint, policy version 3) with Slurm's notice come while the
    roles started (`came`="before", already received) or during the checkpoint's load; returns the calls the roles
    got. The roles stand in: each call is recorded, the load answers the saved loop's state."""
    from pathlib import Path

    from molt_hydra.config.schema import RunConfig
    from molt_hydra.runtime import ray_head
    from molt_hydra.runtime.controller import RLController

    called = []

    def call(name):
        async def recorded(*args, **kw):
            called.append(name)
        return recorded

    async def ranks(group, method, *args, **kw):
        called.append(method)
        if came == "during the load":
            notice.received.set()
        return [{"loop": {"step": 3, "version": 3, "batches_made": 3, "best": None, "next_eval": None,
                          "generator": {}, "queued": [], "kl_coef": 0.0, "wandb_id": None}}]

    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    log = value(sinks=value(rewind=lambda step: None, wandb_id=None))
    monkeypatch.setattr(entrypoint, "_controller", lambda cfg, r, opened, wandb_id: RLController(cfg, r, log))
    cfg = RunConfig()
    calls = value(ranks=ranks, push_weights=call("push_weights"), freeze_heaps=call("freeze_heaps"),
                  keeper=value(watch=call("keeper")))
    roles = value(calls=calls, role_pids={}, actor=object(), critic=None, eval_rows=None,
                  generator=value(load_state_dict=lambda state: None))
    if came == "before":
        notice.received.set()
    assert asyncio.run(asyncio.wait_for(entrypoint._train(cfg, roles, [], Path("ckpt/step_3"), notice), 10)) == 0
    return called


@pytest.mark.parametrize("came, calls, step", [("before", [], None), ("during the load", ["load_checkpoint"], 3)])
def test_a_notice_before_the_first_step_stops_the_run_before_it(monkeypatch, came, calls, step):
    """A notice while the roles started (within the grace) or during the resume's load: nothing new to save, so no
    push, no at-start eval, no step; the run stops for the handover (naming the checkpoint resumed, where loaded).
    Before: the resume's push, the at-start eval and a whole step ran first, often cut short by the grace."""
    notice = PreemptionNotice()
    assert _train_after_notice(monkeypatch, notice, came) == calls
    assert (notice.stopped, notice.saved_step) == (True, step)
