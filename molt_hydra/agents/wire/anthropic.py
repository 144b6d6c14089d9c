"""Anthropic `/v1/messages`: request → `ChatRequest` (tool_use / tool_result blocks as OpenAI-shaped tool calls and
tool messages), reply → message body / events, and Anthropic's error shape."""

from __future__ import annotations

import json
from typing import Any

from molt_hydra.agents.wire import request as check
from molt_hydra.agents.wire.request import ChatRequest, RequestError, bad
from molt_hydra.agents.wire.stream import Stream, new_id, sse

FIELDS = {"messages", "max_tokens", "system", "temperature", "top_p", "top_k", "stop_sequences", "stream", "tools",
          "tool_choice", "thinking", "cache_control", "output_config", "output_format"}
# A client tool's keys served here; eager_input_streaming only changes how a tool_use block is streamed (here: whole).
# Others (input_examples, defer_loading, allowed_callers) change what the model sees or may call: refused.
TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "type", "strict", "eager_input_streaming"}
# A Choice's finish_reason -> Anthropic's stop_reason; "stop" is "stop_sequence" when one ended it, else "end_turn".
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
# Error codes the anthropic SDK branches on, sent as `error.details.error_code`: on thread_unsupported_request its
# tool runner (which asks for a message thread by default) sends the turn again with the full history, unthreaded.
DETAILED_CODES = {"thread_unsupported_request"}


def parse(body: Any) -> ChatRequest:
    if isinstance(body, dict) and body.get("thread") is not None:  # (was: a 400 the tool runner did not recover from)
        raise RequestError(400, "'thread' (a message thread the server keeps) is not served: every turn here carries "
                           "the whole conversation; send 'messages' in full without 'thread' (the anthropic SDK's tool "
                           "runner does so by itself on this error)", "thread", "thread_unsupported_request")
    check.fields(body, FIELDS, "/v1/messages")
    _cache_control(body, "")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    canon = _system(body.get("system"))
    for i, m in enumerate(messages):
        # Anthropic's rule for a user turn (was: accepted, an empty turn rendered). An empty assistant turn is served:
        # this server's own reply is one when a session's length budget is spent, and an agent may echo it back
        if isinstance(m, dict) and m.get("role") == "user" and m.get("content") in ("", []):
            raise bad(f"messages[{i}]: all messages must have non-empty content except for the optional final "
                      "assistant message", f"messages[{i}].content")
        for msg in _message(m, f"messages[{i}]"):
            # as Anthropic (was: served, a blank user turn rendered); an assistant's blank text (streamed before a
            # tool call, echoed back) and a tool result's are served
            if msg["role"] == "user" and isinstance(msg["content"], str) and msg["content"].isspace():
                raise bad(f"messages[{i}]: text content blocks must contain non-whitespace text",
                          f"messages[{i}].content")
            _append_merged(canon, msg)
    if canon[-1]["role"] == "assistant":
        raise bad("the last message is the assistant's (a prefill, to be continued): not supported; end "
                  "'messages' with a user message (to shape the reply, use 'tools' / 'tool_choice' or the prompt)",
                  "messages")
    if isinstance(body.get("stop_sequences"), str):  # as Anthropic (was: taken as a list of one)
        raise bad("'stop_sequences' must be a list of strings, got a string: send it as [\"...\"]", "stop_sequences")
    overrides = check.sampling(body, ("max_tokens",), "stop_sequences", temperature_max=1.0)
    tools = _tools(body.get("tools"))
    tool_choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    thinking, budget = _thinking(body.get("thinking"), overrides.get("max_tokens"))
    fmt, fmt_param = _output_format(body)
    return ChatRequest(messages=canon, tools=tools, overrides=overrides, stream=check.flag(body, "stream"),
                       tool_choice=tool_choice, parallel_tool_calls=parallel, thinking=thinking,
                       thinking_budget=budget, strict_tools=check.strict_names(body.get("tools") or []),
                       response_format=fmt, format_param=fmt_param)


