"""An engine found dead in a step's other engine phases is replaced as in a weight push (runtime/calls.py
`_replacing_dead`): a colocated step's sleep, the sleep metrics read after a push, the sync probe after a push. Before,
only the push replaced a dead engine: one dying in those phases ended the run ('Run failed: rollout engine 1: sleep
failed: ...'). RoleCalls is the real one; the engines and the keeper stand in (a real engine's death and
replacement: tests/integration/test_faults.py)."""

from __future__ import annotations

import asyncio
from functools import partial
from types import SimpleNamespace as value

import pytest
import ray

from molt_hydra.config.schema import TimeoutsConfig, WeightSyncConfig
from molt_hydra.runtime.calls import RoleCalls

SUMS = {"layers.0": [1.0, 2.0, 4.0, 0.0]}  # the trainer's and every engine's (they agree)
LOGPROBS = [0.0, -1.0, -2.0]


class Engine:
    """An engine handle whose calls are recorded; a dead one's raise as a dead Ray actor's."""

    def __init__(self, dead: bool = False):
        self.dead, self.calls = dead, []
        for method in ("sleep", "sleep_metrics", "weight_checksums", "score"):
            setattr(self, method, value(remote=partial(self._call, method)))

    async def _call(self, method, *args):
        self.calls.append(method)
        if self.dead:
            raise ray.exceptions.RayActorError()
        return {"sleep_metrics": {"engine/sleep_s": 1.0}, "weight_checksums": SUMS, "score": LOGPROBS}.get(method)


class Keeper:
    """runtime/engine_keeper.py's part here: which engines are dead; a replacement (a new, live engine)."""

    def __init__(self, roles):
        self.roles, self.replaced = roles, []

    async def dead_engines(self) -> list[int]:
        return [i for i, engine in enumerate(self.roles.engines) if engine.dead]

    async def replace(self, index: int, version: int | None) -> None:
        self.replaced.append((index, version))
        self.roles.engines[index] = Engine()


PHASES = {  # phase -> (its call, what it returns, the version the replacement is given)
    "colocated sleep": (lambda calls: calls.sleep_engines(), None, None),
    "sleep metrics after a push": (lambda calls: calls.engine_phase_metrics(4), {"engine/sleep_s": 1.0}, 4),
    "sync probe after a push": (lambda calls: calls.sync_probe(5, ([1, 2, 3], SUMS, LOGPROBS)),
                                {"weight_sync/probe_logprob_gap": 0.0, "weight_sync/probe_groups": 1.0}, 5),
}


@pytest.mark.parametrize("phase", PHASES)
def test_an_engine_dead_in_a_phase_is_replaced_and_the_phase_goes_on(phase):
    call, returned, version = PHASES[phase]
    old = Engine(dead=True)
    roles = value(engines=[Engine(), old])
    calls = RoleCalls(roles, TimeoutsConfig(), WeightSyncConfig(), "bfloat16")
    calls.keeper = Keeper(roles)
    assert asyncio.run(call(calls)) == returned
    assert calls.keeper.replaced == [(1, version)]
    assert roles.engines[1] is not old and roles.engines[1].calls == old.calls  # the new one had the phase's calls


def test_an_engine_started_since_the_sleep_leaves_the_steps_sleep_figures_alone():
    """The step's sleep seconds are the mean over the engines that slept, its GiB freed their sum: a replacement
    (started after the sleep) reports nothing and must not count as a 0 s sleep."""
    slept, fresh = Engine(), Engine()
    slept.sleep_metrics = value(remote=lambda: asyncio.sleep(0, {"engine/sleep_s": 0.25, "engine/freed_gib": 3.0}))
    fresh.sleep_metrics = value(remote=lambda: asyncio.sleep(0, {}))
    calls = RoleCalls(value(engines=[slept, fresh]), TimeoutsConfig(), WeightSyncConfig(), "bfloat16")
    calls.keeper = Keeper(calls.roles)
    assert asyncio.run(calls.engine_phase_metrics(4)) == {"engine/freed_gib": 3.0, "engine/sleep_s": 0.25}
