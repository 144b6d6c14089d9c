"""Token-exact capture of one chat session (Molt §3.6 "TITO", with its message-drop bug fixed).

A turn *extends* the open segment when the request is the previous request + the assistant reply we returned +
one or more new messages, and the chat template renders the history as a prefix. The extension is then
`bridge + render(all new messages) + generation prompt`, tokenized once, where `bridge` is what the template puts
after an assistant message (e.g. `\\n` after a generated `<|im_end|>`); the generated ids themselves are never
re-tokenized. Molt rendered only the last new message, so the first of two tool results never reached the model.

Anything else (first turn, the agent rewrote or compacted its history, a template that re-renders earlier turns)
seals the open segment and starts a new one from the full render. A request identical to the previous one is a
client retry: the cached reply comes back without generating. With `n > 1` each choice is a branch; the branch
whose reply the agent echoes is extended, the others are sealed as their own segments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from dataclasses import dataclass

from molt_hydra.agents.base import Trajectory, apply_sampling_override
from molt_hydra.agents.chat_messages import ChatRequest, RequestError, image_sources, load_image
from molt_hydra.agents.tool_parser import ToolCall
from molt_hydra.rollout.generation import Generation, GenerationRequest, Sampling, TokenGenerator


@dataclass
class Choice:
    gen: Generation
    content: str  # generated text without the end token / stop string, tool-call blocks removed
    tool_calls: list[ToolCall]
    tool_call_ids: list[str]
    finish_reason: str  # stop | length | tool_calls
    stop_sequence: str | None  # the stop string that ended it, if one did
    pieces: list[str]  # the content cut at token boundaries, for streaming


@dataclass
class TurnReply:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    cached: bool = False


@dataclass
class _Branch:
    traj: Trajectory
    choice: Choice


@dataclass
class SessionStats:
    generate_calls: int = 0
    retries_served: int = 0


_PROBE = "\u2063probe\u2063"


class ChatSession:
    def __init__(
        self,
        session_id: str,
        generator: TokenGenerator,
        tokenizer,
        sampling: Sampling,
        max_length: int,
        tool_parser,
        label=None,
        prompt=None,
        image_tokens_per_image: int = 0,
        max_turns: int | None = None,
    ):
        self.session_id = session_id
        self.generator = generator
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.max_length = max_length
        self.tool_parser = tool_parser
        self.label = label
        self.prompt = prompt
        self.image_tokens_per_image = image_tokens_per_image
        self.max_turns = max_turns
        self.lock = asyncio.Lock()  # turns of one session are serialized
        self.stats = SessionStats()
        self.closed = False
        self._sealed: list[Trajectory] = []
        self._branches: list[_Branch] = []
        self._prev_messages: list[dict] = []
        self._prev_tools: list[dict] | None = None
        self._last_key: str | None = None
        self._last_reply: TurnReply | None = None
        self._turn_end = self._assistant_turn_end()
        self._end_ids = {tokenizer.eos_token_id, *sampling.stop_token_ids}

    # --- rendering ---

    def _render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja raises on messages the template rejects (e.g. role order)
            raise RequestError(400, f"chat template rejected the messages: {e}", "messages") from None

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _assistant_turn_end(self) -> str:
        """What the template renders after an assistant message's content (ChatML: `<|im_end|>\\n`)."""
        text = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}], None, False)
        return text[text.rindex(_PROBE) + len(_PROBE) :]

    def _bridge(self, gen: Generation) -> str:
        """Text closing the generated turn so the next message renders as the template would place it."""
        if gen.token_ids and gen.token_ids[-1] in self._end_ids:
            end_text = self.tokenizer.decode(gen.token_ids[-1:], skip_special_tokens=False)
            if self._turn_end.startswith(end_text):
                return self._turn_end[len(end_text) :]
        return self._turn_end

    # --- one turn ---

    async def complete(self, req: ChatRequest) -> TurnReply:
        async with self.lock:
            if self.closed:
                raise RequestError(404, f"session {self.session_id} is closed", code="session_closed")
            key = json.dumps([req.messages, req.tools, req.n, req.overrides], sort_keys=True, default=str)
            if key == self._last_key and self._last_reply is not None:
                self.stats.retries_served += 1
                return dataclasses.replace(self._last_reply, cached=True)
            return await self._generate_turn(req, key)

    async def _generate_turn(self, req: ChatRequest, key: str) -> TurnReply:
        extension = self._extension(req)
        if extension is not None:
            branch, delta_ids, new_sources = extension
            prompt_ids = branch.traj.token_ids + delta_ids
            images = branch.traj.images + [load_image(s) for s in new_sources]
        else:
            prompt_ids = self._tokenize(self._render(req.messages, req.tools, True))
            images = [load_image(s) for s in image_sources(req.messages)]
        try:
            sampling = apply_sampling_override(self.sampling, req.overrides)
        except (TypeError, ValueError) as e:
            raise RequestError(400, str(e)) from None
        remaining = self.max_length - len(prompt_ids) - self.image_tokens_per_image * len(images)
        out_of_turns = self.max_turns is not None and self.stats.generate_calls >= self.max_turns
        if remaining <= 0 or out_of_turns:
            if extension is None and not out_of_turns:
                raise RequestError(
                    400,
                    f"prompt is {len(prompt_ids)} tokens (+{len(images)} images) but this session's max_length is "
                    f"{self.max_length}",
                    "messages",
                    "context_length_exceeded",
                )
            # Budget spent mid-conversation: keep what was trained on, tell the agent the turn hit the length.
            for b in self._branches:
                b.traj.truncated = True
            empty = Choice(Generation([], [], [], "length"), "", [], [], "length", None, [])
            reply = TurnReply([empty], len(prompt_ids), 0)
            self._last_key, self._last_reply = key, reply
            return reply

        max_tokens = min(sampling.max_tokens, remaining)
        sampling = dataclasses.replace(
            sampling, n=req.n, max_tokens=max_tokens, min_tokens=min(sampling.min_tokens, max_tokens)
        )
        self.stats.generate_calls += 1
        gens = await self.generator.generate(GenerationRequest(self.session_id, list(prompt_ids), sampling, images))
        if len(gens) != req.n:
            raise RuntimeError(f"engine returned {len(gens)} generations for n={req.n}")
        choices = [self._choice(g) for g in gens]

        # Commit only after generation succeeded, so a failed turn leaves the session clean for a retry.
        if extension is not None:
            self._sealed.extend(b.traj for b in self._branches if b is not branch)
            base = branch.traj
            base.append_feedback(delta_ids)
            base.images = images
        else:
            self._sealed.extend(b.traj for b in self._branches)
            base = Trajectory(prompt=req.messages, label=self.label, images=images)
            base.append_feedback(prompt_ids)
        trajs = [base.copy() for _ in range(req.n - 1)] + [base]
        self._branches = []
        for traj, gen, choice in zip(trajs, gens, choices):
            traj.append_action(gen)
            traj.truncated |= gen.finish_reason == "length"
            self._branches.append(_Branch(traj, choice))
        reply = TurnReply(choices, len(prompt_ids), sum(len(g.token_ids) for g in gens))
        self._prev_messages, self._prev_tools = req.messages, req.tools
        self._last_key, self._last_reply = key, reply
        return reply

    def _extension(self, req: ChatRequest):
        """(branch, delta ids, new image sources) when this request continues an open branch, else None."""
        k = len(self._prev_messages)
        if not self._branches or req.tools != self._prev_tools or len(req.messages) < k + 2:
            return None
        if req.messages[:k] != self._prev_messages:
            return None
        branch = next((b for b in self._branches if _echoes(req.messages[k], b.choice)), None)
        if branch is None:
            return None
        head = self._render(req.messages[: k + 1], req.tools, False)
        full = self._render(req.messages, req.tools, True)
        if not full.startswith(head):
            return None
        # Every message after the echoed reply is in this delta (Molt rendered only the last one).
        delta = self._bridge(branch.choice.gen) + full[len(head) :]
        return branch, self._tokenize(delta), image_sources(req.messages[k + 1 :])

    def _choice(self, gen: Generation) -> Choice:
        ids = gen.token_ids
        if gen.finish_reason == "stop" and ids and ids[-1] in self._end_ids | {gen.stop_reason}:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        stop_sequence = gen.stop_reason if isinstance(gen.stop_reason, str) else None
        if stop_sequence is not None and stop_sequence in text:
            text = text[: text.index(stop_sequence)]  # OpenAI/Anthropic omit the stop sequence from the text
        parsed = self.tool_parser(text)
        if parsed.tool_calls:
            finish = "tool_calls"
        else:
            finish = "length" if gen.finish_reason == "length" else "stop"
        call_ids = [f"call_{secrets.token_hex(8)}" for _ in parsed.tool_calls]
        content = parsed.content if parsed.tool_calls else text
        return Choice(gen, content, parsed.tool_calls, call_ids, finish, stop_sequence, self._pieces(content, ids))

    def _pieces(self, content: str, ids: list[int]) -> list[str]:
        """`content` cut where each token's text ends, when per-token decoding reproduces it; else one piece."""
        out, used = [], 0
        for t in ids:
            piece = self.tokenizer.decode([t], skip_special_tokens=False)
            if used >= len(content):
                break
            if not content.startswith(piece, used):
                return [content] if content else []
            out.append(piece)
            used += len(piece)
        return out if used == len(content) else ([content] if content else [])

    # --- end of session ---

    def close(self) -> list[Trajectory]:
        """Seal every open branch; the session's segments in the order they were opened."""
        self.closed = True
        segments = self._sealed + [b.traj for b in self._branches]
        self._sealed, self._branches = [], []
        for i, seg in enumerate(segments):
            seg.segment_index = i
        return segments


def _echoes(message: dict, choice: Choice) -> bool:
    """Is `message` the assistant reply we returned for `choice` (content and tool calls, ids ignored)?"""
    if message.get("role") != "assistant":
        return False
    content = message.get("content") or ""
    if not isinstance(content, str) or content.strip() != choice.content.strip():
        return False
    try:
        calls = [
            (tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in message.get("tool_calls", [])
        ]
    except (json.JSONDecodeError, KeyError, TypeError):
        return False
    return calls == [(c.name, c.arguments) for c in choice.tool_calls]

