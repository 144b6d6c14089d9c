"""A trainer rank's pid is in the run's role pids while the rank still builds its model (runtime/roles.py
`_note_ranks`, read from Ray's GCS: a call to the rank waits for its constructor), so the start's watchers see a rank
stopped by a signal there. Before, the ranks' pids came once every rank was up: a rank stopped while it built its
model held the start for train.timeouts.startup_s (600 s), and its stall named neither the rank nor the cause. The
trainer group stands in (its rank, a real stopped `sleep` process); the real one is
tests/integration/test_late_faults.py's, and compat.actor_pid's is tests/integration/test_start_failures.py's.
And the trainer ranks build beside the engines' and runners' starts: one that fails ends the start at once."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from test_watched_phases import _forever, stopped_process  # noqa: F401 (a fixture)

from molt_hydra.config.schema import RunConfig
from molt_hydra.models import build
from molt_hydra.parallel import group
from molt_hydra.runtime import ray_head, roles, watchdog
from molt_hydra.runtime.watchdog import RoleStalled, RunFailed


def test_a_rank_stopped_while_it_builds_its_model_ends_the_start_naming_it(monkeypatch, stopped_process):
    released = threading.Event()
    rank = object()

    class StartingGroup:
        """Creates its rank, then waits for it to come up (it never does: stopped)."""

        def __init__(self, num_ranks, spec, *, on_ranks=None, **kw):
            if on_ranks is not None:
                on_ranks(SimpleNamespace(workers=[rank]))
            released.wait(20)

    monkeypatch.setattr(group, "TrainerGroup", StartingGroup)
    monkeypatch.setattr(roles, "trainer_spec", lambda *args, **kw: None)
    monkeypatch.setattr(roles, "actor_pid", {rank: stopped_process}.get)
    monkeypatch.setattr(roles, "RANK_PID_POLL_S", 0.01)
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    role_pids: dict[str, int] = {}

    async def start():
        try:
            return await watchdog.beside(
                roles._start_trainers(RunConfig(), "tiny", ("actor",), 1, None, None, lambda name: print, role_pids),
                *ray_head.watchers(role_pids, True))
        finally:
            released.set()  # (the group's thread ends)

    with pytest.raises(RoleStalled) as stall:
        asyncio.run(asyncio.wait_for(start(), 10))
    assert str(stall.value) == "actor rank 0 stalled: its process has made no progress for 0.15 s"
    assert role_pids == {"actor rank 0": stopped_process}


@pytest.mark.parametrize("role", ["rollout engine 1", "agent runner 0"])
def test_an_engine_or_runner_whose_start_fails_ends_the_start_while_the_ranks_build(monkeypatch, role):
    """Before, the engines' and runners' starts were awaited once the trainer ranks were up (minutes on GPU): a
    failed one was told only then. The ranks here never come up."""
    import transformers

    async def noted(role_pids, name, actor, start):
        if name == role:
            await asyncio.sleep(0.05)
            raise RunFailed(role, "its start failed: ValueError: rollout.kv_cache_gb=64 does not fit")

    monkeypatch.setattr(roles, "_noted", noted)
    monkeypatch.setattr(build, "resolve_path", lambda path, weights=True: path)
    monkeypatch.setattr(roles, "init_ray", lambda cfg: None)
    monkeypatch.setattr(roles, "fsdp_roles", lambda cfg: ("actor",))
    monkeypatch.setattr(roles, "colocated_placement", lambda cfg, n: asyncio.sleep(0, (None, None)))
    monkeypatch.setattr(roles, "_start_engines", lambda cfg, path, gpus, share, pids: (
        [], {"rollout engine 1": (None, asyncio.ensure_future(noted(pids, "rollout engine 1", None, "start")))}, None))
    monkeypatch.setattr(roles, "_start_runners", lambda *args: [None])
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    monkeypatch.setattr(roles, "_load_rows", lambda cfg, scoring, tokenizer=None: ([{}] * 8, None))
    monkeypatch.setattr(roles, "_start_trainers", _forever)
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    with pytest.raises(RunFailed) as failed:
        asyncio.run(asyncio.wait_for(roles.build_roles(RunConfig(), {}), 10))
    assert str(failed.value) == f"{role}: its start failed: ValueError: rollout.kv_cache_gb=64 does not fit"


def test_a_failed_pid_lookup_is_asked_again_not_the_starts_failure(monkeypatch):
    """A rank's pid is for the report alone: a GCS call that fails once (a busy GCS while ranks build for minutes)
    ended the trainer group's start with it; now it is asked again at the next poll."""
    answers = iter([RuntimeError("GCS RPC timed out"), None, 4242])

    def lookup(rank):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(roles, "actor_pid", lookup)
    monkeypatch.setattr(roles, "RANK_PID_POLL_S", 0.0)
    pids = {}
    asyncio.run(asyncio.wait_for(roles._note_ranks(pids, "actor", ["rank0"]), 10))
    assert pids == {"actor rank 0": 4242}


