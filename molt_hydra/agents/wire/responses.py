"""OpenAI `/v1/responses` as a chat turn. Input items (messages, function_call, function_call_output) become chat
messages; nothing is stored server-side, so `previous_response_id` is refused: send the whole input each turn."""

from __future__ import annotations

import json
import time
from typing import Any

from molt_hydra.agents.wire import request as check
from molt_hydra.agents.wire.openai_chat import ROLES
from molt_hydra.agents.wire.request import ChatRequest, RequestError, bad
from molt_hydra.agents.wire.stream import Stream, new_id, sse

FIELDS = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p", "stream",
          "text", "parallel_tool_calls", "top_logprobs", "include", "reasoning"}
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for log-probs (the Agents SDK sends it)
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}  # of a function tool
# `include` entries that change nothing here: reasoning is never encrypted (a reply's reasoning item carries its text,
# which an echoed item hands back), so a stateless client loses nothing without `encrypted_content`
INCLUDE_IGNORED = {"reasoning.encrypted_content"}


def parse(body: Any) -> ChatRequest:
    if isinstance(body, dict) and body.get("previous_response_id") is not None:
        raise bad("'previous_response_id' is not supported: this server stores no responses; send the full input "
                  "(agent SDKs do so when store=false)", "previous_response_id")
    check.fields(body, FIELDS, "/v1/responses")
    check.stream_options(body, {"include_obfuscation"})
    items = body.get("input")
    if not isinstance(items, (str, list)) or not items:
        raise bad("'input' must be a non-empty string or a non-empty list of items", "input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    canon: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):  # (was: a falsy one, [] or 0, taken as none)
        raise bad(f"'instructions' must be a string, got {instructions!r}", "instructions")
    if instructions:
        canon.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        _item(item, f"input[{i}]", canon)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list", "tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad(f"tools[{i}]: only function tools {{type: function, name, parameters}} are served "
                          f"(hosted tools run at OpenAI), got {t!r}", "tools")
            check.schema(t.get("parameters"), f"tools[{i}].parameters")
            check.description(t.get("description"), f"tools[{i}].description")
            if unknown := sorted(set(t) - TOOL_KEYS):  # e.g. defer_loading: the tool would be hidden until searched
                raise bad(f"tools[{i}] keys {unknown} are not served (served: {sorted(TOOL_KEYS)})", f"tools[{i}]")
        check.unique_names([t["name"] for t in tools])
        strict = check.strict_names(tools, default=True)  # Responses tools are strict unless `strict: false`
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in tools] or None
    else:
        strict = []
    text = {} if body.get("text") is None else body["text"]
    if not isinstance(text, dict):  # (was: a falsy one, [] or "", taken as none)
        raise bad(f"'text' must be an object, got {text!r}", "text")
    if text.get("verbosity") not in (None, "medium") or set(text) - {"format", "verbosity"}:
        raise bad(f"'text' {text!r}: only 'format' is served ('verbosity' only at its default \"medium\": this "
                  "model is not trained to follow it, so another value would change nothing; the OpenAI Agents SDK "
                  "sends \"low\" when an Agent names no model: give it model=ctx.model_name)", "text")
    return ChatRequest(
        messages=canon, tools=tools, overrides=check.sampling(body, ("max_output_tokens",)),
        stream=check.flag(body, "stream"), tool_choice=check.tool_choice(body.get("tool_choice"), tools),
        strict_tools=strict,
        parallel_tool_calls=check.flag(body, "parallel_tool_calls", None),
        top_logprobs=_top_logprobs(body),
        response_format=check.response_format(text.get("format"), "text.format"), format_param="text.format",
        text={"format": text.get("format") or {"type": "text"}, "verbosity": "medium"},
        thinking=_reasoning(body.get("reasoning")), thinking_param="reasoning.effort", prompt_param="input")