def _system(system: Any, where: str = "system") -> list[dict]:
    """The system prompt (a string or text blocks) at `where` as the canonical messages it starts with."""
    if system is None:
        return []
    if isinstance(system, list):
        parts = [check.text_part(_cache_control(b, f"{where}[{i}]"), where) for i, b in enumerate(system)]
        system = check.content(parts)
        if any(not p["text"] for p in parts) or system.isspace():  # as Anthropic (was: served, a blank prompt)
            raise bad(f"{where}: text content blocks must be non-empty and contain non-whitespace text (leave the "
                      "block out)", where)
    if not isinstance(system, str):
        raise bad(f"'{where}' must be a string or a list of text blocks, got {system!r}", where)
    return [{"role": "system", "content": system}] if system else []


def _cache_control(block: Any, where: str) -> Any:
    """`block`, once its Anthropic prompt-caching marker (top level, system / content blocks, tools) is checked: it
    is accepted and changes nothing here, as vLLM caches prompt prefixes by itself; only its shape is checked."""
    v = block.get("cache_control") if isinstance(block, dict) else None
    if v is not None and not (isinstance(v, dict) and v.get("type") == "ephemeral"):
        key = f"{where}.cache_control" if where else "cache_control"
        raise bad(f"{key} must be {{'type': 'ephemeral'}} (with an optional 'ttl'), got {v!r}", key)
    return block


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise bad("'tools' must be a list of {name, description?, input_schema}", "tools")
    for i, t in enumerate(tools):
        _cache_control(t, f"tools[{i}]")
        if t.get("type") not in (None, "custom"):  # server tools (web_search, bash, ...) run at Anthropic
            raise bad(f"tools[{i}] type {t['type']!r} is a server tool; only client tools are served", "tools")
        if unknown := sorted(set(t) - TOOL_KEYS):
            raise bad(f"tools[{i}] keys {unknown} are not served (served: {sorted(TOOL_KEYS)})", f"tools[{i}]")
    check.unique_names([t["name"] for t in tools])
    return [{"type": "function", "function": {
        "name": t["name"], "description": check.description(t.get("description", ""), f"tools[{i}].description"),
        "parameters": check.schema(t.get("input_schema"), f"tools[{i}].input_schema") or {}}}
        for i, t in enumerate(tools)] or None


