"""One asyncio loop on a background thread per test module, shared by the tests that drive an in-process engine:
the engine's output tasks live on it, and it is drained before the module ends (not at interpreter exit)."""

from __future__ import annotations

import asyncio
import threading

import pytest


def run(loop, coro, timeout=180):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


async def _cancel_pending():
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    run(loop, _cancel_pending())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
