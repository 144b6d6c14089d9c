"""The LR schedule spans the optimizer steps the RL loop takes (runtime/roles.py scheduler_steps): as many batches as
the samples generator returns for the data (rollout/generator.py streams across episodes: full batches, then one
partial one), one optimizer step per train.batch_size samples of each (at least one). Before: num_prompts //
batch_size * num_episodes batches: 12 prompts in batches of 8 over 2 episodes trained 3 steps on a 2-step schedule
(a linear schedule's third step at LR 0; a cosine one's LR rising again)."""

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_rollout_generator import SAMPLING, ScriptedRunner, rows  # noqa: E402

from molt_hydra.config.schema import RunConfig  # noqa: E402
from molt_hydra.rollout.generator import SamplesGenerator  # noqa: E402
from molt_hydra.runtime.roles import scheduler_steps  # noqa: E402


async def _loop_steps(prompts: int, batch: int, episodes: int, n: int, train_batch: int) -> int:
    """Optimizer steps the loop takes: per generated batch, max(samples // train.batch_size, 1) (controller.py)."""
    gen = SamplesGenerator(rows(prompts), ScriptedRunner(), batch_size=batch, n_samples_per_prompt=n,
                           sampling=SAMPLING, num_epochs=episodes)
    steps = 0
    while True:
        b = await gen.generate_batch()
        steps += max(sum(len(g.trajectories) for g in b.groups) // train_batch, 1) if b.groups else 0
        if b.exhausted:
            await gen.close()
            return steps


@pytest.mark.parametrize("prompts,batch,episodes,n,train_batch", [
    (12, 8, 1, 1, 8), (12, 8, 2, 1, 8), (20, 8, 3, 2, 8), (16, 8, 2, 4, 16), (9, 8, 1, 4, 8), (100, 64, 10, 1, 64)])
def test_the_schedule_spans_the_steps_the_loop_takes(prompts, batch, episodes, n, train_batch):
    cfg = RunConfig()
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = batch, n
    cfg.train.num_episodes, cfg.train.batch_size, cfg.train.epochs = episodes, train_batch, 1
    assert scheduler_steps(cfg, prompts) == asyncio.run(_loop_steps(prompts, batch, episodes, n, train_batch))


def test_max_steps_cuts_the_schedule_where_it_cuts_the_loop():
    cfg = RunConfig()
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.batch_size, cfg.train.epochs = 8, 1, 8, 1
    cfg.train.max_steps = 2
    assert scheduler_steps(cfg, 100) == 2  # 12 full batches available, 2 trained
    cfg.train.max_steps = 50
    assert scheduler_steps(cfg, 100) == 13  # 100 prompts: 12 full batches and one of 4, then the data ends


@pytest.mark.parametrize("epochs, critic_epochs", [(1, 3), (2, None), (3, 1)])
def test_each_role_schedule_spans_its_own_epochs(epochs, critic_epochs):
    """The critic steps train.critic.epochs times over each batch (None: train.epochs), the actor train.epochs times:
    each one's schedule spans its own optimizer steps. Before, both spanned train.epochs x the loop's steps, so with
    train.critic.epochs=3 over train.epochs=1 a linear critic schedule reached LR 0 a third of the way in."""
    from molt_hydra.runtime.trainer_options import trainer_spec
    cfg = RunConfig()
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.batch_size = 8, 2, 8
    cfg.train.epochs, cfg.train.critic.epochs = epochs, critic_epochs
    loop = asyncio.run(_loop_steps(20, 8, 1, 2, 8))  # optimizer steps per pass over each batch
    for role, optimizer, passes in (("actor", cfg.train.optimizer, epochs),
                                    ("critic", cfg.train.critic.optimizer, critic_epochs or epochs)):
        spec = trainer_spec(cfg, role, optimizer, "tiny", scheduler_steps(cfg, 20))
        assert spec.total_steps == loop * passes, role


def test_the_actors_schedule_leaves_out_the_critics_warm_up():
    """train.critic.actor_freezing_steps: the actor takes no optimizer step in the loop's first steps, so its schedule
    spans the steps after them (was: them too, so a linear schedule ended above 0: at LR x frozen / all)."""
    from molt_hydra.runtime.trainer_options import trainer_spec
    cfg = RunConfig()
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.batch_size, cfg.train.epochs = 8, 2, 8, 2
    cfg.train.max_steps, cfg.train.critic.actor_freezing_steps = 5, 3
    per_batch = 8 * 2 // 8  # optimizer steps per pass over one batch
    spec = {role: trainer_spec(cfg, role, cfg.train.optimizer, "tiny", scheduler_steps(cfg, 100))
            for role in ("actor", "critic")}
    assert spec["critic"].total_steps == 5 * per_batch * 2  # every loop step, both epochs
    assert spec["actor"].total_steps == (5 - 3) * per_batch * 2  # the steps after the warm-up
