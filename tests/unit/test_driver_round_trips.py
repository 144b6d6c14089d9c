"""Fixed per-step costs off the driver's critical path (runtime/calls.py): `engines_busy` hints sent without waiting
for the ranks' answers (a failed one is raised by the next hint), and every role's start-up heap frozen out of the
garbage collector's full collections."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from molt_hydra.config.schema import TimeoutsConfig, WeightSyncConfig
from molt_hydra.runtime.calls import RoleCalls
from molt_hydra.runtime.watchdog import RunFailed


class Ranks:
    """A trainer group whose ranks answer a hint only when the test says so."""

    def __init__(self, num_ranks: int):
        self.num_ranks, self.answers, self.hints = num_ranks, [], []

    def engines_busy(self, busy: bool) -> list:
        self.hints.append(busy)
        futures = [asyncio.get_running_loop().create_future() for _ in range(self.num_ranks)]
        self.answers.extend(futures)
        return futures


def role_calls(actor, ref=None, critic=None) -> RoleCalls:
    roles = SimpleNamespace(actor=actor, ref=ref, critic=critic, transport="cuda_ipc")
    return RoleCalls(roles, TimeoutsConfig(), WeightSyncConfig(), "float32")


def test_an_unawaited_hint_returns_before_the_ranks_answer_and_an_awaited_one_does_not():
    async def run():
        ranks = Ranks(2)
        calls = role_calls(ranks)
        await asyncio.wait_for(calls.engines_busy(True, wait=False), 5)  # nobody answered: returned anyway
        assert ranks.hints == [True] and not any(f.done() for f in ranks.answers)
        waiting = asyncio.ensure_future(calls.engines_busy(False, wait=True))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()  # held until both ranks answer the awaited hint
        for f in ranks.answers:
            f.set_result(None)
        await asyncio.wait_for(waiting, 5)
        assert ranks.hints == [True, False]

    asyncio.run(run())


def test_a_failed_unawaited_hint_is_raised_by_the_next_one():
    async def run():
        ranks = Ranks(1)
        calls = role_calls(ranks)
        await calls.engines_busy(True, wait=False)
        ranks.answers[0].set_exception(RuntimeError("rank 0 lost its control thread"))
        await asyncio.sleep(0)  # the answer's callback runs
        with pytest.raises(RunFailed) as err:
            await calls.engines_busy(False, wait=False)
        assert err.value.role == "actor rank 0" and "rank 0 lost its control thread" in err.value.cause
        assert ranks.hints == [True]  # the failed run sends nothing more

    asyncio.run(run())


@pytest.mark.parametrize("wait", [False, True], ids=["unawaited", "awaited"])
def test_a_hint_failed_on_a_reference_or_critic_rank_names_that_rank(wait):
    """The reference's and the critic's ranks get the hints too. Before: a reference rank killed (kill -9) ended the
    run as 'Run failed: actor: engines_busy failed: the process died ...', the actor named for the reference's death
    (an unawaited hint), or Ray's ActorDiedError reached the report unnamed (an awaited one)."""
    async def run():
        actor, ref, critic = Ranks(2), Ranks(1), Ranks(2)
        calls = role_calls(actor, ref, critic)
        sending = asyncio.ensure_future(calls.engines_busy(True, wait=wait))
        await asyncio.sleep(0)
        for f in actor.answers + ref.answers + critic.answers[:1]:
            f.set_result(None)
        critic.answers[1].set_exception(RuntimeError("the critic's rank 1 died"))
        with pytest.raises(RunFailed) as err:
            await sending
            await asyncio.sleep(0)  # the failed answer's callback runs
            await calls.engines_busy(False, wait=False)
        assert err.value.role == "critic rank 1" and "the critic's rank 1 died" in err.value.cause, err.value
        ref.answers.clear()
        calls = role_calls(Ranks(1), ref)
        sending = asyncio.ensure_future(calls.engines_busy(True, wait=wait))
        await asyncio.sleep(0)
        ref.answers[0].set_exception(RuntimeError("the reference's rank 0 died"))
        calls.roles.actor.answers[0].set_result(None)
        with pytest.raises(RunFailed) as err:
            await sending
            await asyncio.sleep(0)
            await calls.engines_busy(False, wait=False)
        assert err.value.role == "reference rank 0" and "the reference's rank 0 died" in err.value.cause, err.value

    asyncio.run(run())


