"""The best checkpoint of a resumed run whose `checkpoint.best_metric_key` changed since the save (allowed: it changes
no training, and the resume goes on naming it) is judged by the new key alone (runtime/controller.py `maybe_eval`).
Before, the new key's value was compared with the saved best of the old key: with the saved best pass@4 0.9 and the
new key pass@1, no pass@1 under 0.9 was ever exported as the best, and `best.json` went on naming pass@4."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as value

from molt_hydra.config.schema import RunConfig
from molt_hydra.rollout.generation import Sampling
from molt_hydra.runtime.controller import RLController

TRAINING = Sampling(max_tokens=8)  # the generator's training sampling: an eval without its own cap takes it


def bests(key: str, saved: tuple[str, float], evals: list[dict]) -> list:
    """`ctl.best` after each eval of a run resumed at step 2 with the saved `best` (an actorless stand-in: job=eval
    has no actor, so nothing is exported; the export follows `best` as it changes)."""

    async def evaluate(rows, n, sampling, max_inflight):
        return evals.pop(0)

    cfg = RunConfig()
    cfg.eval.data_path, cfg.eval.every_steps, cfg.checkpoint.best_metric_key = "builtin://arithmetic_eval", 1, key
    generator = value(evaluate=evaluate, load_state_dict=lambda state: None, sampling=TRAINING)
    ctl = RLController(cfg, value(calls=None, eval_rows=[{"prompt": "p"}], actor=None, generator=generator),
                       value(eval=lambda s, m: None))
    ctl.restore({"step": 2, "version": 2, "batches_made": 2, "best": saved, "next_eval": 3,
                 "generator": {"pending": []}, "queued": [], "kl_coef": 0.0})
    seen = []
    for ctl.step in (3, 4, 5):
        asyncio.run(ctl.maybe_eval())
        seen.append(ctl.best)
    return seen


def test_a_changed_best_metric_key_is_judged_by_its_own_values():
    evals = [{"eval/x_pass1": v, "eval/x_pass4": 0.95} for v in (0.4, 0.3, 0.5)]
    assert bests("eval/x_pass1", ("eval/x_pass4", 0.9), evals) == [
        ("eval/x_pass1", 0.4), ("eval/x_pass1", 0.4), ("eval/x_pass1", 0.5)]


def test_an_unchanged_key_goes_on_from_the_saved_best():
    evals = [{"eval/x_pass1": v} for v in (0.4, 0.7, 0.5)]
    assert bests("eval/x_pass1", ("eval/x_pass1", 0.6), evals) == [
        ("eval/x_pass1", 0.6), ("eval/x_pass1", 0.7), ("eval/x_pass1", 0.7)]


def test_a_best_metric_key_the_evaluation_did_not_return_is_told_naming_what_it_returned(capsys):
    """A data source named unlike the data's (eval_gsm8K_pass1 for gsm8k), which validation cannot see (the eval data
    is read at the run's start): each eval says no best was kept and what it returned. Before: not a word, and no
    checkpoint was ever kept as the best."""
    evals = [{"eval_gsm8k_pass1": v, "eval_num_samples": 4.0} for v in (0.5, 0.7, 0.6)]
    assert bests("eval_gsm8K_pass1", None, evals) == [None, None, None]
    out = capsys.readouterr().out
    told = ("eval at step {}: checkpoint.best_metric_key=eval_gsm8K_pass1 is no metric this evaluation returned "
            "(eval_gsm8k_pass1, eval_num_samples): no checkpoint is kept as the best. Fix: name one of them (a data "
            "source whose every rollout failed returns none: eval_dropped_*)")
    assert [out.count(told.format(step)) for step in (3, 4, 5)] == [1, 1, 1]
