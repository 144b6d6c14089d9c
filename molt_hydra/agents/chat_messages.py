"""Request bodies of both wire formats → one canonical chat request, validated with 4xx errors that say what is wrong.

Canonical messages are what the chat template renders and what the session compares turn to turn:
`{"role": system|user|assistant|tool, "content": str | [{"type": "text", "text"} | {"type": "image", "source"}],
"tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": str}}], "tool_call_id"?}`.
Text-only part lists collapse to a string, so echoing a message in either shape compares equal.
"""

from __future__ import annotations

import base64
import dataclasses
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
    overrides: dict = field(default_factory=dict)  # Sampling fields set by this request (checked by the session)
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage
    tool_choice: str | dict = "auto"  # none | auto | required | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None  # False: at most one tool call is returned
    top_logprobs: int | None = None  # None: no logprobs in the reply; k: the sampled token's plus k alternatives
    response_format: dict | None = None  # vLLM structured output: {"json": schema} / {"json_object": True}
    thinking: bool | None = None  # Anthropic thinking enabled / disabled; None: not asked
    raw_prompt: str | None = None  # /v1/completions: the prompt fed verbatim, no chat template

    def key(self) -> str:
        """What makes two requests the same turn (a client retry)."""
        d = dataclasses.asdict(self)
        d.pop("stream"), d.pop("include_usage")
        return json.dumps(d, sort_keys=True, default=str)


# Fields of each wire format that are accepted but change nothing here (documented in docs/agents.md);
# any field neither honoured nor listed here is refused with a 400 naming it.
IGNORED_FIELDS = {"model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_retention", "stream_options"}
# Fields accepted only at the value that changes nothing (sampling shapers training does not assume).
NEUTRAL_VALUES = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
                  "modalities": (["text"],), "truncation": ("disabled",), "best_of": (1,), "echo": (False,),
                  "include": ([],)}


def check_fields(body: dict, honoured: set[str], api: str) -> None:
    for key, value in body.items():
        if value is None or key in honoured or key in IGNORED_FIELDS:
            continue
        if key in NEUTRAL_VALUES:
            if value not in NEUTRAL_VALUES[key]:
                raise _bad(f"'{key}'={value!r} is not supported by the training chat server ({api}): it would change "
                           f"what is sampled; omit it or send {NEUTRAL_VALUES[key][0]!r}", key)
            continue
        raise _bad(f"unsupported field '{key}' for {api}; honoured: {sorted(honoured)}; accepted and ignored: "
                   f"{sorted(IGNORED_FIELDS)} (see docs/agents.md)", key)


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


_OPENAI_CHAT_FIELDS = {"messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature",
                       "top_p", "n", "stop", "seed", "stream", "logprobs", "top_logprobs", "response_format",
                       "parallel_tool_calls"}


def _sampling(body: dict, max_key: str | tuple[str, ...], temperature_max: float = 2.0) -> dict:
    """Sampling fields the client set (the session checks them against the recipe)."""
    overrides: dict = {}
    for key in (max_key,) if isinstance(max_key, str) else max_key:
        v = _integer(body, key, 1)
        if v is not None:
            overrides["max_tokens"] = v
            break
    for key, lo, hi in (("temperature", 0.0, temperature_max), ("top_p", 1e-9, 1.0)):
        v = _number(body, key, lo, hi)
        if v is not None:
            overrides[key] = v
    for key, lo in (("seed", 0), ("top_k", 1)):
        v = _integer(body, key, lo)
        if v is not None:
            overrides[key] = v
    return overrides


def _openai_tool_choice(v: Any, tools: list[dict] | None, param: str = "tool_choice") -> str | dict:
    if v is None:
        return "auto"
    if isinstance(v, dict) and v.get("type") == "function":
        name = (v.get("function") or {}).get("name") if "function" in v else v.get("name")  # chat / responses shape
        if not isinstance(name, str):
            raise _bad(f"'{param}' names no function", param)
        v = {"type": "function", "function": {"name": name}}
    if v not in ("none", "auto", "required") and not isinstance(v, dict):
        raise _bad(f"'{param}' must be none, auto, required or a named function, got {v!r}", param)
    if v in ("required",) or isinstance(v, dict):
        names = [t["function"]["name"] for t in tools or []]
        if not names:
            raise _bad(f"'{param}'={v!r} needs 'tools'", param)
        if isinstance(v, dict) and v["function"]["name"] not in names:
            raise _bad(f"'{param}' names {v['function']['name']!r}, which is not in tools {names}", param)
    return v


