"""Two-rank jobs for tests/unit/test_rank_0_failures.py, in a module of its own: each spawned rank imports it. Rank 0
fails where it alone acts (a weight push to the engines, an export's write); each rank writes how its call ended to
`<path>/rank<r>`."""

import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from molt_hydra.parallel.distributed import init_distributed
from molt_hydra.weight_sync import sender
from molt_hydra.weight_sync.buckets import iter_weight_buckets


class EngineDiesAtTheSecondBucket:
    """WeightSync's part on rank 0: the first bucket lands, the second's push fails."""

    def __init__(self, engines, transport, **kw):
        pass

    async def sync(self, buckets, version):
        for i, _ in enumerate(buckets):
            if i == 1:
                raise RuntimeError("EngineDeadError: the engine core died")
        return {}


def push_fails_on_rank_0(rank: int, world: int, port: int, path: str) -> None:
    init_distributed(rank, world, "127.0.0.1", port, timeout_s=20)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    worker = SimpleNamespace(rank=rank, device=torch.device("cpu"), lora=None,
                             weight_buckets=lambda size, dtype, device: iter_weight_buckets(model, size, dtype, device))
    sender.WeightSync = EngineDiesAtTheSecondBucket
    try:  # one tensor a bucket: 8 buckets, each gathered by a collective of both ranks
        pushed = sender.push_from_rank(worker, [], "object_store", 1, bucket_bytes=1, check_coverage=False,
                                       timeout_s=20, dtype="float32")
        ended = f"returned {pushed}"
    except Exception as e:  # noqa: BLE001 - what the test reads
        ended = f"{type(e).__name__}: {e}".splitlines()[0]
    Path(path, f"rank{rank}").write_text(ended)
    dist.barrier()  # both ranks still meet: their collectives stayed in step
    dist.destroy_process_group()


def export_fails_on_rank_0(rank: int, world: int, port: int, path: str) -> None:
    """export_hf of a 2-rank FSDP model into a directory whose parent is a file: rank 0's write fails."""
    from molt_hydra.parallel.checkpoint import export_hf

    init_distributed(rank, world, "127.0.0.1", port, timeout_s=20)
    model = torch.nn.Linear(8, 8)
    model.config = SimpleNamespace(tie_word_embeddings=False)
    fully_shard(model)
    Path(path, "in_the_way").touch()
    try:
        ended = f"returned {export_hf(Path(path, 'in_the_way', 'hf'), model)}"
    except Exception as e:  # noqa: BLE001 - what the test reads
        ended = f"{type(e).__name__}: {e}".splitlines()[0]
    Path(path, f"rank{rank}").write_text(ended)
    for _ in range(600):  # as a trainer rank (an actor) lives on after its call failed: its connections stay open
        if all(Path(path, f"rank{r}").exists() for r in range(world)):
            break
        time.sleep(0.1)
    dist.destroy_process_group()
