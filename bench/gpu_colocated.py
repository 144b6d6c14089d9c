"""The real GPU loop, colocated on one GPU, as bench rows: each run is `molt-run` with real vLLM (tests/gpu/
test_colocated_vllm.py runs the recipes; `--throughput` runs the Qwen3-4B-shaped one here). Per run: reward first /
last 5 steps, |vllm_kl| after each sync, the weight sync's seconds and GB/s against a device-to-device copy of the same
bytes measured in this process on the same GPU (goal >= 0.5), the engine's sleep / wake seconds and GiB freed, the
step's time split (generate / sleep / train / wake / sync), tokens per second per GPU, and R3's routing figures.

    python bench/gpu_colocated.py --runs DIR [--throughput [--set KEY=VALUE ...]] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

# the 4B-shaped throughput run: long answers, CUDA graphs on, activation checkpointing, 4 x 1024-token micro-batches
THROUGHPUT = ["+recipe=qwen3_toy_gpu", "model.path=tiny://qwen3_4b_shape", "model.gradient_checkpointing=full",
              "rollout.enforce_eager=false", "rollout.max_new_tokens=512", "data.max_len=1024",
              "train.micro_batch_size=4", "train.max_steps=5", "rollout.gpu_memory_utilization=null",
              "logger.progress=false", "logger.wandb.mode=disabled", "checkpoint.export_final=false",
              "checkpoint.save_steps=0"]


def device_copy_seconds(nbytes: int, repeats: int = 10) -> float:
    """Best time of `y.copy_(x)` over `nbytes` on this GPU (the bytes counted once, as the sync's are)."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for i in range(repeats + 1):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        if i:
            best = min(best, start.elapsed_time(end) / 1e3)
    return best


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    m = [r for r in rows if r["kind"] == "train"]
    cfg = yaml.safe_load((run / "resolved_config.yaml").read_text())
    med = lambda key: statistics.median(r.get(f"train/{key}", 0.0) for r in m)  # noqa: E731
    rewards = [r["train/reward"] for r in m]
    k = min(5, len(m) // 2) or 1
    wake = med("timing/engine_wake")
    # the sync's figures step by step (its wake taken out of the same step's), then their median over the steady
    # syncs: the first records the engine's copy plan, the second captures its CUDA graph
    steady_syncs = m[2:] or m[-1:]

    def per_sync(of) -> float:  # `of(v)`: one step's figure, `v(key)` reading its metrics
        return statistics.median(of(lambda key, r=r: r.get(f"train/{key}", 0.0)) for r in steady_syncs)
    sync = per_sync(lambda v: v("timing/weight_sync") - v("timing/engine_wake"))  # its wake is reported apart
    nbytes = int(m[-1].get("train/weight_sync/bytes", 0))
    tokens = [r["train/rollout/num_samples"] * r["train/rollout/response_length_mean"] for r in m]
    steady = m[1:] or m  # the first step also compiles / warms up
    out = {
        "run": run.name, "model": cfg["model"]["path"], "steps": len(m),
        "routing_replay": cfg["rollout"]["routing_replay"],
        "gpu_memory_utilization": cfg["rollout"]["gpu_memory_utilization"],
        "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
        "vllm_kl_max_abs": max(abs(r["train/vllm_kl"]) for r in m), "vllm_kl": [r["train/vllm_kl"] for r in m],
        "sync_s": sync, "sync_bytes": nbytes, "single_pass": m[-1].get("train/weight_sync/single_pass"),
        "engine_sleep_s": med("engine/sleep_s"), "engine_wake_s": wake, "engine_freed_gib": med("engine/freed_gib"),
        "split_s": {"generate": med("timing/generation"), "sleep": med("timing/engine_sleep"),
                    "train": med("timing/make_experience") + med("timing/policy_train"),
                    "release": med("timing/trainer_release"), "wake": wake, "sync": sync,
                    "step": med("timing/step_total")},
        "generated_tokens_per_s_per_gpu": statistics.median(
            t / r["train/timing/step_total"] for t, r in zip(tokens[1:] or tokens, steady)),
        "probe_gap_max": max((r.get("train/weight_sync/probe_logprob_gap", 0.0) for r in m), default=None),
    }
    if "train/routing/agreement" in m[-1]:
        out["routing_agreement"] = [r["train/routing/agreement"] for r in m]
        out["routing_replayed"] = [r["train/routing/replayed"] for r in m]
    if nbytes and sync > 0:
        copy = device_copy_seconds(nbytes)
        single = "train/weight_sync/engine_call_seconds" in m[-1]  # single pass: one call per engine
        # bucketed: the buckets alone; single pass: the one call, less the wakes inside it
        inner_wake = (lambda v: v("timing/engine_wake")) if single else (lambda v: 0.0)
        push = per_sync(lambda v: v("weight_sync/push_seconds") - inner_wake(v))
        out.update(sync_gb_s=nbytes / sync / 1e9, device_copy_gb_s=nbytes / copy / 1e9, sync_vs_copy=copy / sync,
                   push_s=push, push_vs_copy=copy / push if push > 0 else None,
                   # WeightSync's own: the driver's (single pass), trainer rank 0's (bucketed); sync_s less it: the
                   # call into it (single pass: the lock and the offer's check; bucketed: the driver -> trainer call)
                   weight_sync_s=per_sync(lambda v: v("weight_sync/seconds") - v("timing/engine_wake")))
        if single:  # the engine's own load, its vLLM calls, the Ray round trip driver -> engine
            load = per_sync(lambda v: v("weight_sync/engine_load_seconds"))
            out.update(engine_load_s=load, engine_load_vs_copy=copy / load if load > 0 else None,
                       engine_vllm_calls_s=per_sync(lambda v: v("weight_sync/engine_call_seconds")
                                                    - v("weight_sync/engine_load_seconds")),
                       ray_round_trip_s=per_sync(lambda v: v("weight_sync/push_seconds") - v("timing/engine_wake")
                                                 - v("weight_sync/engine_call_seconds")),
                       to_engine_s=per_sync(lambda v: v("weight_sync/to_engine_seconds")),
                       from_engine_s=per_sync(lambda v: v("weight_sync/from_engine_seconds")))
        else:
            out.update({f"{k}_s": per_sync(lambda v, k=k: v(f"weight_sync/{k}_seconds")) for k in ("begin", "finish")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=Path, required=True, help="directory holding run directories (metrics.jsonl)")
    ap.add_argument("--throughput", action="store_true", help="first run the Qwen3-4B-shaped colocated run there")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for the throughput run (repeatable), e.g. model.master_weights=optimizer")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.throughput:
        out = args.runs / "qwen3_4b_shape_throughput"
        own = {a.split("=", 1)[0] for a in args.set}  # a --set replaces the default of its key (molt-run refuses a
        base = [a for a in THROUGHPUT if a.split("=", 1)[0] not in own]  # key given twice)
        cmd = [sys.executable, "-m", "molt_hydra.cli", *base, *args.set, f"hydra.run.dir={out}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        (args.runs / "throughput_console.log").write_text(proc.stdout[-20000:] + "\n--- stderr ---\n"
                                                          + proc.stderr[-20000:])
        print(f"throughput run rc={proc.returncode}", flush=True)
    runs = [p.parent for p in sorted(args.runs.rglob("metrics.jsonl")) if '"kind": "train"' in p.read_text()]
    rows = [summarize(run) for run in runs]  # a run that failed before its first step has no row
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k not in ("vllm_kl",)}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
