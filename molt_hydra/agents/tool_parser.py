"""Tool calls parsed from generated text, per model family. The chat server returns them as structured
`tool_calls` (OpenAI) / `tool_use` blocks (Anthropic); the generated token ids are kept as they are.

Hermes / Qwen format: `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`, possibly several per turn.
A block whose body is not a JSON object with a string `name` stays in the text content, so the agent sees what
the model wrote instead of losing it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedReply:
    content: str  # text outside the parsed tool-call blocks, stripped
    tool_calls: list[ToolCall]


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedReply:
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES_BLOCK.finditer(text):
        call = _hermes_call(m.group(1))
        if call is None:
            continue  # left in the content
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return ParsedReply("".join(kept).strip(), calls)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments JSON-encoded a second time
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args)


TOOL_PARSERS = {"hermes": parse_hermes}


def get_tool_parser(name: str):
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
