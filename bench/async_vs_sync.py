"""Step time of the same recipe in train.mode=async (queue_depth 1) vs train.mode=sync, on a workload where
generation and the rest of the step take about the same time, with the CPU each role used in both modes.

1. Balance: two short sync runs of the embedded default (tiny Qwen3, toy task, 8x8 samples) at max_new_tokens 32 and
   128 give generation and rest-of-step (experience + train + weight sync) time as lines in the token budget; the
   budget where the lines cross (rounded to 8) is the balanced workload.
2. At that budget, a sync run and an async run (queue_depth 1), same samples per step and steps. Reported: mean
   timing/step_total of steps 3..N, each phase's mean time in both modes, the ideal async/sync ratio
   max(gen, rest) / step_sync, and a 2-core bound: an async step cannot take less than (CPU seconds of a sync step)
   / 2 cores either (the bound is the larger of the two).
   Every run is `molt-run` itself, so its engines are built as any run builds them (`rollout.executor=auto`: uni on
   a one-worker CPU engine, the model in vLLM's engine core process).
3. CPU: every process of each run is sampled (psutil, 0.5 s) and its CPU time is booked to its role (engine worker
   = the model, engine core = vLLM's scheduler process, engine front = the AsyncLLM actor, trainer, agent runner,
   driver, Ray's own processes) over the timed steps: CPU seconds per step per role, and cores busy in all.

`--model smollm2`: the same on SmolLM2-135M-Instruct (fp32), the toy task (its answers run to the token budget,
so the budget sets the work; the arithmetic task's answers stop after ~30 tokens), 1 prompt x 4 samples, micro-batch
4, probes at 32 and 128 tokens. Why this workload: on the tiny model a whole step is ~0.4 s, so fixed per-step costs
(Ray calls, the weight sync, vLLM's scheduler and front processes) are what is measured, not overlap; here model
compute dominates both phases. Why 4 samples: training cost grows with samples x tokens while a CPU decode step costs
about the same for 4 or 32 sequences (it reads every fp32 weight either way, ~55-90 ms), so at 32 samples training
takes ~2-5x generation at every budget (bench/RESULTS.md grpo_vs_trl rows), and only a small batch balances.
`--placement`: where the roles compute.
- `shared` (the default run): a sync step trains on both cores while generation runs the model on one (OMP threads =
  cores - 1), so overlap can only fill the core generation leaves idle; an async step cannot take less than the sync
  step's CPU seconds / 2 (the row's 2-core bound, ~0.75 here), which is above the 0.60 goal.
- `disjoint` (`parallelism.borrow_idle_cpus=false`): the trainer keeps to the one CPU Ray reserved for it and the
  engine's model runs on the other, as engines and trainer sit on separate GPUs: a sync step leaves one of them idle
  in each phase, which is the workload async overlap is for (balanced again under this placement).

    flock /tmp/molt_heavy.lock .venv/bin/python bench/async_vs_sync.py [--model tiny|smollm2] [--steps 12]
        [--max-new-tokens N] [--placement shared|disjoint]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, CpuSampler, append_row  # noqa: E402

SKIP = 2
MODELS = {  # model -> (overrides of the embedded default, description)
    "tiny": ([], "default recipe (tiny qwen3, toy, 8x8 samples)"),
    "smollm2": (["model=smollm2_135m", "rollout.batch_size=1", "rollout.n_samples_per_prompt=4", "train.batch_size=4",
                 "train.micro_batch_size=4", "train.optimizer.lr=1e-5", "data.max_len=512"],  # room for ~300 tokens
                "SmolLM2-135M-Instruct fp32, toy task, 1x4 samples, micro 4"),
}
PLACEMENTS = {"shared": [], "disjoint": ["parallelism.borrow_idle_cpus=false"]}
PHASES = ("generation", "vllm_idle_wait", "actor_idle_wait", "make_experience", "policy_train", "weight_sync_wait",
          "weight_sync")
def unprefix(row: dict) -> dict:
    """metrics.jsonl keys of training steps carry a `train/` prefix (kind=train): strip it."""
    return {k[len("train/"):] if k.startswith("train/") else k: v for k, v in row.items()}


def run(mode: str, steps: int, max_new: int, sample_cpu: bool = False, model: str = "tiny",
        placement: str = "shared") -> tuple[list[dict], dict]:
    out = Path(tempfile.mkdtemp(prefix=f"molt_bench_{mode}_"))
    args = [str(Path(sys.executable).with_name("molt-run")), *MODELS[model][0], *PLACEMENTS[placement],
            f"hydra.run.dir={out}",
            f"train.max_steps={steps}",
            f"train.mode={mode}", f"rollout.max_new_tokens={max_new}", "logger.wandb.mode=disabled",
            "checkpoint.export_final=false"]
    if mode == "async":
        args.append("train.queue_depth=1")
    p = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = CpuSampler(p.pid, out / "metrics.jsonl") if sample_cpu else None
    log = p.stdout.read()
    if sampler:
        sampler.stop = True
        sampler.thread.join()
    if p.wait() != 0:
        raise RuntimeError(f"molt-run {mode} failed ({p.returncode}):\n{log[-4000:]}")
    rows = [unprefix(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()
            if "timing/step_total" in line]
    cpu = {}
    if sampler:
        wall, cpu = sampler.per_step(SKIP, steps)
        cpu["_wall"] = wall
    return rows, cpu


def mean(rows, key):
    return statistics.mean(r.get(key, 0.0) for r in rows[SKIP:])


def gen_and_rest(rows) -> tuple[float, float]:
    """A sync step's generation time and everything else (experience, train, weight sync)."""
    gen = mean(rows, "timing/generation")
    return gen, mean(rows, "timing/step_total") - gen - mean(rows, "timing/weight_sync_wait")


