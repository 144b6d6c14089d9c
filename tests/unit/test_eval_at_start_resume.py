"""eval.at_start on a resume (runtime/controller.py `run`): a resumed run starts past step 0, where the at-start eval
belongs, so none runs. Before, that was silent: `checkpoint.resume=must eval.at_start=true` printed nothing, and the
user waited for an eval that never came. Now one line says so and why; a fresh run (or a load_model_only warm start,
whose step is 0) still evaluates. The roles stand in: the eval's generation is the real engines' (tests/integration)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as value

import pytest

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.controller import RLController
from molt_hydra.rollout.generation import Sampling

TRAINING = Sampling(max_tokens=8)  # the generator's training sampling: an eval without its own cap takes it


def _run(monkeypatch, step: int, every_steps: int) -> list[int]:
    """RLController.run from `step` with eval.at_start=true; returns the steps evaluated (the loop itself: none)."""
    evaluated = []

    async def evaluate(rows, n, sampling, max_inflight):
        return {"eval/x_pass1": 0.5}

    async def watched(self, work, *more):  # no watchers, no loop: the start's eval alone
        for other in more:
            other.close()
        return await work

    monkeypatch.setattr(RLController, "watched", watched)
    monkeypatch.setattr(RLController, "_steps", lambda self: asyncio.sleep(0, {}))
    monkeypatch.setattr(RLController, "produce", lambda self: asyncio.sleep(0))
    cfg = RunConfig()
    cfg.eval.data_path, cfg.eval.at_start, cfg.eval.every_steps = "builtin://arithmetic_eval", True, every_steps
    calls = value(freeze_heaps=lambda: asyncio.sleep(0))
    roles = value(calls=calls, eval_rows=[{"prompt": "p"}], actor=None,
                  generator=value(evaluate=evaluate, sampling=TRAINING))
    ctl = RLController(cfg, roles, value(eval=lambda s, m: evaluated.append(s)))
    ctl.step, ctl.next_eval = step, (step // every_steps + 1) * every_steps if every_steps > 0 else None
    asyncio.run(ctl.run())
    return evaluated


@pytest.mark.parametrize("every_steps, schedule", [
    (-1, "no other eval is scheduled (eval.every_steps=-1)."), (4, "the eval schedule goes on (every 4 steps).")])
def test_a_resume_says_it_skips_the_at_start_eval(monkeypatch, capsys, every_steps, schedule):
    assert _run(monkeypatch, 0, every_steps) == [0]  # a fresh run: evaluated at its start, nothing said
    assert capsys.readouterr().out == ""
    assert _run(monkeypatch, 6, every_steps) == []
    assert capsys.readouterr().out == (
        "eval.at_start: skipped, the run resumes at step 6: the at-start eval is a fresh run's (of the weights before "
        f"step 1); {schedule}\n")
