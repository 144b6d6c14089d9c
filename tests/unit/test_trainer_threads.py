"""CPU trainer ranks keep to the CPUs Ray reserved for them while the rollout engines generate, and train on their
share of the node's cores while the engines are idle (parallel/trainer.py `engines_busy`); the driver tells them
around every generation, before the batch is queued (runtime/controller.py `produce`)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

CORES = len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def worker():
    """A 1-rank gloo trainer on the tiny model, reserved 1 CPU, alone on its node; threads restored afterwards."""
    import torch.distributed as dist

    from molt_hydra.parallel.launch import free_port
    from molt_hydra.parallel.trainer import TrainerWorker

    from molt_hydra.parallel.trainer_spec import TrainerSpec

    before = torch.get_num_threads()
    yield TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=free_port(), model_path="tiny://qwen3_tiny",
                                    timeout_s=120, cpu_threads=1, node_ranks=1))
    torch.set_num_threads(before)
    if dist.is_initialized():
        dist.destroy_process_group()


def step_threads(w) -> float:
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 100, (12,), generator=g), "loss_mask": torch.ones(12)}
               for _ in range(4)]
    return w.train_step(samples)["perf/torch_threads"]


@pytest.mark.skipif(CORES < 2, reason="one core: nothing to share")
def test_ranks_use_every_core_only_while_the_engines_are_idle(worker):
    assert step_threads(worker) == 1  # no hint yet: the engines count as generating
    worker.engines_busy(False, 1)
    assert step_threads(worker) == CORES  # one rank on the node: all of its cores
    worker.engines_busy(True, 1)  # an older (or repeated) hint arriving late changes nothing
    assert step_threads(worker) == CORES
    worker.engines_busy(True, 2)
    assert step_threads(worker) == 1


@pytest.mark.skipif(CORES < 2, reason="one core: nothing to share")
def test_a_hint_takes_effect_inside_a_micro_batch(worker):
    """One micro-batch, the hint lands while its first block runs: the blocks after it use every core."""
    from molt_hydra.models.build import decoder_layers

    worker.engines_busy(True, 10)
    layers = decoder_layers(worker.model)
    assert len(layers) >= 2
    hint = layers[0].register_forward_pre_hook(lambda *_: worker.engines_busy(False, 11))
    try:
        threads = step_threads(worker)
    finally:
        hint.remove()
    assert 1 < threads < CORES  # 1 up to block 0, all cores after (1 with threads set per micro-batch only)
    assert step_threads(worker) == CORES


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_driver_tells_the_ranks_around_every_generation_before_queueing_the_batch(mode):
    """Every generation is bracketed by hints; only a sync step's "idle" is awaited before its batch is queued (its
    training must run on every core, for reproducible reductions); the others are sent without a round trip."""
    from molt_hydra.cli import to_run_config
    from molt_hydra.runtime.validate import validate
    from molt_hydra.rollout.generator import FinishedGroup, RolloutBatch
    from molt_hydra.runtime.controller import RLController

    events = []

    class Batches:
        made = 0

        async def generate_batch(self):
            events.append("generate")
            self.made += 1
            if self.made > 2:
                return RolloutBatch([], {}, exhausted=True)
            return RolloutBatch([FinishedGroup(prompt_index=self.made, epoch=0, trajectories=[])], {}, False)

    async def engines_busy(busy, wait):
        events.append(("busy" if busy else "idle") + (" awaited" if wait else ""))

    cfg = validate(to_run_config(compose_config([f"train.mode={mode}"])))
    ctl = RLController(cfg, SimpleNamespace(generator=Batches(), calls=SimpleNamespace(engines_busy=engines_busy)),
                       log=None)

    async def run():
        producer = asyncio.create_task(ctl.produce())
        for _ in range(2):
            await ctl.queue.get()
            events.append("queued")  # what a sync step trains on: by now every rank has heard "idle"
            async with ctl.step_done:
                ctl.step += 1
                ctl.step_done.notify_all()
        await producer

    asyncio.run(run())
    if mode == "sync":
        assert events == ["busy", "generate", "idle awaited", "queued"] * 2 + ["busy", "generate", "idle awaited"]
    else:
        assert [e for e in events if e != "queued"] == ["busy", "generate", "idle"] * 3
