"""Loopback chat server over the token-exact sessions: OpenAI `/v1/chat/completions`, `/v1/responses`,
`/v1/completions`, `/v1/models` and Anthropic `/v1/messages`, plus an unrecorded judge endpoint.

One server per runner process, bound to 127.0.0.1 on a free port, on its OWN thread and event loop: a turn runs on
the agent's loop (where the engine client lives), so a synchronous client that blocks that loop is detected and
answered with an error naming the fix instead of deadlocking. Every route but `/health` needs the per-run API key
(`Authorization: Bearer KEY`, scheme case-insensitive, or `x-api-key: KEY`), else 401. Session routes live under
`/s/{session_id}`: the OpenAI SDK takes `base_url=.../s/{sid}/v1`, the Anthropic SDK `base_url=.../s/{sid}`, a judge
client `base_url=.../s/{sid}/judge/v1`. Every error, 404 / 405 / 413 included, is in the API's own JSON error shape.
Streaming is true token streaming: text reaches the client as the engine samples it; tool calls are sent whole once
the generation ends.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import threading
import time

from aiohttp import web

from molt_hydra.agents.chat_messages import (
    ChatRequest,
    RequestError,
    anthropic_request,
    completions_request,
    openai_request,
    responses_request,
)
from molt_hydra.agents.chat_session import ChatSession, Choice, TurnReply

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20  # base64 images make bodies large
BLOCKED_LOOP_S = 10.0  # the agent's loop did not run a no-op for this long: something blocks it


class ChatServer:
    def __init__(self, api_key: str | None = None, host: str = "127.0.0.1", model_name: str = "policy"):
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.host = host
        self.model_name = model_name
        self.sessions: dict[str, ChatSession] = {}
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("ChatServer is not started")
        return f"http://{self.host}:{self.port}"

    def session_url(self, session_id: str) -> str:
        return f"{self.url}/s/{session_id}"

    async def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chat-server", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._serve(), self._loop))

    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._openai)
        app.router.add_post("/s/{sid}/v1/responses", self._responses)
        app.router.add_post("/s/{sid}/v1/completions", self._completions)
        app.router.add_post("/s/{sid}/v1/messages", self._anthropic)
        app.router.add_post("/s/{sid}/judge/v1/chat/completions", self._judge)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._loop is None:
            return
        if self._runner is not None:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop))
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()
        self._loop = self._thread = None

    def open_session(self, session: ChatSession) -> None:
        session.loop = asyncio.get_running_loop()  # turns run where the agent and the engine client live
        self.sessions[session.session_id] = session

    def close_session(self, session_id: str):
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise RuntimeError(f"unknown session {session_id}")
        return session.close()

    # --- routes ---

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name})

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _openai_error(RequestError(401, "invalid API key", code="invalid_api_key"))
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "molt_hydra"}
        return web.json_response({"object": "list", "data": [model]})

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, openai_request, _openai_error, self._openai_body, self._openai_stream)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, responses_request, _openai_error, self._responses_body,
                                self._responses_stream)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, completions_request, _openai_error, self._completions_body,
                                self._completions_stream)

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, anthropic_request, _anthropic_error, self._anthropic_body,
                                self._anthropic_stream)

    async def _judge(self, request: web.Request) -> web.StreamResponse:
        try:
            session, body = await self._accept(request)
            req = openai_request(body)
            reply = await self._on_agent_loop(session, session.judge(req))
        except RequestError as e:
            return _openai_error(e)
        except Exception as e:
            log.exception("judge request failed")
            return _openai_error(RequestError(500, f"generation failed: {failure_text(e)}", code="server_error"))
        return web.json_response(self._openai_body(reply, req))

    async def _turn(self, request, parse, error, body_of, stream_with) -> web.StreamResponse:
        try:
            session, body = await self._accept(request)
            req = parse(body)
            if req.stream:
                return await stream_with(request, session, req)
            reply = await self._on_agent_loop(session, session.complete(req))
        except RequestError as e:
            return error(e)
        except Exception as e:
            log.exception("%s failed", request.path)
            return error(RequestError(500, f"generation failed: {failure_text(e)}", code="server_error"))
        return web.json_response(body_of(reply, req))

    async def _on_agent_loop(self, session: ChatSession, coro):
        """Run a session coroutine on the agent's loop; refuse loudly when that loop is blocked."""
        ping = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), session.loop)
        try:
            await asyncio.wait_for(asyncio.wrap_future(ping), BLOCKED_LOOP_S)
        except TimeoutError:
            coro.close()
            raise RequestError(
                400, f"the agent's event loop has been blocked for {BLOCKED_LOOP_S:.0f} s, so its turn cannot run: a "
                "synchronous client (openai.OpenAI, anthropic.Anthropic, requests, a sync framework call) inside "
                "async run()? Use the async client (AsyncOpenAI / AsyncAnthropic / the framework's async API) or "
                "move the blocking code off the loop with `await asyncio.to_thread(fn, ...)`", code="event_loop_blocked"
            ) from None
        fut = asyncio.run_coroutine_threadsafe(coro, session.loop)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    async def _accept(self, request: web.Request) -> tuple[ChatSession, object]:
        if not self._authorized(request):
            raise RequestError(401, "invalid API key", code="invalid_api_key")
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise RequestError(404, f"unknown session {request.match_info['sid']!r}", code="unknown_session")
        try:
            return session, json.loads(await request.text())
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        return hmac.compare_digest(key.encode(), self.api_key.encode())

    async def _sse(self, request: web.Request, session: ChatSession, req: ChatRequest, events) -> web.StreamResponse:
        """Stream a turn: `events(kind, payload)` is an async generator of SSE byte chunks fed by ("start"|
        "reasoning"|"content"|"end", ...) as the session generates on the agent's loop."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_delta(kind: str, text: str) -> None:  # called on the agent's loop
            loop.call_soon_threadsafe(queue.put_nowait, (kind, text))

        async def produce():
            try:
                reply = await self._on_agent_loop(session, session.complete(req, on_delta))
                queue.put_nowait(("end", reply))
            except Exception as e:
                queue.put_nowait(("error", e))

        task = asyncio.ensure_future(produce())
        first = await queue.get()
        if first[0] == "error":  # nothing was sent yet: a plain JSON error
            raise first[1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        gen = events()
        await gen.asend(None)
        item = first
        try:
            while True:
                if item[0] == "error":
                    log.error("stream failed: %s", failure_text(item[1]))
                    await resp.write(f"event: error\ndata: {json.dumps({'error': failure_text(item[1])})}\n\n".encode())
                    break
                for chunk in await gen.asend(item):
                    await resp.write(chunk)
                if item[0] == "end":
                    break
                item = await queue.get()
        finally:
            await task
        await resp.write_eof()
        return resp

    # --- OpenAI chat wire ---

    def _openai_body(self, reply: TurnReply, req: ChatRequest) -> dict:
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": i, "message": _openai_message(c), "finish_reason": c.finish_reason,
                 "logprobs": self._logprobs(c, req)}
                for i, c in enumerate(reply.choices)
            ],
            "usage": _openai_usage(reply),
        }

    def _logprobs(self, c: Choice, req: ChatRequest) -> dict | None:
        return None if c.logprobs is None else {"content": c.logprobs}

    async def _openai_stream(self, request, session: ChatSession, req: ChatRequest) -> web.StreamResponse:
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n".encode()

        async def events():
            kind, payload = yield
            out = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
            while True:
                if kind in ("content", "reasoning"):
                    key = "content" if kind == "content" else "reasoning_content"
                    out.append(chunk([{"index": 0, "delta": {key: payload}, "finish_reason": None}]))
                elif kind == "end":
                    out += self._openai_stream_end(payload, req, chunk)
                kind, payload = yield out
                out = []

        return await self._sse(request, session, req, events)

    def _openai_stream_end(self, reply: TurnReply, req: ChatRequest, chunk) -> list[bytes]:
        out = []
        for i, c in enumerate(reply.choices):
            if not reply.streamed:  # not streamed live (n > 1, a cached retry): the whole text now
                out.append(chunk([{"index": i, "delta": {"role": "assistant", "content": c.content,
                                                         "reasoning_content": c.reasoning}, "finish_reason": None}]))
            if c.tool_calls:
                calls = _openai_message(c)["tool_calls"]
                deltas = [dict(tc, index=j) for j, tc in enumerate(calls)]
                out.append(chunk([{"index": i, "delta": {"tool_calls": deltas}, "finish_reason": None}]))
            out.append(chunk([{"index": i, "delta": {}, "finish_reason": c.finish_reason,
                               "logprobs": self._logprobs(c, req)}]))
        if req.include_usage:
            out.append(chunk([], _openai_usage(reply)))
        out.append(b"data: [DONE]\n\n")
        return out

    # --- OpenAI completions wire ---

    def _completions_body(self, reply: TurnReply, req: ChatRequest) -> dict:
        return {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": i, "text": c.content, "finish_reason": "length" if c.finish_reason == "length"
                         else "stop", "logprobs": self._completion_logprobs(c, req)}
                        for i, c in enumerate(reply.choices)],
            "usage": _openai_usage(reply),
        }

    def _completion_logprobs(self, c: Choice, req: ChatRequest) -> dict | None:
        chat = self._logprobs(c, req)
        if chat is None:
            return None
        entries = chat["content"]
        offsets, pos = [], 0
        for e in entries:
            offsets.append(pos)
            pos += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    async def _completions_stream(self, request, session: ChatSession, req: ChatRequest) -> web.StreamResponse:
        cid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(text: str, finish=None, usage=None) -> bytes:
            body = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [] if usage else [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
            if usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n".encode()

        async def events():
            kind, payload = yield
            while True:
                out = []
                if kind == "content":
                    out.append(chunk(payload))
                elif kind == "end":
                    c = payload.choices[0]
                    if not payload.streamed:
                        out.append(chunk(c.content))
                    out.append(chunk("", "length" if c.finish_reason == "length" else "stop"))
                    if req.include_usage:
                        out.append(chunk("", usage=_openai_usage(payload)))
                    out.append(b"data: [DONE]\n\n")
                kind, payload = yield out

        return await self._sse(request, session, req, events)

    # --- OpenAI responses wire ---

    def _responses_body(self, reply: TurnReply, req: ChatRequest, rid: str | None = None) -> dict:
        c = reply.choices[0]
        output: list[dict] = []
        if c.reasoning:
            output.append({"type": "reasoning", "id": f"rs_{secrets.token_hex(12)}", "summary": [],
                           "content": [{"type": "reasoning_text", "text": c.reasoning}], "status": "completed"})
        if c.content or not c.tool_calls:
            output.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                           "status": "completed",
                           "content": [{"type": "output_text", "text": c.content, "annotations": [],
                                        "logprobs": (self._logprobs(c, req) or {}).get("content", [])}]})
        for cid, tc in zip(c.tool_call_ids, c.tool_calls):
            output.append({"type": "function_call", "id": f"fc_{cid.removeprefix('call_')}", "call_id": cid,
                           "name": tc.name, "arguments": json.dumps(tc.arguments), "status": "completed"})
        incomplete = c.finish_reason == "length"
        return {
            "id": rid or f"resp_{secrets.token_hex(12)}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str)
            else {"type": "function", "name": req.tool_choice["function"]["name"]},
            "tools": [dict(t["function"], type="function") for t in req.tools or []],
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
                      "total_tokens": reply.prompt_tokens + reply.completion_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }

    async def _responses_stream(self, request, session: ChatSession, req: ChatRequest) -> web.StreamResponse:
        rid, seq = f"resp_{secrets.token_hex(12)}", iter(range(1 << 30))

        def ev(kind: str, **data) -> bytes:
            return f"event: {kind}\ndata: {json.dumps(dict(data, type=kind, sequence_number=next(seq)))}\n\n".encode()

        async def events():
            shell = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                     "model": self.model_name, "output": [], "error": None, "incomplete_details": None,
                     "tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
            kind, payload = yield
            out = [ev("response.created", response=shell), ev("response.in_progress", response=shell)]
            open_kind, index, item_id, text = None, -1, None, ""

            def close() -> list[bytes]:
                if open_kind == "content":
                    part = {"type": "output_text", "text": text, "annotations": []}
                    return [ev("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                               text=text),
                            ev("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                               part=part),
                            ev("response.output_item.done", output_index=index,
                               item={"type": "message", "id": item_id, "role": "assistant", "status": "completed",
                                     "content": [part]})]
                if open_kind == "reasoning":
                    item = {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
                            "content": [{"type": "reasoning_text", "text": text}]}
                    return [ev("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                               text=text),
                            ev("response.output_item.done", output_index=index, item=item)]
                return []

            while True:
                if kind in ("content", "reasoning"):
                    if kind != open_kind:
                        out += close()
                        open_kind, index, item_id, text = kind, index + 1, f"{'msg' if kind == 'content' else 'rs'}_" \
                            f"{secrets.token_hex(12)}", ""
                        if kind == "content":
                            out += [ev("response.output_item.added", output_index=index,
                                       item={"type": "message", "id": item_id, "role": "assistant",
                                             "status": "in_progress", "content": []}),
                                    ev("response.content_part.added", item_id=item_id, output_index=index,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
                        else:
                            out.append(ev("response.output_item.added", output_index=index,
                                          item={"type": "reasoning", "id": item_id, "summary": [],
                                                "status": "in_progress"}))
                    text += payload
                    name = "response.output_text.delta" if kind == "content" else "response.reasoning_text.delta"
                    out.append(ev(name, item_id=item_id, output_index=index, content_index=0, delta=payload,
                                  **({"logprobs": []} if kind == "content" else {})))
                elif kind == "end":
                    out += close()
                    final = self._responses_body(payload, req, rid)
                    # items not streamed live (tool calls, or all of a cached reply) are announced whole
                    streamed = index + 1 if payload.streamed else 0
                    for j, item in enumerate(final["output"][streamed:], start=streamed):
                        out.append(ev("response.output_item.added", output_index=j, item=item))
                        if item["type"] == "function_call":
                            out.append(ev("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=j, arguments=item["arguments"]))
                        out.append(ev("response.output_item.done", output_index=j, item=item))
                    done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                    out.append(ev(done, response=final))
                kind, payload = yield out
                out = []

        return await self._sse(request, session, req, events)

    # --- Anthropic wire ---

    def _anthropic_body(self, reply: TurnReply, req: ChatRequest) -> dict:
        c = reply.choices[0]
        return {
            "id": f"msg_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": _anthropic_blocks(c),
            "stop_reason": _anthropic_stop_reason(c),
            "stop_sequence": c.stop_sequence,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
        }

    async def _anthropic_stream(self, request, session: ChatSession, req: ChatRequest) -> web.StreamResponse:
        mid = f"msg_{secrets.token_hex(12)}"

        def ev(kind: str, data: dict) -> bytes:
            return f"event: {kind}\ndata: {json.dumps(dict(data, type=kind))}\n\n".encode()

        async def events():
            kind, payload = yield
            # input_tokens is known before the first token: the session tokenized the prompt already
            start = {"id": mid, "type": "message", "role": "assistant", "model": self.model_name, "content": [],
                     "stop_reason": None, "stop_sequence": None,
                     "usage": {"input_tokens": session.last_prompt_tokens, "output_tokens": 0}}
            out = [ev("message_start", {"message": start})]
            open_kind, index = None, -1
            while True:
                if kind in ("content", "reasoning"):
                    if kind != open_kind:
                        if open_kind is not None:
                            out.append(ev("content_block_stop", {"index": index}))
                        open_kind, index = kind, index + 1
                        block = {"type": "text", "text": ""} if kind == "content" else \
                            {"type": "thinking", "thinking": "", "signature": ""}
                        out.append(ev("content_block_start", {"index": index, "content_block": block}))
                    delta = {"type": "text_delta", "text": payload} if kind == "content" else \
                        {"type": "thinking_delta", "thinking": payload}
                    out.append(ev("content_block_delta", {"index": index, "delta": delta}))
                elif kind == "end":
                    if open_kind is not None:
                        out.append(ev("content_block_stop", {"index": index}))
                    blocks = _anthropic_blocks(payload.choices[0])
                    for block in blocks[index + 1 if payload.streamed else 0:]:
                        index += 1
                        if block["type"] == "tool_use":
                            out.append(ev("content_block_start",
                                          {"index": index, "content_block": dict(block, input={})}))
                            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                        elif block["type"] == "thinking":
                            out.append(ev("content_block_start",
                                          {"index": index, "content_block": dict(block, thinking="")}))
                            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
                        else:
                            out.append(ev("content_block_start",
                                          {"index": index, "content_block": dict(block, text="")}))
                            delta = {"type": "text_delta", "text": block["text"]}
                        out.append(ev("content_block_delta", {"index": index, "delta": delta}))
                        out.append(ev("content_block_stop", {"index": index}))
                    body = self._anthropic_body(payload, req)
                    out.append(ev("message_delta", {"delta": {"stop_reason": body["stop_reason"],
                                                              "stop_sequence": body["stop_sequence"]},
                                                    "usage": body["usage"]}))
                    out.append(ev("message_stop", {}))
                kind, payload = yield out
                out = []

        return await self._sse(request, session, req, events)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own 404 / 405 / 413 answers are plain text: give them the API's JSON error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = RequestError(e.status, f"{e.reason}: {request.method} {request.path}", code=e.reason.lower())
        return _anthropic_error(err) if request.path.endswith("/messages") else _openai_error(err)


def _openai_message(c: Choice) -> dict:
    msg: dict = {"role": "assistant", "content": c.content if c.content or not c.tool_calls else None}
    if c.reasoning is not None:
        msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": tc.name, "arguments": json.dumps(tc.arguments)}}
            for cid, tc in zip(c.tool_call_ids, c.tool_calls)
        ]
    return msg


def _openai_usage(reply: TurnReply) -> dict:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _anthropic_blocks(c: Choice) -> list[dict]:
    blocks: list[dict] = [{"type": "thinking", "thinking": c.reasoning, "signature": ""}] if c.reasoning else []
    blocks += [{"type": "text", "text": c.content}] if c.content else []
    blocks += [
        {"type": "tool_use", "id": "toolu_" + cid.removeprefix("call_"), "name": tc.name, "input": tc.arguments}
        for cid, tc in zip(c.tool_call_ids, c.tool_calls)
    ]
    return blocks


def _anthropic_stop_reason(c: Choice) -> str:
    if c.tool_calls:
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop_sequence is not None else "end_turn"


# `SomeError: message` lines of a (remote) traceback text
_RAISED = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): (\S.*)$", re.MULTILINE)


def failure_text(e: BaseException) -> str:
    """What failed, with the engine's own message: the first exception along the chain (Ray's remote cause, then
    `__cause__` / `__context__`) whose message is not empty. vLLM raises e.g. `EngineGenerateError()` with no text and
    the real error as its cause; across Ray only the remote traceback's text keeps that cause, so it is read there."""
    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = getattr(x, "cause", None) or x.__cause__ or x.__context__
    for x in chain:
        if str(x).strip() and not type(x).__name__.startswith("RayTaskError"):
            return f"{type(x).__name__}: {' '.join(str(x).split())[:500]}"
    for x in chain:  # only empty messages: the innermost named error with text in a remote traceback
        found = _RAISED.findall(getattr(x, "traceback_str", "") or str(x))
        if found:
            name, text = found[0]  # a chained traceback prints the root cause first
            return f"{type(chain[-1]).__name__} ({name}: {text.strip()[:500]})"
    return f"{type(chain[-1]).__name__} (the engine gave no message; see the engine's log)"


def _openai_error(e: RequestError) -> web.Response:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    if e.status == 401:
        kind = "authentication_error"
    body = {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}
    return web.json_response(body, status=e.status)


def _anthropic_error(e: RequestError) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
        e.status, "invalid_request_error")
    if e.status >= 500:
        kind = "api_error"
    return web.json_response({"type": "error", "error": {"type": kind, "message": e.message}}, status=e.status)
