"""Knobs wired by issue 17 reach their mechanism: `eval.batch_size` bounds the eval groups in flight."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from molt_hydra.rollout.generation import Sampling
from molt_hydra.rollout.generator import SamplesGenerator

SAMPLING = Sampling(max_tokens=4)


@dataclass
class Traj:
    reward: float = 1.0
    score: float | None = None
    rollout_id: str = ""
    truncated: bool = False
    action_ranges: list = field(default_factory=lambda: [(0, 3)])


class PeakCountingRunner:
    """Counts how many groups run at once (each holds for a few event-loop turns)."""

    def __init__(self):
        self.running = self.peak = 0

    async def run_group(self, row, n, sampling):
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        return [(Traj(rollout_id=f"{row['id']}-{i}"), None) for i in range(n)]


def _peak(max_inflight, pool_limit=5):
    runner = PeakCountingRunner()
    gen = SamplesGenerator([{"id": 0}], runner, batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING,
                           max_inflight_groups=pool_limit)
    asyncio.run(gen.evaluate([{"id": i} for i in range(12)], 2, SAMPLING, max_inflight=max_inflight))
    return runner.peak


def test_eval_batch_size_bounds_groups_in_flight():
    assert _peak(2) == 2
    assert _peak(7) == 7


def test_eval_batch_size_none_uses_the_pool_limit():
    assert _peak(None, pool_limit=5) == 5
