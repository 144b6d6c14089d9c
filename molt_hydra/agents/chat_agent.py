"""`ChatAgent` + `ChatAgentRunner`: the agent owns the loop through the stock `openai` / `anthropic` SDK, pointed at
this process's loopback chat server (Molt §3.5). Each rollout gets a session; when the agent returns its `Result`,
every segment the session captured gets the rollout's reward, score and info. transformers and the model code are
imported where a model's config is read (deferred: heavy, and config validation builds runners).
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from molt_hydra.agents.base import (Episode, Result, Runner, Trajectory, model_images, reward_and_score,
                                    seed_agent_rngs, shippable)
from molt_hydra.agents.targets import subclass
from molt_hydra.agents.tool_parser import check_parser_names, reply_parser
from molt_hydra.agents.wire.images import image_data_uri
from molt_hydra.agents.wire.server import MODEL_NAME, ChatServer
from molt_hydra.agents.wire.session import ChatSession
from molt_hydra.data.images import to_pil_images
from molt_hydra.rollout.generation import EngineFailure, Sampling, TokenGenerator


@dataclass
class AgentContext:
    """What a ChatAgent gets. OpenAI SDK: `AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)`; Anthropic SDK:
    `AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)`; model name `ctx.model_name`."""

    messages: list[dict]  # OpenAI wire messages; each `<image>` marker replaced by the next image as a data URI
    tools: list[dict] | None
    prompt: str  # text of the last user turn
    label: Any
    images: list
    base_url: str
    session_url: str
    api_key: str
    model_name: str
    session_id: str
    sampling_params: Sampling
    max_length: int
    max_turns: int | None = None  # generating turns the session allows; later turns return an empty "length" reply
    judge_url: str = ""  # OpenAI base_url of the unrecorded judge endpoint (same engines, never training data)


ChatContext = AgentContext  # Molt's name, so ported agent files keep working


class ChatAgent(ABC):
    """Fresh instance per rollout, built with the runner's `agent_kwargs`."""

    @abstractmethod
    async def run(self, ctx: AgentContext) -> Result: ...


class ChatAgentRunner(Runner):
    def __init__(self, agent: type[ChatAgent] | str, agent_kwargs: dict | None = None,
                 tool_parser: str | None = "hermes", image_tokens_per_image: int = 0,
                 reasoning_parser: str | None = None, max_choices: int = 8, accepts_images: bool = True,
                 max_images: int | None = None):
        """`tool_parser` / `reasoning_parser`: vLLM parser names for the model family (agent.tool_parser /
        agent.reasoning_parser); `max_choices`: the largest `n` a request may ask for (agent.max_choices);
        `accepts_images`: False for a text-only model, so image parts get a 400 (data.max_images_per_prompt > 0);
        `max_images`: the engines' per-prompt image limit (data.max_images_per_prompt), more is a 400."""
        self.agent_cls = subclass(agent, ChatAgent, "ChatAgentRunner needs a ChatAgent subclass")
        self.agent_kwargs = dict(agent_kwargs or {})
        self.configure_chat(tool_parser, reasoning_parser, max_choices, accepts_images, max_images)
        self.image_tokens_per_image = image_tokens_per_image
        self.server: ChatServer | None = None
        self._server_loop = None
        self._server_started: asyncio.Future | None = None

    def configure_chat(self, tool_parser: str | None = "hermes", reasoning_parser: str | None = None,
                       max_choices: int = 8, accepts_images: bool = True, max_images: int | None = None) -> None:
        """The agent.* chat settings (the runner process applies the config's values over the constructor's)."""
        if tool_parser not in (None, "hermes") or reasoning_parser is not None:
            # an unknown name fails here, once, not in every rollout; vLLM's default is not looked up (its
            # registries cost seconds, and config validation builds runners)
            check_parser_names(tool_parser, reasoning_parser)
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.max_choices, self.accepts_images, self.max_images = max_choices, accepts_images, max_images

    async def _ensure_server(self) -> ChatServer:
        # The server lives on the loop that runs the agents (its sessions call the engine from that loop);
        # a runner driven from a new loop gets a new server.
        loop = asyncio.get_running_loop()
        if self._server_loop is not loop:
            self.server, self._server_loop = ChatServer(), loop
            self._server_started = asyncio.ensure_future(self.server.start())
        await asyncio.shield(self._server_started)
        return self.server

    async def execute(self, episode: Episode, generator: TokenGenerator, tokenizer) -> list[Trajectory]:
        server = await self._ensure_server()
        sid = uuid.uuid4().hex
        takes_images, placeholder = model_images(tokenizer.name_or_path)
        session = ChatSession(
            sid, generator, tokenizer, episode.sampling, episode.max_length,
            reply_parser(tokenizer, self.tool_parser, self.reasoning_parser), label=episode.label,
            image_tokens_per_image=self.image_tokens_per_image, max_turns=episode.max_turns,
            max_choices=self.max_choices, max_images=self.max_images, model_label=tokenizer.name_or_path,
            accepts_images=self.accepts_images and takes_images, image_placeholder=placeholder)
        server.open_session(session)
        messages = prompt_messages(episode.prompt, episode.images)
        url = server.session_url(sid)
        ctx = AgentContext(
            messages=messages, tools=copy.deepcopy(episode.tools), prompt=last_user_text(messages),
            # the agent's own label and images: an edit in place (a box drawn on an image) would otherwise reach the
            # row's later rollouts, every epoch (the images: the row's, decoded once at load)
            label=copy.deepcopy(episode.label), images=[copy.copy(im) for im in episode.images],
            base_url=url + "/v1", session_url=url, api_key=server.api_key, model_name=MODEL_NAME, session_id=sid,
            sampling_params=episode.sampling, max_length=episode.max_length, max_turns=episode.max_turns,
            judge_url=url + "/judge/v1")
        seed_agent_rngs(episode.sampling.seed, "run")
        try:
            result = await self.agent_cls(**self.agent_kwargs).run(ctx)
        except Exception as e:  # after the engines failed a turn of its: theirs (engine_aborted), not the agent's
            if session.engine_failure is not None:
                raise EngineFailure(f"{self.agent_cls.__name__}.run raised {type(e).__name__} after the engines "
                                    f"failed a turn of its session: {session.engine_failure}") from e
            raise
        finally:
            segments = server.close_session(sid)
        reward, score = reward_and_score(result, f"{self.agent_cls.__name__}.run")
        shippable(result.info, f"{self.agent_cls.__name__}.run")
        _refuse_step_fields(result, f"{self.agent_cls.__name__}.run")
        if result.images and not session.accepts_images:  # they would replace the trajectory's (none) for training
            raise ValueError(f"{self.agent_cls.__name__}.run returned {len(result.images)} Result.images, but the "
                             "model is text-only; return images only with a vision model (leave Result.images None)")
        images = None if result.images is None else to_pil_images(  # decoded as a row's (a path, bytes: RGB)
            result.images, len(result.images), f"Result.images of {self.agent_cls.__name__}.run")
        for seg in segments:  # the rollout counts once per group; every segment trains on its own tokens
            seg.reward, seg.score, seg.info = reward, score, dict(result.info)
            seg.truncated |= bool(result.truncated)  # the agent cut the episode off (its truncated_rate counts it)
            if images is not None:
                seg.images = list(images)
        return segments

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server, self._server_loop = None, None