def _tool_choice(v: Any, tools: list[dict] | None) -> tuple[str | dict, bool | None]:
    if v is None:
        return "auto", None
    kind = v.get("type") if isinstance(v, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": v.get("name")}}
    if mapped is None:
        raise bad(f"'tool_choice' type must be auto, any, tool or none, got {v!r}", "tool_choice")
    keys = {"type", *(["disable_parallel_tool_use"] if kind != "none" else []), *(["name"] if kind == "tool" else [])}
    if unknown := sorted(set(v) - keys):  # as Anthropic (was: ignored)
        raise bad(f"tool_choice.{unknown[0]}: Extra inputs are not permitted (tool_choice type {kind!r} takes "
                  f"{sorted(keys)})", "tool_choice")
    disable = check.flag(v, "disable_parallel_tool_use", None)
    if kind in ("any", "tool") and not tools:  # (was: "'tool_choice'='required' needs 'tools'", a value not sent)
        raise bad(f"'tool_choice' {{type: {kind!r}}} needs 'tools': send the tools it may call", "tool_choice")
    return check.tool_choice(mapped, tools), (None if disable is None else not disable)


def _thinking(v: Any, max_tokens: int | None) -> tuple[bool | None, int | None]:
    """(thinking enabled / disabled / not asked, its budget_tokens); the session checks both against the model.
    `adaptive` (Claude decides whether and how long to think) is what the policy does anyway: as not asked."""
    if v is None:
        return None, None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad(f"'thinking' type must be enabled, adaptive or disabled, got {v!r}", "thinking")
    if unknown := sorted(set(v) - {"type", "budget_tokens", "display"}):
        raise bad(f"'thinking' keys {unknown} are not served (served: type, budget_tokens, display)", "thinking")
    if v.get("display") not in (None, "summarized"):  # (was: ignored, and the thinking sent in full)
        raise bad(f"'thinking.display'={v['display']!r} is not served: thinking comes back in full, as 'summarized' "
                  "(omit display, or leave the thinking blocks unread)", "thinking.display")
    if kind != "enabled":
        if v.get("budget_tokens") is not None:  # (was: ignored, as Anthropic refuses it: an extra input)
            raise bad(f"'thinking.budget_tokens' goes with type 'enabled' only; with {kind!r} it bounds nothing (the "
                      "policy thinks as it was trained to): omit it, or send type 'enabled'", "thinking.budget_tokens")
        return (False if kind == "disabled" else None), None
    budget = v.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise bad("'thinking.budget_tokens' must be a positive integer", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise bad(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})", "thinking")
    return True, budget


def _output_format(body: dict) -> tuple[dict | None, str]:
    """Structured output: `output_config.format` (what the SDK's messages.parse sends) or the older top-level
    `output_format` (LiteLLM), `{type: json_schema, schema}`, as vLLM's; `output_config.effort` only at its default
    "high": how hard Claude tries has no knob in a policy that does what it was trained to."""
    config, legacy = body.get("output_config"), body.get("output_format")
    if config is not None and not isinstance(config, dict):
        raise bad(f"'output_config' must be an object, got {config!r}", "output_config")
    config = config or {}
    if unknown := sorted(set(config) - {"format", "effort"}):
        raise bad(f"'output_config' keys {unknown} are not served (served: effort, format)", "output_config")
    if config.get("effort") not in (None, "high"):
        raise bad(f"'output_config.effort'={config['effort']!r} is not served: the policy has no effort setting and "
                  "answers as trained (Anthropic's default, 'high'); omit it", "output_config.effort")
    fmt, param = config.get("format"), "output_config.format"
    if legacy is not None:
        if fmt is not None:
            raise bad("'output_format' and 'output_config.format' are both set: send one", "output_format")
        fmt, param = legacy, "output_format"
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
        raise bad(f"'{param}' must be {{'type': 'json_schema', 'schema': {{...}}}}, got {fmt!r}", param)
    return check.response_format(fmt, param), param


def _message(m: Any, where: str) -> list[dict]:
    """One Anthropic message → canonical messages: a user turn's tool_result blocks (first, as Anthropic requires)
    become tool messages."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise bad(f"{where} must be an object with role 'user', 'assistant' or 'system'", where)
    content = m.get("content")
    if m["role"] == "system":  # the SDK's SystemMessageParam, which LangChain sends where the agent put it: rendered
        # there, as the template renders a system message (was: a 400 refusing the role)
        system = _system(content, f"{where}.content")
        if not system or system[0]["content"].isspace():
            raise bad(f"{where}: a system message's content must be non-empty text", f"{where}.content")
        return system
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of blocks", where)
    parts, tool_calls, thoughts, out = [], [], [], []  # out: the tool results first, as tool messages
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _cache_control(b, at).get("type") if isinstance(b, dict) else None
        if kind in ("text", "image"):
            if kind == "text" and b.get("text") == "" and m["role"] == "user":  # as Anthropic (was: accepted); a
                raise bad(f"{at}: text content blocks must be non-empty (leave the block out)", at)  # tool's: served
            parts.append(_part(b, at))
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad(f"{at}: tool_use needs a string name and an object input", at)
            tool_calls.append({"id": str(b.get("id", "")), "type": "function",
                               "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            thoughts.append(_thought(b, at))
        elif kind == "tool_result" and m["role"] == "user":
            if parts:  # as Anthropic: a 400 (was: silently moved ahead of the text, not the turn that was sent)
                first = next(i for i, x in enumerate(content) if x.get("type") in ("text", "image"))
                raise bad(f"{at}: tool_result blocks must come first in a user message, but {where}.content[{first}] "
                          f"is a {content[first]['type']} block before it; put the text and images after every "
                          f"tool_result", at)
            result = _tool_result(b, at)
            out.append({"role": "tool", "content": result, "tool_call_id": str(b.get("tool_use_id", ""))})
        else:
            raise bad(f"{at}: unsupported block type {kind!r} in a {m['role']} message", at)
    if parts or tool_calls or thoughts or not out:
        msg: dict = {"role": m["role"], "content": check.content(parts)}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        if thoughts:  # under both names, as chat's echoed `reasoning` (was: dropped)
            msg["reasoning"] = msg["reasoning_content"] = "\n".join(thoughts)
        out.append(msg)
    return out


def _thought(b: dict, where: str) -> str:
    """An echoed thinking block's text, which reaches the chat template as chat's echoed `reasoning` does (Qwen3's
    renders it in the turns after the last user message). A redacted_thinking block is thinking Anthropic encrypted,
    which nothing here can read (this server never sends one): a 400, not a thought silently left out."""
    if b["type"] == "redacted_thinking":
        raise bad(f"{where}: a redacted_thinking block is thinking encrypted by Anthropic, which this server cannot "
                  "read; leave the block out (or send its thinking as a thinking block)", where)
    if not isinstance(b.get("thinking"), str):
        raise bad(f"{where}: a thinking block needs a string 'thinking'", where)
    return b["thinking"]


def _append_merged(canon: list[dict], msg: dict) -> None:
    """Append `msg`, merged into the message before it when both are the user's or both the assistant's: Anthropic
    joins consecutive same-role messages into one turn (a chat template would render two). Their texts are joined by
    a blank line; an assistant's tool calls follow its text, as in one Anthropic message."""
    prev = canon[-1] if canon else None
    if prev is None or msg["role"] not in ("user", "assistant") or prev["role"] != msg["role"]:
        canon.append(msg)
        return
    if isinstance(prev["content"], str) and isinstance(msg["content"], str):  # text alone
        prev["content"] = "\n\n".join(c for c in (prev["content"], msg["content"]) if c)
    else:  # images too: parts, which the template renders one after the other
        a, b = ([{"type": "text", "text": c}] if isinstance(c, str) else c for c in (prev["content"], msg["content"]))
        gap = [{"type": "text", "text": "\n\n"}] if prev["content"] and msg["content"] else []
        prev["content"] = check.content([p for p in a + gap + b if p["type"] != "text" or p["text"]])
    if msg.get("tool_calls"):
        prev["tool_calls"] = prev.get("tool_calls", []) + msg["tool_calls"]
    if msg.get("reasoning"):
        thought = "\n".join(filter(None, (prev.get("reasoning"), msg["reasoning"])))
        prev["reasoning"] = prev["reasoning_content"] = thought


def _tool_result(b: dict, where: str) -> str | list[dict]:
    """A tool_result's content; `is_error: true` marks it "Error: " in front, the model's only way to see it (chat
    templates have no field for a failed tool call)."""
    is_error = b.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad(f"{where}.is_error must be a boolean", where)
    content = check.text_or_parts(b.get("content", ""), f"{where}.content", _part)
    if not is_error:
        return content
    if isinstance(content, str):
        return "Error: " + content
    return [{"type": "text", "text": "Error: "}, *content]


def _part(b: Any, where: str) -> dict:
    """A text or image block (of a message or a tool result)."""
    kind = _cache_control(b, where).get("type") if isinstance(b, dict) else None
    if kind == "text":
        return check.text_part(b, where)
    src = b.get("source") if kind == "image" else None
    if isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str):
        return {"type": "image", "source": f"data:{src.get('media_type', 'image/png')};base64,{src['data']}",
                "at": where}
    if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image", "source": src["url"], "at": where}
    raise bad(f"{where}: expected a text block or an image with source {{type: base64, media_type, data}} or "
              "{type: url, url}", where)


