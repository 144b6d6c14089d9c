"""geo3k-style VLM agent: a geometry question with its figure, solved with the python tool, graded with math-verify.

Images flow through both paths:
* ChatAgent (`Geo3kPythonAgent`, the conf/agent/geo3k_python.yaml target): each `<image>` marker of the prompt
  arrives in `ctx.messages` as an `image_url` data URI; the loopback server decodes it and sends the image to the
  engine with the turn, and keeps it on the trajectory.
* Env (`Geo3kPythonEnv`): `reset` turns each `<image>` marker into an `{"type": "image"}` part, so the model's own
  chat template writes its image placeholder; the runner passes the row's images to the engine with every turn.
"""

from pathlib import Path

from molt_hydra.agents import ChatAgentRunner, StepEnvRunner
from molt_hydra.agents.loading import resolve_target
from molt_hydra.models.vlm import image_parts

_HERE = Path(__file__).resolve().parent
PythonToolEnv = resolve_target(f"{_HERE}/python_tool_env.py:PythonToolEnv")
PythonToolChatAgent = resolve_target(f"{_HERE}/python_tool_chat.py:PythonToolChatAgent")
digit_fraction = resolve_target(f"{_HERE}/toy.py:digit_fraction")


class Geo3kPythonEnv(PythonToolEnv):
    def reset(self, state):
        prompt = state["observation"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return dict(super().reset(state), observation=image_parts(messages))


class Geo3kPythonAgent(PythonToolChatAgent):
    """The python-tool chat agent; the images are already in `ctx.messages` as data URIs."""


class TinyGeoAgent(Geo3kPythonAgent):
    """The tiny_vlm_geo_cpu agent: the same multi-turn python-tool VLM agent; a correct \\boxed{} answer (math-verify)
    earns 1. A random-init tiny model never writes one, so a wrong answer earns 0.5 x its digit fraction (the toy
    task's signal): the samples of a group then differ, and GRPO's advantages are non-zero from the first step."""

    def grade(self, answer: str, label) -> float:
        correct = super().grade(answer, label)
        return correct if correct else 0.5 * digit_fraction(answer)


class AgentRunner(ChatAgentRunner):
    def __init__(self, **agent_kwargs):
        super().__init__(Geo3kPythonAgent, agent_kwargs=agent_kwargs)


class EnvAgentRunner(StepEnvRunner):
    def __init__(self, **env_kwargs):
        super().__init__(Geo3kPythonEnv, env_kwargs=env_kwargs)
