"""The run's watchers (runtime/ray_head.py `watchers`, run beside the work by watchdog.beside) watch the roles' start
and job=eval too, not only the RL loop's steps. Before: a kill -9 of Ray's GCS while the engines loaded their model
ended the run 60 s later with Ray's own C++ line (no role named, Ray's processes left behind), and a role stopped by a
signal held the start for train.timeouts.startup_s (600 s), job=eval for train.timeouts.step_s (3600 s).
Ray's head processes and the roles stand in here (real `sleep` processes); the real ones are the slow tests' in
tests/integration/test_faults.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace as value

import pytest

from molt_hydra.config.schema import RunConfig
from molt_hydra.models import build
from molt_hydra.runtime import entrypoint, ray_head, roles, watchdog
from molt_hydra.runtime.controller import RLController
from molt_hydra.runtime.watchdog import RoleStalled, RunFailed
from molt_hydra.rollout.generation import Sampling

TRAINING = Sampling(max_tokens=8)  # the generator's training sampling: an eval without its own cap takes it


async def _forever(*args, **kwargs):
    await asyncio.Event().wait()


@pytest.fixture
def starting(monkeypatch):
    """build_roles with Ray's start skipped, waiting forever where it first waits on the roles (an engine loading)."""
    monkeypatch.setattr(roles, "init_ray", lambda cfg: None)
    monkeypatch.setattr(build, "resolve_path", lambda path, weights=True: path)
    monkeypatch.setattr(roles, "fsdp_roles", lambda cfg: ("actor",))
    monkeypatch.setattr(roles, "colocated_placement", _forever)
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    return lambda: asyncio.run(asyncio.wait_for(roles.build_roles(RunConfig(), {}), 20))


@pytest.fixture
def stopped_process(monkeypatch):
    monkeypatch.setattr(watchdog, "STOPPED_POLLS", 3)
    monkeypatch.setattr(watchdog, "STOPPED_POLL_S", 0.05)
    process = subprocess.Popen(["sleep", "60"])
    os.kill(process.pid, signal.SIGSTOP)
    yield process.pid
    process.kill()
    process.wait()


def test_a_dead_gcs_ends_the_roles_start_naming_it(monkeypatch, starting):
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {"gcs_server": -signal.SIGKILL})
    with pytest.raises(RunFailed) as failed:
        starting()
    assert (failed.value.role, failed.value.cause) == (
        "Ray's gcs_server", "the process died (killed by SIGKILL); no role can go on without it")


def test_a_stopped_raylet_ends_the_roles_start_naming_it(monkeypatch, starting, stopped_process):
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "pids", lambda: {"Ray's raylet": stopped_process})
    with pytest.raises(RoleStalled) as stall:
        starting()
    assert str(stall.value) == f"Ray's raylet stalled: its process has made no progress for {3 * 0.05:g} s"


def test_a_stopped_engine_ends_an_eval_job_naming_it(monkeypatch, stopped_process):
    """job=eval: the eval's requests wait on the stopped engine (its deadline: step_s, 3600 s by default)."""
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    cfg = RunConfig()
    fake = value(calls=value(keeper=value(watch=_forever)), role_pids={"rollout engine 0": stopped_process},
                 eval_rows=[{"prompt": "1+1?"}], generator=value(evaluate=_forever, sampling=TRAINING))
    monkeypatch.setattr(entrypoint, "_controller", lambda cfg, r, opened, wandb_id: RLController(cfg, r, None))
    with pytest.raises(RoleStalled) as stall:
        asyncio.run(asyncio.wait_for(entrypoint._eval_only(cfg, fake, []), 20))
    assert str(stall.value) == f"rollout engine 0 stalled: its process has made no progress for {3 * 0.05:g} s"


def test_the_engine_keeper_runs_during_an_eval_job(monkeypatch):
    """job=eval: a dead engine is replaced (the keeper), and its failure, past rollout.max_engine_restarts, ends the
    eval (before: no keeper ran; the eval's requests waited for an engine that never came, step_s)."""
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    versions = []

    async def keeper_watch(weights_version):
        versions.append(weights_version())
        raise RunFailed("rollout engine 0", "died after 3 restart(s); rollout.max_engine_restarts=3 allows no more")

    fake = value(calls=value(keeper=value(watch=keeper_watch)), role_pids={}, eval_rows=[{"prompt": "1+1?"}],
                 generator=value(evaluate=_forever, sampling=TRAINING))
    monkeypatch.setattr(entrypoint, "_controller", lambda cfg, r, opened, wandb_id: RLController(cfg, r, None))
    with pytest.raises(RunFailed, match="^rollout engine 0: died after 3 restart"):
        asyncio.run(asyncio.wait_for(entrypoint._eval_only(RunConfig(), fake, []), 20))
    assert versions == [0]  # a new engine loads the scored checkpoint itself: no weights pushed to it


def test_a_dead_gcs_ends_a_resumes_checkpoint_load_naming_it(monkeypatch):
    """The trainer ranks loading the checkpoint a run resumes (minutes on GPU) are watched too."""
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {"raylet": -signal.SIGKILL})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    fake = value(calls=value(ranks=_forever), role_pids={}, critic=None, actor=object())
    notice = value(install=lambda loop, task: None, received=asyncio.Event())
    with pytest.raises(RunFailed, match="^Ray's raylet: the process died \\(killed by SIGKILL\\)"):
        asyncio.run(asyncio.wait_for(entrypoint._train(RunConfig(), fake, [], Path("step_3"), notice), 20))


def test_a_failed_watcher_ends_the_work_and_every_task_ends_with_it():
    """watchdog.beside: a watcher's failure is raised and the work cancelled wherever it waits; a watcher that
    returns is done, the work goes on; the work's result is returned, its watchers cancelled."""
    ended = []

    async def work(seconds):
        try:
            await asyncio.sleep(seconds)
            return "done"
        finally:
            ended.append("work")

    async def fails():
        await asyncio.sleep(0.05)
        raise RunFailed("Ray's gcs_server", "the process died")

    async def main():
        with pytest.raises(RunFailed, match="Ray's gcs_server"):
            await watchdog.beside(work(60), asyncio.sleep(0), fails())
        assert ended == ["work"]
        watcher = asyncio.ensure_future(_forever())
        assert await watchdog.beside(work(0.1), asyncio.sleep(0), watcher) == "done"
        assert watcher.cancelled()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_the_stopped_roles_are_read_from_a_copy_of_the_growing_pids(monkeypatch):
    """watch_stopped reads the pids in a thread while the roles' start adds to the dict: it reads a copy (before, the
    start's first added pid could fail the run: 'driver: RuntimeError: dictionary changed size during iteration')."""
    seen = []

    class Polled(Exception):
        pass

    def stopped(pids, alone=None):  # three polls, however slowly a loaded box starts their thread (was: those in 0.2 s)
        seen.append(pids)
        if len(seen) == 3:
            raise Polled
        return []

    monkeypatch.setattr(watchdog, "STOPPED_POLL_S", 0.01)
    monkeypatch.setattr(watchdog, "stopped", stopped)
    pids = {"rollout engine 0": 1}
    with pytest.raises(Polled):
        asyncio.run(asyncio.wait_for(watchdog.watch_stopped(pids), 60))
    assert len(seen) == 3 and all(p == pids and p is not pids for p in seen)