def test_an_engine_that_hangs_at_start_is_named_with_its_phase(monkeypatch):
    """Of three engines, 0 starts, 1 hangs in its start (its process up), 2 is never placed by Ray: the start-up's
    stall names engines 1 and 2, each with where it is. Before: 'rollout engine stalled: start did not finish within
    0.2 s', whichever engine it was."""
    import transformers

    async def noted(role_pids, name, actor, start):
        if name in ("rollout engine 0", "rollout engine 1", "agent runner 0"):
            role_pids[name] = 4320 + int(name[-1])
        if name in ("rollout engine 1", "rollout engine 2"):
            await asyncio.Event().wait()

    cfg = RunConfig()
    cfg.train.timeouts.startup_s = 0.2
    monkeypatch.setattr(roles, "_noted", noted)
    monkeypatch.setattr(roles, "actor_pid", lambda actor: None)  # engine 2: no process leased
    monkeypatch.setattr(build, "resolve_path", lambda path, weights=True: path)
    monkeypatch.setattr(roles, "init_ray", lambda cfg: None)
    monkeypatch.setattr(roles, "fsdp_roles", lambda cfg: ("actor",))
    monkeypatch.setattr(roles, "colocated_placement", lambda cfg, n: asyncio.sleep(0, (None, None)))
    monkeypatch.setattr(roles, "_start_engines", lambda cfg, path, gpus, share, pids: (
        ["e0", "e1", "e2"], roles._starts(pids, "rollout engine", ["e0", "e1", "e2"], "start"), None))
    monkeypatch.setattr(roles, "_start_runners", lambda *args: ["r0"])
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    monkeypatch.setattr(roles, "_load_rows", lambda cfg, scoring, tokenizer=None: ([{}] * 8, None))
    monkeypatch.setattr(roles, "_start_trainers", lambda *args: asyncio.sleep(0, (None, None, None)))
    monkeypatch.setattr(ray_head, "dead_head_processes", lambda: {})
    monkeypatch.setattr(ray_head, "live_head_processes", lambda: {})
    with pytest.raises(RoleStalled) as stall:
        asyncio.run(asyncio.wait_for(roles.build_roles(cfg, {}), 10))
    assert stall.value.role == "rollout engine 1"
    assert str(stall.value) == (
        "rollout engine 1, rollout engine 2 stalled: start did not finish within 0.2 s (rollout engine 1: its process "
        "(pid 4321) is up, in its start (an engine: vLLM's model load, KV cache, engine core); rollout engine 2: Ray "
        "has not placed its actor (no process yet: the CPUs / GPUs it asks for are not free))")


def test_a_trainer_rank_that_hangs_at_start_is_named_with_its_phase(monkeypatch):
    """Of three actor ranks, 0 is up, 1 hangs in its constructor (its process up), 2 has no process yet: the start's
    deadline names ranks 1 and 2, each with its node and where it is. Before: 'actor stalled: start did not finish
    within 0.3 s', whichever rank hung (the group's own message, naming them, came later: its clock starts once they
    are placed)."""
    released = threading.Event()
    ranks = [SimpleNamespace(__ray_ready__=SimpleNamespace(remote=ready))
             for ready in (lambda: asyncio.sleep(0), lambda: asyncio.Event().wait(), lambda: asyncio.Event().wait())]

    class StartingGroup:
        def __init__(self, num_ranks, spec, *, on_ranks=None, **kw):
            self.workers, self.rendezvous = ranks, "10.0.0.1:4100"
            self.rank_nodes = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
            on_ranks(self)
            released.wait(20)

    cfg = RunConfig()
    cfg.train.timeouts.startup_s = 0.3
    monkeypatch.setattr(group, "TrainerGroup", StartingGroup)
    monkeypatch.setattr(roles, "trainer_spec", lambda *args, **kw: None)
    monkeypatch.setattr(roles, "actor_pid", lambda rank: {id(ranks[0]): 4320, id(ranks[1]): 4321}.get(id(rank)))
    monkeypatch.setattr(roles, "RANK_PID_POLL_S", 0.01)
    monkeypatch.setattr(roles, "RANK_UP_S", 0.1)
    role_pids: dict[str, int] = {}

    async def start():
        try:
            return await roles._start_trainers(cfg, "tiny", ("actor",), 1, None, None, lambda name: print, role_pids)
        finally:
            released.set()  # (the group's thread ends)

    with pytest.raises(RoleStalled) as stall:
        asyncio.run(asyncio.wait_for(start(), 10))
    assert stall.value.role == "actor rank 1"
    assert str(stall.value) == (
        "actor rank 1, actor rank 2 stalled: start did not finish within 0.3 s (actor rank 1: its process (pid 4321) "
        "on 10.0.0.2 is still in its constructor (its model build, then the process group's rendezvous at rank 0's "
        "10.0.0.1:4100); actor rank 2: Ray has not started its process on 10.0.0.3 yet)")


def test_the_trainer_groups_own_timeout_is_raised_as_it_is(monkeypatch):
    """A TimeoutError of the group's own (before the start's deadline) keeps its message. Before, the deadline took
    it for its own: 'actor stalled: start did not finish within 5 s'."""
    own = "trainer group 'actor': Ray could not place 1 rank(s) of {'CPU': 1} within 0s; the cluster has {'CPU': 0}"

    class PlacementTimedOut:
        def __init__(self, num_ranks, spec, **kw):
            raise TimeoutError(own)

    cfg = RunConfig()
    cfg.train.timeouts.startup_s = 5
    monkeypatch.setattr(group, "TrainerGroup", PlacementTimedOut)
    monkeypatch.setattr(roles, "trainer_spec", lambda *args, **kw: None)
    with pytest.raises(TimeoutError) as timeout:
        asyncio.run(asyncio.wait_for(
            roles._start_trainers(cfg, "tiny", ("actor",), 1, None, None, lambda name: print, {}), 10))
    assert str(timeout.value) == own