def _refuse_step_fields(result, returned_by: str) -> None:
    """`Result.observation`, `sampling_params` and `terminated=False` steer an Env's next turn (the step runner); a
    ChatAgent's turns are its own requests, over when `run` returns: set, they would change nothing (a refusal)."""
    step_fields = [f"Result.{name}" for name, unset in (("observation", ""), ("sampling_params", None))
                   if getattr(result, name) != unset]
    if step_fields:
        raise ValueError(f"{returned_by} returned {' and '.join(step_fields)}, which steer an Env's next turn; a "
                         "ChatAgent's turns are its own requests to ctx.base_url (sampling goes in each request): "
                         "leave them unset")
    if not result.terminated and not result.truncated:  # (was `is False`: numpy's False_ or 0 passed unseen)
        raise ValueError(f"{returned_by} returned Result.terminated=False; a ChatAgent's episode ends when run "
                         "returns: set Result.truncated=True if it was cut off")


def prompt_messages(prompt: str | list[dict], images: list) -> list[dict]:
    """Dataset row → OpenAI wire messages; each literal `<image>` in a user string becomes the next image (Molt), and
    so does each bare `{"type": "image"}` part of a user message (the processors' and TRL's form, which job=sft and an
    Env's chat template take; was: a 400 for every rollout, or refused at validation)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else copy.deepcopy(prompt)
    pending = list(images)

    def image() -> dict:  # the next image, or (more places than images) the marker literally
        return ({"type": "image_url", "image_url": {"url": image_data_uri(pending.pop(0))}} if pending
                else {"type": "text", "text": "<image>"})

    for m in messages:
        content = m.get("content") if m.get("role") == "user" else None
        if isinstance(content, list):
            m["content"] = [image() if row_image_part(part) else part for part in content]
        elif isinstance(content, str) and "<image>" in content:
            m["content"] = [part for i, chunk in enumerate(content.split("<image>")) for part in (
                [image()] if i else []) + ([{"type": "text", "text": chunk}] if chunk else [])]
    return messages


def row_image_part(part) -> bool:
    """A content part that stands for the row's next image: `{"type": "image"}` naming no image of its own (other keys
    null, as a parquet / datasets column of parts holds them)."""
    return isinstance(part, dict) and part.get("type") == "image" and all(
        value is None for key, value in part.items() if key != "type")


def last_user_text(messages: list[dict]) -> str:
    last = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")  # its content
    return last if isinstance(last, str) else "".join(p.get("text", "") for p in last if p.get("type") == "text")
