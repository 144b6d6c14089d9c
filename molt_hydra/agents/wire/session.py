"""Token-exact capture of one chat session (Molt §3.6 "TITO", with its message-drop bug fixed).

A turn *extends* the open segment when the request is the previous request + the assistant reply we returned +
one or more new messages, and the chat template renders the history as a prefix. The extension is then
`bridge + render(all new messages) + generation prompt`, tokenized once, where `bridge` is what the template puts
after an assistant message (e.g. `\\n` after a generated `<|im_end|>`); the generated ids themselves are never
re-tokenized. Molt rendered only the last new message, so the first of two tool results never reached the model.

Anything else (first turn, the agent rewrote or compacted its history, a template that re-renders earlier turns)
seals the open segment and starts a new one from the full render. A request identical to the previous one is a
client retry: the cached reply comes back without generating, unless the client's SDK marked it a first attempt
(`x-stainless-retry-count: 0`, which the openai and anthropic SDKs send, and "1", "2"... on their own retries): then
the agent asks for another sample of the same prompt (self-consistency, a batch of identical calls), which is
generated in a new segment, as any request that does not extend the open one, with seeds of its own (the rollout's
seed, which every turn takes, would sample the same tokens again; a client's seed is honoured as sent). With
`n > 1` each choice is a branch; the branch whose reply the agent echoes is extended, the others are sealed as their
own segments.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from molt_hydra.agents.base import RECIPE_SAMPLING, Trajectory, image_tokens, text_prompt_ids
from molt_hydra.agents.json_grammar import compact, strict_calls
from molt_hydra.agents.tool_parser import ParsedReply, ReplyParser, ToolCall
from molt_hydra.agents.wire.images import image_sources, load_image
from molt_hydra.agents.wire.request import ChatRequest, RequestError
from molt_hydra.compat.vllm import forced_tool_schema
from molt_hydra.rollout.engine import join_deltas
from molt_hydra.rollout.generation import EngineFailure, Generation, GenerationRequest, Sampling, TokenGenerator

# What a streaming client gets while the engine samples: ("reasoning" | "content", text delta).
DeltaSink = Callable[[str, str], None]
# A token the processed distribution rules out (top_p / top_k) has logprob -inf, which JSON cannot carry (Python
# writes `-Infinity`, which other JSON parsers refuse): reported as vLLM's server and OpenAI report it.
LOGPROB_FLOOR = -9999.0
PARSE_GROWTH = 64  # a streamed text is parsed again once it grew by 1/PARSE_GROWTH of its length (`_stream`)


@dataclass
class Choice:
    gen: Generation
    content: str  # generated text without the end token / stop string, tool-call blocks removed
    tool_calls: list[ToolCall]
    tool_call_ids: list[str]
    finish_reason: str  # stop | length | tool_calls
    stop_sequence: str | None  # the stop string that ended it, if one did
    reasoning: str | None = None  # the model's thinking, split off by the reasoning parser
    logprobs: list[dict] | None = None  # OpenAI logprobs.content entries, when the client asked for them
    reasoning_tokens: int = 0  # generated tokens inside the thinking markers (vLLM's reasoning parser counts them)


@dataclass
class TurnReply:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    streamed: bool = False  # choice 0's text already reached the client token by token
    # the turn's cap was the session's remaining max_length, below every max_tokens: a `length` finish is the context
    # window filling (Anthropic says so apart, and clients compact then rather than ask for more tokens)
    context_full: bool = False


_PROBE = "\u2063probe\u2063"


@dataclass(eq=False, repr=False)
class ChatSession:
    session_id: str
    generator: TokenGenerator
    tokenizer: Any
    sampling: Sampling
    max_length: int
    parser: ReplyParser
    label: Any = None
    image_tokens_per_image: int | Callable[[Any], int] = 0  # per image beyond its placeholder (base.image_tokens)
    max_turns: int | None = None
    max_choices: int = 8
    accepts_images: bool = True
    max_images: int | None = None  # the engines' per-prompt image limit; a prompt carries the conversation's
    image_placeholder: int | None = None  # a vision model's image token id: a prompt holds one per image, no more
    model_label: str = "policy"

    def __post_init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None  # the agent's loop, where the generator is called
        self.context = None  # the rollout's contextvars.Context (`ChatServer.open_session`), which its turns run in
        self.lock = asyncio.Lock()  # turns of one session are serialized
        self.generate_calls = 0  # turns generated (agent.max_turns bounds them)
        self.last_prompt_tokens = 0  # of the latest turn (streamed Anthropic usage reports it up front)
        self.closed = False
        self.turns: set = set()  # the server's futures of the turns running on `loop` (`close` cancels them)
        self._sealed: list[Trajectory] = []
        self._branches: list[tuple[Trajectory, Choice]] = []  # one open segment per choice of the latest turn
        self._prev_messages: list[dict] = []
        self._prev_tools: list[dict] | None = None
        self._last_key: str | None = None
        self._last_reply: TurnReply | None = None
        self._drawn = 0  # choices sampled in this session so far: a turn's seeds start past theirs
        self._judged = 0  # choices the judge endpoint sampled so far: its seeds start past theirs
        # the engines' failure of one of its turns, if any: an agent that raises after it is not blamed for it
        self.engine_failure: str | None = None
        self._turn_end = self._assistant_turn_end()
        self._end_ids = {self.tokenizer.eos_token_id, *self.sampling.stop_token_ids}

    # --- rendering ---

    def _render(self, messages: list[dict], tools, generation_prompt: bool, param: str = "messages") -> str:
        try:
            return self.tokenizer.apply_chat_template(_with_argument_objects(messages), tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises on messages the template rejects (e.g. role order)
            raise RequestError(400, f"chat template rejected the messages: {e}", param) from None

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _assistant_turn_end(self) -> str:
        """What the template renders after an assistant message's content (ChatML: `<|im_end|>\\n`)."""
        text = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}], None, False)
        return text[text.rindex(_PROBE) + len(_PROBE) :]

    def _bridge(self, gen: Generation) -> str:
        """Text closing the generated turn so the next message renders as the template would place it."""
        if gen.token_ids and gen.token_ids[-1] in self._end_ids:  # the generated end token is part of the turn's end
            return self._turn_end.removeprefix(self.tokenizer.decode(gen.token_ids[-1:], skip_special_tokens=False))
        return self._turn_end

    # --- one turn ---

    async def complete(self, req: ChatRequest, on_delta: DeltaSink | None = None) -> TurnReply:
        async with self.lock:
            if self.closed:
                raise RequestError(404, f"session {self.session_id} is closed", code="session_closed")
            key = req.key()
            repeat = key == self._last_key and self._last_reply is not None
            # (was: every repeat taken for a retry, so k identical first attempts got one sample k times)
            if repeat and not req.first_attempt:
                # its prompt, which a streamed Anthropic reply reports up front (was: that of a request refused since)
                self.last_prompt_tokens = self._last_reply.prompt_tokens
                return dataclasses.replace(self._last_reply, streamed=False)
            if repeat:  # a new sample of the cached request's prompt: should it fail, the SDK's retry of it (count 1)
                # is generated (was: answered with the earlier sample's cached reply, e.g. after a 503
                # generation_aborted: a duplicate the agent took for a new sample)
                self._last_key = None
            try:
                self._last_key, self._last_reply = key, await self._generate_turn(req, on_delta)
            except (EngineFailure, RequestError) as e:
                if isinstance(e, EngineFailure) or e.code == "generation_aborted":
                    self.engine_failure = str(e)
                raise
            return self._last_reply

    async def judge(self, req: ChatRequest) -> TurnReply:
        """An LLM-as-judge call on the same engines: the client's sampling is honoured and nothing is recorded."""
        if req.stream:
            raise RequestError(400, "the judge endpoint serves non-streamed chat completions only", "stream")
        self._check_n(req)  # the cheap 400s before images are loaded and the prompt rendered
        self._check_thinking(req)  # (was: reasoning_effort unchecked here)
        prompt_ids, images = self._full_prompt(req)
        o, prompt_tokens = req.overrides, self._prompt_tokens(prompt_ids, images)
        remaining = self.max_length - prompt_tokens  # (was: its images' tokens not counted)
        if remaining <= 0:
            raise RequestError(400, f"judge prompt is {prompt_tokens} tokens; max_length is {self.max_length}",
                               "messages", "context_length_exceeded")
        # seeds of the judge's own, past its earlier calls' (was: the rollout's own at every call, so k identical calls,
        # a majority vote, drew one verdict k times): a stream 2**62 away from the turns', which a judge call made
        # while a turn generates neither shares nor shifts; taken before the await: gathered calls too
        seed = None if self.sampling.seed is None else (self.sampling.seed + 2**62 + self._judged) % 2**63
        self._judged += req.n
        sampling = dataclasses.replace(
            self.sampling, max_tokens=min(o.get("max_tokens", self.sampling.max_tokens), remaining),
            min_tokens=0, stop=self.sampling.stop + o.get("stop", ()), seed=o.get("seed", seed),
            **{k: o[k] for k in ("temperature", "top_p", "top_k") if k in o}, **self._decoding(req))
        gens = await self.generator.generate(
            GenerationRequest(f"{self.session_id}-judge", prompt_ids, sampling, images))
        return TurnReply([self._choice(g, req) for g in gens], prompt_tokens, sum(len(g.token_ids) for g in gens))

    async def count_tokens(self, req: ChatRequest) -> int:
        """The prompt tokens of `req` as a turn would take them, its usage counts them: the open segment extended
        where `req` continues it (was: rendered whole, without the earlier turns' thinking a continued turn keeps:
        fewer than the turn then used); nothing generated or recorded. On the agent's loop, as every use of the
        tokenizer (a fast tokenizer is not safe across threads)."""
        _, prompt_ids, images = self._prompt(req)
        return self._prompt_tokens(prompt_ids, images)

    def _prompt_tokens(self, prompt_ids: list[int], images: list) -> int:
        """A prompt's tokens as the engine takes them, as usage and count_tokens report them: each image's
        placeholder expanded to its tokens (was: counted as one token, while the length budget took its tokens)."""
        return len(prompt_ids) + image_tokens(self.image_tokens_per_image, images)

    def _full_prompt(self, req: ChatRequest) -> tuple[list[int], list]:
        """A chat request rendered whole (no open segment to extend): its token ids and images."""
        images = self._load_images(req)
        ids = self._tokenize(self._render(req.messages, req.tools, True, req.prompt_param))
        return self._check_image_places(ids, images, req.prompt_param), images

    def _check_image_places(self, ids: list[int], images: list, param: str) -> list[int]:
        """`ids`, new prompt tokens with `images` (their image parts rendered): a vision model's placeholder written
        into a text reads as an image's place. Was: with images, the engine's refusal as a 500; without, the text
        silently became an image slot with no image."""
        if self.image_placeholder is not None and (places := ids.count(self.image_placeholder)) != len(images):
            token = self.tokenizer.convert_ids_to_tokens(self.image_placeholder)
            raise RequestError(400, f"the text holds this vision model's image placeholder {token!r}: the prompt "
                               f"has {places} of them for its {len(images)} image(s), and the model reads each as an "
                               f"image's place. Remove {token!r} from the text; send each image as an image part, for "
                               "which the chat template writes the placeholder", param)
        return ids

    def _load_images(self, req: ChatRequest, start: int = 0, earlier: list | None = None) -> list:
        """The images of a prompt: `earlier` ones (of the segment it extends) + those in `req.messages[start:]`,
        checked; a bad one is a 400 naming its position in the request."""
        sources = image_sources(req.messages[start:])
        if sources and not self.accepts_images:
            raise RequestError(400, f"model {self.model_label!r} takes no images: it is text-only (or "
                                    "data.max_images_per_prompt=0); remove the image parts, or train a vision model "
                                    "with data.max_images_per_prompt > 0", req.prompt_param)
        where = req.image_params[len(req.image_params) - len(sources):]  # the request's last, in render order
        images = list(earlier or [])
        for source, at in zip(sources, where, strict=True):
            images.append(load_image(source, at))
            try:  # counted now: the model's processor refuses some sizes (Qwen-VL: an aspect ratio over 200)
                image_tokens(self.image_tokens_per_image, images[-1:])
            except ValueError as e:
                raise RequestError(400, f"{at or 'an image'}: the model's image processor cannot take this "
                                   f"{images[-1].width}x{images[-1].height} image ({e}); crop or pad it", at) from None
        if self.max_images is not None and len(images) > self.max_images:
            raise RequestError(400, f"the conversation has {len(images)} images > data.max_images_per_prompt="
                                    f"{self.max_images}, the engines' per-prompt image limit (every turn's prompt "
                                    "carries all earlier images): send fewer images, or raise "
                                    "data.max_images_per_prompt", req.prompt_param)
        return images

    def _turn_sampling(self, req: ChatRequest, remaining: int) -> Sampling:
        """The recipe's sampling, narrowed by the client (the one rule, docs/agents.md): temperature / top_p / top_k
        that differ from the rollout's are refused; max_tokens only lowers the per-turn cap (as do the `remaining`
        tokens of the session's max_length); stop strings add to the recipe's; seed is honoured; n is bounded by
        agent.max_choices."""
        self._check_thinking(req)
        o = req.overrides
        for key, recipe_key in RECIPE_SAMPLING.items():
            ours, theirs = getattr(self.sampling, key), o.get(key)
            if theirs is not None and not math.isclose(theirs, ours, rel_tol=0, abs_tol=1e-6):
                raise RequestError(400, f"'{key}'={theirs} differs from this rollout's {recipe_key}={ours}: "
                                   f"training assumes the recipe's sampling, so a client may not change it; omit "
                                   f"'{key}' or send {ours}", key, "sampling_mismatch")
        max_tokens = min(self.sampling.max_tokens, o.get("max_tokens", math.inf), remaining)
        if req.thinking_budget is not None and req.thinking_budget < max_tokens:
            # vLLM could only cut a thought short by forcing its end marker: tokens the policy did not sample
            raise RequestError(400, f"'thinking.budget_tokens'={req.thinking_budget} is below this turn's token cap "
                               f"{max_tokens} (the least of rollout.max_tokens={self.sampling.max_tokens}, "
                               "'max_tokens' and the session's remaining length), and a thought is never cut short "
                               "here: the model thinks as long as it samples to. Send budget_tokens >= the cap (with "
                               "'max_tokens' above it), or omit 'thinking'", "thinking.budget_tokens")
        seed = o.get("seed", self.sampling.seed)
        if "seed" not in o and seed is not None:  # the rollout's seed: each turn (and each sample of a repeated
            # request) takes seeds past those the session's earlier choices took (the engine: seed + choice index).
            # Was: the same seed for every turn, so vLLM drew the same noise at each position of every turn (a turn
            # repeated an earlier one's tokens where their distributions were alike), and a repeat sampled the same
            seed = (seed + self._drawn) % 2**63
        return dataclasses.replace(
            self.sampling, max_tokens=max_tokens, min_tokens=min(self.sampling.min_tokens, max_tokens),
            stop=self.sampling.stop + tuple(s for s in o.get("stop", ()) if s not in self.sampling.stop),
            seed=seed, **self._decoding(req))

    def _check_thinking(self, req: ChatRequest) -> None:
        if req.thinking is not None and req.thinking != (self.parser.reasoning is not None):
            param = req.thinking_param
            raise RequestError(400, f"'{param}' {'enables' if req.thinking else 'disables'} thinking, which does not "
                               "match this model's setup "
                               f"(agent.reasoning_parser={self.parser.reasoning_parser_name!r})"
                               f": thinking is what the model was trained to do; omit '{param}'", param)

    def _check_n(self, req: ChatRequest) -> None:
        if req.n > self.max_choices:
            raise RequestError(400, f"'n'={req.n} exceeds agent.max_choices={self.max_choices}", "n")

    def _decoding(self, req: ChatRequest) -> dict:
        """Engine-side output controls of a request: choices (n, checked by `_check_n`), logprobs and structured
        output (response_format / forced tool / strict tools or a single call under tool_choice auto)."""
        structured = req.response_format
        if req.tool_choice == "auto" and req.tools and self.parser.tool is None:  # (was: the calls came back as text)
            raise RequestError(400, "'tools' under tool_choice \"auto\" cannot be served with agent.tool_parser=null: "
                               "the calls the model writes are not read, so they would come back as text; set "
                               "agent.tool_parser to the model family's vLLM parser (hermes, qwen3_coder, llama3_json, "
                               "...), or send tool_choice \"required\" / a named tool (enforced without a parser) or "
                               "\"none\"", "tools")
        calls = req.tool_choice == "auto" and bool(req.tools) and self.parser.tool is not None  # a call is parsed
        strict = bool(req.strict_tools) and req.tool_choice == "auto"  # (a forced call follows its schema anyway)
        # parallel_tool_calls false: held to one call as sampled, never cut to one after (the trajectory would train a
        # call the agent never ran); moot when no call is parsed (no tool parser)
        single = req.parallel_tool_calls is False and calls
        if req.forced_tool:  # the reply is the call: a format beside it (the Agents SDK's output_type under
            if structured is not None:  # tool_choice required) shapes the later text turns; its schema checked here
                compact(structured, req.format_param)
            structured = compact({"json": forced_tool_schema(req.tools, req.tool_choice, req.parallel_tool_calls)},
                                 "tools")
        elif structured is not None and calls:  # the format's JSON or calls (was: the JSON only, so tools were
            compact(structured, req.format_param)  # never called; with a strict tool, a 400); its schema checked here
            structured = strict_calls(req.tools, req.strict_tools, self.parser.envelope, self.parser.tool_parser_name,
                                      single, structured.get("json") or {"type": "object"}, req.format_param)
        elif strict or single:
            structured = strict_calls(req.tools, req.strict_tools, self.parser.envelope, self.parser.tool_parser_name,
                                      single)
        else:
            structured = compact(structured, req.format_param)
        return {"n": req.n, "top_logprobs": req.top_logprobs or 0, "structured": structured}

    async def _generate_turn(self, req: ChatRequest, on_delta: DeltaSink | None) -> TurnReply:
        self._check_n(req)
        extension, prompt_ids, images = self._prompt(req)
        prompt_tokens = self._prompt_tokens(prompt_ids, images)
        remaining = self.max_length - prompt_tokens
        sampling = self._turn_sampling(req, remaining)
        out_of_turns = self.max_turns is not None and self.generate_calls >= self.max_turns
        self.last_prompt_tokens = prompt_tokens  # also of a turn out of budget: its reply reports this prompt
        if remaining <= 0 or out_of_turns:
            if extension is None and not out_of_turns:
                # Anthropic's words, which clients match to compact their history (was: "prompt is N tokens",
                # matched by none: an agent that compacts on overflow failed instead). N as count_tokens counts the
                # prompt, its images' tokens included
                held = image_tokens(self.image_tokens_per_image, images)
                raise RequestError(400, f"prompt is too long: {prompt_tokens} tokens > {self.max_length - 1} maximum "
                                   f"(this session's max_length is {self.max_length}: the context length holds the "
                                   f"prompt{f' (its {len(images)} images {held} tokens of it)' if held else ''}"
                                   " and at least one generated token)", req.prompt_param, "context_length_exceeded")
            # Budget spent mid-conversation: keep what was trained on, tell the agent the turn hit the length.
            for traj, _ in self._branches:
                traj.truncated = True
            # one empty choice per choice asked for (was: one, whatever `n`: an agent reading choices[1] failed)
            return TurnReply([Choice(Generation([], [], [], "length"), "", [], [], "length", None, None,
                                     None if req.top_logprobs is None else []) for _ in range(req.n)],
                             prompt_tokens, 0, context_full=not out_of_turns)
        self.generate_calls += 1
        request = GenerationRequest(self.session_id, list(prompt_ids), sampling, images)
        streamed = on_delta is not None and req.n == 1 and hasattr(self.generator, "generate_stream")
        choices = [await self._stream(request, req, on_delta)] if streamed else [
            self._choice(g, req) for g in await self.generator.generate(request)]
        if len(choices) != req.n:
            raise RuntimeError(f"engine returned {len(choices)} generations for n={req.n}")
        if self.closed:  # the rollout ended while this turn generated: its segments belong to the trainer now
            raise RequestError(404, f"session {self.session_id} closed while this turn was generating; the turn is "
                               "not recorded", code="session_closed")
        # Commit only after generation succeeded, so a failed turn leaves the session clean for a retry.
        self._commit(req, extension, prompt_ids, images, choices)
        self._drawn += req.n
        return TurnReply(choices, prompt_tokens, sum(len(c.gen.token_ids) for c in choices), streamed=streamed,
                         context_full=remaining < min(self.sampling.max_tokens,
                                                      req.overrides.get("max_tokens", math.inf)))

    def _prompt(self, req: ChatRequest):
        """(extension or None, prompt ids, images) of a turn: a raw prompt, the open branch extended, or a full
        render."""
        if req.raw_prompt is not None:
            ids = text_prompt_ids(self.tokenizer, req.raw_prompt)
            return None, self._check_image_places(ids, [], req.prompt_param), []
        extension = self._extension(req)
        if extension is None:
            return None, *self._full_prompt(req)
        traj, delta_ids = extension
        images = self._load_images(req, len(self._prev_messages), traj.images)
        self._check_image_places(delta_ids, images[len(traj.images):], req.prompt_param)
        return extension, traj.token_ids + delta_ids, images

    def _commit(self, req: ChatRequest, extension, prompt_ids: list[int], images: list, choices: list[Choice]) -> None:
        """Record a generated turn: the extended (or a new) segment, one branch per choice; other branches seal."""
        base, new_ids = extension or (Trajectory(prompt=req.raw_prompt or req.messages, label=self.label), prompt_ids)
        self._sealed.extend(traj for traj, _ in self._branches if traj is not base)
        base.append_feedback(new_ids)
        base.images = images
        self._branches = list(zip([copy.deepcopy(base) for _ in range(req.n - 1)] + [base], choices))
        for traj, choice in self._branches:
            traj.append_action(choice.gen)
            traj.truncated |= choice.gen.finish_reason == "length"
        # A raw completion is never continued as a chat: no chat request equals this marker.
        self._prev_messages = req.messages if req.raw_prompt is None else [{"raw_prompt": req.raw_prompt}]
        self._prev_tools = req.tools

    async def _stream(self, request: GenerationRequest, req: ChatRequest, on_delta: DeltaSink) -> Choice:
        """Sample one completion token by token, handing the client each safe-to-show piece as it appears."""
        stops = request.sampling.stop
        hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be completing
        sent = {"reasoning": "", "content": ""}
        deltas: list[Generation] = []

        def emit(kind: str, text: str | None) -> None:
            text = text or ""
            if len(text) > len(sent[kind]) and text.startswith(sent[kind]):
                on_delta(kind, text[len(sent[kind]):])
                sent[kind] = text

        detok, parsed = _Detokenizer(self.tokenizer), -1  # parsed: the length of the text parsed last
        async for d in self.generator.generate_stream(request):
            deltas.append(d)
            if req.forced_tool:
                continue  # the reply is a tool call, sent whole at the end
            text = detok.add([t for t in d.token_ids if t not in self._end_ids])  # (they only end a generation)
            # vLLM's parsers scan the whole text (a reasoning parser: ~0.2 us a character): parsed again once it grew
            # by 1/64, the parsing stays linear in the text (was: every token, quadratic: minutes for a long thought)
            if len(text) - parsed <= len(text) // PARSE_GROWTH:
                continue
            parsed = len(text)
            found = min((text.find(s) for s in stops if s in text), default=None)
            upto = text if found is None else text[:found]
            if req.raw_prompt is not None:  # a raw completion is text as sampled, as `_choice` makes it (was: parsed
                reasoning, content = None, upto  # for thinking: all before `</think>` never streamed)
            else:
                reasoning, content = self.parser.streamable(upto, req.tools, req.tool_choice != "none")
            # a tail that may still become a stop string is held back from the parsed pieces, content first (was: cut
            # from the text before parsing, through a marker: `<think>` cut to `<thi` was sent as thinking, and no
            # more thinking reached the client, the rest not extending it)
            reasoning, content = reasoning or "", content or ""
            held = 0 if found is not None else hold  # (a stop found: the text before it is final)
            emit("reasoning", reasoning[: max(0, len(reasoning) - max(0, held - len(content)))])
            emit("content", content[: max(0, len(content) - held)])
        final = self._choice(join_deltas(deltas), req)  # parsed once (a parse failure is counted once)
        emit("reasoning", final.reasoning)
        emit("content", final.content)
        return final

    def _extension(self, req: ChatRequest):
        """(the open segment it continues, delta ids) when this request continues an open branch, else None."""
        k = len(self._prev_messages)
        if (not self._branches or req.tools != self._prev_tools or len(req.messages) < k + 2
                or req.messages[:k] != self._prev_messages):
            return None
        traj, choice = next(((t, c) for t, c in self._branches if _echoes(req.messages[k], c)), (None, None))
        if traj is None:
            return None
        messages, echoed = list(req.messages), req.messages[k]
        if choice.reasoning and echoed.get("reasoning") is None:  # the reply as generated, its thinking too, where the
            # client does not echo it (LangChain): a template that shows the last turn's thinking (Qwen3's, after the
            # last user message) renders it in both (was: no prefix, a new segment at each turn of a tool loop)
            messages[k] = dict(echoed, reasoning=choice.reasoning, reasoning_content=choice.reasoning)
        head = self._render(messages[: k + 1], req.tools, False, req.prompt_param)
        full = self._render(messages, req.tools, True, req.prompt_param)
        if not full.startswith(head):
            return None
        # Every message after the echoed reply is in this delta (Molt rendered only the last one).
        delta = self._bridge(choice.gen) + full[len(head) :]
        return traj, self._tokenize(delta)

    def _choice(self, gen: Generation, req: ChatRequest) -> Choice:
        if gen.finish_reason not in ("stop", "length"):  # vLLM's abort / error: cut short, never a finished turn
            # (was: served as finish_reason "stop" / stop_reason "end_turn", and recorded as a finished turn)
            raise RequestError(503, f"the engine ended this turn's generation with finish reason {gen.finish_reason!r}"
                               f" after {len(gen.token_ids)} tokens (vLLM aborted or failed the request: the engine "
                               "stopping, the request cancelled inside it, or an engine error on it): a cut-short "
                               "reply is neither served nor recorded; send the request again",
                               code="generation_aborted")
        ids = gen.token_ids
        if gen.finish_reason == "stop" and ids and ids[-1] in self._end_ids | {gen.stop_reason}:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        stop_sequence = gen.stop_reason if isinstance(gen.stop_reason, str) else None
        if stop_sequence:  # OpenAI/Anthropic omit the stop sequence from the text. Cut where the engine stopped: in
            # the occurrence the last token completed. vLLM does not look in the first min_tokens tokens (the recipe's
            # 1), so one may occur there too (was: cut there, and the agent never saw the rest the trajectory trains);
            # a character split at the token boundary decodes as U+FFFD, not counted
            before = self.tokenizer.decode(ids[:-1], skip_special_tokens=False).rstrip("\ufffd")
            at = text.find(stop_sequence, max(0, len(before) - len(stop_sequence) + 1))
            text = text.partition(stop_sequence)[0] if at < 0 else text[:at]
        if req.raw_prompt is not None:
            parsed = ParsedReply(text, [])
        elif req.forced_tool:
            parsed = self.parser.parse_forced(text, req.tool_choice)
        else:
            parsed = self.parser.parse(text, req.tools, parse_tools=req.tool_choice != "none")
        calls = parsed.tool_calls  # parallel_tool_calls false: at most one, by the grammar (`_decoding`)
        finish = "tool_calls" if calls else "length" if gen.finish_reason == "length" else "stop"
        call_ids = [f"call_{secrets.token_hex(8)}" for _ in calls]
        return Choice(gen, parsed.content, calls, call_ids, finish, stop_sequence, parsed.reasoning,
                      None if req.top_logprobs is None else self._logprob_entries(gen),
                      self.parser.reasoning.count_reasoning_tokens(gen.token_ids) if self.parser.reasoning else 0)

    def _logprob_entries(self, gen: Generation) -> list[dict]:
        """The engine's logprob of every generated token (and its top alternatives), in OpenAI's shape."""
        def entry(tid: int, lp: float) -> dict:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
            raw = token_bytes(self.tokenizer, tid, text)
            return {"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": list(raw)}

        tops = gen.top_logprobs or [{}] * len(gen.token_ids)
        return [dict(entry(t, lp), top_logprobs=[entry(a, x) for a, x in sorted(top.items(), key=lambda kv: -kv[1])])
                for t, lp, top in zip(gen.token_ids, gen.logprobs, tops)]

    # --- end of session ---

    def close(self) -> list[Trajectory]:
        """Seal every open branch; the session's segments in the order they were opened. A turn still running (the
        agent timed out, or returned without awaiting it) could reach no one: it is cancelled, which aborts its engine
        request (was: it generated on to its token cap, taking the engines from the rollouts still running)."""
        self.closed = True
        for turn in list(self.turns):
            turn.cancel()
        segments = self._sealed + [traj for traj, _ in self._branches]
        for i, seg in enumerate(segments):
            seg.segment_index = i
        return segments


