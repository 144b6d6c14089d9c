"""Muon's per-step cost against AdamW's, same model, same process (train.optimizer.name=muon, parallel/muon.py).

Builds a random-init Qwen3-shaped TrainerWorker (bench/gpu_trainer.py's shapes, FSDP2, bf16 compute, fp32 params),
then for AdamW and for Muon in turn: one warm-up training step, `--steps` timed PPO training steps on synthetic
experiences, and `--opt-steps` timed optimizer steps alone (on constant grads). Prints one JSON row with both times
and the ratios muon / adamw, writes it to --out, and on GPU appends a row to bench/RESULTS.md (--no-append: print).

    python bench/muon_cost.py --out muon.json                       # one GPU, Qwen3-4B shape
    torchrun --standalone --nproc_per_node=N bench/muon_cost.py --out muon.json
    python bench/muon_cost.py --device cpu --shape tiny --out /tmp/m.json   # smoke check of this script
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.0, nesterov=True, experts_adamw=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_optimizer(w, data, obj, args, muon: dict | None) -> dict:
    """Swaps in a fresh optimizer (AdamW or Muon) over the worker's model; times training and optimizer steps."""
    from molt_hydra.parallel.optim import build_optimizer, build_scheduler

    w.optimizer = w.scheduler = None
    gc.collect()
    if w.device.type == "cuda":
        torch.cuda.empty_cache()
    w.optimizer = build_optimizer(w.model, lr=1e-6, muon=muon)
    w.scheduler = build_scheduler(w.optimizer, total_steps=100)
    w.train_step(data, obj)  # warm-up (allocates the optimizer state's first use, kernels)
    _sync(w.device)
    t = time.perf_counter()
    for _ in range(args.steps):
        m = w.train_step(data, obj)
    _sync(w.device)
    train_s = (time.perf_counter() - t) / args.steps
    for p in w.model.parameters():  # the optimizer-only steps reuse one set of grads
        p.grad = torch.ones_like(p) * 1e-3
    _sync(w.device)
    t = time.perf_counter()
    for _ in range(args.opt_steps):
        w.optimizer.step()
    _sync(w.device)
    opt_s = (time.perf_counter() - t) / args.opt_steps
    w.optimizer.zero_grad(set_to_none=True)
    mem = torch.cuda.max_memory_allocated() / 2**30 if w.device.type == "cuda" else 0.0
    return {"train_step_s": train_s, "optimizer_step_s": opt_s, "policy_loss": m["policy_loss"], "peak_mem_gb": mem}


def main():
    from gpu_trainer import samples, write_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="4b", help="a bench/gpu_trainer.py shape (4b, 1.7b, 0.6b, tiny)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=2, help="sequences per rank per training step")
    ap.add_argument("--steps", type=int, default=2, help="timed training steps per optimizer")
    ap.add_argument("--opt-steps", type=int, default=5, help="timed optimizer-only steps per optimizer")
    ap.add_argument("--no-append", action="store_true", help="GPU runs: print the RESULTS.md row, do not append it")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch touches CUDA: the trainer picks gloo on CPU
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.launch import free_port
    from molt_hydra.parallel.objectives import ActorObjective
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    port = int(os.environ.get("MASTER_PORT", free_port()))
    path = write_config(args.shape, rank)
    t = time.perf_counter()
    w = TrainerWorker(TrainerSpec(rank=rank, world_size=world, master_port=port, model_path=path, random_init=True,
                                  gradient_checkpointing=args.device == "cuda",
                                  param_dtype="bf16" if args.device == "cuda" else "fp32",
                                  max_tokens_per_micro_batch=args.mbs * args.seq, timeout_s=300))
    build_s = time.perf_counter() - t
    data = samples(args.mbs, args.seq, w.model.config.vocab_size, seed=rank)
    obj = ActorObjective(PolicyLoss("ppo"))
    adamw = time_optimizer(w, data, obj, args, None)
    muon = time_optimizer(w, data, obj, args, MUON)
    n_muon = sum(p.numel() for g in w.optimizer.param_groups if g["muon"] for p in g["params"])
    row = {"bench": "muon_cost", "shape": args.shape, "world": world, "device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "tokens_per_rank_step": args.mbs * args.seq, "build_s": build_s,
           "params_b": sum(p.numel() for p in w.model.parameters()) / 1e9, "muon_params_b": n_muon / 1e9,
           **{f"adamw_{k}": v for k, v in adamw.items()}, **{f"muon_{k}": v for k, v in muon.items()},
           "optimizer_step_ratio": muon["optimizer_step_s"] / adamw["optimizer_step_s"],
           "train_step_ratio": muon["train_step_s"] / adamw["train_step_s"],
           "muon_extra_s_per_step": muon["train_step_s"] - adamw["train_step_s"]}
    if rank == 0:
        print(f"muon / adamw: optimizer step x{row['optimizer_step_ratio']:.2f} "
              f"({muon['optimizer_step_s']:.3f} s vs {adamw['optimizer_step_s']:.3f} s), training step "
              f"x{row['train_step_ratio']:.3f} ({muon['train_step_s']:.3f} s vs {adamw['train_step_s']:.3f} s)")
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(row, indent=1))
        if args.device == "cuda":  # the CPU smoke shape measures nothing worth a row
            from _common import append_row
            append_row("muon_cost", f"Qwen3-{args.shape} shape, random init, {world} x {row['gpu']}, FSDP2 bf16 "
                       f"compute / fp32 params, {args.mbs} x {args.seq} tokens per rank, full AC",
                       f"AdamW: step {adamw['train_step_s']:.3f} s, optimizer {adamw['optimizer_step_s']:.3f} s",
                       f"Muon: step {muon['train_step_s']:.3f} s, optimizer {muon['optimizer_step_s']:.3f} s",
                       f"x{row['train_step_ratio']:.3f} step, x{row['optimizer_step_ratio']:.2f} optimizer",
                       f"Muon on {row['muon_params_b']:.2f} B of {row['params_b']:.2f} B params; +"
                       f"{row['muon_extra_s_per_step']:.3f} s per training step")
    w.shutdown()


if __name__ == "__main__":
    main()
