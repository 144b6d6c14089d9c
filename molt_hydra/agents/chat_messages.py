"""Request bodies of both wire formats → one canonical chat request, validated with 4xx errors that say what is wrong.

Canonical messages are what the chat template renders and what the session compares turn to turn:
`{"role": system|user|assistant|tool, "content": str | [{"type": "text", "text"} | {"type": "image", "source"}],
"tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": str}}], "tool_call_id"?}`.
Text-only part lists collapse to a string, so echoing a message in either shape compares equal.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from typing import Any


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None = None  # OpenAI function-tool shape, as the chat template expects
    overrides: dict = field(default_factory=dict)  # Sampling fields set by this request
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param, "invalid_request_error")


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{key}' must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(f"'{key}' must be an integer >= {lo}, got {v!r}", key)
    return v


def _stops(body: dict, key: str) -> tuple[str, ...] | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _bad(f"'{key}' must be a non-empty string or a list of non-empty strings, got {v!r}", key)
    return tuple(v)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {v!r}", key)
    return v


def _content(parts: list[dict]) -> str | list[dict]:
    """Text-only part lists collapse to one string (templates concatenate text parts)."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _text_part(p: dict, where: str) -> dict:
    if not isinstance(p.get("text"), str):
        raise _bad(f"{where}: text part needs a string 'text'", where)
    return {"type": "text", "text": p["text"]}


# --- OpenAI /v1/chat/completions ---

_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def openai_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    canon = [_openai_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    overrides: dict = {}
    max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
    if max_tokens is not None:
        overrides["max_tokens"] = max_tokens
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 1e-9, 1.0)):
        v = _number(body, key, lo, hi)
        if v is not None:
            overrides[key] = v
    seed = _integer(body, "seed", 0)
    if seed is not None:
        overrides["seed"] = seed
    stop = _stops(body, "stop")
    if stop is not None:
        overrides["stop"] = stop
    n = _integer(body, "n", 1) or 1
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    return ChatRequest(
        messages=canon,
        tools=_openai_tools(body.get("tools")),
        overrides=overrides,
        n=n,
        stream=_flag(body, "stream"),
        include_usage=bool(stream_options.get("include_usage")),
    )


def _openai_message(m: Any, where: str) -> dict:
    if not isinstance(m, dict) or m.get("role") not in _OPENAI_ROLES:
        raise _bad(f"{where} must be an object with role in {sorted(_OPENAI_ROLES)}", where)
    role = _OPENAI_ROLES[m["role"]]
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = _content([_openai_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)])
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of parts", where)
    out: dict = {"role": role, "content": content}
    if role == "assistant" and m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise _bad(f"{where}.tool_calls must be a list", where)
        out["tool_calls"] = [_openai_tool_call(tc, f"{where}.tool_calls[{j}]") for j, tc in enumerate(m["tool_calls"])]
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def _openai_part(p: Any, where: str) -> dict:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind in ("text", "input_text"):
        return _text_part(p, where)
    if kind == "image_url":
        url = p.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise _bad(f"{where}: image_url part needs image_url.url", where)
        return {"type": "image", "source": url}
    raise _bad(f"{where}: unsupported content part type {kind!r} (text, image_url)", where)


def _openai_tool_call(tc: Any, where: str) -> dict:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where} needs function.name", where)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return {"id": str(tc.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _openai_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    return tools or None


# --- Anthropic /v1/messages ---


def anthropic_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    canon: list[dict] = []
    system = body.get("system")
    if system:
        if isinstance(system, list):
            system = _content([_text_part(b, "system") for b in system])
        if not isinstance(system, str):
            raise _bad("'system' must be a string or a list of text blocks", "system")
        canon.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        canon.extend(_anthropic_message(m, f"messages[{i}]"))
    overrides: dict = {}
    max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is not None:
        overrides["max_tokens"] = max_tokens
    for key, lo, hi in (("temperature", 0.0, 1.0), ("top_p", 1e-9, 1.0)):
        v = _number(body, key, lo, hi)
        if v is not None:
            overrides[key] = v
    top_k = _integer(body, "top_k", 1)
    if top_k is not None:
        overrides["top_k"] = top_k
    stop = _stops(body, "stop_sequences")
    if stop is not None:
        overrides["stop"] = stop
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise _bad("'tools' must be a list of {name, description?, input_schema}", "tools")
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
            for t in tools
        ] or None
    return ChatRequest(messages=canon, tools=tools, overrides=overrides, stream=_flag(body, "stream"))


def _anthropic_message(m: Any, where: str) -> list[dict]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"{where} must be an object with role 'user' or 'assistant'", where)
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of blocks", where)
    parts: list[dict] = []
    tool_calls: list[dict] = []
    tool_results: list[dict] = []  # a user turn's tool_result blocks become tool messages before its text
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append(_text_part(b, at))
        elif kind == "image":
            parts.append(_anthropic_image(b, at))
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise _bad(f"{at}: tool_use needs a string name and an object input", at)
            args = json.dumps(b.get("input", {}))
            tool_calls.append({"id": str(b.get("id", "")), "type": "function", "function": {"name": b["name"], "arguments": args}})
        elif kind == "tool_result" and m["role"] == "user":
            inner = b.get("content", "")
            if isinstance(inner, str):
                inner_parts = [{"type": "text", "text": inner}]
            elif isinstance(inner, list):
                inner_parts = [
                    _anthropic_image(x, at) if isinstance(x, dict) and x.get("type") == "image" else _text_part(x, at)
                    for x in inner
                ]
            else:
                raise _bad(f"{at}: tool_result content must be a string or a list of blocks", at)
            tool_results.append(
                {"role": "tool", "content": _content(inner_parts), "tool_call_id": str(b.get("tool_use_id", ""))}
            )
        else:
            raise _bad(f"{at}: unsupported block type {kind!r} in a {m['role']} message", at)
    out = list(tool_results)
    if parts or tool_calls or not tool_results:
        msg: dict = {"role": m["role"], "content": _content(parts)}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    return out


def _anthropic_image(b: dict, where: str) -> dict:
    src = b.get("source")
    if isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str):
        return {"type": "image", "source": f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"}
    if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image", "source": src["url"]}
    raise _bad(f"{where}: image needs source {{type: base64, media_type, data}} or {{type: url, url}}", where)


# --- images ---


def image_sources(messages: list[dict]) -> list[str]:
    """Image sources of these messages, in the order the template renders their placeholders."""
    return [
        p["source"]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    ]


def load_image(source: str):
    """A data: URI (base64) or a local file path → PIL image. The loopback server fetches nothing over the network."""
    from PIL import Image

    if source.startswith("data:"):
        header, _, data = source.partition(",")
        if ";base64" not in header:
            raise _bad("image data URI must be base64-encoded")
        try:
            raw = base64.b64decode(data, validate=True)
            img = Image.open(io.BytesIO(raw))
            img.load()
        except Exception as e:  # binascii / PIL errors: a client's bad bytes, not a server failure
            raise _bad(f"image data URI is not a decodable image: {e}") from None
        return img
    if source.startswith(("http://", "https://")):
        raise _bad("image URLs are not fetched; send images as base64 data URIs")
    path = source.removeprefix("file://")
    try:
        img = Image.open(path)
        img.load()
    except Exception as e:
        raise _bad(f"cannot open image {path!r}: {e}") from None
    return img


def image_data_uri(img) -> str:
    """PIL image → PNG data URI (how datasets' images reach a ChatAgent's messages)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
