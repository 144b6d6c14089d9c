"""OpenAI `/v1/chat/completions` (also the judge endpoint's wire): request → `ChatRequest`, reply → body / chunks,
and the OpenAI error shape that `/v1/completions` and `/v1/responses` share."""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from molt_hydra.agents.wire import request as check
from molt_hydra.agents.wire.request import ChatRequest, RequestError, bad
from molt_hydra.agents.wire.stream import Stream, new_id, sse

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FIELDS = {"messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
          "stop", "seed", "stream", "logprobs", "top_logprobs", "response_format", "parallel_tool_calls",
          "top_k", "reasoning_effort"}  # (top_k: vLLM's extension; the sampling rule checks it as Anthropic's)


def parse(body: Any) -> ChatRequest:
    check.fields(body, FIELDS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    canon = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    overrides = check.sampling(body, ("max_completion_tokens", "max_tokens"), "stop")
    tools = _tools(body.get("tools"))
    return ChatRequest(canon, tools, overrides, n=check.integer(body, "n", 1) or 1, stream=check.flag(body, "stream"),
                       include_usage=check.include_usage(body),
                       tool_choice=check.tool_choice(body.get("tool_choice"), tools),
                       strict_tools=check.strict_names([t["function"] for t in tools or []]),
                       parallel_tool_calls=check.flag(body, "parallel_tool_calls", None),
                       top_logprobs=check.top_logprobs(body, "logprobs"),
                       response_format=check.response_format(body.get("response_format")),
                       thinking=check.reasoning_effort(body.get("reasoning_effort"), "reasoning_effort"),
                       thinking_param="reasoning_effort")


def _message(m: Any, where: str) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
        raise bad(f"{where} must be an object with role in {sorted(ROLES)}", where)
    role = ROLES[m["role"]]
    if m.get("function_call") is not None:  # (was: dropped, the model saw an empty assistant turn)
        raise bad(f"{where}.function_call (legacy function calling) is not served: send the call as 'tool_calls' "
                  "and its result as a 'tool' message", f"{where}.function_call")
    if m.get("prefix") not in (None, False):  # DeepSeek / Mistral prefix completion, which LiteLLM passes on (was:
        # ignored, and the reply a new turn after the message instead of its continuation)
        raise bad(f"{where}.prefix={m['prefix']!r} (a prefill for the reply to continue) is not served: the reply is "
                  "always a new assistant turn after the messages sent, as Anthropic's prefill is refused here; leave "
                  "'prefix' out (the message then stays as history) or drop the message", f"{where}.prefix")
    if m.get("content") is None and role in ("system", "user"):  # as OpenAI (was: served, an empty turn rendered)
        raise bad(f"'{where}.content' is missing or null: a {m['role']} message needs its content, a string or a list "
                  "of parts", f"{where}.content")
    content = "" if m.get("content") is None else m["content"]
    if role == "assistant" and m.get("refusal") is not None:  # another model's refusal in the history, its text as
        refusal = m["refusal"]  # the turn's content, as vLLM renders a refusal part (was: dropped, an empty turn)
        if not isinstance(refusal, str):
            raise bad(f"{where}.refusal must be a string, got {refusal!r}", f"{where}.refusal")
        if refusal and content not in ("", []):
            raise bad(f"{where} has both 'content' and 'refusal': an assistant turn is one or the other; send the "
                      "refusal's text as the content, or only the refusal", f"{where}.refusal")
        content = refusal or content
    # as OpenAI (was: served, an empty turn rendered); an assistant's (a tool-call turn, echoed) and a tool's served
    if content == [] and role in ("system", "user"):
        raise bad(f"Invalid '{where}.content': empty array. Expected an array with minimum length 1, but got an "
                  "empty array instead.", f"{where}.content")
    part = functools.partial(_part, assistant=role == "assistant")
    out: dict = {"role": role, "content": check.text_or_parts(content, f"{where}.content", part)}
    if role == "assistant" and m.get("tool_calls") is not None:
        if not isinstance(m["tool_calls"], list):  # (was: a falsy one, {} or "", taken as none)
            raise bad(f"{where}.tool_calls must be a list, got {m['tool_calls']!r}", f"{where}.tool_calls")
        if m["tool_calls"]:  # (an empty list: as none, the canonical message has no tool_calls)
            out["tool_calls"] = [_tool_call(tc, f"{where}.tool_calls[{j}]") for j, tc in enumerate(m["tool_calls"])]
    # an echoed thinking (`reasoning`, or its older name `reasoning_content`) goes to the template under both names, as
    # vLLM hands it (was: dropped; Qwen3's template renders it in the assistant turns after the last user message)
    key = "reasoning" if m.get("reasoning") is not None else "reasoning_content"
    if role == "assistant" and m.get(key) is not None:
        if not isinstance(m[key], str):
            raise bad(f"{where}.{key} must be a string, got {m[key]!r}", f"{where}.{key}")
        out["reasoning"] = out["reasoning_content"] = m[key]
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    if m.get("name") is not None:  # a participant's name: rendered where the chat template renders one
        if not isinstance(m["name"], str):
            raise bad(f"{where}.name must be a string, got {m['name']!r}", f"{where}.name")
        out["name"] = m["name"]
    return out


def _part(p: Any, where: str, assistant: bool = False) -> dict:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind in ("text", "input_text"):
        return check.text_part(p, where)
    if kind == "refusal" and assistant:  # an assistant's refusal part: its text, as vLLM renders it (was: a 400)
        if not isinstance(p.get("refusal"), str):
            raise bad(f"{where}: refusal part needs a string 'refusal'", where)
        return {"type": "text", "text": p["refusal"]}
    if kind == "image_url":
        url = p.get("image_url")
        detail, url = (url.get("detail"), url.get("url")) if isinstance(url, dict) else (None, url)
        if not isinstance(url, str):
            raise bad(f"{where}: image_url part needs image_url.url", where)
        if detail not in (None, "auto", "high"):  # (was: ignored, the image taken whole whatever it asked)
            raise bad(f"{where}: image_url.detail={detail!r} is not honoured: the model's image processor takes "
                      "every image at its own full resolution, as 'auto' and 'high' do; downscale the image before "
                      "sending it, or send detail 'auto'", where)
        return {"type": "image", "source": url, "at": where}
    raise bad(f"{where}: unsupported content part type {kind!r} (text, image_url{', refusal' if assistant else ''})",
              where)


def _tool_call(tc: Any, where: str) -> dict:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} needs function.name", where)
    args = fn.get("arguments", "{}")
    args = args if isinstance(args, str) else json.dumps(args)
    return {"id": str(tc.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        check.schema(fn.get("parameters"), f"tools[{i}].function.parameters")
        check.description(fn.get("description"), f"tools[{i}].function.description")
    check.unique_names([t["function"]["name"] for t in tools])
    return tools or None


# --- replies ---


def message(c) -> dict:
    msg: dict = {"role": "assistant", "content": c.content if c.content or not c.tool_calls else None}
    # vLLM 0.32's field (was: `reasoning_content`, its older name). Not both: the Agents SDK's stream shows a thought
    if c.reasoning is not None:  # once for each field that carries it
        msg["reasoning"] = c.reasoning
    if c.tool_calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": tc.name, "arguments": json.dumps(tc.arguments)}}
            for cid, tc in zip(c.tool_call_ids, c.tool_calls)]
    return msg


def usage(reply) -> dict:
    """A turn's token counts (/v1/completions: a raw completion is text as sampled, no thinking told apart)."""
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def chat_usage(reply) -> dict:
    # the thinking's tokens, as OpenAI and vLLM's server (with a reasoning parser) report them (was: absent, read as 0
    # by the Agents SDK and LiteLLM; the Responses API reported them)
    return {**usage(reply),
            "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in reply.choices)}}


def finish_reason(c, req: ChatRequest) -> str:
    """A named tool_choice's call ends "stop", as OpenAI's and vLLM's (was: "tool_calls", which they give for a call
    under "auto" / "required" only)."""
    return "stop" if c.finish_reason == "tool_calls" and isinstance(req.tool_choice, dict) else c.finish_reason


def logprobs(c) -> dict | None:
    return None if c.logprobs is None else {"content": c.logprobs}


def body(reply, req: ChatRequest, model: str) -> dict:
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": message(c), "finish_reason": finish_reason(c, req),
                         "logprobs": logprobs(c)}
                        for i, c in enumerate(reply.choices)],
            "usage": chat_usage(reply)}


