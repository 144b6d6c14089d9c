"""An evaluation samples each turn under the training's cap where neither eval.max_new_tokens nor
rollout.max_new_tokens is set (eval.max_new_tokens: "None = rollout.max_new_tokens"). Before, both unset meant
data.max_len // 2 tokens a turn in training (runtime/roles.py) but 256 in every evaluation (runtime/controller.py): a
CPU run with data.max_len=1024 trained on responses up to 512 tokens long and scored the same policy cut at 256."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace as value

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.cli import validated  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402
from molt_hydra.runtime.roles import _generator  # noqa: E402


class SamplingRecorder:
    """The agent runners' stand-in (no engine here): records each group's sampling, returns one scored rollout."""

    def __init__(self):
        self.samplings = []

    async def run_group(self, row, n, sampling):
        self.samplings.append(sampling)
        return [(value(reward=1.0, score=None, rollout_id=f"r{i}", action_ranges=[(0, 1)], truncated=False), None)
                for i in range(n)]


def _training_and_eval_sampling(overrides: list[str]):
    """(the config, a training group's sampling, an evaluation's) of a run with `overrides`."""
    cfg = validated(compose_config(overrides), overrides)
    generator = _generator(cfg, [{"prompt": "p"}], [])
    generator.runner = recorder = SamplingRecorder()
    ctl = RLController(cfg, value(calls=None, eval_rows=[{"prompt": "q"}], actor=None, generator=generator),
                       value(eval=lambda step, metrics: None))
    asyncio.run(generator.generate_batch())  # a training group: the one prompt
    asyncio.run(ctl.maybe_eval(force=True))
    return (cfg, *recorder.samplings)


def test_eval_without_a_cap_samples_under_the_trainings():
    _, training, evaluation = _training_and_eval_sampling([
        "rollout.max_new_tokens=null", "data.max_len=1024", "eval.data_path=builtin://toy_eval", "eval.at_start=true"])
    assert training.max_tokens == 1024 // 2  # rollout.max_new_tokens=null: half of data.max_len a turn (its schema doc)
    assert evaluation.max_tokens == training.max_tokens


def test_eval_samples_with_the_trainings_top_k_and_min_tokens():
    """eval.* sets the cap, temperature and top_p (each None = the rollout's); everything else is the training's
    sampling. Before: top_k -1 (every token) and min_tokens 1 (EOS masked on the first token) in every evaluation,
    whatever rollout.top_k=20 and the training's min_tokens 0: the policy scored was not the one sampled in training."""
    cfg, training, evaluation = _training_and_eval_sampling([
        "rollout.top_k=20", "eval.data_path=builtin://toy_eval", "eval.at_start=true", "eval.temperature=0.5"])
    assert (training.top_k, training.min_tokens, training.temperature) == (20, 0, cfg.rollout.temperature)
    assert (evaluation.top_k, evaluation.min_tokens, evaluation.temperature) == (20, 0, 0.5)
