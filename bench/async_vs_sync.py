"""Step time of the same recipe in train.mode=async (queue_depth 1) vs train.mode=sync, same samples trained per
step and same number of steps: the embedded default (tiny Qwen3, toy task) with longer responses so that generation
and training take similar time. Reported: mean timing/step_total of steps 3..N from each run's metrics.jsonl, the
sync run's mean generation and train time (to show the workload is balanced), and the ideal async/sync ratio
max(gen, train) / (gen + train) for those times.

    flock /tmp/molt_heavy.lock .venv/bin/python bench/async_vs_sync.py [--max-new-tokens 32] [--steps 12]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, append_row  # noqa: E402

SKIP = 2


def unprefix(row: dict) -> dict:
    """metrics.jsonl keys of training steps carry a `train/` prefix (kind=train): strip it."""
    return {k[len("train/"):] if k.startswith("train/") else k: v for k, v in row.items()}


def run(mode: str, steps: int, max_new: int) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"molt_bench_{mode}_")
    args = [str(Path(sys.executable).with_name("molt-run")), f"hydra.run.dir={out}", f"train.max_steps={steps}",
            f"train.mode={mode}", f"rollout.max_new_tokens={max_new}", "logger.wandb.mode=disabled"]
    if mode == "async":
        args.append("train.queue_depth=1")
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"molt-run {mode} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    return [unprefix(json.loads(line)) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
            if "timing/step_total" in line]


def mean(rows, key):
    return statistics.mean(r.get(key, 0.0) for r in rows[SKIP:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    sync = run("sync", args.steps, args.max_new_tokens)
    asyn = run("async", args.steps, args.max_new_tokens)
    s, a = mean(sync, "timing/step_total"), mean(asyn, "timing/step_total")
    gen = mean(sync, "timing/generation")
    train = s - gen - mean(sync, "timing/weight_sync_wait")  # everything of the sync step that is not generation
    trained_s = sum(r["num_samples_trained"] for r in sync[SKIP:])
    trained_a = sum(r["num_samples_trained"] for r in asyn[SKIP:])
    for name, rows in (("sync", sync), ("async", asyn)):
        print(name, [round(r["timing/step_total"], 2) for r in rows])
    append_row("async_vs_sync",
               f"default recipe (tiny qwen3, toy, 8x8 samples) max_new_tokens={args.max_new_tokens}, {args.steps} steps,"
               f" mean step_total of steps {SKIP + 1}..{args.steps}; sync run: generation {gen:.2f} s, rest of step "
               f"(experience+train+weight sync) {train:.2f} s; samples trained {trained_s:.0f} sync / {trained_a:.0f} "
               "async", f"sync {s:.2f} s/step", f"async (queue_depth 1) {a:.2f} s/step",
               f"ratio {a / s:.2f} (goal <= 0.60; ideal for these times {max(gen, train) / (gen + train):.2f})")


if __name__ == "__main__":
    main()
