"""Spreads token-in/token-out requests over engine actors; all turns of one session stick to one engine.

A new session goes to the live engine with the fewest requests in flight and stays there (its prefix stays in that
engine's cache). A dead engine (its actor gone, or its vLLM engine core: the actor then reports itself unhealthy) is
no longer sent anything; its requests are retried, with their own sampling seeds, on another live engine or on the
replacement the driver starts (runtime/engine_keeper.py), waiting for one while none is live. Retries and deaths are
counted. Every engine call has a timeout: a stuck engine fails the request, counted, never a silent hang.
Requests travel to each engine in batches, their results back through a long poll (rollout/batched_calls.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import OrderedDict

from molt_hydra.rollout.batched_calls import BatchedCalls
from molt_hydra.rollout.generation import EngineFailure, EngineTimeout, Generation, GenerationRequest
# imported where used: ray (heavy)


# The running rollout's `asyncio.timeout` (agents/base.py): time spent waiting for a replacement engine is added to
# it, so an engine death does not count against `agent.timeout_s`.
EPISODE_DEADLINE: contextvars.ContextVar = contextvars.ContextVar("episode_deadline", default=None)


MAX_RETRIES = 2  # a request whose engine died is retried this often on another (or its replacement)


class Router:
    """A `TokenGenerator` over Ray handles of `VLLMEngine`. Sessions stick to their engine (a new one goes to the
    least loaded live engine), remembered in a bounded LRU so long runs do not grow it forever."""

    def __init__(self, engines: list, *, timeout_s: float = 600.0, max_sessions: int = 100_000):
        if not engines:
            raise ValueError(f"need at least one engine, got {len(engines)}")
        self.engines = engines
        self.timeout_s = timeout_s
        # a memory bound on the stickiness map, not a knob: an evicted session only loses its engine's prefix cache
        # (it is re-placed on the least loaded engine), and 100k is far above the sessions a runner keeps in flight
        self.max_sessions = max_sessions
        self.in_flight = [0] * len(engines)
        self.alive = [True] * len(engines)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self.counts = {"requests": 0, "retries": 0, "timeouts": 0, "engine_deaths": 0}
        self._outage, self._down_since = 0.0, None  # seconds with no live engine (requests waiting for one)
        self._links = [BatchedCalls(e, "generate") for e in engines]

    def pick(self, session_id: str) -> int:
        """The session's engine index: sticky; the least loaded live one when new or when its engine died."""
        index = self._sessions.get(session_id)
        if index is None or not self.alive[index]:
            live = [i for i, ok in enumerate(self.alive) if ok]
            if not live:
                raise EngineFailure("every rollout engine is dead")
            index = min(live, key=lambda i: (self.in_flight[i], i))
        self._sessions[session_id] = index
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return index

    async def generate(self, request: GenerationRequest) -> list[Generation]:
        self.counts["requests"] += 1
        for attempt in range(MAX_RETRIES + 1):
            index = await self._live_engine(request.session_id)
            engine, link = self.engines[index], self._links[index]
            self.in_flight[index] += 1
            try:
                return await asyncio.wait_for(link.call(request), self.timeout_s)  # a timeout aborts it in vLLM
            except asyncio.TimeoutError:
                self.counts["timeouts"] += 1
                raise EngineTimeout(f"engine {index} did not answer session {request.session_id!r} within "
                                   f"{self.timeout_s} s") from None
            except Exception as e:
                await self._engine_failed(index, engine, e, request, attempt)
                self.counts["retries"] += 1
            finally:
                if self.engines[index] is engine:
                    self.in_flight[index] -= 1

    async def _live_engine(self, session_id: str) -> int:
        """A live engine for the session, waiting (up to the engine timeout) while every engine is being replaced;
        the rollout's own deadline moves on by the time waited."""
        start = time.monotonic()
        while not any(self.alive):
            self._down_since = self._down_since or start
            if time.monotonic() - start >= self.timeout_s:
                raise EngineFailure(f"every rollout engine is dead; none came back within {self.timeout_s} s")
            before = time.monotonic()
            await asyncio.sleep(0.5)
            episode = EPISODE_DEADLINE.get()
            if episode is not None and episode.when() is not None:
                episode.reschedule(episode.when() + time.monotonic() - before)
        if self._down_since is not None:
            self._outage += time.monotonic() - self._down_since
            self._down_since = None
        return self.pick(session_id)

    def outage_s(self) -> float:
        """Seconds so far during which requests waited for a live engine."""
        return self._outage + (time.monotonic() - self._down_since if self._down_since is not None else 0.0)

    @staticmethod
    async def _healthy(engine) -> bool:
        try:
            return await asyncio.wait_for(engine.healthy.remote(), 10)
        except Exception:  # dead or not answering: not a healthy engine
            return False

    def replace_engine(self, index: int, engine) -> int:
        """The driver's replacement for dead engine `index` (started, holding the current weights and version); returns
        how many requests were still in flight on the dead one (they fail now and are retried on the new one)."""
        stranded = self.in_flight[index]
        self._links[index].close(RuntimeError(f"engine {index} was replaced"))
        self.engines[index] = engine
        self._links[index] = BatchedCalls(engine, "generate")
        self.alive[index], self.in_flight[index] = True, 0
        return stranded

    async def generate_stream(self, request: GenerationRequest):
        """One completion as the engine samples it (`VLLMEngine.generate_stream` deltas). The engines' failures are
        `generate`'s: each delta, the first too, comes within timeout_s or the stream ends in an EngineTimeout (was: the
        wait for the next delta had none, and a stuck engine held the turn until the rollout's own timeout); a dead
        engine is counted and left, the stream retried on another live one (or its replacement, waited for) while it
        has yielded nothing, else an EngineFailure (was: the actor's raw error, a 500 the chat agent's rollout was
        dropped for as its own exception, the engine still picked). A consumer that gives up (its turn cancelled, the
        stream closed) cancels the actor's generator, which aborts the request in vLLM (Ray does not: the engine
        sampled on to the token cap)."""
        import ray

        self.counts["requests"] += 1
        for attempt in range(MAX_RETRIES + 1):
            index = await self._live_engine(request.session_id)
            engine, yielded, finished, stream = self.engines[index], False, False, None
            self.in_flight[index] += 1
            try:
                stream = engine.generate_stream.options(num_returns="streaming").remote(request)
                while True:
                    try:  # the wait for the next delta's ref is what can hang (the ref is ready once reported);
                        ref = await asyncio.wait_for(anext(stream), self.timeout_s)  # only it is timed
                    except StopAsyncIteration:
                        finished = True
                        return
                    except asyncio.TimeoutError:
                        self.counts["timeouts"] += 1
                        raise EngineTimeout(f"engine {index} gave session {request.session_id!r} no streamed delta "
                                            f"within {self.timeout_s} s") from None
                    yield await ref
                    yielded = True
            except EngineTimeout:
                raise
            except Exception as e:
                await self._engine_failed(index, engine, e, request, attempt, streamed=yielded)
                self.counts["retries"] += 1
            finally:
                if self.engines[index] is engine:
                    self.in_flight[index] -= 1
                if not finished and stream is not None:
                    ray.cancel(stream)

    async def _engine_failed(self, index: int, engine, e: Exception, request: GenerationRequest, attempt: int,
                             streamed: bool = False) -> None:
        """A call to engine `index` raised `e`: re-raised when it is the request's own error (the engine is healthy),
        else the engine is counted dead and left, and the call retried (this returns) unless it was the last attempt
        or its stream had `streamed` tokens to the consumer (a retry would sample another completion after them)."""
        import ray

        if not isinstance(e, ray.exceptions.RayActorError) and await self._healthy(engine):
            raise e
        if self.engines[index] is engine and self.alive[index]:  # first to see this death
            self.counts["engine_deaths"] += 1
            self.alive[index] = False
        if streamed or attempt == MAX_RETRIES:
            why = "mid-stream, after its first tokens were sent" if streamed else \
                f"after {MAX_RETRIES} retries on other engines"
            raise EngineFailure(f"engine {index} failed session {request.session_id!r} {why}: {type(e).__name__}: "
                                f"{e}") from e

    def metrics(self) -> dict[str, float]:
        return {f"rollout/router/{k}": float(v) for k, v in self.counts.items()}
