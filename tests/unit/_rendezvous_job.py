"""A two-rank job for tests/unit/test_rank_rendezvous_port.py, in a module of its own: each spawned rank imports it."""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from molt_hydra.parallel.distributed import init_distributed


def summed_ranks(rank: int, world: int, port: int, path: str) -> None:
    init_distributed(rank, world, "127.0.0.1", port, timeout_s=60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    Path(path, f"rank{rank}").write_text(f"{port} {total.item():g}")
    dist.destroy_process_group()


def rank_1_hangs(rank: int, world: int, port: int, path: str) -> None:
    Path(path, f"rank{rank}").write_text("started")
    if rank == 1:
        time.sleep(60)  # (a collective waiting on a peer that never comes)
