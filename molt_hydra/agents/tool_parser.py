"""Tool calls and reasoning in generated text, parsed by vLLM's own parsers (`vllm.tool_parsers`, `vllm.reasoning`),
chosen per model family by `agent.tool_parser` (hermes, qwen3_coder, llama3_json, mistral, ...) and
`agent.reasoning_parser` (qwen3, deepseek_r1, ...). The chat server returns them as structured `tool_calls` /
`tool_use` blocks and `reasoning` / thinking blocks; the generated token ids are kept as they are.

A call whose arguments are not a JSON object stays in the text content, so the agent sees what the model wrote.
`tool_choice` "required" / a named tool is enforced with vLLM's structured output (the JSON schema vLLM's own
server derives from the tools); such a reply is the bare JSON and is parsed here, not by the model-family parser.
vLLM is imported where a parser is looked up (deferred: config validation imports the agents without it).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass

from molt_hydra.compat.vllm import chat_completion_request

log = logging.getLogger(__name__)
_failures = {"count": 0}  # tool-call blocks a parser could not read, in this process (agent/tool_parse_failures)


def parse_failures() -> int:
    return _failures["count"]


# How a family's tool call opens (the trigger, the text before the tool's name), continues to its arguments and
# closes, as its chat template writes it: a strict tool's arguments are held to their schema in between
# (json_grammar.strict_calls).
CALL_ENVELOPES = {"hermes": ("<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>")}

_seen = threading.local()  # .error: the parser error this thread logged last (`_parser_errors`, `_take_error`)


def _parser_errors(record: logging.LogRecord) -> bool:
    """vLLM's tool parsers log a traceback at ERROR when a call block does not parse (e.g. a stop string cut it) and
    return the text as content. That is the model's output, not a fault here: the record is kept for `parse` to count
    and report in one warning line."""
    if record.levelno >= logging.ERROR and record.exc_info:
        _seen.error = record.exc_info[1]
        return False
    return True


def _take_error() -> BaseException | None:
    error, _seen.error = getattr(_seen, "error", None), None
    return error


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedReply:
    content: str  # text outside reasoning and parsed tool-call blocks
    tool_calls: list[ToolCall]
    reasoning: str | None = None


def check_parser_names(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """Unknown parser names fail naming the config key and vLLM's known names."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tools = {*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers}
    if tool_parser and tool_parser not in tools:
        raise ValueError(f"agent.tool_parser={tool_parser!r} is not a vLLM tool parser; known: {sorted(tools)}")
    if reasoning_parser and reasoning_parser not in ReasoningParserManager.list_registered():
        raise ValueError(f"agent.reasoning_parser={reasoning_parser!r} is not a vLLM reasoning parser; known: "
                         f"{ReasoningParserManager.list_registered()}")