def _reasoning(v: Any) -> bool | None:
    """`reasoning`: its effort as the thinking asked for (the OpenAI Agents SDK sends effort "none" by default when
    an Agent names no model); a summary is not written: the whole thinking comes back as the item's content."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(f"'reasoning' must be an object, got {v!r}", "reasoning")
    if unknown := sorted(set(v) - {"effort", "summary", "generate_summary"}):
        raise bad(f"'reasoning' keys {unknown} are not served (served: effort, summary)", "reasoning")
    for key in ("summary", "generate_summary"):
        if v.get(key) is not None:  # (a summary the client would wait for and never get)
            raise bad(f"'reasoning.{key}'={v[key]!r} is not served: no summary is written, the model's whole thinking "
                      "comes back as the reasoning item's content (reasoning_text); omit it", f"reasoning.{key}")
    return check.reasoning_effort(v.get("effort"), "reasoning.effort")


def _top_logprobs(body: dict) -> int | None:
    """Log-probs when `include` asks for them or `top_logprobs` > 0; other `include` entries (hosted tools' outputs,
    server-side images) are refused, naming them."""
    include = [] if body.get("include") is None else body["include"]
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad(f"'include' must be a list of strings, got {include!r}", "include")
    if unknown := sorted(set(include) - INCLUDE_IGNORED - {LOGPROBS}):
        raise bad(f"'include' entries {unknown} are not served (no hosted tools, nothing stored); served: "
                  f"{[LOGPROBS, *sorted(INCLUDE_IGNORED)]}", "include")
    top = check.top_logprobs(body, None)
    return top if LOGPROBS in include or top else None


def _item(item: Any, where: str, canon: list[dict]) -> None:
    if not isinstance(item, dict):
        raise bad(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        if not isinstance(item.get("role"), str) or item["role"] not in ROLES or item["role"] == "tool":
            raise bad(f"{where}: message role must be user, system, developer or assistant", where)
        if item["role"] == "user" and item.get("content") in (None, "", []):  # as OpenAI (was: an empty turn rendered)
            raise bad(f"{where}.content: a user message's content must be a non-empty string or list of parts",
                      f"{where}.content")
        content = check.text_or_parts(item.get("content", ""), f"{where}.content", _part)
        if ROLES[item["role"]] == "assistant" and _thought_alone(canon):  # the reply's text after its reasoning item
            canon[-1]["content"] = content
        else:
            canon.append({"role": ROLES[item["role"]], "content": content})
    elif kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
            raise bad(f"{where}: function_call needs a string name and arguments", where)
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
        if canon and canon[-1]["role"] == "assistant":  # the reply's text and its calls are one chat message
            canon[-1].setdefault("tool_calls", []).append(call)
        else:
            canon.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        out = check.text_or_parts(item.get("output", ""), f"{where}.output", _part)
        canon.append({"role": "tool", "content": out, "tool_call_id": str(item.get("call_id", ""))})
    elif kind == "reasoning":  # an echoed thinking: to the template, as chat's `reasoning` (was: dropped)
        _reasoning_item_in(item, where, canon)
    else:
        raise bad(f"{where}: unsupported input item type {kind!r} (message, function_call, function_call_output, "
                  "reasoning)", where)


def _thought_alone(canon: list[dict]) -> bool:
    """Is the last message an assistant's reasoning item alone, which the reply's text and calls after it join?"""
    last = canon[-1] if canon else {}
    return (last.get("role") == "assistant" and "reasoning" in last and last["content"] == ""
            and "tool_calls" not in last)


def _reasoning_item_in(item: dict, where: str, canon: list[dict]) -> None:
    """A reasoning item opens the assistant message its reply's text and calls join, its thinking under both names,
    as chat's echoed `reasoning` and vLLM's server hand it to the template (Qwen3's renders it after the last user
    message): its `content` text, else its summary's. Thinking encrypted by another server cannot be read: a 400."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise bad(f"{where}: a reasoning item's content / summary must be a list of {{type, text}} parts", where)
    if not parts and item.get("encrypted_content"):
        raise bad(f"{where}.encrypted_content: thinking encrypted by another server cannot be read here; send the "
                  "reasoning item's text as content [{type: reasoning_text, text}], or leave the item out",
                  f"{where}.encrypted_content")
    text = "\n".join(p["text"] for p in parts)
    last = canon[-1] if canon else {}
    if not text:
        return  # no thinking to render (a reasoning item with an empty summary)
    if last.get("role") == "assistant" and last.get("reasoning") is None:  # after its reply's text or call (as vLLM)
        last["reasoning"] = last["reasoning_content"] = text
    elif _thought_alone(canon):  # a second reasoning item before the reply's text: one thinking
        last["reasoning"] = last["reasoning_content"] = f"{last['reasoning']}\n{text}"
    else:
        canon.append({"role": "assistant", "content": "", "reasoning": text, "reasoning_content": text})


