"""Knobs wired by issue 17 reach their mechanism: `eval.batch_size` bounds the eval groups in flight;
`train.rollout_dump_dir` saves every rollout batch and `train.rollout_replay_dir` trains on them instead of generating."""

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


# ------------------------------------------------------------------ train.rollout_dump_dir / rollout_replay_dir
class ScriptedBatches:
    """A generator that yields `n` one-group batches, then the end of the data."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    async def generate_batch(self):
        from molt_hydra.rollout.generator import FinishedGroup, RolloutBatch

        self.calls += 1
        if self.calls > self.n:
            return RolloutBatch([], {}, exhausted=True)
        group = FinishedGroup(prompt_index=self.calls, epoch=0, trajectories=[{"reward": float(self.calls)}])
        return RolloutBatch([group], {"rollout/x": float(self.calls)}, exhausted=False)


class NoGeneration:
    async def generate_batch(self):
        raise AssertionError("replay must not generate")


def _controller(overrides, generator):
    from types import SimpleNamespace

    from _config_helpers import compose_config
    from molt_hydra.cli import to_run_config
    from molt_hydra.runtime.validate import validate
    from molt_hydra.runtime.controller import RLController

    async def engines_busy(busy, wait):  # no trainer ranks to tell
        pass

    roles = SimpleNamespace(generator=generator, calls=SimpleNamespace(engines_busy=engines_busy))
    return RLController(validate(to_run_config(compose_config(overrides))), roles, log=None)


def _drain(ctl) -> list:
    """Take every batch the producer makes, marking each as trained (what the loop does between them)."""
    async def run():
        producer = asyncio.create_task(ctl.produce())
        batches = []
        while True:
            get = asyncio.ensure_future(ctl.queue.get())
            done, _ = await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
            if producer in done and producer.exception() is not None:  # as RLController.run: its failure ends it
                raise producer.exception()
            batch, _ = await get  # a producer that ended put the end of the data (None) last
            if batch is None:
                return batches
            batches.append(batch)
            async with ctl.step_done:
                ctl.step += 1
                ctl.step_done.notify_all()
    return asyncio.run(run())


def test_rollout_dump_then_replay(tmp_path):
    import torch

    dump = tmp_path / "dump"
    made = _drain(_controller([f"train.rollout_dump_dir={dump}"], ScriptedBatches(3)))
    assert sorted(p.name for p in dump.iterdir()) == [f"rollout_step{j}.pt" for j in range(3)]
    assert torch.load(dump / "rollout_step1.pt", weights_only=False).groups[0].trajectories == [{"reward": 2.0}]

    replayed = _drain(_controller([f"train.rollout_replay_dir={dump}"], NoGeneration()))
    assert [b.groups[0].prompt_index for b in replayed] == [b.groups[0].prompt_index for b in made] == [1, 2, 3]
    assert [b.metrics for b in replayed] == [b.metrics for b in made]


# ------------------------------------------------------------------ model.aux_loss_coef under job=sft
def test_sft_trains_with_the_moe_load_balancing_loss(tmp_path):
    """Before: `job=sft model=qwen3_moe_tiny model.aux_loss_coef=1` validated, but runtime/sft_job.py hands run_sft
    `trainer_options` only, which left the coefficient out (job=rl's trainer_spec added it itself): every SFT rank's
    TrainerSpec kept 0.0, the trainer added no load-balancing loss, and the run trained as with 0. Here run_sft, on one
    gloo rank, takes what sft_job hands it: the first step's loss (before any update) is the same, the next differ."""
    from _config_helpers import compose_config
    from molt_hydra.cli import checked
    from molt_hydra.parallel.sft import run_sft
    from molt_hydra.runtime.trainer_options import trainer_options

    import json

    rows = [{"input": [{"role": "user", "content": f"What is {i}+1?"}], "output": f"{i + 1}"} for i in range(8)]
    (data := tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 8))
    losses = []
    for coef in (0, 1):
        overrides = ["job=sft", "model=qwen3_moe_tiny", f"model.aux_loss_coef={coef}", f"data.train_path={data}",
                     "data.input_key=input", "data.output_key=output", "dry_run=true"]
        cfg, _ = checked(compose_config(overrides), overrides)
        history = run_sft(cfg.model.path, rows, str(tmp_path / str(coef)), input_key="input", output_key="output",
                          batch_size=4, max_len=64, max_epochs=2, export_hf=False,
                          **{**trainer_options(cfg, cfg.train.optimizer), "lr": 3e-3, "timeout_s": 120})
        losses.append([r["sft_loss"] for r in history])
    assert len(losses[0]) == 4 and losses[0][0] == losses[1][0], losses
    assert all(a != b for a, b in zip(losses[0][1:], losses[1][1:])), losses
