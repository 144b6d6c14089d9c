"""Spreads token-in/token-out requests over engine actors; all turns of one session stick to one engine.

A new session goes to the live engine with the fewest requests in flight and stays there (its prefix stays in that
engine's cache). A dead engine (its actor gone, or its vLLM engine core: the actor then reports itself unhealthy) is
no longer sent anything; its requests are retried, with their own sampling seeds, on another live engine or on the
replacement the driver starts (runtime/engine_keeper.py), waiting for one while none is live. Retries and deaths are
counted. Every engine call has a timeout: a stuck engine fails the request, counted, never a silent hang.

Requests travel in batches (`EngineLink`): a Ray actor call costs about half a millisecond of CPU on each side, as much
as vLLM spends on a short request, so all the requests issued for one engine in one event-loop turn (a GRPO group's
samples, a batch's first turns) go out in one call, and finished results come back through one outstanding long poll.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
import uuid
from collections import OrderedDict

from molt_hydra.rollout.generation import Generation, GenerationRequest


# The running rollout's `asyncio.timeout` (agents/base.py): time spent waiting for a replacement engine is added to
# it, so an engine death does not count against `agent.timeout_s`.
EPISODE_DEADLINE: contextvars.ContextVar = contextvars.ContextVar("episode_deadline", default=None)


class SessionAffinity:
    """Sticky least-loaded assignment session → engine index, bounded LRU so long runs do not grow it forever."""

    def __init__(self, num_engines: int, max_sessions: int = 100_000):
        if num_engines < 1:
            raise ValueError(f"need at least one engine, got {num_engines}")
        self.in_flight = [0] * num_engines
        self.alive = [True] * num_engines
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def pick(self, session_id: str) -> int:
        index = self._sessions.get(session_id)
        if index is None or not self.alive[index]:
            live = [i for i, ok in enumerate(self.alive) if ok]
            if not live:
                raise RuntimeError("every rollout engine is dead")
            index = min(live, key=lambda i: (self.in_flight[i], i))
        self._sessions[session_id] = index
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return index

    def mark_dead(self, index: int) -> None:
        self.alive[index] = False

    def revive(self, index: int) -> None:
        self.alive[index], self.in_flight[index] = True, 0


class EngineLink:
    """One router's batched calls to one engine actor (`VLLMEngine.submit` / `collect` / `abort`): requests sent in the
    same event-loop turn leave in one `submit`; while any is waiting, one `collect` is outstanding and hands back all
    the results that finished meanwhile. If the actor dies, every request waiting on it fails with that error."""

    def __init__(self, engine, client: str):
        self.engine, self.client = engine, client
        self._outbox: list = []  # (key, request) of this event-loop turn
        self._waiting: dict[int, asyncio.Future] = {}
        self._collector: asyncio.Task | None = None
        self._keys = itertools.count()

    def send(self, request: GenerationRequest) -> tuple[int, asyncio.Future]:
        loop = asyncio.get_running_loop()
        key, future = next(self._keys), loop.create_future()
        self._waiting[key] = future
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append((key, request))
        if self._collector is None:
            self._collector = asyncio.ensure_future(self._collect())
        return key, future

    def abort(self, key: int) -> None:
        """Stop a request whose caller gave up on it (timeout, cancelled rollout): vLLM frees its slot."""
        if self._waiting.pop(key, None) is not None:
            self.engine.abort.remote(self.client, [key])

    def close(self, error: Exception) -> None:
        """The engine was replaced: what still waits on it fails (and is retried elsewhere)."""
        self._fail(error)
        if self._collector is not None:
            self._collector.cancel()

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        submitted = asyncio.ensure_future(self.engine.submit.remote(self.client, batch))
        submitted.add_done_callback(lambda done: self._submitted(done, [key for key, _ in batch]))

    def _submitted(self, submitted: asyncio.Future, keys: list[int]) -> None:
        if not submitted.cancelled() and submitted.exception() is not None:  # the actor never got them
            for key in keys:
                future = self._waiting.pop(key, None)
                if future is not None and not future.done():
                    future.set_exception(submitted.exception())

    async def _collect(self) -> None:
        """While requests wait: one long poll at a time, each answer resolving every request that finished."""
        try:
            while self._waiting:
                for key, result in await self.engine.collect.remote(self.client):
                    future = self._waiting.pop(key, None)
                    if future is None or future.done():  # aborted, or its caller gave up
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        except Exception as e:  # the actor is gone (RayActorError): nothing waiting on it will come back
            self._fail(e)
        finally:
            self._collector = None

    def _fail(self, error: Exception) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)


class Router:
    """A `TokenGenerator` over Ray handles of `VLLMEngine`."""

    def __init__(self, engines: list, *, timeout_s: float = 600.0, max_retries: int = 2, max_sessions: int = 100_000):
        self.engines = engines
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.affinity = SessionAffinity(len(engines), max_sessions)
        self.counts = {"requests": 0, "retries": 0, "timeouts": 0, "engine_deaths": 0}
        self._outage, self._down_since = 0.0, None  # seconds with no live engine (requests waiting for one)
        self._client = uuid.uuid4().hex  # this router's results, apart from other runners' on the same engines
        self._links = [EngineLink(e, self._client) for e in engines]

    def engine_for(self, session_id: str) -> int:
        return self.affinity.pick(session_id)

    async def generate(self, request: GenerationRequest) -> list[Generation]:
        import ray

        self.counts["requests"] += 1
        for attempt in range(self.max_retries + 1):
            index = await self._live_engine(request.session_id)
            engine, link = self.engines[index], self._links[index]
            key, future = link.send(request)
            self.affinity.in_flight[index] += 1
            try:
                return await asyncio.wait_for(future, self.timeout_s)
            except asyncio.TimeoutError:
                self.counts["timeouts"] += 1
                link.abort(key)  # aborts the request inside vLLM
                raise TimeoutError(
                    f"engine {index} did not answer session {request.session_id!r} within {self.timeout_s} s"
                ) from None
            except asyncio.CancelledError:  # the rollout was given up on: free its slot in the engine
                link.abort(key)
                raise
            except Exception as e:
                if not isinstance(e, ray.exceptions.RayActorError) and await self._healthy(engine):
                    raise  # the request's own error, not the engine's
                if self.engines[index] is engine and self.affinity.alive[index]:  # first to see this death
                    self.counts["engine_deaths"] += 1
                    self.affinity.mark_dead(index)
                if attempt == self.max_retries:
                    raise
                self.counts["retries"] += 1
            finally:
                if self.engines[index] is engine:
                    self.affinity.in_flight[index] -= 1

    async def _live_engine(self, session_id: str) -> int:
        """A live engine for the session, waiting (up to the engine timeout) while every engine is being replaced;
        the rollout's own deadline moves on by the time waited."""
        start = time.monotonic()
        while True:
            try:
                index = self.affinity.pick(session_id)
            except RuntimeError:
                if self._down_since is None:
                    self._down_since = start
                if time.monotonic() - start >= self.timeout_s:
                    raise RuntimeError(f"every rollout engine is dead; none came back within {self.timeout_s} s")
                before = time.monotonic()
                await asyncio.sleep(0.5)
                episode = EPISODE_DEADLINE.get()
                if episode is not None and episode.when() is not None:
                    episode.reschedule(episode.when() + time.monotonic() - before)
                continue
            if self._down_since is not None:
                self._outage += time.monotonic() - self._down_since
                self._down_since = None
            return index

    def outage_s(self) -> float:
        """Seconds so far during which requests waited for a live engine."""
        return self._outage + (time.monotonic() - self._down_since if self._down_since is not None else 0.0)

    @staticmethod
    async def _healthy(engine) -> bool:
        try:
            return await asyncio.wait_for(engine.healthy.remote(), 10)
        except Exception:  # dead or not answering: not a healthy engine
            return False

    def replace_engine(self, index: int, engine) -> None:
        """The driver's replacement for dead engine `index` (started, holding the current weights and version)."""
        self._links[index].close(RuntimeError(f"engine {index} was replaced"))
        self.engines[index] = engine
        self._links[index] = EngineLink(engine, self._client)
        self.affinity.revive(index)

    async def generate_stream(self, request: GenerationRequest):
        """One completion as the engine samples it (`VLLMEngine.generate_stream` deltas); no retry once started."""
        self.counts["requests"] += 1
        index = self.affinity.pick(request.session_id)
        self.affinity.in_flight[index] += 1
        try:
            async for ref in self.engines[index].generate_stream.options(num_returns="streaming").remote(request):
                yield await asyncio.wait_for(ref, self.timeout_s)
        finally:
            self.affinity.in_flight[index] -= 1

    def metrics(self) -> dict[str, float]:
        return {f"rollout/router/{k}": float(v) for k, v in self.counts.items()}
