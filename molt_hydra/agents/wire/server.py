"""The loopback HTTP server: routes, the per-run API key, the agent's event loop, SSE, and errors in each API's shape.

One server per runner process, bound to 127.0.0.1 on a free port, on its OWN thread and event loop: a turn runs on
the agent's loop (where the engine client lives), so a synchronous client that blocks that loop is detected and
answered with an error naming the fix instead of deadlocking. Every route but `/health` needs the per-run API key
(`Authorization: Bearer KEY`, scheme case-insensitive, or `x-api-key: KEY`), else 401. Session routes live under
`/s/{session_id}`: the OpenAI SDK takes `base_url=.../s/{sid}/v1`, the Anthropic SDK `base_url=.../s/{sid}`, a judge
client `base_url=.../s/{sid}/judge/v1`; `/v1/messages/count_tokens` counts a prompt's tokens (Anthropic's SDK).
A request repeating the session's last one is a client's retry (the cached reply) unless its
`x-stainless-retry-count` header, which the SDKs send, says 0: a first attempt, sampled again (session.py).
Every error, 404 / 405 / 413 included, is in the API's own JSON error shape. Streaming is true token streaming:
text reaches the client as the engine samples it; tool calls are sent whole once the generation ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import json
import logging
import math
import re
import secrets
import threading

from aiohttp import web

from molt_hydra.agents.wire import anthropic, completions, openai_chat, responses
from molt_hydra.agents.wire.request import RequestError, unicode_text
from molt_hydra.agents.wire.session import ChatSession

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20  # base64 images make bodies large
BLOCKED_LOOP_S = 10.0  # the agent's loop did not run a no-op for this long: something blocks it
# path under /s/{sid} -> (request parser, reply body, stream of a streamed reply)
WIRES = {
    "/v1/chat/completions": (openai_chat.parse, openai_chat.body, openai_chat.ChatStream),
    "/v1/completions": (completions.parse, completions.body, completions.CompletionStream),
    "/v1/responses": (responses.parse, responses.body, responses.ResponseStream),
    "/v1/messages": (anthropic.parse, anthropic.body, anthropic.MessageStream),
}
JUDGE = "/judge/v1/chat/completions"  # OpenAI chat, unrecorded: `ChatSession.judge`
COUNT_TOKENS = "/v1/messages/count_tokens"  # Anthropic's `messages.count_tokens`
ATTEMPT_HEADER = "x-stainless-retry-count"  # the openai / anthropic SDKs': 0, then 1, 2... on their own retries
HOST = "127.0.0.1"
MODEL_NAME = "policy"  # what /v1/models lists; replies name it as their model


class ChatServer:
    def __init__(self, api_key: str | None = None):
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.sessions: dict[str, ChatSession] = {}
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def session_url(self, session_id: str) -> str:
        return f"http://{HOST}:{self.port}/s/{session_id}"

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
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_get("/s/{sid}/v1/models/{model}", self._model)
        for path, wire in WIRES.items():
            app.router.add_post(f"/s/{{sid}}{path}", functools.partial(self._turn, *wire))
        app.router.add_post(f"/s/{{sid}}{JUDGE}", functools.partial(self._turn, *WIRES["/v1/chat/completions"]))
        app.router.add_post(f"/s/{{sid}}{COUNT_TOKENS}", self._count_tokens)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._loop is None:
            return
        if self._runner is not None:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop))
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()
        self._loop = self._thread = None

    def open_session(self, session: ChatSession) -> None:
        session.loop = asyncio.get_running_loop()  # turns run where the agent and the engine client live
        session.context = contextvars.copy_context()  # in the rollout's context (`_on_agent_loop`)
        self.sessions[session.session_id] = session

    def close_session(self, session_id: str):
        return self.sessions.pop(session_id).close()

    # --- routes ---

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": MODEL_NAME})

    async def _models(self, request: web.Request) -> web.Response:
        """The policy, in a list both SDKs read (OpenAI's `object` / `data`, Anthropic's `has_more` / ids)."""
        self._check_key(request)
        return web.json_response({"object": "list", "data": [_model_info(MODEL_NAME)], "has_more": False,
                                  "first_id": MODEL_NAME, "last_id": MODEL_NAME})

    async def _model(self, request: web.Request) -> web.Response:
        """`models.retrieve(name)` (was: 404): any name, as every request's `model` reaches the policy."""
        self._check_key(request)
        return web.json_response(_model_info(request.match_info["model"]))

    async def _turn(self, parse, body_of, stream, request: web.Request) -> web.StreamResponse:
        judge = request.path.endswith(JUDGE)
        session, body = await self._accept(request)
        req = parse(body)
        # the openai / anthropic SDKs' attempt count: "0" is a first attempt, never a retry even where it repeats the
        # session's last request (k samples of one prompt); absent (a raw HTTP client), a repeat is taken for a retry
        attempt = request.headers.get(ATTEMPT_HEADER)
        if attempt is not None and not re.fullmatch(r"[0-9]+", attempt.strip()):
            raise RequestError(400, f"header {ATTEMPT_HEADER}={attempt!r} must be a non-negative integer: 0 on a "
                               "first attempt (a repeated request is then sampled again), the retry's number on a "
                               "client's retry (answered with the reply already generated); or omit it",
                               ATTEMPT_HEADER)
        req.first_attempt = attempt is not None and int(attempt) == 0
        if req.stream and not judge:
            return await self._sse(request, session, stream(req, MODEL_NAME, session))
        reply = await self._on_agent_loop(session, session.judge(req) if judge else session.complete(req))
        return web.json_response(body_of(reply, req, MODEL_NAME))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens as the same request to /v1/messages would report them in `usage.input_tokens`."""
        session, body = await self._accept(request)
        req = anthropic.parse(body)
        return web.json_response({"input_tokens": await self._on_agent_loop(session, session.count_tokens(req))})

    async def _on_agent_loop(self, session: ChatSession, coro):
        """Run a session coroutine on the agent's loop; refuse loudly when that loop is blocked or gone."""
        if not session.loop.is_running():  # (was: a 500 "Event loop is closed", or the blocked-loop 400 after 10 s)
            coro.close()
            raise RequestError(503, f"the agent's event loop of session {session.session_id} is no longer running "
                               "(the runner that opened it has ended): no turn can run", code="agent_loop_stopped")
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
        # cancelling the wrapper (the server stopping) cancels the turn on the agent's loop too; a client that goes
        # away cancels nothing (aiohttp runs the handler on): the turn ends and is recorded for the client's retry
        # in its rollout's context: the router extends that rollout's deadline while it waits for a replacement engine
        # (rollout/router.py EPISODE_DEADLINE). Was: in this thread's, the first rollout's (it started the server), so
        # an outage extended that one's, long expired (a RuntimeError: each turn a 500, the rollout dropped as the
        # agent's exception), never the turn's own
        turn = session.context.run(asyncio.run_coroutine_threadsafe, coro, session.loop)
        session.turns.add(turn)  # closing the session cancels it
        turn.add_done_callback(session.turns.discard)
        if session.closed:  # closed on the agent's loop before the add (its turn may have begun): cancelled here
            turn.cancel()
        try:
            return await asyncio.wrap_future(turn)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this request's own cancellation (the server stopping)
                raise
            # the turn's task was cancelled on the agent's loop (was: a dropped connection, or a stream that never
            # ended): the client gets an error it can read
            raise RequestError(503, f"the turn of session {session.session_id} was cancelled on the agent's event "
                               "loop before it finished (its rollout was cancelled, timed out or ended, or the runner "
                               "is shutting down): it is not recorded", code="turn_cancelled") from None

    async def _accept(self, request: web.Request) -> tuple[ChatSession, object]:
        self._check_key(request)
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise RequestError(404, f"unknown session {request.match_info['sid']!r}: never opened, or its rollout has "
                               "ended; use the ctx.base_url / ctx.session_url of the running rollout",
                               code="unknown_session")
        try:
            # bytes: JSON's own UTF-8/16/32, whatever charset says
            body = json.loads(await request.read(), parse_constant=_not_json, parse_float=_finite)
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
        except RecursionError:
            raise RequestError(400, "request body is not valid JSON: nested too deeply to parse",
                               code="invalid_json") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
            raise RequestError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        unicode_text(body)
        return session, body

    def _check_key(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.encode(errors="surrogateescape"), self.api_key.encode()):  # bytes as sent
            raise RequestError(401, "invalid API key", code="invalid_api_key")

    async def _sse(self, request: web.Request, session: ChatSession, stream) -> web.StreamResponse:
        """Stream a turn: ("reasoning" | "content", text) pieces, then ("end", reply), reach `stream` as the session
        generates on the agent's loop; a failure before the first piece is a plain JSON error, after it an SSE
        `error` event."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_delta(kind: str, text: str) -> None:  # called on the agent's loop
            loop.call_soon_threadsafe(queue.put_nowait, (kind, text))

        async def produce():
            try:
                queue.put_nowait(("end", await self._on_agent_loop(session, session.complete(stream.req, on_delta))))
            except Exception as e:
                queue.put_nowait(("error", e))

        task = asyncio.ensure_future(produce())
        kind, payload = await queue.get()
        if kind == "error":  # nothing was sent yet: a plain JSON error
            raise payload
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        out = stream.start()
        try:
            await resp.prepare(request)
            while kind not in ("end", "error"):
                await resp.write(b"".join(out + stream.delta(kind, payload)))
                out = []
                kind, payload = await queue.get()
            if kind == "end":
                await resp.write(b"".join(out + stream.end(payload)))
            else:
                error = request_error(payload)
                log.error("stream failed: %s", error.message)
                await resp.write(b"".join(out + stream.error(error)))
            await resp.write_eof()
        except ConnectionResetError:  # the turn still ends and is recorded: the client's retry gets it from the cache
            log.info("%s: the client closed the stream before its end", request.path)
        finally:
            await task
        return resp


def _not_json(name: str):
    """Python's decoder reads NaN / Infinity / -Infinity, which JSON has not (was: accepted, and a body echoing them,
    a Responses tool's schema, was sent back as no client's JSON parser but Python's reads it)."""
    raise ValueError(f"{name} is not a JSON value (JSON has no NaN or Infinity)")


