"""ChatAgent hello-world through the stock OpenAI SDK: ask once, reward 1.0 when the label appears in the reply."""

from openai import AsyncOpenAI

from molt_hydra.agents import ChatAgent, ChatAgentRunner, Result


class MinimalChatAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        text = reply.choices[0].message.content or ""
        return Result(reward=float(str(ctx.label) in text), info={"reply_chars": len(text)})


class AgentRunner(ChatAgentRunner):
    def __init__(self, **agent_kwargs):
        super().__init__(MinimalChatAgent, agent_kwargs=agent_kwargs)
