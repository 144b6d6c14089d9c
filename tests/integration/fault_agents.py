"""Agents that misbehave on purpose, for tests/integration/test_faults.py: the toy task of the default run with one
fault each (loaded by path: `agent.runner._target_=<this file>:Name`)."""

import asyncio
import functools
import itertools
import math
import os
import sys
import time

from molt_hydra.agents.base import Env, Result, Runner
from molt_hydra.agents.chat_agent import ChatAgent
from molt_hydra.agents.step_runner import StepEnvRunner
from molt_hydra.recipes.agents.toy import ToyEnv

_made = itertools.count()  # environments made in this runner process (one per rollout)


class BlockingEnv(ToyEnv):
    """The first rollout of the whole run (whichever runner process claims `marker` first) blocks its thread with a
    synchronous sleep, as agent code calling a blocking library would."""

    def __init__(self, marker: str, seconds: float):
        self.marker, self.seconds = marker, seconds

    async def step(self, state):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            time.sleep(self.seconds)
        except FileExistsError:
            pass
        return await super().step(state)


class NanRewardEnv(ToyEnv):
    """Every 4th rollout made in a runner process returns a NaN reward."""

    def __init__(self):
        self.nan = next(_made) % 4 == 0

    async def step(self, state):
        result = await super().step(state)
        if self.nan:
            result.reward = math.nan
        return result


class RaisingEnv(ToyEnv):
    """Every rollout raises, as agent code with a bug would."""

    async def step(self, state):
        raise ValueError("the grader is down")


class StringRewardEnv(ToyEnv):
    """Every rollout's reward is the grader's text, not a number (as a grader parsing nothing would return)."""

    async def step(self, state):
        result = await super().step(state)
        result.reward = f"{result.reward:.1f}"
        return result


class ExitingEnv(ToyEnv):
    """Every rollout calls sys.exit(), as agent code giving up the way a script would."""

    async def step(self, state):
        sys.exit("the grader gave up")


async def _give_up():
    sys.exit("the grader gave up")


class GatheredExitEnv(ToyEnv):
    """Every rollout's grading, a coroutine it gathers, calls sys.exit(): asyncio raises it out of the agent loop."""

    async def step(self, state):
        await asyncio.gather(_give_up())


class SyncStepEnv(ToyEnv):
    """A plain `def step` (the runner awaits it): refused at validation (tests/config/test_handoff_rules.py)."""

    def step(self, state):  # noqa: D102 -- wrongly synchronous, on purpose
        return Result(reward=1.0)


class SyncRunAgent(ChatAgent):
    """A ChatAgent with a plain `def run`: refused at validation likewise."""

    def run(self, ctx):  # noqa: D102
        return Result(reward=1.0)


class SyncExecuteRunner(StepEnvRunner):
    """A Runner whose `execute` is a plain `def`: refused at validation likewise."""

    def __init__(self):
        super().__init__(ToyEnv)

    def execute(self, episode, generator, tokenizer):  # noqa: D102
        return []


def _timed(fn):
    """A plain decorator, as users write them: its wrapper is a `def` returning the `async def`'s coroutine."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            wrapper.seconds = time.perf_counter() - start

    return wrapper


class DecoratedStepEnv(ToyEnv):
    """An `async def step` under a plain decorator: the runner awaits the coroutine the wrapper returns (taken)."""

    step = _timed(ToyEnv.step)


def _in_thread(fn):
    """An async decorator running a plain `def` in a thread (what the refusal of a plain `def` suggests)."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    return wrapper


class ThreadedStepEnv(ToyEnv):
    """A plain `def step` under an async decorator: awaitable, taken (was: refused as a plain function, its wrapper
    unwrapped to the `def`)."""

    @_in_thread
    def step(self, state):  # noqa: D102
        return Result(reward=1.0)


class YieldingStepEnv(ToyEnv):
    """An `async def step` that yields its Result (an async generator): refused at validation."""

    async def step(self, state):  # noqa: D102 -- yields, on purpose
        yield Result(reward=1.0)


class YieldingRunAgent(ChatAgent):
    """A ChatAgent whose `run` yields its Result (a generator): refused likewise."""

    def run(self, ctx):  # noqa: D102
        yield Result(reward=1.0)


class NoStateStepEnv(ToyEnv):
    """An `async def step(self)` without the state the runner passes: refused at validation likewise."""

    async def step(self):  # noqa: D102 -- the state parameter left out, on purpose
        return Result(reward=1.0)


class PropertyStepEnv(ToyEnv):
    """A `step` that is a property, not a method: refused at validation likewise."""

    step = property(lambda self: None)


class NoCtxRunAgent(ChatAgent):
    """A ChatAgent whose `run` takes no ctx: refused at validation likewise."""

    async def run(self):  # noqa: D102
        return Result(reward=1.0)


class NoStepEnv(Env):
    """An Env that defines no `step` (its grading written as `grade`): refused at validation naming the method (was:
    "Can't instantiate abstract class", told to fix the agent.runner kwargs)."""

    async def grade(self, state):  # noqa: D102
        return Result(reward=1.0)


class NoRunAgent(ChatAgent):
    """A ChatAgent whose loop is named `rollout`, not `run`: refused likewise."""

    async def rollout(self, ctx):  # noqa: D102
        return Result(reward=1.0)


class NoExecuteRunner(Runner):
    """A Runner without `execute`: refused likewise (was: passed validation; its runner processes failed to start)."""


class NoneStepEnv(ToyEnv):
    """`step = None`: refused as no method (was: passed; every rollout failed "'NoneType' object is not callable")."""

    step = None


class RefusingRunner(StepEnvRunner):
    """A runner whose own constructor refuses (a grader it cannot reach): a config error at validation."""

    def __init__(self):
        super().__init__(ToyEnv)
        raise ValueError("the grader is unreachable")


class PausingEnv(ToyEnv):
    """The run's first rollout (whichever runner process claims `marker` first) holds its runner for `seconds` before
    anything is generated (a blocking `reset`): the engines have their first weights, no token is generated yet."""

    def __init__(self, marker: str, seconds: float):
        self.marker, self.seconds = marker, seconds

    def reset(self, state):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            time.sleep(self.seconds)
        except FileExistsError:
            pass
        return state


class MisalignedRunner(StepEnvRunner):
    """A Runner whose own `execute` drops each segment's last log-prob (as a runner ported by hand may): every sample
    is then dropped as logprob_misalign, none trained."""

    def __init__(self):
        super().__init__(ToyEnv)

    async def execute(self, episode, generator, tokenizer):  # noqa: D102
        segments = await super().execute(episode, generator, tokenizer)
        for seg in segments:
            seg.logprobs = seg.logprobs[:-1]
        return segments