def _finite(text: str) -> float:
    """A JSON number past float's range (1e999) reads as inf in Python: refused as NaN / Infinity are."""
    if math.isinf(value := float(text)):
        raise ValueError(f"{text} is past a float's range (it would read as Infinity)")
    return value


def _model_info(model_id: str) -> dict:
    """A model object in OpenAI's fields and Anthropic's (`type`, `display_name`, `created_at`)."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "molt_hydra", "type": "model",
            "display_name": model_id, "created_at": "1970-01-01T00:00:00Z"}


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Every failure as the API's JSON error: a request's own (4xx), aiohttp's plain-text 404 / 405 / 413, and any
    other exception (500, with the engine's message)."""
    headers = {}
    try:
        return await handler(request)
    except RequestError as e:
        error = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = RequestError(e.status, f"{e.reason}: {request.method} {request.path}",
                             code=e.reason.lower().replace(" ", "_"))
        if "Allow" in e.headers:  # a 405's methods the route serves, which HTTP requires it to name (was: dropped)
            headers["Allow"] = e.headers["Allow"]
        if e.status == 404 and not request.path.startswith("/s/"):
            error.message += " (the API routes live under /s/{session_id}: use ctx.base_url / ctx.session_url)"
        elif e.status == 404 and "/judge/" in request.path:  # e.g. the Agents SDK's default Responses model
            error.message += (f" (the judge serves only {JUDGE}, non-streamed: call client.chat.completions.create, "
                              "or in the Agents SDK use OpenAIChatCompletionsModel)")
        elif e.status == 404 and request.path.endswith("/") and any(  # (was: told no completion is stored here)
                request.path.rstrip("/").endswith(route) for route in (*WIRES, COUNT_TOKENS)):
            error.message += f" (no trailing slash: {request.method} {request.path.rstrip('/')})"
        elif e.status == 404 and re.match(r"/s/[^/]+/(v1/v1/|(?!v1/|judge/))", request.path):  # (was: bare)
            error.message += (" (a client's base_url with /v1 twice or none: the OpenAI client takes "
                              "base_url=ctx.base_url, which ends in /v1; the Anthropic client takes "
                              "base_url=ctx.session_url, without /v1, which it adds itself)")
        elif e.status in (404, 405) and "/v1/responses/" in request.path:  # (was: a bare Not Found)
            error.message += (" (no response is stored here, 'store' is ignored: one cannot be retrieved, deleted, "
                              "listed or continued by id, and input tokens are counted in a turn's usage only; send "
                              "the whole input to POST /v1/responses each turn)")
        elif e.status in (404, 405) and "/v1/chat/completions" in request.path and "/judge/" not in request.path:
            error.message += (" (no chat completion is stored here, 'store' is ignored: one cannot be retrieved, "
                              "listed, updated or deleted, nor its messages listed; keep the reply that POST "
                              "/v1/chat/completions returned, and send the whole conversation each turn)")
        elif e.status == 404:  # e.g. embeddings or audio through the agent's client (was: a bare Not Found)
            error.message += (f" (a session serves POST {', '.join(WIRES)} and {COUNT_TOKENS}, and GET /v1/models: "
                              "the policy's chat turns only)")
    except Exception as e:
        log.exception("%s failed", request.path)
        error = request_error(e)
    # Anthropic's routes, served or not (was: a 404 under /v1/messages/, e.g. batches, in OpenAI's shape)
    anthropic_route = request.path.endswith("/v1/messages") or "/v1/messages/" in request.path
    shape = anthropic.error if anthropic_route else openai_chat.error
    return web.json_response(shape(error), status=error.status, headers=headers)


def request_error(e: Exception) -> RequestError:
    """A failure as the error a client gets: a request's own, else a 500 with the engine's message."""
    if isinstance(e, RequestError):
        return e
    return RequestError(500, f"generation failed: {failure_text(e)}", code="server_error")


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
        if raised := _RAISED.search(getattr(x, "traceback_str", "") or str(x)):  # (a chained one prints it first)
            return f"{type(chain[-1]).__name__} ({raised[1]}: {raised[2].strip()[:500]})"
    return f"{type(chain[-1]).__name__} (the engine gave no message; see the engine's log)"
