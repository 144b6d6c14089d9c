"""A role's start, with real Ray actors: a trainer rank's pid is read from Ray's GCS while its constructor still runs
(compat/ray.py `actor_pid`): the start's watchers then see a rank stopped while it builds its model
(tests/unit/test_starting_rank_watched.py; a real run's: tests/integration/test_late_faults.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_real_errors import local_ray  # noqa: E402,F401 (a fixture)

from molt_hydra.compat.ray import actor_pid  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import a test module


class BuildingRank:
    """A trainer rank still in its constructor (building its model) until `marker` exists."""

    def __init__(self, marker: str):
        while not os.path.exists(marker):
            time.sleep(0.05)

    def pid(self) -> int:
        return os.getpid()


def test_a_ranks_pid_is_read_while_its_constructor_runs(local_ray, tmp_path):
    marker = tmp_path / "model built"
    rank = ray.remote(BuildingRank).remote(str(marker))
    deadline = time.monotonic() + 30
    while (pid := actor_pid(rank)) is None:
        assert time.monotonic() < deadline, "no pid from Ray's GCS"
        time.sleep(0.05)
    marker.touch()  # (only now can its constructor end)
    assert ray.get(rank.pid.remote(), timeout=30) == pid