# GPT-2's byte-level BPE alphabet (Qwen, Llama 3, ...): the character each byte is written as in a token's piece → the
# byte. Printable Latin-1 bytes are themselves; the others are the characters from U+0100 on, in byte order.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_OTHER = [b for b in range(256) if b not in _PRINTABLE]
BYTE_LEVEL = {chr(c): b for b, c in zip(_PRINTABLE + _OTHER, _PRINTABLE + [256 + i for i in range(len(_OTHER))])}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Llama 2, Mistral, Gemma)


def token_bytes(tokenizer, tid: int, text: str) -> bytes:
    """A token's own UTF-8 bytes, which OpenAI's `bytes` carries so that a character split over tokens can be joined
    (was: the bytes of its decoded text, U+FFFD's for each part of such a character). Read from the token's piece in
    the byte-level or byte-fallback alphabet, or SentencePiece's metaspace ("▁": a space, which a Llama 2 / Mistral
    decoder strips from a token decoded alone, so the words ran together); else the decoded text's (it is whole)."""
    piece = tokenizer.convert_ids_to_tokens(tid)
    if not isinstance(piece, str):
        return text.encode()
    if byte := _BYTE_FALLBACK.fullmatch(piece):
        return bytes.fromhex(byte[1])
    if all(c in BYTE_LEVEL for c in piece):
        raw = bytes(BYTE_LEVEL[c] for c in piece)
        if raw.decode(errors="replace") == text:  # the piece is in the byte-level alphabet, not another one's text
            return raw
    if "▁" in piece and piece.replace("▁", " ").strip() == text.strip():
        return piece.replace("▁", " ").encode()
    return text.encode()


