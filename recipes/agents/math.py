"""Single-turn math: the model answers once; reward 1.0 when its last \\boxed{} equals the label (math-verify)."""

import asyncio

from molt_hydra.agents import Env, Result, StepEnvRunner
from molt_hydra.agents.math_grading import grade_math, last_boxed


class MathEnv(Env):
    def __init__(self, require_boxed: bool = True):
        self.require_boxed = require_boxed  # False: grade the last answer math-verify finds when there is no box

    async def step(self, state):
        reward = await asyncio.to_thread(grade_math, state["action_text"], state["label"], self.require_boxed)
        return Result(reward=reward, info={"has_boxed": float(last_boxed(state["action_text"]) is not None)})


class AgentRunner(StepEnvRunner):
    def __init__(self, **env_kwargs):
        super().__init__(MathEnv, env_kwargs=env_kwargs)
