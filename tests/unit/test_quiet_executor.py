"""CPU engines run vLLM's multiprocess executor with shared-memory queue readers that block instead of spinning
(rollout/quiet_executor.py); the live engine's workers are checked in tests/integration/test_rollout_engines.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from molt_hydra.rollout.engine import VLLMEngine
from molt_hydra.rollout.quiet_executor import READER_BUSY_LOOP_S, QuietMultiprocExecutor, quiet_worker_reader


def engine_args(monkeypatch, tiny_model, on_cpu: bool, **extra):
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    captured = {}
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: on_cpu)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, args: captured.setdefault("a", args)))
    asyncio.run(VLLMEngine(tiny_model, extra_engine_args=extra).start())
    return captured["a"]


@pytest.mark.parametrize("asked", [None, "mp", "uni"])
def test_cpu_engines_use_the_quiet_multiprocess_executor(monkeypatch, tiny_model, asked):
    extra = {} if asked is None else {"distributed_executor_backend": asked}
    assert engine_args(monkeypatch, tiny_model, True, **extra).distributed_executor_backend is QuietMultiprocExecutor


@pytest.mark.parametrize("asked", [None, "mp", "ray"])
def test_gpu_engines_keep_the_executor_asked_for(monkeypatch, tiny_model, asked):
    extra = {} if asked is None else {"distributed_executor_backend": asked}
    assert engine_args(monkeypatch, tiny_model, False, **extra).distributed_executor_backend == asked


def test_readers_stop_spinning_and_still_receive_every_message():
    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=writer.wait_until_ready)
    ready.start()
    reader.wait_until_ready()
    ready.join(30)
    assert reader._spin_condition.busy_loop_s > 0  # vLLM's default spins after every read

    executor = QuietMultiprocExecutor.__new__(QuietMultiprocExecutor)  # its queues set by hand, no worker started
    executor.response_mqs = [reader]
    worker_calls = []
    executor.collective_rpc = lambda method, args: worker_calls.append((method, args))
    executor._post_init_executor()
    assert reader._spin_condition.busy_loop_s == READER_BUSY_LOOP_S < 0.1  # vLLM's: 1 s
    assert worker_calls == [(quiet_worker_reader, (READER_BUSY_LOOP_S,))]  # every worker's reader, in the worker

    received = []
    reading = threading.Thread(target=lambda: received.extend(reader.dequeue(timeout=30) for _ in range(3)))
    reading.start()
    for message in ("step", 1, {"three": 3}):  # the reader blocks between them, woken by each notify
        writer.enqueue(message)
    reading.join(60)
    assert received == ["step", 1, {"three": 3}]
