"""Process group + device mesh for the trainer ranks: gloo on CPU, NCCL on GPU, with a timeout on every collective.

The HF backend is data parallel only (FSDP2 over `dp`): tensor / expert / context parallel sizes > 1 are refused here
with a clear error (config/validate.py refuses them earlier). The AutoModel backend builds its own dp x cp x tp (+ ep)
mesh (models/automodel.py) and does not use `build_device_mesh`.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, *, offload: bool = False,
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


def build_device_mesh(dp_size: int, *, tp_size: int = 1, ep_size: int = 1, cp_size: int = 1):
    from torch.distributed.device_mesh import init_device_mesh

    unsupported = {k: v for k, v in dict(tp_size=tp_size, ep_size=ep_size, cp_size=cp_size).items() if v != 1}
    if unsupported:
        raise NotImplementedError(
            f"parallelism {unsupported} is not supported by the molt_hydra FSDP2 trainer (HF transformers backend, "
            f"data parallel only); set these to 1 and scale with parallelism.dp_size")
    world = dist.get_world_size()
    if dp_size != world:
        raise ValueError(f"dp_size={dp_size} must equal the number of trainer ranks ({world}) when tp=ep=cp=1")
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dp_size,), mesh_dim_names=("dp",))
