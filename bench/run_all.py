"""`make bench`: every benchmark of bench/, one after the other, each appending its rows to bench/RESULTS.md.
GPU benchmarks run only where CUDA is available (else skipped with a note; their rows come from the device).
Each script runs in its own process. On a shared machine wrap it: `flock /tmp/molt_heavy.lock make bench`.

    .venv/bin/python bench/run_all.py [--only rollout_overhead,weight_sync,...]
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCH, REPO, cuda_available  # noqa: E402

CPU_BENCHES = ["startup_cost", "rollout_overhead", "weight_sync", "async_vs_sync --model smollm2",
               "async_vs_sync --model smollm2 --placement disjoint", "grpo_vs_trl", "grpo_vs_trl --model smollm2",
               "moe_routing", "master_weight_traffic"]  # a name, then its arguments


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="")
    args = p.parse_args()
    chosen = [b for b in CPU_BENCHES + ["gpu_trainer"] if not args.only or b.split()[0] in args.only.split(",")]
    failed = []
    for name in chosen:
        if name == "gpu_trainer":
            if not cuda_available():
                print("| skipped | gpu_trainer | no CUDA here: run `torchrun --nproc_per_node=N bench/gpu_trainer.py`"
                      " on the device; its rows are in RESULTS.md |", flush=True)
                continue
            import torch

            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={torch.cuda.device_count()}", str(BENCH / "gpu_trainer.py"),
                   "--out", "/tmp/molt_bench_gpu.json"]
        else:
            cmd = [sys.executable, str(BENCH / f"{name.split()[0]}.py"), *name.split()[1:]]
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=REPO).returncode
        print(f"== {name}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print("failed:", ", ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