def _part(p: Any, at: str) -> dict:
    ptype = p.get("type") if isinstance(p, dict) else None
    if ptype in ("input_text", "output_text", "text"):
        return check.text_part(p, at)
    if ptype == "input_image":
        if not isinstance(p.get("image_url"), str):  # (was: "unsupported content part 'input_image'", a type it serves)
            raise bad(f"{at}: an input_image needs 'image_url', the image's URL or a data: URL (base64); 'file_id' is "
                      "not served: no file is uploaded or stored here", at)
        if p.get("detail") not in (None, "auto", "high"):  # (was: ignored, the image taken whole whatever it asked)
            raise bad(f"{at}: input_image detail={p['detail']!r} is not honoured: the model's image processor takes "
                      "every image at its own full resolution, as 'auto' and 'high' do; downscale the image before "
                      "sending it, or send detail 'auto'", at)
        return {"type": "image", "source": p["image_url"], "at": at}
    if ptype == "refusal" and isinstance(p.get("refusal"), str):
        return {"type": "text", "text": p["refusal"]}
    raise bad(f"{at}: unsupported content part {ptype!r} (input_text, output_text, input_image)", at)


# --- replies ---


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message_item(item_id: str, parts: list[dict], status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}


def body(reply, req: ChatRequest, model: str, rid: str | None = None) -> dict:
    c, status = reply.choices[0], _status(reply.choices[0])
    output = [_reasoning_item(new_id("rs_"), c.reasoning)] if c.reasoning else []
    if c.content or not c.tool_calls:  # a message cut at the cap is "incomplete", as OpenAI's (was: "completed")
        output.append(_message_item(new_id("msg_"), [{"type": "output_text", "text": c.content, "annotations": [],
                                                      "logprobs": c.logprobs or []}], status))
    output += [{"type": "function_call", "id": f"fc_{cid.removeprefix('call_')}", "call_id": cid, "name": tc.name,
                "arguments": json.dumps(tc.arguments), "status": "completed"}
               for cid, tc in zip(c.tool_call_ids, c.tool_calls)]
    usage = {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
             "total_tokens": reply.prompt_tokens + reply.completion_tokens,
             # both required by OpenAI's usage schema (was: no cache_write_tokens: the SDK's Response.model_validate
             # failed on it)
             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens}}
    return {"id": rid or new_id("resp_"), "object": "response", "created_at": int(time.time()),
            "status": status, "error": None, "model": model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None, "usage": usage,
            **_settings(req)}


def _status(c) -> str:
    """Of a reply's message item, and the response's: a turn cut at its token cap is "incomplete"."""
    return "incomplete" if c.finish_reason == "length" else "completed"


def _settings(req: ChatRequest) -> dict:
    """The request's tool settings and `text` (its format), as a response object echoes them (from `response.created`
    on). LangChain's streamed structured output parses the text only where `text.format` says json_schema (was: no
    `text`, and it failed: "Structured Output response does not have a 'parsed' field")."""
    tool_choice = req.tool_choice
    if isinstance(tool_choice, dict):
        tool_choice = {"type": "function", "name": tool_choice["function"]["name"]}
    return {"parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": tool_choice,
            "tools": [dict(t["function"], type="function") for t in req.tools or []], "text": req.text}


