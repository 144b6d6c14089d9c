"""A trainer call that fails on one rank while the others wait on it in a collective (runtime/calls.py `_every`): an
out-of-memory on one rank mid-step leaves its peers in their next all-gather until the collective timeout
(train.timeouts.collective_s, 30 min). Before, the driver waited for every rank until train.timeouts.trainer_call_s
(30 min), then ended the run as 'actor stalled: train_step did not finish', the out-of-memory untold. Now the other
ranks get PEERS_S once one failed, and the failure is named; a rank that died is still named over its peers' errors,
which follow from its death."""

import asyncio
from types import SimpleNamespace

import pytest

from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError

from molt_hydra.runtime import calls
from molt_hydra.runtime.watchdog import RoleStalled, RunFailed


async def _raises(error: Exception, after_s: float = 0.0):
    await asyncio.sleep(after_s)
    raise error


async def _never():
    await asyncio.Event().wait()


def _rank(call):
    """A trainer rank whose train_step is `call()` (a coroutine, as a Ray ObjectRef is awaited)."""
    return SimpleNamespace(train_step=SimpleNamespace(remote=lambda *a, **kw: call()))


def _failure(*per_rank, monkeypatch, peers_s: float) -> tuple[RunFailed, float]:
    """The failure of the actor's train_step on ranks doing `per_rank`, under a 5 s trainer-call deadline."""
    monkeypatch.setattr(calls, "PEERS_S", peers_s, raising=False)
    group = SimpleNamespace(workers=[_rank(call) for call in per_rank], num_ranks=len(per_rank))
    role_calls = calls.RoleCalls(SimpleNamespace(), SimpleNamespace(trainer_call_s=5.0), None, "float32")

    async def run():
        start = asyncio.get_running_loop().time()
        try:
            await role_calls.ranks(group, "train_step")
        except RunFailed as e:
            return e, asyncio.get_running_loop().time() - start
        raise AssertionError("no failure")
    return asyncio.run(run())


def test_a_rank_that_failed_is_named_while_its_peer_waits_on_it_and_a_death_still_comes_first(monkeypatch):
    error, took = _failure(_never, lambda: _raises(MemoryError("out of memory")), monkeypatch=monkeypatch,
                           peers_s=0.5)
    assert (error.role, error.cause) == ("actor rank 1", "train_step failed: MemoryError: out of memory")
    assert took < 4  # the grace, not the deadline
    # the grace's purpose: a rank that died is named over the peer whose error (from its death) came first
    died = ActorDiedError(ActorDiedErrorContext(class_name="PolicyWorker", actor_id=bytes(16), pid=1,
                                                error_message="Worker exit type: SYSTEM_ERROR Worker exit detail: "
                                                              "killed."))
    error, _ = _failure(lambda: _raises(RuntimeError("Connection closed by peer")), lambda: _raises(died, after_s=0.2),
                        monkeypatch=monkeypatch, peers_s=3.0)
    assert error.role == "actor rank 1" and error.cause.startswith("train_step failed: the process died")


def test_a_rank_that_died_first_ends_the_call_at_once_without_the_grace(monkeypatch):
    """The grace waits for a death to be told; once a rank's death is in, the cause is known: no wait for its peers
    (stuck in a collective with it)."""
    died = ActorDiedError(ActorDiedErrorContext(class_name="PolicyWorker", actor_id=bytes(16), pid=1,
                                                error_message="Worker exit type: SYSTEM_ERROR Worker exit detail: "
                                                              "killed."))
    error, took = _failure(lambda: _raises(died), _never, monkeypatch=monkeypatch, peers_s=3.0)
    assert error.role == "actor rank 0" and error.cause.startswith("train_step failed: the process died")
    assert took < 1.5  # not the 3 s grace


def test_a_train_step_of_several_epochs_has_the_deadline_of_as_many_calls():
    """The step's train.epochs run in one trainer call (its metrics over all of them); each epoch is one call's work,
    so the call's deadline is train.timeouts.trainer_call_s times them (was: one call's, so a step of 4 epochs of 8
    minutes each, which had passed as 4 calls, stopped the run as stalled)."""
    async def three_tenths():
        await asyncio.sleep(0.3)
        return {"ok": 1.0}

    group = SimpleNamespace(workers=[_rank(three_tenths)], num_ranks=1)
    role_calls = calls.RoleCalls(SimpleNamespace(), SimpleNamespace(trainer_call_s=0.2), None, "float32")
    assert asyncio.run(role_calls.ranks(group, "train_step", calls=3)) == [{"ok": 1.0}]  # within 3 x 0.2 s
    with pytest.raises(RoleStalled, match="train_step did not finish within 0.2 s"):
        asyncio.run(role_calls.ranks(group, "train_step"))  # one call's 0.2 s
