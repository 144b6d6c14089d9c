"""The closing summary of an RL run (runtime/entrypoint.py `_summary`): a run whose data ended before train.max_steps
says so, and what gives it more. Stand-ins: the controller's and roles' few attributes the summary reads (the loop
they come from is the real runs' in tests/integration)."""

import json
from types import SimpleNamespace

import pytest

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.entrypoint import _summary


def _ended_at(tmp_path, steps: int, *, max_steps, replay=None) -> list[str]:
    cfg = RunConfig()
    cfg.output_dir, cfg.train.max_steps, cfg.train.num_episodes = str(tmp_path), max_steps, 2
    cfg.train.rollout_replay_dir = replay
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "train/reward": 0.5})
                                                    + "\n" for s in range(1, steps + 1)))
    ctl = SimpleNamespace(step=steps, version=steps, log=SimpleNamespace(sinks=SimpleNamespace(wandb_run=None)))
    return _summary(cfg, SimpleNamespace(last_checkpoint=str(tmp_path / "ckpt")), ctl, None)


def test_a_run_whose_prompts_ran_out_before_max_steps_says_so_and_the_fix(tmp_path):
    """Before: 'steps: 2   policy version: 2', exit 0, the 8 steps asked for not trained without a word."""
    assert _ended_at(tmp_path, 2, max_steps=10)[0] == (
        "steps: 2 of train.max_steps=10   policy version: 2   (the prompts ran out: train.num_episodes=2 passes "
        "over them; raise it to train longer)")


def test_a_replay_whose_dump_ran_out_before_max_steps_names_the_dump(tmp_path):
    assert _ended_at(tmp_path, 3, max_steps=5, replay="/dump")[0] == (
        "steps: 3 of train.max_steps=5   policy version: 3   (the batches of train.rollout_replay_dir=/dump ran "
        "out)")


@pytest.mark.parametrize("max_steps", [None, 4])
def test_a_run_that_trained_every_step_asked_for_says_only_its_steps(tmp_path, max_steps):
    assert _ended_at(tmp_path, 4, max_steps=max_steps)[0] == "steps: 4   policy version: 4"
