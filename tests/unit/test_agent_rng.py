"""Agent code drawing from Python's `random` or numpy's global RNG draws as a function of the rollout's seed (the one
the runner process derives from train.seed, the epoch, the prompt and the sample: runtime/agent_runner.py), whatever
the runner process drew before and whatever rollouts run beside it. Before: those RNGs were the runner process's
own, seeded from os.urandom when it started, so the same train.seed gave other draws (other observations, other
rewards) and a resumed run drew unlike the uninterrupted one.

The engine is a stand-in (what it samples does not matter here): the runners and the Env / ChatAgent are real.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from molt_hydra.agents import ChatAgent, ChatAgentRunner, Env, Episode, Result, StepEnvRunner
from molt_hydra.rollout.generation import Generation, Sampling


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


class Finishes:
    """Stand-in engine: every turn is two tokens ending on the end-of-text token."""

    def __init__(self, tok):
        self.ids = [7, tok.eos_token_id]

    async def generate(self, request):
        return [Generation(list(self.ids), [-0.5, -0.5], [0, 0], "stop")]


class Dice(Env):
    """Draws at construction, in reset and in each of two turns, from both global RNGs; the reward is the last draw."""

    def __init__(self):
        self.drawn = [random.random()]

    def reset(self, state):
        self.drawn.append(float(np.random.rand()))
        return state

    async def step(self, state):
        self.drawn += [random.random(), float(np.random.rand())]
        done = state["turn"] == 1
        return Result(reward=self.drawn[-1], observation="" if done else " again", terminated=done,
                      info={"drawn": list(self.drawn)})


def group(seeds: list[int]) -> list[Episode]:
    return [Episode(prompt="roll", sampling=Sampling(max_tokens=4, seed=s), max_length=64, rollout_id=f"r{s}")
            for s in seeds]


def draws(outcome) -> dict[str, list[float]]:
    return {t.rollout_id: t.info["drawn"] for t in outcome.trajectories}


def test_an_envs_random_draws_are_a_function_of_its_rollouts_seed_also_after_a_resume(tok):
    runner, engine = StepEnvRunner(Dice), Finishes(tok)

    async def uninterrupted():  # two groups, their rollouts concurrent, the second after the first
        first = await runner.run_group(group([11, 12]), engine, tok)
        return draws(first), draws(await runner.run_group(group([21, 22]), engine, tok))

    random.seed(1), np.random.seed(1)  # the runner process's state as it started: another in every process
    first, second = asyncio.run(uninterrupted())
    random.seed(2), np.random.seed(2)  # a resumed run: a fresh runner process, its first group the second one
    resumed = draws(asyncio.run(runner.run_group(group([21, 22]), engine, tok)))
    assert resumed == second
    alone = draws(asyncio.run(runner.run_group(group([22]), engine, tok)))  # no other rollout beside it
    assert alone == {"r22": second["r22"]}
    # each rollout, and each turn of one, draws its own numbers (no two draws alike)
    every = [x for d in (first, second) for drawn in d.values() for x in drawn]
    assert len(every) == 4 * 6 and len(set(every)) == len(every)


def test_a_chat_agents_random_draws_are_a_function_of_its_rollouts_seed(tok):
    drawn: dict[int, tuple[float, float]] = {}

    class Picks(ChatAgent):
        async def run(self, ctx):  # e.g. picks a persona or a tool order at random, before its first request
            drawn[ctx.sampling_params.seed] = (random.random(), float(np.random.rand()))
            return Result(reward=1.0)  # (no request: the rollout is dropped as empty_session, beside the point here)

    async def run(seeds):
        runner = ChatAgentRunner(Picks)
        try:
            await runner.run_group(group(seeds), Finishes(tok), tok)
        finally:
            await runner.close()
        return dict(drawn)

    random.seed(1), np.random.seed(1)
    before = asyncio.run(run([11, 12]))
    drawn.clear()
    random.seed(2), np.random.seed(2)
    assert asyncio.run(run([12])) == {12: before[12]}
    assert before[11] != before[12]