class ResponseStream(Stream):
    """Each run of reasoning or content is an output item, opened, filled by deltas and closed."""

    ID_PREFIX = "resp_"
    seq, item_id, text = 0, None, ""  # events sent; the open item's id and text so far
    status = "completed"  # of the message item, known at the end (its item closes there: text is the last run)
    logprobs: list = []  # of the text, known at the end (its item closes there: text is the last run)

    def __init__(self, *args):
        super().__init__(*args)
        self.items: list[dict] = []  # the items streamed, as closed

    def ev(self, kind: str, **data) -> bytes:
        self.seq += 1
        return sse(dict(data, type=kind, sequence_number=self.seq - 1), kind)

    def at(self, **data) -> dict:  # where the open item's text goes
        return dict(item_id=self.item_id, output_index=self.index, content_index=0, **data)

    def shell(self, **data) -> dict:
        """The response object of the lifecycle events (created, in_progress, failed): one id throughout."""
        return {"id": self.id, "object": "response", "created_at": self.created, "status": "in_progress",
                "model": self.model, "output": [], "error": None, "incomplete_details": None, **_settings(self.req),
                **data}

    def start(self) -> list[bytes]:
        return [self.ev(kind, response=self.shell()) for kind in ("response.created", "response.in_progress")]

    def open(self) -> list[bytes]:
        self.item_id, self.text = new_id("msg_" if self.kind == "content" else "rs_"), ""
        if self.kind == "reasoning":
            item = {"type": "reasoning", "id": self.item_id, "summary": [], "status": "in_progress"}
            return [self.ev("response.output_item.added", output_index=self.index, item=item)]
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.ev("response.output_item.added", output_index=self.index,
                        item=_message_item(self.item_id, [], "in_progress")),
                self.ev("response.content_part.added", **self.at(part=part))]

    def piece(self, text: str) -> list[bytes]:
        self.text += text
        if self.kind == "content":
            return [self.ev("response.output_text.delta", **self.at(delta=text, logprobs=[]))]
        return [self.ev("response.reasoning_text.delta", **self.at(delta=text))]

    def close(self) -> list[bytes]:
        if self.kind == "content":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
            self.items.append(_message_item(self.item_id, [part], self.status))
            return [self.ev("response.output_text.done", **self.at(text=self.text, logprobs=self.logprobs)),
                    self.ev("response.content_part.done", **self.at(part=part)),
                    self.ev("response.output_item.done", output_index=self.index, item=self.items[-1])]
        if self.kind == "reasoning":
            self.items.append(_reasoning_item(self.item_id, self.text))
            return [self.ev("response.reasoning_text.done", **self.at(text=self.text)),
                    self.ev("response.output_item.done", output_index=self.index, item=self.items[-1])]
        return []

    def end(self, reply) -> list[bytes]:
        c, out = reply.choices[0], []
        # in the text's .done events too, as in response.completed (was: [] there, the engine's log-probs only in it)
        self.logprobs, self.status = c.logprobs or [], _status(c)
        if not reply.streamed:  # a retry's cached reply: its reasoning and text as a stream sends them, one delta each
            # (was: their items added whole, no output_text.delta: a client reading the deltas had no text)
            for kind, text in (("reasoning", c.reasoning), ("content", c.content)):
                out += self.delta(kind, text) if text else []
        out += self.close()
        final = body(reply, self.req, self.model, self.id)
        # the items streamed stand as sent, ids and text; the reply's others (tool calls, an empty message) follow
        # whole. Not by position: text streamed before a tool call may be blank, which the reply leaves out
        streamed = self.items
        for item in streamed:
            if item["type"] == "message":
                item["content"][0]["logprobs"] = self.logprobs
        rest = [item for item in final["output"] if item["type"] not in {i["type"] for i in streamed}]
        final["output"] = streamed + rest
        for j, item in enumerate(rest, start=len(streamed)):
            if item["type"] != "function_call":
                out.append(self.ev("response.output_item.added", output_index=j, item=item))
            else:  # a call opens empty and one delta carries its arguments, as OpenAI's (was: no delta: a client
                # joining the deltas, as the events are documented, had a call without arguments)
                at = dict(item_id=item["id"], output_index=j)
                out += [self.ev("response.output_item.added", output_index=j,
                                item=dict(item, arguments="", status="in_progress")),
                        self.ev("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                        self.ev("response.function_call_arguments.done", **at, arguments=item["arguments"])]
            out.append(self.ev("response.output_item.done", output_index=j, item=item))
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + [self.ev(done, response=final)]

    def error(self, e: RequestError) -> list[bytes]:
        """The `error` event, then `response.failed`, which ends a failed response in the Responses protocol (was: the
        error alone, the response never ended): its items as streamed, the open one cut short ("incomplete")."""
        output = list(self.items)
        if self.kind == "content":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            output.append(_message_item(self.item_id, [part], "incomplete"))
        elif self.kind == "reasoning":
            output.append(dict(_reasoning_item(self.item_id, self.text), status="incomplete"))
        error = {"code": "server_error" if e.status >= 500 else e.code, "message": e.message}
        return [self.ev("error", code=e.code, message=e.message, param=e.param),
                self.ev("response.failed", response=self.shell(status="failed", output=output, error=error))]