class ReplyParser:
    """One model family's reasoning + tool-call parsers (vLLM's), built once per runner."""

    def __init__(self, tokenizer, tool_parser: str | None = "hermes", reasoning_parser: str | None = None):
        check_parser_names(tool_parser, reasoning_parser)
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        self.tool_parser_name, self.reasoning_parser_name = tool_parser, reasoning_parser
        self.tool = self.reasoning = None
        if tool_parser:
            cls = ToolParserManager.get_tool_parser(tool_parser)
            logging.getLogger(cls.__module__).addFilter(_parser_errors)  # once per logger: the same filter object
            try:
                self.tool = cls(tokenizer)
            except RuntimeError as e:  # vLLM's parsers check the tokenizer has the family's marker tokens
                raise ValueError(f"agent.tool_parser={tool_parser!r} does not fit this model's tokenizer ({e}); set "
                                 "agent.tool_parser to the model family's parser, or null for none") from None
        if reasoning_parser:
            self.reasoning = ReasoningParserManager.get_reasoning_parser(reasoning_parser)(tokenizer)
        # Text streamed as content must stop where a tool call may begin (vLLM's parsers name their start marker;
        # llama3_json's calls may also open with a bare `{`, its `tool_call_start_regex`).
        self.tool_start = getattr(self.tool, "tool_call_start_token", None) or getattr(self.tool, "bot_token", None)
        self.tool_start_regex = getattr(self.tool, "tool_call_start_regex", None)
        self.envelope = CALL_ENVELOPES.get(tool_parser)

    def parse(self, text: str, tools: list[dict] | None, parse_tools: bool = True) -> ParsedReply:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text, chat_completion_request(tools))
            content = content or ""
        if self.tool is None or not parse_tools or not tools:
            return ParsedReply(content, [], reasoning)
        _take_error()
        info = self.tool.extract_tool_calls(content, chat_completion_request(tools))
        error = _take_error()
        if error is not None:
            return self._unparsed(content, reasoning, f"{type(error).__name__}: {error}")
        if not info.tools_called:
            return ParsedReply(content, [], reasoning)
        calls = []
        for tc in info.tool_calls:
            try:
                args = json.loads(tc.function.arguments or "{}")
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):
                return self._unparsed(content, reasoning, f"arguments of {tc.function.name!r} are not a JSON object")
            calls.append(ToolCall(tc.function.name, args))
        # only the whitespace before the calls goes, as `streamable` streams it (was: strip(), and Qwen3's
        # `</think>\n\nSure. <tool_call>` was "Sure." in a plain reply, "\n\nSure." streamed; vLLM keeps it too)
        return ParsedReply((info.content or "").rstrip(), calls, reasoning)

    def parse_forced(self, text: str, tool_choice) -> ParsedReply:
        """The bare JSON a forced tool choice generated, after the thinking of a reasoning model (the engine's grammar
        starts where its reasoning ends: runtime/roles.py hands vLLM the reasoning parser): an array of {name,
        parameters} ("required") or the named tool's arguments object."""
        thought = self.parse(text, None, parse_tools=False)
        try:
            obj = json.loads(thought.content)
        except json.JSONDecodeError:  # cut by max_tokens (or a stop string): no call, no text, as vLLM's "required"
            # (was: the partial JSON as the reply's text, which an agent took as its final answer)
            return ParsedReply("", [], thought.reasoning)
        if isinstance(tool_choice, dict):
            calls = [ToolCall(tool_choice["function"]["name"], obj)] if isinstance(obj, dict) else []
        else:
            calls = [ToolCall(c["name"], c.get("parameters") or {}) for c in obj if isinstance(c, dict) and "name" in c]
        return ParsedReply("", calls, thought.reasoning)

    def _unparsed(self, content: str, reasoning: str | None, why: str) -> ParsedReply:
        """A tool-call block that does not parse stays text for the agent; counted, and one warning line."""
        _failures["count"] += 1
        log.warning("agent.tool_parser=%s could not read a tool call (%s); the reply is kept as text "
                    "(agent/tool_parse_failures)", self.tool_parser_name, " ".join(why.split())[:200])
        return ParsedReply(content, [], reasoning)

    def streamable(self, text: str, tools: list[dict] | None, parse_tools: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a partial generation that are safe to stream: content stops before anything that
        could still turn into a tool call. With a parser that names no start marker, no content streams early."""
        parsed = self.parse(text, tools, parse_tools=False)
        content = parsed.content
        if self.tool is not None and parse_tools and tools:
            if self.tool_start is None:
                return parsed.reasoning, ""
            starts = [content.find(self.tool_start)]
            if self.tool_start_regex is not None and (opened := self.tool_start_regex.search(content)):
                starts.append(opened.start())
            cut = min((i for i in starts if i >= 0), default=-1)
            if cut < 0:  # hold back a suffix that may be the start of the marker
                cut = next((len(content) - k for k in range(min(len(self.tool_start) - 1, len(content)), 0, -1)
                            if self.tool_start.startswith(content[-k:])), len(content))
            # whitespace before a call is stripped from the reply (Qwen3's `</think>\n\n<tool_call>`): held back until
            # text follows it (was: streamed, a blank text block / delta the reply does not have)
            content = content[:cut].rstrip()
        return parsed.reasoning, content


# The runner's one `ReplyParser` per tokenizer and parser names (building one reads the whole vocabulary).
reply_parser = functools.cache(ReplyParser)