def test_no_ranks_no_hints():
    asyncio.run(role_calls(None).engines_busy(True, wait=True))


def test_every_role_and_the_driver_freeze_their_start_up_heaps():
    """RoleCalls.freeze_heaps sends gc.freeze to every actor of the run (engines, runners, each trainer group's
    ranks) and freezes the driver's own heap; here each "actor" runs the call in this process and counts it."""
    import gc

    ran = []

    class Actor:
        def __init__(self, name):
            self.__ray_call__ = SimpleNamespace(remote=lambda fn: self._run(name, fn))

        @staticmethod
        async def _run(name, fn):
            fn(None)
            ran.append(name)

    group = lambda role: SimpleNamespace(workers=[Actor(f"{role} {i}") for i in range(2)])  # noqa: E731
    roles = SimpleNamespace(engines=[Actor("engine")], runners=[Actor("runner")], actor=group("actor"), ref=None,
                            critic=group("critic"))
    calls = RoleCalls(roles, TimeoutsConfig(), WeightSyncConfig(), "float32")
    gc.unfreeze()
    try:
        asyncio.run(calls.freeze_heaps())
        assert sorted(ran) == ["actor 0", "actor 1", "critic 0", "critic 1", "engine", "runner"]
        assert gc.get_freeze_count() > 0  # the driver's own heap too
    finally:
        gc.unfreeze()


class ReleasingRanks:
    """A trainer group whose ranks answer the release of cached GPU memory: (GiB kept, no offer), or an error."""

    def __init__(self, *answers):
        self.num_ranks = len(answers)  # (two ranks or more: no single-pass offer rides on the release)
        self.workers = [SimpleNamespace(__ray_call__=SimpleNamespace(remote=lambda fn, arg, a=a: _answered(a)))
                        for a in answers]


async def _answered(answer):
    if isinstance(answer, Exception):
        raise answer
    return answer, None


def test_a_release_failed_on_a_reference_rank_names_that_rank():
    """Colocated, every trainer rank empties its allocator's cache before the engines wake. Before: a failure on any
    group's rank was told as Ray's raw error (a death) or as the actor's stall."""
    async def run():
        calls = role_calls(ReleasingRanks(2.0, 3.5), ReleasingRanks(1.0, 0.5))
        assert await calls.release_trainer_memory() == {"memory/trainer_resident_gib": 3.5}  # the fullest rank
        calls = role_calls(ReleasingRanks(2.0, 2.0), ReleasingRanks(1.0, RuntimeError("cudaErrorLaunchFailure")))
        with pytest.raises(RunFailed) as err:
            await calls.release_trainer_memory()
        assert err.value.role == "reference rank 1" and "cudaErrorLaunchFailure" in err.value.cause, err.value

    asyncio.run(run())


def test_a_stalled_awaited_hint_names_the_ranks_that_did_not_answer():
    """Before: a reference rank that never answered the awaited hint was told as 'actor stalled'."""
    from molt_hydra.runtime.watchdog import RoleStalled

    async def run():
        actor, ref = Ranks(2), Ranks(2)
        calls = RoleCalls(SimpleNamespace(actor=actor, ref=ref, critic=None, transport="cuda_ipc"),
                          TimeoutsConfig(trainer_call_s=0.2), WeightSyncConfig(), "float32")
        sending = asyncio.ensure_future(calls.engines_busy(True, wait=True))
        await asyncio.sleep(0)
        for f in actor.answers + ref.answers[:1]:
            f.set_result(None)
        with pytest.raises(RoleStalled) as stall:
            await sending
        assert str(stall.value) == "reference rank 1 stalled: engines_busy did not finish within 0.2 s"

    asyncio.run(run())