def balanced_tokens(steps: int, model: str, placement: str) -> tuple[int, str]:
    """The max_new_tokens where a sync step's generation and rest take the same time (two probes, linear fit)."""
    probes = {}
    for tokens in (32, 128):
        rows = run("sync", steps, tokens, model=model, placement=placement)[0]
        probes[tokens] = gen_and_rest(rows)
        print(f"probe sync max_new_tokens={tokens}: generation {probes[tokens][0]:.2f} s, rest "
              f"{probes[tokens][1]:.2f} s, response length {mean(rows, 'rollout/response_length_mean'):.0f}",
              flush=True)
    (g0, r0), (g1, r1) = probes[32], probes[128]
    slope = ((g1 - g0) - (r1 - r0)) / 96  # d(gen - rest) / d(tokens)
    tokens = 32 + (r0 - g0) / slope if slope > 0 else 256
    chosen = int(min(max(round(tokens / 8) * 8, 16), 512))
    how = "; ".join(f"probe {t} tok: gen {g:.2f} s / rest {r:.2f} s" for t, (g, r) in probes.items())
    return chosen, how


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=None, help="skip the balance probes and use this budget")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--placement", choices=sorted(PLACEMENTS), default="shared")
    args, _ = p.parse_known_args()  # --no-append is read by _common.append_row
    if args.max_new_tokens is None:
        tokens, how = balanced_tokens(6, args.model, args.placement)
    else:
        tokens, how = args.max_new_tokens, "budget given"
    print(f"balanced workload: max_new_tokens={tokens} ({how})", flush=True)
    sync, cpu_s = run("sync", args.steps, tokens, sample_cpu=True, model=args.model, placement=args.placement)
    asyn, cpu_a = run("async", args.steps, tokens, sample_cpu=True, model=args.model, placement=args.placement)
    s, a = mean(sync, "timing/step_total"), mean(asyn, "timing/step_total")
    gen, rest = gen_and_rest(sync)
    ideal = max(gen, rest) / s
    cpu_sync, cpu_async = (sum(v for k, v in c.items() if k != "_wall") for c in (cpu_s, cpu_a))
    core_bound = max(gen, rest, cpu_sync / 2) / s  # a sync step's CPU seconds spread over both cores at best
    for name, rows in (("sync", sync), ("async", asyn)):
        print(name, [round(r["timing/step_total"], 2) for r in rows])
    phases = "; ".join(f"{ph} {mean(sync, 'timing/' + ph):.2f}/{mean(asyn, 'timing/' + ph):.2f}" for ph in PHASES)
    roles = "; ".join(f"{r} {cpu_s.get(r, 0):.2f}/{cpu_a.get(r, 0):.2f}" for r in sorted(set(cpu_s) | set(cpu_a))
                      if r != "_wall")
    where = " ".join(PLACEMENTS[args.placement]) or "the trainer borrows the cores the engine leaves idle"
    trained_s = sum(r["num_samples_trained"] for r in sync[SKIP:])
    trained_a = sum(r["num_samples_trained"] for r in asyn[SKIP:])
    append_row("async_vs_sync",
               f"{MODELS[args.model][1]}, placement {args.placement} ({where}), balanced max_new_tokens={tokens} "
               f"({how}), "
               f"{args.steps} steps, mean step_total of steps {SKIP + 1}..{args.steps}; samples trained "
               f"{trained_s:.0f} sync / {trained_a:.0f} async, mean response length "
               f"{mean(sync, 'rollout/response_length_mean'):.0f} / {mean(asyn, 'rollout/response_length_mean'):.0f}",
               f"sync {s:.2f} s/step (generation {gen:.2f} s, rest {rest:.2f} s)",
               f"async (queue_depth 1) {a:.2f} s/step",
               f"ratio {a / s:.2f} (goal <= 0.60; ideal max(gen, rest)/sync {ideal:.2f}; "
               f"2-core bound {core_bound:.2f})",
               f"phase means s sync/async: {phases}; trainer torch threads (mean over micro-batches) "
               f"{mean(sync, 'perf/torch_threads'):.2f}/{mean(asyn, 'perf/torch_threads'):.2f}. "
               f"CPU s/step sync/async: {roles}; all {cpu_sync:.2f}/"
               f"{cpu_async:.2f} (cores busy {cpu_sync / s:.2f}/{cpu_async / a:.2f}); load avg at the end "
               + " ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
