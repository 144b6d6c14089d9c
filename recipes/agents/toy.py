"""The CPU toy task of the embedded default (`molt-run` with no recipe): make the response digits.

reward = (digit characters in the response) / (all characters of the response, special tokens included), in [0, 1].

Why a random-init tiny model learns it in ~30 GRPO steps (8 prompts x 8 samples, 8 new tokens):
* it is verifiable from the response alone, and prompts ("Count: 123") only vary the context;
* 139 of the tiny tokenizer's 512 tokens are pure digits, so the untrained policy already emits digit tokens about a
  quarter of the time: the 8 samples of a group get different rewards and GRPO's advantages are non-zero from step 1;
* the optimum does not depend on the context: it is one direction (raise every digit token's logit, lower the
  long special tokens such as `<|im_end|>`), which a 2-layer model with tied embeddings moves along quickly.
"""

from molt_hydra.agents import Env, Result, StepEnvRunner


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class ToyEnv(Env):
    async def step(self, state):
        reward = digit_fraction(state["action_text"])
        return Result(reward=reward, info={"digit_fraction": reward, "response_chars": len(state["action_text"])})


class AgentRunner(StepEnvRunner):
    def __init__(self, **env_kwargs):
        super().__init__(ToyEnv, env_kwargs=env_kwargs)
