"""The phases of an RL run outside its loop run beside the run's watchers too (runtime/entrypoint.py `_train`, through
RLController.watched for the resume's push; ray_head.watchers, without the engine keeper, after the loop): a resume's
weight push, the final save and the final HF export. Before, each was awaited
alone: a trainer rank stopped by a signal there was told only when the call's deadline passed (trainer_call_s: 1800 s
by default; the push: engine_call_s, 900 s), and a dead GCS not at all (Ray's own exit of the driver, 60 s later, no
role named). The roles stand in here (a real stopped `sleep` process as the rank); a real run's is
tests/integration/test_late_faults.py."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from types import SimpleNamespace as value

import pytest
from test_watched_phases import _forever, stopped_process  # noqa: F401 (a fixture)

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime import entrypoint, ray_head
from molt_hydra.runtime.controller import RLController
from molt_hydra.runtime.watchdog import RoleStalled, RunFailed


async def _ranks(group, method, *args, **kw):
    """A trainer group's calls: the checkpoint's load answers at once; every other call waits on the stopped rank."""
    if method == "load_checkpoint":
        return [{}]
    return await _forever()


def _train(monkeypatch, phase: str, pids: dict[str, int]):
    """`_train` of a run whose trainer calls wait forever in `phase`: the resume's push (a warm start's, of the
    loaded weights), the final save, or the final export."""
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    monkeypatch.setattr(RLController, "run", lambda self: asyncio.sleep(0, {}))  # (the loop: its own tests)
    log = value(sinks=value(rewind=lambda step: None, wandb_id=None))
    monkeypatch.setattr(entrypoint, "_controller", lambda cfg, r, opened, wandb_id: RLController(cfg, r, log))
    cfg = RunConfig()
    cfg.checkpoint.load_model_only = True
    cfg.checkpoint.save_steps = -1 if phase == "final save" else 0
    cfg.checkpoint.export_final = phase == "final export"
    calls = value(ranks=_ranks, push_weights=_forever, router_metrics=lambda: asyncio.sleep(0, {}),
                  keeper=value(watch=_forever, metrics=dict))
    roles = value(calls=calls, role_pids=pids, actor=object(), critic=None, generator=value(state_dict=dict),
                  run_record={})
    found = Path("step_3") if phase == "resume's push" else None
    notice = value(install=lambda loop, task: None, received=asyncio.Event())
    return asyncio.run(asyncio.wait_for(entrypoint._train(cfg, roles, [], found, notice), 10))


PHASES = ["resume's push", "final save", "final export"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_rank_stopped_in_a_phase_after_the_loop_ends_the_run_naming_it(monkeypatch, stopped_process, phase):
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    with pytest.raises(RoleStalled) as stall:
        _train(monkeypatch, phase, {"actor rank 0": stopped_process})
    assert str(stall.value) == "actor rank 0 stalled: its process has made no progress for 0.15 s"


@pytest.mark.parametrize("phase", PHASES)
def test_a_dead_gcs_in_a_phase_after_the_loop_ends_the_run_naming_it(monkeypatch, phase):
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {"gcs_server": -signal.SIGKILL})
    with pytest.raises(RunFailed) as failed:
        _train(monkeypatch, phase, {})
    assert (failed.value.role, failed.value.cause) == (
        "Ray's gcs_server", "the process died (killed by SIGKILL); no role can go on without it")


@pytest.mark.parametrize("saved_step, saves", [(3, []), (2, ["save_checkpoint"]), (None, ["save_checkpoint"])])
def test_the_final_save_is_skipped_where_the_loop_saved_its_last_step(monkeypatch, saved_step, saves):
    """checkpoint.save_steps=1, train.max_steps=3: the loop saved step 3; before, the final save wrote it again. A
    loop that ran no step (a finished run resumed: saved_step None) or saved an earlier one still saves."""
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    called = []

    async def ranks(group, method, *args, **kw):
        called.append(method)
        return ["step_3"]

    async def loop(self):
        self.step, self.saved_step = 3, saved_step
        return {}

    monkeypatch.setattr(RLController, "run", loop)
    log = value(sinks=value(rewind=lambda step: None, wandb_id=None), progress=value(summary=print))
    monkeypatch.setattr(entrypoint, "_controller", lambda cfg, r, opened, wandb_id: RLController(cfg, r, log))
    monkeypatch.setattr(entrypoint, "_summary", lambda cfg, roles, ctl, export: [])
    monkeypatch.setattr(Path, "write_text", lambda self, text: len(text))  # (the checkpoint's run_record.json)
    cfg = RunConfig()
    cfg.checkpoint.save_steps, cfg.checkpoint.export_final = 1, False
    calls = value(ranks=ranks, router_metrics=lambda: asyncio.sleep(0, {}), keeper=value(watch=_forever, metrics=dict))
    roles = value(calls=calls, role_pids={}, actor=object(), critic=None, generator=value(state_dict=dict),
                  run_record={})
    notice = value(install=lambda loop, task: None, received=asyncio.Event())
    assert asyncio.run(asyncio.wait_for(entrypoint._train(cfg, roles, [], None, notice), 10)) == 0
    assert called == saves


def test_an_engine_lost_after_the_loop_does_not_fail_the_final_save_and_export(monkeypatch):
    """The engines' keeper watches the loop only: an engine that dies once training is done (the OOM killer during the
    export's gather to host memory) ended a finished run as failed, its final save and export lost, or started a
    replacement competing with them for memory."""
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    called = []

    async def ranks(group, method, *args, **kw):
        await asyncio.sleep(0.2)  # (the keeper's failure comes first, were it watching)
        called.append(method)
        return ["exported"]

    async def engine_lost(version):
        raise RunFailed("rollout engine 0", "its process died")

    monkeypatch.setattr(RLController, "run", lambda self: asyncio.sleep(0, {}))
    log = value(sinks=value(rewind=lambda step: None, wandb_id=None), progress=value(summary=print))
    monkeypatch.setattr(entrypoint, "_controller", lambda cfg, r, opened, wandb_id: RLController(cfg, r, log))
    monkeypatch.setattr(entrypoint, "_summary", lambda cfg, roles, ctl, export: [export])
    monkeypatch.setattr(Path, "write_text", lambda self, text: len(text))  # (the checkpoint's run_record.json)
    cfg = RunConfig()
    cfg.checkpoint.save_steps, cfg.checkpoint.export_final = 1, True
    calls = value(ranks=ranks, router_metrics=lambda: asyncio.sleep(0, {}), keeper=value(watch=engine_lost,
                                                                                         metrics=dict))
    roles = value(calls=calls, role_pids={}, actor=object(), critic=None, generator=value(state_dict=dict),
                  run_record={})
    notice = value(install=lambda loop, task: None, received=asyncio.Event())
    assert asyncio.run(asyncio.wait_for(entrypoint._train(cfg, roles, [], None, notice), 10)) == 0
    assert called == ["save_checkpoint", "export_hf"]
