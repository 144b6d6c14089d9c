"""Rank functions for the resume tests (spawned by molt_hydra.parallel.launch.run_ranks; gloo on CPU). Each rank
writes what the test compares to `<out>.rank<r>` with torch.save."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch


def draw() -> tuple:
    """One draw from each RNG a checkpoint saves and restores (python, numpy, torch)."""
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def resumed_on_two_ranks(rank, world_size, port, root, out):
    """Loads the 1-rank checkpoint root/step_3 on these 2 ranks (FSDP2), draws; saves step_5 here, draws; loads step_5
    back on the same 2 ranks, draws again."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from molt_hydra.parallel.checkpoint import load_checkpoint, save_checkpoint

    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    torch.manual_seed(0)  # as TrainerWorker seeds every rank alike
    model = fully_shard(torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    draws = {}
    load_checkpoint(root, model, opt, step="step_3", seed=7)
    draws["more_ranks"] = draw()
    save_checkpoint(root, 5, model, opt)
    draws["after_save"] = draw()
    load_checkpoint(root, model, opt, step="step_5", seed=7)
    draws["same_ranks"] = draw()
    torch.save(draws, f"{out}.rank{rank}")
    dist.destroy_process_group()


def notified(rank, world_size, port, out):
    """Slurm's notice (SIGUSR2) to this rank, then a file: there only if the rank lived on."""
    os.kill(os.getpid(), signal.SIGUSR2)
    torch.save("lived on", f"{out}.rank{rank}")


def progress_bar(rank, world_size, port):
    """A progress bar, as transformers' model loading shows in each rank."""
    from tqdm.auto import tqdm

    for _ in tqdm(range(3), desc="Loading weights"):
        pass