class ChatStream(Stream):
    ID_PREFIX = "chatcmpl-"

    def chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices}
        return sse(body if usage is None else dict(body, usage=usage))

    def start(self) -> list[bytes]:
        return [self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]

    def piece(self, text: str) -> list[bytes]:
        key = "content" if self.kind == "content" else "reasoning"
        return [self.chunk([{"index": 0, "delta": {key: text}, "finish_reason": None}])]

    def end(self, reply) -> list[bytes]:
        out = []
        for i, c in enumerate(reply.choices):
            # not streamed live (n > 1, a cached retry): the whole text now. Choice 0's role went in `start`: SDKs
            # concatenate every delta's fields, so a second one reads "assistantassistant"
            whole = {"content": c.content, "reasoning": c.reasoning, **({"role": "assistant"} if i else {})}
            if not reply.streamed:
                out.append(self.chunk([{"index": i, "delta": whole, "finish_reason": None}]))
            # the log-probs come with a text delta, as OpenAI sends them: the Agents SDK reads them there only (was: on
            # the finish chunk, and a streamed turn's were lost to it). Not on a choice's first chunk: the openai SDK's
            # accumulator takes that chunk's log-probs twice
            if c.logprobs is not None:
                out.append(self.chunk([{"index": i, "delta": {"content": ""}, "finish_reason": None,
                                        "logprobs": logprobs(c)}]))
            if c.tool_calls:
                calls = [dict(tc, index=j) for j, tc in enumerate(message(c)["tool_calls"])]
                out.append(self.chunk([{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}]))
            out.append(self.chunk([{"index": i, "delta": {}, "finish_reason": finish_reason(c, self.req)}]))
        if self.req.include_usage:
            out.append(self.chunk([], chat_usage(reply)))
        return out + [b"data: [DONE]\n\n"]

    def error(self, e: RequestError) -> list[bytes]:
        return [sse(error(e))]


def error(e: RequestError) -> dict:
    kind = "authentication_error" if e.status == 401 else "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}
