"""Process group + device mesh for the trainer ranks: gloo on CPU, NCCL on GPU, with a timeout on every collective.

The HF backend is data parallel only (FSDP2 over `dp`): config/validate.py refuses tensor / expert / context parallel
sizes > 1 there. The AutoModel backend builds its own dp x cp x tp (+ ep)
mesh (models/automodel.py) and does not use `build_device_mesh`.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, *,
                     timeout_s: float = 600.0) -> torch.device:
    """Join (or create) the default process group; return this rank's device. Idempotent."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", master_addr)
        os.environ.setdefault("MASTER_PORT", str(master_port))
        if torch.cuda.is_available():
            # gloo beside NCCL: small CPU-side collectives (counts, metrics) and CPU-offloaded FSDP2 params
            backend = "cuda:nccl,cpu:gloo"
            local = rank % torch.cuda.device_count()
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            backend, device = "gloo", torch.device("cpu")
        dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"tcp://{master_addr}:{master_port}",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_device_mesh(dp_size: int):
    """FSDP2's one `dp` dimension over every rank (the config keeps tp = ep = cp = 1 on the HF backend)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp_size != dist.get_world_size():  # a mesh smaller than the world leaves ranks outside every collective: a hang
        raise ValueError(f"dp_size={dp_size} must equal the number of trainer ranks ({dist.get_world_size()}) on the "
                         "HF backend (data parallel only)")
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dp_size,), mesh_dim_names=("dp",))
