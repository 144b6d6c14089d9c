"""Many calls to one Ray actor per round trip, their results back through one long poll.

A Ray actor call costs about half a millisecond of CPU on each side, as much as vLLM spends on a short request, and
a rollout step makes one per sample. So the calls a process makes to one actor in one event-loop turn (a batch's
prompt groups to a runner, a group's samples to an engine) leave in one `submit`; while any is waiting, one `collect`
is outstanding and hands back every result that finished meanwhile, so a result is never held back for another.

Caller: `BatchedCalls(actor, method)`, then `await calls.call(*args)`. A call whose caller gives up (a timeout, a
cancelled rollout) is aborted in the actor; if the actor dies, every call waiting on it fails with that error.
Callee: the actor's class derives from `BatchedCallee` and names the methods it serves this way in `BATCHED`.
Each result travels pickled on its own, so one that cannot be sent (a lock in a custom Runner's Trajectory) fails
its own call with an error naming it, not the reply that carries every other finished call of that caller.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import uuid


class BatchedCalls:
    def __init__(self, actor, method: str):
        self.actor, self.method = actor, method
        self.client = uuid.uuid4().hex  # this caller's results, apart from other callers' of the same actor
        self._outbox: list = []  # (key, args) of this event-loop turn
        self._waiting: dict[int, asyncio.Future] = {}
        self._collector: asyncio.Task | None = None
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None  # where the futures live

    async def call(self, *args):
        loop = self._loop = asyncio.get_running_loop()
        key, future = next(self._keys), loop.create_future()
        self._waiting[key] = future
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append((key, args))
        if self._collector is None:
            self._collector = asyncio.ensure_future(self._collect())
        try:
            return await future
        except asyncio.CancelledError:  # the caller gave up: the actor stops the call
            if self._waiting.pop(key, None) is not None:
                self.actor.abort.remote(self.client, [key])
            raise

    def close(self, error: Exception) -> None:
        """The actor is being replaced: what still waits on it fails now. Callable from any thread (a runner's
        replacement arrives on its actor loop; its requests wait on the agent loop)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._close, error)

    def _close(self, error: Exception) -> None:
        self._fail(list(self._waiting), error)
        if self._collector is not None:
            self._collector.cancel()

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        submitted = asyncio.ensure_future(self.actor.submit.remote(self.client, self.method, batch))
        submitted.add_done_callback(functools.partial(self._submitted, [key for key, _ in batch]))

    def _submitted(self, keys: list[int], submitted: asyncio.Future) -> None:
        if not submitted.cancelled() and submitted.exception() is not None:  # the actor never got them
            self._fail(keys, submitted.exception())

    async def _collect(self) -> None:
        from ray import cloudpickle  # (deferred: heavy; the agent API imports this module)

        try:
            while self._waiting:
                for key, packed in await self.actor.collect.remote(self.client):
                    future = self._waiting.pop(key, None)
                    if future is None or future.done():  # aborted, or its caller gave up
                        continue
                    if packed is None:  # cancelled there, not by this caller (its abort is done above)
                        future.set_exception(RuntimeError(f"{self.method} was cancelled inside the actor"))
                        continue
                    try:
                        failed, result = cloudpickle.loads(packed)
                    except Exception as e:  # noqa: BLE001 - e.g. its class is not importable here: this call fails
                        failed, result = True, RuntimeError(f"{self.method}'s result cannot be read here "
                                                            f"({type(e).__name__}: {e})")
                    if failed:
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        except Exception as e:  # the actor is gone (RayActorError): nothing waiting on it will come back
            self._fail(list(self._waiting), e)
        finally:
            self._collector = None

    def _fail(self, keys: list[int], error: BaseException) -> None:
        for key in keys:
            future = self._waiting.pop(key, None)
            if future is not None and not future.done():
                future.set_exception(error)


class BatchedCallee:
    """The actor side: `submit` starts each call as a task of the actor's event loop, `collect` hands back finished
    ones (pickled: (False, the result) or (True, the call's exception); None for one aborted)."""

    BATCHED: tuple[str, ...] = ()  # the async methods callers may reach through `submit`

    @functools.cached_property
    def _batched(self):
        return {"running": {}, "finished": collections.defaultdict(asyncio.Queue)}

    async def submit(self, client: str, method: str, batch: list[tuple[int, tuple]]) -> None:
        if method not in self.BATCHED:
            raise ValueError(f"{type(self).__name__}.{method} is not served in batches (BATCHED: {self.BATCHED})")
        fn, running = getattr(self, method), self._batched["running"]
        for key, args in batch:
            task = running[(client, key)] = asyncio.ensure_future(fn(*args))
            task.add_done_callback(functools.partial(self._settled, client, key, method))

    async def collect(self, client: str) -> list[tuple[int, object]]:
        """Every (key, packed result) of `client` finished since its last call, waiting until there is one."""
        inbox = self._batched["finished"][client]
        done = [await inbox.get()]
        while not inbox.empty():
            done.append(inbox.get_nowait())
        return done

    async def abort(self, client: str, keys: list[int]) -> None:
        for key in keys:
            task = self._batched["running"].get((client, key))
            if task is not None:
                task.cancel()

    def _settled(self, client: str, key: int, method: str, task: asyncio.Task) -> None:
        from ray import cloudpickle

        del self._batched["running"][(client, key)]
        packed = None
        if not task.cancelled():
            error = task.exception()  # the caller decides what a failure means
            try:
                packed = cloudpickle.dumps((error is not None, task.result() if error is None else error))
            except Exception as e:  # noqa: BLE001 - what Ray could not ship either: its text instead
                said = (f"{type(error).__name__}: {error}" if error is not None else
                        f"{type(self).__name__}.{method} returned a {type(task.result()).__name__} that cannot be "
                        f"sent to its caller ({type(e).__name__}: {e}); return plain data")
                packed = cloudpickle.dumps((True, RuntimeError(said)))
        self._batched["finished"][client].put_nowait((key, packed))
