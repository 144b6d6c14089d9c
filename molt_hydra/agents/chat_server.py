"""Loopback chat server: OpenAI `/v1/chat/completions` and Anthropic `/v1/messages` over the token-exact sessions.

One server per runner process, bound to 127.0.0.1 on a free port, on the runner's event loop. Every route but
`/health` needs the per-run API key (`Authorization: Bearer KEY` or `x-api-key: KEY`), else 401. Session routes
live under `/s/{session_id}`: the OpenAI SDK takes `base_url=.../s/{sid}/v1`, the Anthropic SDK
`base_url=.../s/{sid}`. Bad requests get a 4xx JSON error in the wire format's own error shape; an engine failure
gets a 500; the server keeps serving. Streaming replays the finished generation as SSE events, so a streamed and a
non-streamed turn capture the same tokens.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time

from aiohttp import web

from molt_hydra.agents.chat_messages import RequestError, anthropic_request, openai_request
from molt_hydra.agents.chat_session import ChatSession, Choice, TurnReply

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20  # base64 images make bodies large


class ChatServer:
    def __init__(self, api_key: str | None = None, host: str = "127.0.0.1", model_name: str = "policy"):
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.host = host
        self.model_name = model_name
        self.sessions: dict[str, ChatSession] = {}
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("ChatServer is not started")
        return f"http://{self.host}:{self.port}"

    def session_url(self, session_id: str) -> str:
        return f"{self.url}/s/{session_id}"

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._openai)
        app.router.add_post("/s/{sid}/v1/messages", self._anthropic)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, session: ChatSession) -> None:
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
        try:
            session, body = await self._accept(request)
            req = openai_request(body)
            reply = await session.complete(req)
        except RequestError as e:
            return _openai_error(e)
        except Exception as e:
            log.exception("chat completion failed")
            return _openai_error(RequestError(500, f"generation failed: {type(e).__name__}: {e}", code="server_error"))
        if req.stream:
            return await self._openai_stream(request, reply, req.include_usage)
        return web.json_response(self._openai_body(reply))

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        try:
            session, body = await self._accept(request)
            req = anthropic_request(body)
            reply = await session.complete(req)
        except RequestError as e:
            return _anthropic_error(e)
        except Exception as e:
            log.exception("messages request failed")
            return _anthropic_error(RequestError(500, f"generation failed: {type(e).__name__}: {e}", code="api_error"))
        if req.stream:
            return await self._anthropic_stream(request, reply)
        return web.json_response(self._anthropic_body(reply))

    async def _accept(self, request: web.Request) -> tuple[ChatSession, object]:
        if not self._authorized(request):
            raise RequestError(401, "invalid API key", code="invalid_api_key")
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise RequestError(404, f"unknown session {request.match_info['sid']!r}", code="unknown_session")
        try:
            return session, json.loads(await request.text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None

    def _authorized(self, request: web.Request) -> bool:
        bearer = request.headers.get("Authorization", "")
        key = bearer[7:] if bearer.startswith("Bearer ") else request.headers.get("x-api-key", "")
        return hmac.compare_digest(key.encode(), self.api_key.encode())

    # --- OpenAI wire ---

    def _openai_body(self, reply: TurnReply) -> dict:
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": i, "message": _openai_message(c), "finish_reason": c.finish_reason, "logprobs": None}
                for i, c in enumerate(reply.choices)
            ],
            "usage": _openai_usage(reply),
        }

    async def _openai_stream(self, request: web.Request, reply: TurnReply, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        async def send(choices: list[dict], usage: dict | None = None) -> None:
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                     "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        for i, c in enumerate(reply.choices):
            await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            for piece in c.pieces:
                await send([{"index": i, "delta": {"content": piece}, "finish_reason": None}])
            if c.tool_calls:
                calls = _openai_message(c)["tool_calls"]
                await send([{"index": i, "delta": {"tool_calls": [dict(tc, index=j) for j, tc in enumerate(calls)]},
                             "finish_reason": None}])
            await send([{"index": i, "delta": {}, "finish_reason": c.finish_reason}])
        if include_usage:
            await send([], _openai_usage(reply))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # --- Anthropic wire ---

    def _anthropic_body(self, reply: TurnReply) -> dict:
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

    async def _anthropic_stream(self, request: web.Request, reply: TurnReply) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(event: str, data: dict) -> None:
            await resp.write(f"event: {event}\ndata: {json.dumps(dict(data, type=event))}\n\n".encode())

        body = self._anthropic_body(reply)
        start = dict(body, content=[], stop_reason=None, stop_sequence=None,
                     usage={"input_tokens": reply.prompt_tokens, "output_tokens": 0})
        await send("message_start", {"message": start})
        for i, block in enumerate(body["content"]):
            if block["type"] == "text":
                await send("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
                delta = {"type": "text_delta", "text": block["text"]}
            else:
                await send("content_block_start", {"index": i, "content_block": dict(block, input={})})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            await send("content_block_delta", {"index": i, "delta": delta})
            await send("content_block_stop", {"index": i})
        await send("message_delta", {"delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
                                     "usage": {"output_tokens": reply.completion_tokens}})
        await send("message_stop", {})
        await resp.write_eof()
        return resp


def _openai_message(c: Choice) -> dict:
    msg: dict = {"role": "assistant", "content": c.content if c.content or not c.tool_calls else None}
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
    blocks: list[dict] = [{"type": "text", "text": c.content}] if c.content else []
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


def _openai_error(e: RequestError) -> web.Response:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    if e.status == 401:
        kind = "authentication_error"
    body = {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}
    return web.json_response(body, status=e.status)


def _anthropic_error(e: RequestError) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status, "invalid_request_error")
    if e.status >= 500:
        kind = "api_error"
    return web.json_response({"type": "error", "error": {"type": kind, "message": e.message}}, status=e.status)