def _response_format(v: Any, param: str = "response_format") -> dict | None:
    """OpenAI response_format (or Responses text.format) → vLLM structured output fields."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = v.get("json_schema", v)  # chat nests it; the Responses API puts it at the top
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad(f"'{param}' json_schema needs a 'schema' object", param)
        return {"json": schema}
    raise _bad(f"'{param}' type must be text, json_object or json_schema, got {kind!r}", param)


def _top_logprobs(body: dict, flag_key: str | None) -> int | None:
    top = _integer(body, "top_logprobs", 0)
    if top is not None and top > 20:
        raise _bad(f"'top_logprobs' must be <= 20, got {top}", "top_logprobs")
    if flag_key is not None and not _flag(body, flag_key):
        if top:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _parallel(body: dict) -> bool | None:
    v = body.get("parallel_tool_calls")
    if v is not None and not isinstance(v, bool):
        raise _bad(f"'parallel_tool_calls' must be a boolean, got {v!r}", "parallel_tool_calls")
    return v


def openai_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    check_fields(body, _OPENAI_CHAT_FIELDS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    canon = [_openai_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    overrides = _sampling(body, ("max_completion_tokens", "max_tokens"))
    stop = _stops(body, "stop")
    if stop is not None:
        overrides["stop"] = stop
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    tools = _openai_tools(body.get("tools"))
    return ChatRequest(
        messages=canon,
        tools=tools,
        overrides=overrides,
        n=_integer(body, "n", 1) or 1,
        stream=_flag(body, "stream"),
        include_usage=bool(stream_options.get("include_usage")),
        tool_choice=_openai_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_parallel(body),
        top_logprobs=_top_logprobs(body, "logprobs"),
        response_format=_response_format(body.get("response_format")),
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


_ANTHROPIC_FIELDS = {"messages", "max_tokens", "system", "temperature", "top_p", "top_k", "stop_sequences", "stream",
                     "tools", "tool_choice", "thinking"}


def _cache_control(v: Any, where: str) -> None:
    """Anthropic's prompt-caching marker (top level, system / content blocks, tools): accepted, changes nothing here,
    as vLLM caches prompt prefixes by itself; only its shape is checked."""
    if v is not None and not (isinstance(v, dict) and v.get("type") == "ephemeral"):
        key = f"{where}.cache_control" if where else "cache_control"
        raise _bad(f"{key} must be {{'type': 'ephemeral'}} (with an optional 'ttl'), got {v!r}", key)


def _cache_controls(body: dict) -> None:
    _cache_control(body.get("cache_control"), "")
    system = body.get("system")
    blocks = [(f"system[{i}]", b) for i, b in enumerate(system)] if isinstance(system, list) else []
    blocks += [(f"tools[{i}]", t) for i, t in enumerate(body.get("tools") or [])]
    for i, m in enumerate(body.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        blocks += [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(content)] if isinstance(content, list) \
            else []
    for where, b in blocks:
        if isinstance(b, dict):
            _cache_control(b.get("cache_control"), where)


def anthropic_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    check_fields(body, _ANTHROPIC_FIELDS | {"cache_control"}, "/v1/messages")
    _cache_controls(body)
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
    overrides = _sampling(body, "max_tokens", temperature_max=1.0)
    stop = _stops(body, "stop_sequences")
    if stop is not None:
        overrides["stop"] = stop
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise _bad("'tools' must be a list of {name, description?, input_schema}", "tools")
        for i, t in enumerate(tools):
            if t.get("type") not in (None, "custom"):  # server tools (web_search, bash, ...) run at Anthropic
                raise _bad(f"tools[{i}] type {t['type']!r} is a server tool; only client tools are served", "tools")
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
    tool_choice, parallel = _anthropic_tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(messages=canon, tools=tools, overrides=overrides, stream=_flag(body, "stream"),
                       tool_choice=tool_choice, parallel_tool_calls=parallel,
                       thinking=_anthropic_thinking(body.get("thinking"), overrides.get("max_tokens")))


def _anthropic_tool_choice(v: Any, tools: list[dict] | None) -> tuple[str | dict, bool | None]:
    if v is None:
        return "auto", None
    kind = v.get("type") if isinstance(v, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": v.get("name")}}
    if mapped is None:
        raise _bad(f"'tool_choice' type must be auto, any, tool or none, got {v!r}", "tool_choice")
    disable = v.get("disable_parallel_tool_use")
    return _openai_tool_choice(mapped, tools), (None if disable is None else not disable)


def _anthropic_thinking(v: Any, max_tokens: int | None) -> bool | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "disabled":
        return False
    if kind != "enabled":
        raise _bad(f"'thinking' type must be enabled or disabled, got {v!r}", "thinking")
    budget = v.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise _bad("'thinking.budget_tokens' must be a positive integer", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})", "thinking")
    return True


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


# --- OpenAI /v1/responses ---

_RESPONSES_FIELDS = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
                     "stream", "text", "parallel_tool_calls", "top_logprobs"}


def responses_request(body: Any) -> ChatRequest:
    """The Responses API as a chat turn. Input items (messages, function_call, function_call_output) become chat
    messages; nothing is stored server-side, so `previous_response_id` is refused: send the whole input each turn."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise _bad("'previous_response_id' is not supported: this server stores no responses; send the full input "
                   "(agent SDKs do so when store=false)", "previous_response_id")
    check_fields(body, _RESPONSES_FIELDS, "/v1/responses")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    canon: list[dict] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        canon.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        _responses_item(item, f"input[{i}]", canon)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise _bad(f"tools[{i}]: only function tools {{type: function, name, parameters}} are served "
                           f"(hosted tools run at OpenAI), got {t!r}", "tools")
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in tools] or None
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text")
    return ChatRequest(
        messages=canon,
        tools=tools,
        overrides=_sampling(body, "max_output_tokens"),
        stream=_flag(body, "stream"),
        tool_choice=_openai_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_parallel(body),
        top_logprobs=_top_logprobs(body, None) if body.get("top_logprobs") else None,
        response_format=_response_format(text.get("format"), "text.format"),
    )


