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
