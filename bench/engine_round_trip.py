"""Where a colocated sync's fixed cost goes: the Ray round trip to a real `VLLMEngine` actor against a bare async actor
in the same cluster, and the engine's vLLM call into its worker (collective_rpc) on top of it.

The GPU runs (bench/RESULTS.md, sessions 23 and 26) measured a single-pass sync's round trip driver -> engine at
~4 ms, while a bare actor call costs well under 1 ms: this bench tells whether the engine actor (its event loop, its
threads) or the calling process makes the difference. Rows (medians of `--calls` calls, ms, and the ratio to the bare
actor's round trip measured in this process): bare actor; engine awake (`get_version`); engine asleep; engine ->
worker (`worker_call`, a Ray call plus a collective_rpc); bare actor while a Python thread spins in the caller (the
GIL's switch interval, 5 ms by default, is what a busy thread in the driver would add).

    python bench/engine_round_trip.py [--model M] [--calls 200] [--no-append]

(default model: the toy GPU recipe's `tiny://qwen3_0p6b_shape` on CUDA, `tiny://qwen3_tiny` on CPU)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row  # noqa: E402


class Bare:
    async def get_version(self) -> int:
        return 0


async def median_ms(call, calls: int) -> float:
    await call()  # the first call also connects
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        await call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


async def measure(engine, bare, calls: int) -> dict[str, float]:
    rows = {"bare": await median_ms(lambda: bare.get_version.remote(), calls),
            "engine_awake": await median_ms(lambda: engine.get_version.remote(), calls),
            "engine_worker_rpc": await median_ms(lambda: engine.worker_call.remote("device_free_bytes"), calls)}
    await engine.sleep.remote()
    rows["engine_asleep"] = await median_ms(lambda: engine.get_version.remote(), calls)
    spinning = threading.Event()

    def spin() -> None:  # pure Python work holding the GIL between switches
        while not spinning.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    rows["bare_with_busy_caller_thread"] = await median_ms(lambda: bare.get_version.remote(), calls)
    spinning.set()
    thread.join()
    return rows


def main() -> None:
    import ray
    import torch

    from molt_hydra.models.tiny import resolve_model_path
    from molt_hydra.rollout.engine import VLLMEngine

    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny://qwen3_0p6b_shape" if gpu else "tiny://qwen3_tiny")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--no-append", action="store_true", help="print the row only")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    engine_args = (dict(gpu_memory_utilization=0.3, sleep_level=2) if gpu
                   else dict(dtype="float32", kv_cache_gb=1, sleep_level=0))
    engine = ray.remote(VLLMEngine).options(num_cpus=0, num_gpus=1 if gpu else 0).remote(
        resolve_model_path(args.model), enforce_eager=True, max_model_len=1024, seed=0, **engine_args)
    ray.get(engine.start.remote(), timeout=600)
    bare = ray.remote(Bare).options(num_cpus=0).remote()
    rows = asyncio.run(measure(engine, bare, args.calls))
    ray.get(engine.shutdown.remote(), timeout=60)
    ray.shutdown()
    device = torch.cuda.get_device_name() if gpu else "CPU engine"
    append_row("engine_round_trip", f"{args.model}, {device}, median of {args.calls} calls, GIL switch interval "
               f"{sys.getswitchinterval() * 1e3:g} ms", f"bare async actor {rows['bare']:.3f} ms",
               ", ".join(f"{k} {v:.3f} ms" for k, v in rows.items() if k != "bare"),
               ", ".join(f"{k} {v / rows['bare']:.2f}x" for k, v in rows.items() if k != "bare"))

if __name__ == "__main__":
    main()