class _Detokenizer:
    """The text of a generation as its tokens arrive, each decoded a bounded number of times (was: the whole
    generation decoded again per token, quadratic: minutes of the agent loop for a 32k-token stream). vLLM's
    incremental detokenizing: the text a window of tokens adds beyond the window's previous read point. A character
    whose bytes span tokens decodes as U+FFFD until its last byte comes, so it is held back until whole (was: sent, and
    the stream stopped there, as later text no longer extended what was sent)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self.prefix = self.read = 0  # the window: ids[prefix:] is decoded, of which ids[prefix:read] is in `text`

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=False)
        window = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=False)
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.text += window[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self.text


def _with_argument_objects(messages: list[dict]) -> list[dict]:
    """The messages with each tool call's arguments as a JSON object, as vLLM's server hands them to the template
    (the Transformers convention). Templates that write them with `| tojson` (Qwen2.5, Llama 3.1, Hermes) rendered
    the wire's JSON string quoted and escaped, `"arguments": "{\\"x\\": 1}"`, a call the model never writes (was: the
    prompt of a full render, count_tokens and the judge). Arguments that are not a JSON object stay as sent."""
    def call(tc: dict) -> dict:
        try:
            args = json.loads(tc["function"]["arguments"])
        except (json.JSONDecodeError, TypeError):
            return tc
        return dict(tc, function=dict(tc["function"], arguments=args)) if isinstance(args, dict) else tc

    return [dict(m, tool_calls=[call(tc) for tc in m["tool_calls"]]) if m.get("tool_calls") else m for m in messages]


def _echoes(message: dict, choice: Choice) -> bool:
    """Is `message` the assistant reply we returned for `choice` (content, tool calls and an echoed thinking; ids
    ignored)? A thinking the client changed is not (was: the segment extended, and the model read the thinking it had
    generated, never the client's); one not echoed is (LangChain sends none back: `_extension`)."""
    content, thought = message.get("content") or "", message.get("reasoning")
    if message.get("role") != "assistant" or not isinstance(content, str) or content.strip() != choice.content.strip():
        return False
    if thought is not None and thought.strip() != (choice.reasoning or "").strip():
        return False
    try:
        calls = [(tc["function"]["name"], json.loads(tc["function"]["arguments"]))
                 for tc in message.get("tool_calls", [])]
    except (json.JSONDecodeError, KeyError, TypeError):
        return False
    return calls == [(c.name, c.arguments) for c in choice.tool_calls]

