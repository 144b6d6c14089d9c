"""Multi-turn python-tool agent in the ChatAgent style: real `tool_calls` through the stock OpenAI SDK.

Each turn: the model either calls `python` (one or more calls; every result goes back as its own tool message) or
answers; the final answer is graded with math-verify against the label. Code runs in the sandboxed executor.
"""

import asyncio
from dataclasses import asdict
import json

from openai import AsyncOpenAI

from molt_hydra.agents import ChatAgent, ChatAgentRunner, Result
from molt_hydra.agents.math_grading import grade_math
from molt_hydra.agents.python_executor import SandboxLimits, run_python

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run code",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
    },
}


class PythonToolChatAgent(ChatAgent):
    def __init__(self, max_turns: int = 4, **exec_limits):
        """`exec_limits`: the sandbox's limits, `exec_<name>` for each field of SandboxLimits (bounds checked)."""
        self.max_turns = max_turns
        self.limits = SandboxLimits.from_agent_kwargs(exec_limits)

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages, tools = list(ctx.messages), ctx.tools or [PYTHON_TOOL]
        calls = failed = 0
        answer = ""
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages, tools=tools)
            msg = reply.choices[0].message
            answer = msg.content or ""
            if not msg.tool_calls:
                break
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                calls += 1
                try:
                    code = json.loads(call.function.arguments)["code"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    failed += 1
                    output = "error: arguments must be {\"code\": \"...\"}"
                else:
                    result = await run_python(code, **asdict(self.limits))
                    failed += not result.ok
                    output = result.as_observation()
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        reward = await asyncio.to_thread(self.grade, answer, ctx.label)
        return Result(reward=reward, info={"tool_calls": calls, "tool_failures": failed})

    def grade(self, answer: str, label) -> float:
        return grade_math(answer, label)


class AgentRunner(ChatAgentRunner):
    def __init__(self, **agent_kwargs):
        super().__init__(PythonToolChatAgent, agent_kwargs=agent_kwargs)
