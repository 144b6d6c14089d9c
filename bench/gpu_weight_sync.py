"""Seconds per GB of a full GPU weight sync of a random-init Qwen3 (4B by default: fp32 master weights on the trainer
GPU, bf16 on the wire and in the engine), with the project's send and receive code in two processes (the engine side on
the stand-in model runner of tests/gpu/_weight_sync_standin.py: vLLM cannot be installed on the device).

- cuda_ipc, trainer and engine on GPU 0, against a device-to-device copy of the same bytes on that GPU (goal >= 0.5):
  bucketed (pack + load, the path for dp > 1) per bucket size, and single pass (the engine loads straight from the
  trainer's own parameters, one trainer rank), with the engine's loaders on every sync and with the replayed copy
  plan (weight_sync/copy_plan.py), against floors in one process (one CUDA graph of per-tensor copies; one-call
  `_foreach_copy_`) and with the engine side's own time;
- nccl, trainer GPU 0 -> engine GPU 1 (when 2 GPUs are visible), against a plain NCCL broadcast of the same bytes
  over the same group (goal >= 0.8).
Both baselines are measured in the same run. Appends one row per transport and bucket size to RESULTS.md.

    python bench/gpu_weight_sync.py [--shape 4b] [--bucket-mb 512,2048]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from _common import append_row  # noqa: E402
from _weight_sync_standin import (StandInEngine, StandInTrainerRank, broadcast_seconds, call_seconds,  # noqa: E402
                                  cast_copy_seconds, connect, device_copy_seconds, free_port, graph_copy_seconds,
                                  sync_seconds, wire_bytes)

from molt_hydra.weight_sync.buckets import pack_bucket  # noqa: E402
from molt_hydra.weight_sync.copy_plan import CopyPlan  # noqa: E402


def pack_seconds(rank: StandInTrainerRank, bucket_bytes: int, repeats: int = 3) -> float:
    """The send side alone: gather every bucket and cast+pack it (no receiver)."""
    import time

    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize(rank.device)
        start = time.perf_counter()
        for bucket in rank.weight_buckets(bucket_bytes, None, rank.device):
            pack_bucket(bucket, torch.bfloat16)
        torch.cuda.synchronize(rank.device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def best_ms(fn, repeats: int = 7) -> float:
    import time

    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3


def profile_single_pass(r: StandInTrainerRank, engine: StandInEngine, path: str | None) -> None:
    """Where a replayed single-pass sync spends its time: its pieces timed alone (trainer side path selection, an
    event loop, each engine call) and, with `path`, a cProfile of 10 whole `push_from_rank` calls."""
    import asyncio
    import cProfile
    import io
    import pstats

    from molt_hydra.weight_sync.sender import push_from_rank
    from molt_hydra.weight_sync.shared_params import rank_shared_params

    def push():
        push_from_rank(r, [engine], "cuda_ipc", engine.version + 1, bucket_bytes=1 << 30, check_coverage=False,
                       timeout_s=600, dtype="bfloat16")

    token = r.shared_params[1].token
    parts = {"whole push_from_rank": best_ms(push),
             "rank_shared_params (trainer: address check)": best_ms(
                 lambda: rank_shared_params(r, "cuda_ipc", torch.bfloat16)),
             "asyncio.run of nothing": best_ms(lambda: asyncio.run(asyncio.sleep(0))),
             "engine call update_from_shared_params (begin + replay + stream sync + finish)": best_ms(
                 lambda: engine.call("update_from_shared_params", token, None, None, False)),
             "engine call load_shared_params (replay + stream sync)": best_ms(
                 lambda: engine.call("load_shared_params", token, None, None)),
             "  of it inside the engine": engine.call("last_load_seconds") * 1e3,
             "  of it the plan's replay alone (in the engine, from the mapped trainer memory)": engine.call(
                 "replay_seconds") * 1e3,
             "trainer stream synchronize": best_ms(lambda: torch.cuda.current_stream(r.device).synchronize())}
    print("breakdown (ms, best of 7): " + "; ".join(f"{k} {v:.3f}" for k, v in parts.items()), flush=True)
    if path:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            push()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(35)
        stats.sort_stats("tottime").print_stats(25)
        Path(path).write_text(text.getvalue())
        print(text.getvalue()[:6000], flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4b")
    p.add_argument("--bucket-mb", default="512,2048")
    p.add_argument("--transports", default="cuda_ipc,nccl")
    p.add_argument("--profile", default="", help="write a cProfile of replayed single-pass syncs (bf16) here")
    args, _ = p.parse_known_args()  # --no-append is read by _common.append_row
    buckets = [int(b) for b in args.bucket_mb.split(",")]
    gpu = torch.cuda.get_device_name(0)
    n_gpus = torch.cuda.device_count()
    rank = StandInTrainerRank(args.shape, torch.device("cuda", 0))
    nbytes = wire_bytes(rank)
    gb = nbytes / 1e9
    params = sum(t.numel() for t in rank.expected().values()) / 1e9
    setup = (f"random Qwen3 {args.shape} ({params:.2f} B params, {gb:.2f} GB bf16 on the wire, fp32 master), "
             f"project send side (push_from_rank) + worker-extension receive side on a stand-in model runner, "
             f"best of 3 whole push_from_rank calls after a warm-up (path selection, send-side cast+pack, pause .. "
             f"finish); {n_gpus}x {gpu}, torch "
             f"{torch.__version__}")

    transports = args.transports.split(",")
    engine = StandInEngine(args.shape, "cuda:0") if "cuda_ipc" in transports else None  # no coverage checked
    copy_s = device_copy_seconds(nbytes, rank.device) / gb
    for mb in buckets if engine else ():
        sync_s = sync_seconds(rank, engine, "cuda_ipc", mb << 20) / gb
        pack_s = pack_seconds(rank, mb << 20) / gb
        append_row("gpu_weight_sync", f"cuda_ipc, one GPU, {mb} MB buckets; " + setup,
                   f"device copy {copy_s:.4f} s/GB ({1 / copy_s:.0f} GB/s)",
                   f"cuda_ipc {sync_s:.4f} s/GB ({1 / sync_s:.0f} GB/s)", f"{copy_s / sync_s:.2f} of a device copy "
                   "(goal >= 0.5)", f"send side alone (gather + fp32->bf16 cast + pack) {pack_s:.4f} s/GB")
    if engine:
        # single pass: the engine maps the trainer's parameters once (in the warm-up), then loads from them; with
        # fp32 trainer parameters (the loader casts: 6 bytes/param) and bf16 ones (a plain copy: 4 bytes/param);
        # each with the loaders running every sync (the path before copy plans) and with the replayed copy plan
        rank.single_pass = True
        rank16 = StandInTrainerRank(args.shape, rank.device, single_pass=True, dtype=torch.bfloat16)
        single_setup = setup.replace("bf16 on the wire", "bf16 written into the engine, nothing on a wire")
        for r, kind in ((rank, "fp32"), (rank16, "bf16")):
            engine.call("set_loader", False, False)
            loader_s = sync_seconds(r, engine, "cuda_ipc", buckets[0] << 20) / gb
            loader_engine_s = engine.call("last_load_seconds") / gb
            engine.call("set_loader", False, True)
            sync_s = sync_seconds(r, engine, "cuda_ipc", buckets[0] << 20) / gb
            path = engine.call("shared_load")
            replay_engine_s = engine.call("last_load_seconds") / gb
            floor_s = cast_copy_seconds(r) / gb
            graph_s = graph_copy_seconds(r, CopyPlan.BRANCHES) / gb
            graph1_s = graph_copy_seconds(r, 1) / gb
            append_row("gpu_weight_sync", f"cuda_ipc single pass, one GPU, one trainer rank, {kind} trainer "
                       "parameters, replayed copy plan; " + single_setup.replace("fp32 master",
                                                                                  f"{kind} trainer parameters"),
                       f"device copy {copy_s:.5f} s/GB ({1 / copy_s:.0f} GB/s)",
                       f"single pass, replayed plan {sync_s:.5f} s/GB ({1 / sync_s:.0f} GB/s; last load path "
                       f"{path[0]}); loaders every sync {loader_s:.5f} s/GB",
                       f"{copy_s / sync_s:.2f} of a device copy replayed, {copy_s / loader_s:.2f} with the loaders "
                       "(goal >= 0.5)",
                       f"engine side (load_shared_params incl. stream sync) replay {replay_engine_s:.5f} / loaders "
                       f"{loader_engine_s:.5f} s/GB; floors in one process: the plan's CUDA graph of per-tensor "
                       f"{kind}->bf16 copy_ on {CopyPlan.BRANCHES} streams {graph_s:.5f} s/GB ({copy_s / graph_s:.2f} "
                       f"of a copy), on one stream {graph1_s:.5f} s/GB ({copy_s / graph1_s:.2f}), one-call "
                       f"_foreach_copy_ "
                       f"{floor_s:.5f} s/GB ({copy_s / floor_s:.2f}); a stand-in worker call's round trip "
                       f"{call_seconds(engine) * 1e3:.2f} ms (3 per sync)")
            profile_single_pass(r, engine, args.profile and f"{args.profile}.{kind}")
        rank.single_pass = False
        del rank16
        engine.close()

    if n_gpus >= 2 and "nccl" in transports:
        engine = StandInEngine(args.shape, "cuda:1")
        connect(rank, engine, free_port())
        bcast_s = broadcast_seconds(rank, engine, nbytes) / gb
        for mb in buckets:
            sync_s = sync_seconds(rank, engine, "nccl", mb << 20) / gb
            pack_s = pack_seconds(rank, mb << 20) / gb
            append_row("gpu_weight_sync", f"nccl, GPU 0 -> GPU 1, {mb} MB buckets; " + setup,
                       f"plain NCCL broadcast {bcast_s:.4f} s/GB ({1 / bcast_s:.0f} GB/s)",
                       f"nccl {sync_s:.4f} s/GB ({1 / sync_s:.0f} GB/s)",
                       f"{bcast_s / sync_s:.2f} of a plain broadcast (goal >= 0.8)",
                       f"send side alone (gather + fp32->bf16 cast + pack) {pack_s:.4f} s/GB")
        engine.close()


if __name__ == "__main__":
    main()