# --- replies ---


def _text_block(kind: str, text: str) -> dict:
    """A run of "reasoning" (a thinking block) or of "content" (a text block)."""
    if kind == "content":
        return {"type": "text", "text": text}
    return {"type": "thinking", "thinking": text, "signature": ""}


def _blocks(c) -> list[dict]:
    blocks = [_text_block(kind, text) for kind, text in (("reasoning", c.reasoning), ("content", c.content)) if text]
    return blocks + [{"type": "tool_use", "id": "toolu_" + cid.removeprefix("call_"), "name": tc.name,
                      "input": tc.arguments} for cid, tc in zip(c.tool_call_ids, c.tool_calls)]


def body(reply, req: ChatRequest, model: str) -> dict:
    c = reply.choices[0]
    stop_reason = STOP_REASONS.get(c.finish_reason, "end_turn" if c.stop_sequence is None else "stop_sequence")
    if stop_reason == "max_tokens" and reply.context_full:
        stop_reason = "model_context_window_exceeded"
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": _blocks(c),
            "stop_reason": stop_reason, "stop_sequence": c.stop_sequence,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}}


def _whole(block: dict) -> tuple[dict, dict]:
    """A block streamed whole: it starts empty and one delta carries all of it."""
    if block["type"] == "tool_use":
        return dict(block, input={}), {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    key = block["type"]  # thinking / text
    return dict(block, **{key: ""}), {"type": f"{key}_delta", key: block[key]}


class MessageStream(Stream):
    """Each run of reasoning or content is a content block (thinking / text); tool_use blocks are sent whole."""

    ID_PREFIX = "msg_"

    @staticmethod
    def ev(kind: str, data: dict) -> bytes:
        return sse(dict(data, type=kind), kind)

    def start(self) -> list[bytes]:
        # input_tokens is known before the first token: the session tokenized the prompt already
        start = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": self.session.last_prompt_tokens, "output_tokens": 0}}
        return [self.ev("message_start", {"message": start})]

    def open(self) -> list[bytes]:
        return [self.ev("content_block_start", {"index": self.index, "content_block": _text_block(self.kind, "")})]

    def piece(self, text: str) -> list[bytes]:
        key = "text" if self.kind == "content" else "thinking"
        delta = {"type": f"{key}_delta", key: text}
        return [self.ev("content_block_delta", {"index": self.index, "delta": delta})]

    def close(self) -> list[bytes]:
        return [] if self.kind is None else [self.ev("content_block_stop", {"index": self.index})]

    def end(self, reply) -> list[bytes]:
        out = self.close()
        # the blocks streamed stand as sent; the reply's others (tool calls, all of a cached reply) follow whole. Not
        # by position: text streamed before a tool call may be blank, which the reply leaves out
        sent = {"thinking" if kind == "reasoning" else "text" for kind in self.kinds_sent} if reply.streamed else set()
        for block in [b for b in _blocks(reply.choices[0]) if b["type"] not in sent]:
            self.index += 1
            started, delta = _whole(block)
            out += [self.ev("content_block_start", {"index": self.index, "content_block": started}),
                    self.ev("content_block_delta", {"index": self.index, "delta": delta}),
                    self.ev("content_block_stop", {"index": self.index})]
        final = body(reply, self.req, self.model)
        delta = {key: final[key] for key in ("stop_reason", "stop_sequence")}
        return out + [self.ev("message_delta", {"delta": delta, "usage": final["usage"]}), self.ev("message_stop", {})]

    def error(self, e: RequestError) -> list[bytes]:
        return [sse(error(e), "error")]


def error(e: RequestError) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
        e.status, "invalid_request_error")
    out = {"type": "api_error" if e.status >= 500 else kind, "message": e.message}
    if e.code in DETAILED_CODES:
        out["details"] = {"error_code": e.code}
    return {"type": "error", "error": out}
