"""The pixel task of `recipes/tiny_vlm_colors_cpu.yaml`: name the colour of the shape in the image by its letter.

Single-turn Env: `reset` turns the prompt's `<image>` marker into an image part (the chat template writes the model's
placeholder; the runner sends the row's image to the engine). Graded exactly: the reply up to the end-of-turn token,
without surrounding whitespace, must be the label (`R`, `G`, `B` or `Y`): reward 1, else 0. The
question is the same on every row, so nothing but the pixels tells the answer; chance is 1/4.
"""

from molt_hydra.agents import Env, Result, StepEnvRunner
from molt_hydra.models.vlm import image_parts


def exact_answer(action_text: str, eos_token: str) -> str:
    return action_text.split(eos_token)[0].strip()


class ColorEnv(Env):
    def reset(self, state):
        prompt = state["observation"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return dict(state, observation=image_parts(messages))

    async def step(self, state):
        answer = exact_answer(state["action_text"], state["tokenizer"].eos_token)
        correct = float(answer == state["label"])
        return Result(reward=correct, info={"correct": correct})


class AgentRunner(StepEnvRunner):
    def __init__(self, **env_kwargs):
        super().__init__(ColorEnv, env_kwargs=env_kwargs)
