"""Muon for the matrices, AdamW for the rest (Molt's `--optim muon`, inventory §1.1 optimizer block), under FSDP2.

Param groups as Molt's muon.py: 2-D weights and 3-D grouped MoE expert weights (unless `experts_adamw`, Molt's
MUON_EXPERTS_ADAMW) -> Muon at `muon.lr` / `muon.weight_decay`; vectors, norms, biases -> AdamW at the AdamW lr / wd;
embeddings -> AdamW with wd 0; output heads (an untied lm_head, a critic's value head) -> AdamW at
lr = muon.lr / sqrt(d_in), wd 0. A tied lm_head is the embedding.

Distribution: the momentum is elementwise, so it stays sharded like its parameter (a DTensor in `state`, saved and
resharded by DCP as the AdamW moments are). Only the Newton-Schulz orthogonalisation needs a whole matrix: each rank
all-gathers the (Nesterov-blended) momentum of a matrix, orthogonalises it, and keeps its own shard of the result.
Every rank orthogonalises every matrix (redundant compute, one all-gather per matrix per step, no second collective);
bench/muon_cost.py measures the step against AdamW's. The orthogonalisation itself is torch.optim.Muon's.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adamw import adamw


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (laid out like `param`'s shard) gathered into the whole matrix on every rank."""
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor() if hasattr(param, "device_mesh") else local


def _own_shard(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a whole matrix, as `param` is sharded (Replicate -> its placements is local slicing)."""
    mesh = getattr(param, "device_mesh", None)
    return whole if mesh is None else \
        DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, param.placements).to_local()


def orthogonalised(matrix: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's update direction for a 2-D `matrix` taken as the (blended) momentum: sqrt(max(1, A/B)) x
    Newton-Schulz(matrix). A one-step torch Muon with no momentum and no weight decay, on a zero parameter whose grad
    is `matrix`, leaves exactly minus that in the parameter."""
    proxy = torch.zeros_like(matrix, requires_grad=True)
    proxy.grad = matrix
    torch.optim.Muon([proxy], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0).step()
    return proxy.detach().neg_()


class MuonAdamW(torch.optim.Optimizer):
    """Groups with `muon=True` step with Muon, the others with AdamW. State is created up front (DCP then knows the
    checkpoint's structure before the first step): Muon `momentum_buffer`, AdamW `step` / `exp_avg` / `exp_avg_sq`."""

    def __init__(self, groups: list[dict], *, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True):
        super().__init__(groups, dict(betas=tuple(betas), eps=eps, momentum=momentum, nesterov=nesterov, muon=False))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"momentum_buffer": torch.zeros_like(p)} if group["muon"] else {
                    "step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["muon"]:
                for p in params:
                    self._muon_step(p, group)
                continue
            states = [self.state[p] for p in params]
            adamw([local_part(p) for p in params], [local_part(p.grad) for p in params],
                  [local_part(s["exp_avg"]) for s in states], [local_part(s["exp_avg_sq"]) for s in states], [],
                  [s["step"] for s in states], foreach=True, amsgrad=False, beta1=group["betas"][0],
                  beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=False)

    def _muon_step(self, p: torch.Tensor, group: dict):
        mu = group["momentum"]
        buf, grad = local_part(self.state[p]["momentum_buffer"]), local_part(p.grad)
        buf.lerp_(grad, 1 - mu)  # torch Muon's momentum, elementwise on the shard
        whole = _whole(p, grad.lerp(buf, mu) if group["nesterov"] else buf)  # the (Nesterov-blended) momentum
        # grouped experts [E, d_out, d_in]: each expert's matrix is orthogonalised on its own
        update = torch.stack([orthogonalised(m) for m in whole]) if whole.dim() == 3 else orthogonalised(whole)
        local = local_part(p)
        local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(_own_shard(p, update.to(local.dtype)), alpha=-group["lr"])


def muon_param_groups(model, *, lr: float, weight_decay: float, muon_lr: float, muon_weight_decay: float,
                      experts_adamw: bool = False) -> list[dict]:
    """Molt's classification of the trainable parameters into Muon / AdamW / embedding / head groups (empty ones
    dropped)."""
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = [m for m in (out, getattr(model, "value_head", None)) if m is not None and id(m.weight) not in embed_ids]
    head_ids = {id(m.weight) for m in heads}
    muon, plain, embeds, head = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in embed_ids:
            embeds.append(p)
        elif id(p) in head_ids:
            head.append(p)
        elif p.dim() == 2 or (p.dim() == 3 and "experts" in name and not experts_adamw):
            muon.append(p)
        else:
            plain.append(p)
    d_in = heads[0].weight.shape[-1] if heads else 1
    groups = [dict(params=muon, muon=True, lr=muon_lr, weight_decay=muon_weight_decay),
              dict(params=plain, lr=lr, weight_decay=weight_decay),
              dict(params=embeds, lr=lr, weight_decay=0.0),
              dict(params=head, lr=muon_lr / math.sqrt(d_in), weight_decay=0.0)]
    return [g for g in groups if g["params"]]