def _responses_item(item: Any, where: str, canon: list[dict]) -> None:
    if not isinstance(item, dict):
        raise _bad(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in _OPENAI_ROLES or item["role"] == "tool":
            raise _bad(f"{where}: message role must be user, system, developer or assistant", where)
        content = item.get("content", "")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                at = f"{where}.content[{j}]"
                ptype = p.get("type") if isinstance(p, dict) else None
                if ptype in ("input_text", "output_text", "text"):
                    parts.append(_text_part(p, at))
                elif ptype == "input_image" and isinstance(p.get("image_url"), str):
                    parts.append({"type": "image", "source": p["image_url"]})
                elif ptype == "refusal" and isinstance(p.get("refusal"), str):
                    parts.append({"type": "text", "text": p["refusal"]})
                else:
                    raise _bad(f"{at}: unsupported content part {ptype!r} (input_text, output_text, input_image)", at)
            content = _content(parts)
        elif not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or a list of parts", where)
        canon.append({"role": _OPENAI_ROLES[item["role"]], "content": content})
    elif kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
            raise _bad(f"{where}: function_call needs a string name and arguments", where)
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
        last = canon[-1] if canon else None
        if last is not None and last["role"] == "assistant":  # the reply's text and its calls are one chat message
            last.setdefault("tool_calls", []).append(call)
        else:
            canon.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        out = item.get("output", "")
        if isinstance(out, list):
            out = _content([_text_part(p, where) if p.get("type") != "input_image"
                            else {"type": "image", "source": p.get("image_url")} for p in out])
        elif not isinstance(out, str):
            raise _bad(f"{where}: function_call_output.output must be a string or a list of parts", where)
        canon.append({"role": "tool", "content": out, "tool_call_id": str(item.get("call_id", ""))})
    elif kind == "reasoning":
        pass  # an echoed reasoning item: chat templates drop earlier turns' reasoning, so it renders nowhere
    else:
        raise _bad(f"{where}: unsupported input item type {kind!r} (message, function_call, function_call_output, "
                   "reasoning)", where)


# --- OpenAI /v1/completions ---

_COMPLETIONS_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "logprobs"}


def completions_request(body: Any) -> ChatRequest:
    """A raw-text completion: the prompt is tokenized as sent, without the chat template."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    check_fields(body, _COMPLETIONS_FIELDS | {"suffix"}, "/v1/completions")
    if body.get("suffix"):
        raise _bad("'suffix' (fill-in-the-middle) is not supported", "suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be one non-empty string", "prompt")
    overrides = _sampling(body, "max_tokens")
    stop = _stops(body, "stop")
    if stop is not None:
        overrides["stop"] = stop
    logprobs = _integer(body, "logprobs", 0)
    if logprobs is not None and logprobs > 5:
        raise _bad(f"'logprobs' must be <= 5, got {logprobs}", "logprobs")
    stream_options = body.get("stream_options") or {}
    return ChatRequest(messages=[], overrides=overrides, n=_integer(body, "n", 1) or 1, stream=_flag(body, "stream"),
                       include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
                       top_logprobs=logprobs, raw_prompt=prompt)


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
        return img.convert("RGB")  # palette, alpha, CMYK, 16-bit grey: RGB, as prompt loading converts
    if source.startswith(("http://", "https://")):
        raise _bad("image URLs are not fetched; send images as base64 data URIs")
    path = source.removeprefix("file://")
    try:
        img = Image.open(path)
        img.load()
    except Exception as e:
        raise _bad(f"cannot open image {path!r}: {e}") from None
    return img.convert("RGB")


def image_data_uri(img) -> str:
    """PIL image → PNG data URI (how datasets' images reach a ChatAgent's messages)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
