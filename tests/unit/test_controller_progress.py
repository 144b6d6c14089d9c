"""A run that trains nothing fails: train.max_untrainable_steps steps in a row with every sample dropped end it with
the drop reasons summed over those steps; one trainable step starts the count again."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402
from molt_hydra.runtime.watchdog import RunFailed  # noqa: E402


def controller(limit: int) -> RLController:
    cfg = to_run_config(compose_config([f"train.max_untrainable_steps={limit}"]))
    return RLController(cfg, SimpleNamespace(calls=None), log=None)


def dropped(**counts) -> dict[str, float]:
    return {**{f"rollout/dropped/{k}": float(v) for k, v in counts.items()},
            "rollout/dropped/total": float(sum(counts.values()))}


def test_consecutive_untrainable_steps_fail_with_their_drops():
    ctl = controller(3)
    ctl._check_progress(False, dropped(stale=5, no_action_tokens=0))
    ctl._check_progress(False, dropped(stale=2, logprob_misalign=1))
    with pytest.raises(RunFailed) as err:
        ctl._check_progress(False, dropped(stale=4))
    assert err.value.role == "trainer" and "3 steps in a row" in err.value.cause
    assert err.value.drops == {"stale": 5 + 2 + 4, "logprob_misalign": 1}


def test_a_trainable_step_resets_the_count():
    ctl = controller(2)
    ctl._check_progress(False, dropped(stale=1))
    ctl._check_progress(True, dropped())
    ctl._check_progress(False, dropped(stale=1))  # one in a row again: still below the limit
    with pytest.raises(RunFailed) as err:
        ctl._check_progress(False, dropped(stale=1))
    assert err.value.drops == {"stale": 2}


def test_the_count_of_untrainable_steps_survives_a_resume():
    """A run stopped after 2 of 3 allowed untrainable steps and resumed fails at the same step as the uninterrupted
    run. Before: the count was not in the checkpoint, so the resumed run allowed 3 more (5 in a row)."""
    from molt_hydra.rollout.generation import Sampling
    from molt_hydra.rollout.generator import SamplesGenerator

    def with_generator(ctl):
        gen = SamplesGenerator([{"prompt": "p"}], runner=None, batch_size=1, n_samples_per_prompt=1,
                               sampling=Sampling(max_tokens=1))
        ctl.roles.generator, ctl.log = gen, SimpleNamespace(sinks=SimpleNamespace(wandb_id=None))
        return ctl

    ctl = with_generator(controller(3))
    ctl._check_progress(False, dropped(stale=5))
    ctl._check_progress(False, dropped(stale=2))
    resumed = with_generator(controller(3))
    resumed.restore(ctl.client_state())
    with pytest.raises(RunFailed) as err:
        resumed._check_progress(False, dropped(stale=4))
    assert "3 steps in a row" in err.value.cause and err.value.drops == {"stale": 5 + 2 + 4}


def test_a_run_that_ends_before_the_limit_having_trained_nothing_fails_with_its_drops():
    """train.max_steps (or the data) below train.max_untrainable_steps, every sample of every step dropped. Before: the
    run 'finished', exit 0, 'steps: 2   policy version: 0', its checkpoint the untrained model."""
    ctl = controller(3)
    for n in (16, 16):
        ctl._check_progress(False, dropped(logprob_misalign=n))
        ctl.step += 1
    with pytest.raises(RunFailed) as err:
        ctl._check_trained()
    assert err.value.role == "trainer" and err.value.drops == {"logprob_misalign": 32}
    assert err.value.cause == ("no step of the run had a trainable sample (it ended after 2, before "
                               "train.max_untrainable_steps=3 steps in a row could tell it)")


def test_a_run_whose_last_steps_alone_were_untrainable_ends_as_it_is():
    ctl = controller(3)
    ctl._check_progress(True, dropped())
    for _ in range(2):
        ctl._check_progress(False, dropped(stale=1))
    ctl.step = 3
    ctl._check_trained()  # (steps 2 and 3 dropped everything: below the limit, the run trained at step 1)
