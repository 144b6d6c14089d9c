"""A role's start, with real Ray actors. A rollout engine whose start (or restart) fails is named with its index and
the cause (runtime/roles.py `_noted`, runtime/engine_keeper.py), with the last error in its log (vLLM's engine core
writes its error there; the engine's own exception only points at it). Before, the run read 'Run failed: rollout
engine: RuntimeError: Engine core initialization failed. See root cause above ...', whichever of several engines it
was, with nothing above. And a trainer rank's pid is read from Ray's GCS while its constructor still runs
(compat/ray.py `actor_pid`): the start's watchers then see a rank stopped while it builds its model
(tests/unit/test_starting_rank_watched.py; a real run's: tests/integration/test_late_faults.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as value

import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_real_errors import local_ray, report  # noqa: E402,F401 (a fixture)

from molt_hydra.compat.ray import actor_pid  # noqa: E402
from molt_hydra.runtime.engine_keeper import EngineKeeper  # noqa: E402
from molt_hydra.runtime.roles import _noted  # noqa: E402
from molt_hydra.runtime.watchdog import RunFailed  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import a test module
FULL = "Available memory on node 0 (20.57/23.54 GiB) is less than requested memory for kv (100000.0 GiB)"
CORE = "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"


class VLLMEngine:
    """Named as the real engine actor class (as Ray names it in its errors); its start fails as vLLM's does when the
    KV cache does not fit: its engine core, a child process sharing its stderr (Ray's worker log), dies with the
    error; the start raises vLLM's RuntimeError, which only points at it."""

    def __init__(self, **kwargs):
        pass

    def start(self):
        subprocess.run([sys.executable, "-c", f"raise ValueError({FULL!r})"])
        raise RuntimeError(CORE)

    def shutdown(self):
        pass


def logged(cause: str, message: str) -> None:
    """`message` is `cause` then the engine core's error, from the actor's worker log."""
    head, _, tail = message.partition("; the last error in its log (")
    assert head == cause, message
    log, _, error = tail.partition("): ")
    assert Path(log).name.startswith("worker-") and log.endswith(".err") and error == f"ValueError: {FULL}", message


class BuildingRank:
    """A trainer rank still in its constructor (building its model) until `marker` exists."""

    def __init__(self, marker: str):
        while not os.path.exists(marker):
            time.sleep(0.05)

    def pid(self) -> int:
        return os.getpid()


def test_an_engine_whose_start_fails_is_named_by_its_index_and_cause(local_ray, tmp_path):
    engine = ray.remote(VLLMEngine).remote()
    role_pids: dict[str, int] = {}
    with pytest.raises(RunFailed) as failed:
        asyncio.run(_noted(role_pids, "rollout engine 1", engine, "start"))
    assert list(role_pids) == ["rollout engine 1"]  # (its pid, asked first)
    first = report(tmp_path, failed.value)[0]
    assert first.startswith("Run failed: rollout engine 1: ") and first.endswith("."), first
    logged(f"its start failed: RuntimeError: {CORE}", first.removeprefix("Run failed: rollout engine 1: ")[:-1])


def test_an_engine_whose_restart_fails_is_named_by_its_index_and_cause(local_ray):
    """The engine keeper's replacement of a dead engine 1 whose start fails."""
    engines = [ray.remote(VLLMEngine).remote() for _ in range(2)]
    roles = value(engines=engines, transport="object_store", new_engine=lambda i: ray.remote(VLLMEngine).remote())
    keeper = EngineKeeper(roles, max_restarts=3, startup_s=60)
    with pytest.raises(RunFailed) as failed:
        asyncio.run(keeper.replace(1, 2))
    assert failed.value.role == "rollout engine 1"
    logged(f"its restart failed: RuntimeError: {CORE}", failed.value.cause)


def test_a_ranks_pid_is_read_while_its_constructor_runs(local_ray, tmp_path):
    marker = tmp_path / "model built"
    rank = ray.remote(BuildingRank).remote(str(marker))
    deadline = time.monotonic() + 30
    while (pid := actor_pid(rank)) is None:
        assert time.monotonic() < deadline, "no pid from Ray's GCS"
        time.sleep(0.05)
    marker.touch()  # (only now can its constructor end)
    assert ray.get(rank.pid.remote(), timeout=30) == pid
