"""Multi-turn python-tool agent in the Env style: the framework owns the token loop, the env writes the framing.

The prompt is rendered with the `python` tool in the system turn. After each generation the env runs every Hermes
`<tool_call>` in it and feeds the results back as the chat template would render tool messages (one
`<tool_response>` user turn per call, then a new assistant header), so the whole episode is one token sequence
with one action range per turn. No tool call ends the episode; the answer is graded with math-verify.
"""

import asyncio
from dataclasses import asdict

from molt_hydra.agents import Env, Result, StepEnvRunner
from molt_hydra.agents.math_grading import grade_math
from molt_hydra.agents.python_executor import SandboxLimits, run_python
from molt_hydra.agents.tool_parser import reply_parser

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run code",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
    },
}
EOS = "<|im_end|>"  # ChatML; the tiny model and Qwen share it
TOOL_TURN = "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
NEXT_ASSISTANT = "<|im_start|>assistant\n"


class PythonToolEnv(Env):
    def __init__(self, max_turns: int = 4, **exec_limits):
        """`exec_limits`: the sandbox's limits, `exec_<name>` for each field of SandboxLimits (bounds checked)."""
        self.max_turns = max_turns
        self.limits = SandboxLimits.from_agent_kwargs(exec_limits)
        self.calls = self.failed = 0

    def reset(self, state):
        return dict(state, tools=[PYTHON_TOOL])

    async def step(self, state):
        text = state["action_text"]
        parsed = reply_parser(state["tokenizer"], "hermes").parse(text.removesuffix(EOS), [PYTHON_TOOL])
        last_turn = state["turn"] + 1 >= self.max_turns
        if not parsed.tool_calls or last_turn:
            reward = await asyncio.to_thread(grade_math, parsed.content, state["label"])
            return Result(reward=reward, info={"tool_calls": self.calls, "tool_failures": self.failed})
        outputs = []
        for call in parsed.tool_calls:
            self.calls += 1
            code = call.arguments.get("code")
            if not isinstance(code, str):
                self.failed += 1
                outputs.append('error: arguments must be {"code": "..."}')
                continue
            result = await run_python(code, **asdict(self.limits))
            self.failed += not result.ok
            outputs.append(result.as_observation())
        # The template puts "\n" after an assistant's <|im_end|>; a turn cut before its end token gets both.
        close = "\n" if text.endswith(EOS) else EOS + "\n"
        feedback = close + "".join(TOOL_TURN.format(o) for o in outputs) + NEXT_ASSISTANT
        return Result(reward=0.0, observation=feedback, terminated=False)


class AgentRunner(StepEnvRunner):
    def __init__(self, **env_kwargs):
        super().__init__(PythonToolEnv, env_kwargs=env_kwargs)
