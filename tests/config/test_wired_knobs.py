"""Knobs wired by issue 17 reach their mechanism: `eval.batch_size` bounds the eval groups in flight;
`train.rollout_dump_dir` saves every rollout batch and `train.rollout_replay_dir` trains on them instead of
generating."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from molt_hydra.rollout.generation import Sampling
from molt_hydra.rollout.generator import SamplesGenerator

SAMPLING = Sampling(max_tokens=4)


def config_errors(overrides):
    from test_validation import config_errors

    return config_errors(overrides)


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


def _drain(ctl, timings: list | None = None) -> list:
    """Take every batch the producer makes, marking each as trained (what the loop does between them); each batch's
    timing goes to `timings`, if given."""
    async def run():
        producer = asyncio.create_task(ctl.produce())
        batches = []
        while True:
            get = asyncio.ensure_future(ctl.queue.get())
            done, _ = await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
            if producer in done and producer.exception() is not None:  # as RLController.run: its failure ends it
                raise producer.exception()
            batch, timing = await get  # a producer that ended put the end of the data (None) last
            if batch is None:
                return batches
            if timings is not None:
                timings.append(timing)
            batches.append(batch)
            async with ctl.step_done:
                ctl.step += 1
                ctl.step_done.notify_all()
    return asyncio.run(run())


def test_rollout_dump_then_replay(tmp_path):
    import torch

    dump = tmp_path / "dump"
    made = _drain(_controller([f"train.rollout_dump_dir={dump}"], ScriptedBatches(3)))
    assert sorted(p.name for p in dump.iterdir()) == ["rollout_settings.json",
                                                      *(f"rollout_step{j}.pt" for j in range(3))]
    assert torch.load(dump / "rollout_step1.pt", weights_only=False).groups[0].trajectories == [{"reward": 2.0}]

    replayed = _drain(_controller([f"train.rollout_replay_dir={dump}"], NoGeneration()))
    assert [b.groups[0].prompt_index for b in replayed] == [b.groups[0].prompt_index for b in made] == [1, 2, 3]
    assert [b.metrics for b in replayed] == [b.metrics for b in made]


def test_a_replay_times_its_reads_not_a_generation(tmp_path):
    """A replay's batch read was timed as `timing/generation`, so perf/rollout_tokens_per_sec was tokens per second of
    reading a file and the rollout-busy share a disk's: a replay now times `timing/rollout_read` alone."""
    dump, made, replayed = tmp_path / "dump", [], []
    _drain(_controller([f"train.rollout_dump_dir={dump}"], ScriptedBatches(2)), made)
    _drain(_controller([f"train.rollout_replay_dir={dump}"], NoGeneration()), replayed)
    assert [sorted(t) for t in made] == [["timing/generation", "timing/vllm_idle_wait"]] * 2
    assert [sorted(t) for t in replayed] == [["timing/rollout_read"]] * 2


def test_a_fresh_run_over_an_earlier_dump_stops_before_anything_starts(tmp_path):
    """Before: the run overwrote the earlier dump's batches one by one and left its later ones, so a replay of the
    directory trained on both runs' batches under the last run's settings record."""
    from _config_helpers import run_cli
    from molt_hydra.config.schema import EXIT_FAILED

    dump = tmp_path / "dump"
    dump.mkdir()
    for j in range(3):
        (dump / f"rollout_step{j}.pt").write_bytes(b"an earlier run's batch")
    r = run_cli([f"output_dir={tmp_path / 'out'}", f"train.rollout_dump_dir={dump}", "train.max_steps=1"])
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == EXIT_FAILED, r.describe()
    assert last.startswith(f"Run failed: train.rollout_dump_dir={dump} holds an earlier run's dump "
                           "(3 batch files"), last
    assert "Fix: point train.rollout_dump_dir at an empty directory" in last
    assert not (tmp_path / "out" / "ray").exists()  # nothing started
    assert [p.read_bytes() for p in dump.glob("rollout_step*")] == [b"an earlier run's batch"] * 3  # nor touched


def test_a_run_restarted_before_its_first_checkpoint_dumps_again_from_batch_0(tmp_path):
    """Its own dump (the record names its output_dir): a Slurm requeue before the first save is not refused."""
    import json

    from molt_hydra.config.validate import REPLAY_RECORD
    from molt_hydra.runtime.entrypoint import _refuse_an_earlier_dump

    dump = _dump(tmp_path)  # (the scripted run's output_dir)
    ctl = _controller([f"train.rollout_dump_dir={dump}"], ScriptedBatches(1))
    assert json.loads((Path(dump) / REPLAY_RECORD).read_text())["output_dir"] == str(Path(ctl.cfg.output_dir).resolve())
    _refuse_an_earlier_dump(ctl.cfg)  # no exit: this run's own
    ctl.cfg.output_dir = str(tmp_path / "another_run")
    with pytest.raises(SystemExit):
        _refuse_an_earlier_dump(ctl.cfg)


def _dump(tmp_path, overrides=()) -> str:
    dump = tmp_path / "dump"
    _drain(_controller([f"train.rollout_dump_dir={dump}", *overrides], ScriptedBatches(2)))
    return str(dump)


def test_a_dump_records_what_generated_it(tmp_path):
    """The dump's rollout_settings.json holds this run's sampling, as configured (was: nothing but the batches)."""
    import json

    dump = _dump(tmp_path, ["rollout.temperature=0.7", "rollout.top_k=5"])
    record = json.loads((tmp_path / "dump" / "rollout_settings.json").read_text())
    assert (record["rollout.temperature"], record["rollout.top_k"]) == (0.7, 5)
    assert record["model.tokenizer_path"] == "tiny://qwen3_tiny"  # (conf/model/qwen3_tiny.yaml's path)
    assert config_errors([f"train.rollout_replay_dir={dump}", "rollout.temperature=0.7", "rollout.top_k=5"]) == []


