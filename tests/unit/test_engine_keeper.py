"""The engine keeper's health poll (runtime/engine_keeper.py) runs outside the engines lock, so a weight push never
waits on it, and a death it saw is re-checked under the lock before anything is replaced."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from molt_hydra.runtime import engine_keeper
from molt_hydra.runtime.engine_keeper import EngineKeeper


class Engine:
    """A Ray handle stand-in whose `healthy` answers what the test sets, when the test lets it."""

    def __init__(self, healthy: bool):
        self.is_healthy, self.polled, self.answer = healthy, asyncio.Event(), asyncio.Event()
        self.answer.set()
        self.healthy = SimpleNamespace(remote=self._healthy)
        self.__ray_call__ = SimpleNamespace(remote=self._no_probe)

    async def _healthy(self) -> bool:
        self.polled.set()
        await self.answer.wait()
        return self.is_healthy

    async def _no_probe(self, _fn):
        raise RuntimeError("not a Ray actor")  # the keeper then tracks no local processes for it


def keeper_over(engine: Engine) -> tuple[EngineKeeper, SimpleNamespace, list]:
    replaced: list = []
    roles = SimpleNamespace(engines=[engine], calls=SimpleNamespace(engines_lock=asyncio.Lock()))
    keeper = EngineKeeper(roles, max_restarts=1, startup_s=10)

    async def replace(index, version):
        replaced.append((index, version))

    keeper.replace = replace
    return keeper, roles, replaced


def test_a_health_poll_waiting_on_a_busy_engine_does_not_hold_the_engines_lock(monkeypatch):
    monkeypatch.setattr(engine_keeper, "POLL_S", 0.0)

    async def run():
        engine = Engine(healthy=True)
        engine.answer.clear()  # the engine is busy: its health answer waits
        keeper, roles, _ = keeper_over(engine)
        watcher = asyncio.create_task(keeper.watch(lambda: 1))
        await asyncio.wait_for(engine.polled.wait(), 5)
        locked = roles.calls.engines_lock.locked()  # a weight push would wait on it now
        watcher.cancel()
        return locked

    assert asyncio.run(run()) is False


def test_a_death_seen_by_the_poll_is_rechecked_under_the_lock_before_replacing(monkeypatch):
    monkeypatch.setattr(engine_keeper, "POLL_S", 0.0)

    async def run():
        dead = Engine(healthy=False)
        keeper, roles, replaced = keeper_over(dead)
        await roles.calls.engines_lock.acquire()  # a weight push holds it ...
        watcher = asyncio.create_task(keeper.watch(lambda: 1))
        await asyncio.wait_for(dead.polled.wait(), 5)
        for _ in range(5):
            await asyncio.sleep(0)
        roles.engines[0] = Engine(healthy=True)  # ... and replaced the dead engine itself
        roles.calls.engines_lock.release()
        await asyncio.wait_for(roles.engines[0].polled.wait(), 5)
        for _ in range(5):
            await asyncio.sleep(0)
        watcher.cancel()
        return replaced

    assert asyncio.run(run()) == []


def test_a_dead_engine_is_replaced_with_the_trainers_version(monkeypatch):
    monkeypatch.setattr(engine_keeper, "POLL_S", 0.0)

    async def run():
        keeper, roles, replaced = keeper_over(Engine(healthy=False))
        watcher = asyncio.create_task(keeper.watch(lambda: 7))
        for _ in range(50):
            await asyncio.sleep(0)
            if replaced:
                break
        watcher.cancel()
        return replaced

    assert asyncio.run(run())[:1] == [(0, 7)]
