"""The sync probe's time is a part of the step's timing (`timing/sync_probe`, with its `timing/share/`): its trainer
side (a forward and per-layer weight sums, before the push) and the engines' (after it). Before, it fell in no part:
on a probed step the trainer-side shares left it unexplained (the tiny CPU run: 2 % of a step; a forward and a sum
over every parameter on each side of a large model). The roles are stand-ins with known durations."""

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.runtime import controller  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402

VIEW_S, PUSH_S, PROBE_S = 0.2, 0.1, 0.3


class Calls:
    """Stand-in for runtime/calls.py: the trainer's probe view, the push and the engines' probe each take known time."""

    async def trainer_probe_view(self):
        await asyncio.sleep(VIEW_S)
        return "view"

    async def push_weights(self, version: int) -> dict:
        await asyncio.sleep(PUSH_S)
        return {}

    async def sync_probe(self, version: int, trainer_view) -> dict:
        assert trainer_view == "view"
        await asyncio.sleep(PROBE_S)
        return {"weight_sync/probe_logprob_gap": 0.0, "weight_sync/probe_groups": 2.0}


def test_a_probed_sync_times_its_probe_apart_from_the_push():
    cfg = to_run_config(compose_config(["train.mode=sync", "rollout.weight_sync.probe_every=1"]))
    ctl = RLController(cfg, SimpleNamespace(calls=Calls()), log=None)
    ctl.batches_made = 1  # the batch the sync waits for exists

    async def timed():
        t0 = time.perf_counter()
        synced = await ctl.sync_weights()
        return synced, time.perf_counter() - t0

    synced, elapsed = asyncio.run(timed())
    assert synced["weight_sync/probe_groups"] == 2.0 and ctl.version == 1
    assert synced["timing/sync_probe"] >= VIEW_S + PROBE_S and synced["timing/weight_sync"] >= PUSH_S
    assert synced["timing/sync_probe"] + synced["timing/weight_sync"] <= elapsed  # the push is not the probe's
    # each a share of the step (trainer_release too: colocated, it is before the push, outside timing/weight_sync)
    assert {"trainer_release", "sync_probe", "weight_sync"} <= set(controller.TRAINER_PARTS)