@pytest.mark.parametrize("key,now", [
    ("rollout.temperature", 0.7), ("rollout.top_p", 0.9), ("model.tokenizer_path", "tiny://qwen3_moe_tiny"),
    ("algorithm.dynamic_filtering.enable", True), ("rollout.n_samples_per_prompt", 16), ("agent.max_turns", 2),
    ("rollout.num_runners", 2)])
def test_a_replay_sampled_otherwise_than_its_dump_is_refused(tmp_path, key, now):
    """Before: validated; the replay recomputed log-probs at the new temperature (or against another tokenizer's ids)
    with tokens sampled at the dump's, and took generation knobs that changed nothing."""
    from _config_helpers import compose_config
    from molt_hydra.cli import to_run_config
    from molt_hydra.config.bounds import get
    from molt_hydra.runtime.validate import validate

    import json

    dump = _dump(tmp_path)  # with the default config's value of `key`
    was = get(validate(to_run_config(compose_config([]))), key if key != "model.tokenizer_path" else "model.path")
    assert was != now  # the premise
    lines = [line for line in config_errors([f"train.rollout_replay_dir={dump}", f"{key}={now}"])
             if line.startswith(f"{key}: ")]
    assert len(lines) == 1, lines
    assert (f"{now!r}, but train.rollout_replay_dir={dump} was generated with {was!r} (rollout_settings.json)"
            in lines[0])
    assert f"Fix: set {key}={was if isinstance(was, str) else json.dumps(was)} " in lines[0]  # (Hydra's true, 1.0)


def test_a_replay_that_evaluates_may_run_another_agent(tmp_path):
    """The agent scores the evaluation, so it is compared with the dump's only where the run evaluates nothing."""
    dump = _dump(tmp_path)
    evaluating = ["eval.data_path=builtin://toy_eval", "eval.every_steps=1"]
    assert config_errors([f"train.rollout_replay_dir={dump}", "agent.max_turns=2", *evaluating]) == []


def test_a_sync_replay_of_an_async_dump_is_refused_for_its_stale_tokens(tmp_path):
    """An async dump (queue_depth D=1) sampled batch j at version j - 1; a replay trains it at version j (a sync after
    every step). Before: a sync replay (train.max_staleness=0) validated, trained batch 0, then dropped every sample of
    each later batch as stale (below, the trainer's own selection) until the run failed for nothing trainable."""
    from molt_hydra.agents.base import Trajectory
    from molt_hydra.algorithm.experience import select_trainable
    from molt_hydra.rollout.generator import FinishedGroup

    traj = Trajectory(token_ids=[1, 2, 3, 4], logprobs=[0.0, 0.0, -0.5, -0.5], versions=[-1, -1, 4, 4],
                      action_ranges=[(2, 4)], rollout_id="g-0")  # batch 5 of the dump: sampled at version 5 - 1
    kept, drops = select_trainable([FinishedGroup(5, 0, [traj])], 64, None, version=5, max_staleness=0,
                                   drop_stale=True, dp_size=1)
    assert (kept, dict(drops)) == ([], {"stale": 1})  # the premise: the sync replay's step 6 keeps nothing

    dump = _dump(tmp_path, ["train.mode=async", "train.queue_depth=1"])  # (the schema's default)
    assert config_errors([f"train.rollout_replay_dir={dump}", "train.mode=async", "train.queue_depth=1"]) == []
    lines = config_errors([f"train.rollout_replay_dir={dump}", "train.mode=sync"])
    assert lines == [f"train.mode: train.rollout_replay_dir={dump} was generated 1 version(s) ahead of training "
                     "(train.mode=async), so its tokens are up to 1 versions older than the replay step that trains "
                     "them, and train.max_staleness=0 would drop them as stale. Fix: set train.mode=async "
                     "train.queue_depth=1"]


@pytest.mark.parametrize("key, value", [("train.queue_depth", "1"), ("train.partial_rollout", "false"),
                                        ("train.mode", "asynch"), ("train.queue_depth", -1)])
def test_a_hand_written_schedule_of_the_wrong_type_is_refused_naming_it(tmp_path, key, value):
    """The refusal of a record-less dump asks for the file to be written by hand. Before: "1" for the queue depth (a
    string) was a TypeError traceback out of validation."""
    import json

    dump = _dump(tmp_path, ["train.mode=async", "train.queue_depth=1"])
    record = Path(dump) / "rollout_settings.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), key: value}))
    lines = config_errors([f"train.rollout_replay_dir={dump}", "train.mode=async", "train.queue_depth=1"])
    assert len(lines) == 1 and lines[0].startswith("train.rollout_replay_dir: rollout_settings.json records "), lines
    assert f"{key}={value!r}" in lines[0] and "Fix: " in lines[0]


def test_a_replay_of_a_dump_without_its_record_is_refused(tmp_path):
    (dump := tmp_path / "old").mkdir()
    (dump / "rollout_step0.pt").write_bytes(b"")  # (a dump made before dumps recorded their sampling)
    lines = config_errors([f"train.rollout_replay_dir={dump}"])
    assert len(lines) == 1 and lines[0].startswith(f"train.rollout_replay_dir: '{dump}/rollout_settings.json' cannot "
                                                   "be read (FileNotFoundError")
    assert "Fix: dump the batches again, or write that file" in lines[0]


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
