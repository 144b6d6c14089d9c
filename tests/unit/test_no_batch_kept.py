"""A run whose data runs out before its first step had a batch fails naming the drops (runtime/controller.py
`_steps`). Before: with every prompt group dropped by the dynamic filter (a CPU run of the toy task with
algorithm.dynamic_filtering.low=0.95, whose rewards are ~0.3), it printed "run finished, steps: 0", exported the
untrained model and exited 0; the drops, counted in the last (empty) batch, were never logged."""

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.rollout.generation import Sampling  # noqa: E402
from molt_hydra.rollout.generator import SamplesGenerator  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402
from molt_hydra.runtime.roles import _generator  # noqa: E402
from molt_hydra.runtime.watchdog import RunFailed  # noqa: E402

PROMPTS, SAMPLES, LOW = 6, 2, 0.95


class Runner:
    """Every rollout scores 0.3, below the filter's low bound: every group is filtered out."""

    async def run_group(self, row, n, sampling):
        return [(SimpleNamespace(reward=0.3, score=None, rollout_id=f"{row['prompt']}/{i}"), None) for i in range(n)]


class Calls:
    keeper = None  # (no engine is replaced here)

    async def engines_busy(self, busy: bool, wait: bool) -> None:
        pass


def test_data_that_ran_out_before_the_first_batch_fails_with_its_drops():
    cfg = to_run_config(compose_config(["rollout.batch_size=2", f"rollout.n_samples_per_prompt={SAMPLES}"]))
    generator = SamplesGenerator([{"prompt": f"p{i}"} for i in range(PROMPTS)], runner=Runner(), batch_size=2,
                                 n_samples_per_prompt=SAMPLES, sampling=Sampling(max_tokens=1),
                                 dynamic_filtering=(LOW, 1.0), carry_over=False)
    ctl = RLController(cfg, SimpleNamespace(calls=Calls(), generator=generator, eval_rows=None, role_pids={}),
                       log=SimpleNamespace(sinks=SimpleNamespace(wandb_id=None)))

    async def loop():
        return await asyncio.gather(ctl._steps(), ctl.produce())

    with pytest.raises(RunFailed, match="the data ran out before the first step had a batch") as failed:
        asyncio.run(loop())
    assert failed.value.role == "rollout"
    assert failed.value.drops == {"dynamic_filter": PROMPTS * SAMPLES}  # every rollout of every group


def test_a_replay_directory_without_the_first_batch_fails_naming_the_file(tmp_path):
    """Before: told as "no prompt group was kept", with no drops, for a directory that holds no rollout_step0.pt."""
    cfg = to_run_config(compose_config([f"train.rollout_replay_dir={tmp_path}"]))
    ctl = RLController(cfg, SimpleNamespace(calls=Calls(), generator=None, eval_rows=None, role_pids={}),
                       log=SimpleNamespace(sinks=SimpleNamespace(wandb_id=None)))

    async def loop():
        return await asyncio.gather(ctl._steps(), ctl.produce())

    with pytest.raises(RunFailed, match=f"train.rollout_replay_dir={tmp_path} holds no rollout_step0.pt"):
        asyncio.run(loop())


class Solved:
    """A task the policy always solves: every rollout scores 1.0, so every group's mean is the filter's high bound."""

    def __init__(self):
        self.groups = 0

    async def run_group(self, row, n, sampling):
        self.groups += 1
        return [(SimpleNamespace(reward=1.0, score=None, rollout_id=f"{row['prompt']}/{self.groups}/{i}"), None)
                for i in range(n)]


class OneTimesOut(Solved):
    """One rollout of each group times out, the others score 0.5, inside the filter's band: each group is incomplete,
    dropped whatever its scores."""

    async def run_group(self, row, n, sampling):
        self.groups += 1
        return [(None, "agent_timeout")] + [
            (SimpleNamespace(reward=0.5, score=None, rollout_id=f"{row['prompt']}/{self.groups}/{i}"), None)
            for i in range(1, n)]


@pytest.mark.parametrize("runner_cls", [Solved, OneTimesOut])
def test_a_batch_the_filter_never_fills_fails_after_max_gen_batches_naming_the_filter(runner_cls):
    """Before: the generator generated on without a step through every episode of the data (here 10**6 episodes,
    i.e. for ever), or until train.timeouts.step_s (an hour) told a stall naming neither the filter nor the scores.
    A group with a failed rollout is dropped whatever its scores: then the failures are named as the cause (was: the
    scores and the band, whose fixes change nothing)."""
    batch, cap = 2, 3
    cfg = to_run_config(compose_config([f"rollout.batch_size={batch}", f"rollout.n_samples_per_prompt={SAMPLES}",
                                        "algorithm.dynamic_filtering.enable=true", "train.num_episodes=1000000",
                                        f"algorithm.dynamic_filtering.max_gen_batches={cap}"]))
    generator = _generator(cfg, [{"prompt": f"p{i}"} for i in range(PROMPTS)], [])
    generator.runner = runner = runner_cls()
    ctl = RLController(cfg, SimpleNamespace(calls=Calls(), generator=generator, eval_rows=None, role_pids={}),
                       log=SimpleNamespace(sinks=SimpleNamespace(wandb_id=None)))

    async def loop():
        return await asyncio.wait_for(asyncio.gather(ctl._steps(), ctl.produce()), 30)

    with pytest.raises(RunFailed) as failed:
        asyncio.run(loop())
    seen = cap * batch  # max_gen_batches batches' worth, then no more
    cause = failed.value.cause
    assert failed.value.role == "rollout" and runner.groups == seen
    assert cause.startswith(f"dynamic filtering kept 0 of the {seen} prompt groups generated for a batch of {batch} "
                            f"(algorithm.dynamic_filtering.max_gen_batches={cap} batches' worth)")
    assert "raise algorithm.dynamic_filtering.max_gen_batches" in cause
    if runner_cls is Solved:
        assert (f"0 groups had a failed rollout, their mean score is 1, {seen} groups with every score >= high, 0 "
                "with every score <= low") in cause
        assert "make the rollouts complete" not in cause
        assert failed.value.drops == {"dynamic_filter": seen * SAMPLES}
    else:
        assert (f"{seen} groups had a failed rollout, their mean score is 0.5, 0 groups with every score >= high, 0 "
                "with every score <= low") in cause
        assert "Fix: make the rollouts complete (the failures below); " in cause
        assert failed.value.drops == {"agent_timeout": seen, "incomplete_group": seen * (SAMPLES - 1)}
