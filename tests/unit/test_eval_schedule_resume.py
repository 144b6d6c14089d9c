"""The eval schedule of a resumed run (runtime/controller.py `restore`) is this run's `eval.every_steps`, which may
change on a resume (it changes no training, and the resume goes on naming it). Before, the saved run's next eval step
came back: `eval.every_steps` 2 -> 3 resumed at step 2 evaluated at step 4, off the new schedule (3, 6), and an eval
turned on at a resume (-1 -> 2, resumed at step 5) ran at step 5, then 6. Due at once on a resume: an eval the save
skipped (Slurm's notice saves before that step's eval), and the resumed step's own where the saved run had run none.
The roles stand in: the eval's generation is the real engines' (tests/integration/test_rl_loop.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as value

import pytest

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.controller import RLController
from molt_hydra.rollout.generation import Sampling

TRAINING = Sampling(max_tokens=8)  # the generator's training sampling: an eval without its own cap takes it


def evaluated_steps(every_steps: int, step: int, saved_next_eval: int | None, until: int) -> list[int]:
    """The steps a run resumed at `step` evaluates at, up to `until` (the loop's `maybe_eval` after each step; the
    first call: the one `run` makes before the first step, for an eval the save skipped)."""
    evaluated = []

    async def evaluate(rows, n, sampling, max_inflight):
        return {"eval/x_pass1": 0.5}

    cfg = RunConfig()
    cfg.eval.data_path, cfg.eval.every_steps = "builtin://arithmetic_eval", every_steps
    generator = value(evaluate=evaluate, load_state_dict=lambda state: None, sampling=TRAINING)
    roles = value(calls=None, eval_rows=[{"prompt": "p"}], actor=None, generator=generator)
    ctl = RLController(cfg, roles, value(eval=lambda s, m: evaluated.append(s)))
    ctl.restore({"step": step, "version": step, "batches_made": step, "best": None, "next_eval": saved_next_eval,
                 "generator": {"pending": []}, "queued": [], "kl_coef": 0.0})
    for ctl.step in range(step, until + 1):
        asyncio.run(ctl.maybe_eval())
    return evaluated


@pytest.mark.parametrize("every_steps, step, saved_next_eval, expected", [
    (3, 2, 4, [3, 6, 9]),  # saved every 2 steps after step 2's eval: the next was step 4
    (2, 5, None, [6, 8]),  # saved with no interval
    (2, 4, None, [4, 6, 8]),  # (this step's: the saved run had not evaluated it)
    (2, 2, None, [2, 4]),  # the first eval, skipped by the notice's save
    (5, 4, 6, [5, 10]),
    (2, 2, 4, [4, 6, 8]),  # unchanged: as the saved run would have
    (2, 2, 2, [2, 4, 6, 8]),  # step 2's eval skipped by the notice's save: run first thing
])
def test_a_resumed_run_evaluates_on_its_own_schedule(every_steps, step, saved_next_eval, expected):
    assert evaluated_steps(every_steps, step, saved_next_eval, until=max(expected)) == expected
