"""AdamW (or Muon, parallel/muon.py) + HF LR schedule with warmup (Molt's optimizer block)."""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.adamw import adamw

from molt_hydra.compat.torch import dtensor_in_place, graphs_of
from molt_hydra.config.validate import FLOOR_SCHEDULERS
from molt_hydra.parallel.muon import MuonAdamW, local_part, muon_param_groups
from molt_hydra.weight_sync.buckets import bucket_weights


FP32_STATE = ("master", "exp_avg", "exp_avg_sq")


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW whose parameters are low-precision (bf16) compute weights: the optimizer holds each one's fp32 master and
    fp32 moments, steps the masters with the param's grad upcast (torch's own fused AdamW kernel, so the update is
    torch AdamW's fp32 update), and writes the masters back into the params rounded to their dtype. FSDP2 then
    gathers bf16 without a cast and reduce-scatters fp32 into bf16 grads (model.master_weights=optimizer).

    The masters and moments live in `state` (DTensors placed like their params), so checkpoints save and restore
    them. Clipping folds into the step: `clip_grad_norm_` only measures, the kernel divides by its `grad_scale`.

    With `accumulate_fp32` set (the trainer sets it when an optimizer step spans several micro-batches), a
    post-accumulate-grad hook adds each micro-batch's grad (FSDP2: the reduced shard) into an fp32 sum and frees it,
    so the sum is never rounded to bf16 between micro-batches (Megatron's main_grad); the step consumes the sums.
    One micro-batch: the hook does nothing (its bf16 grad is the computed grad; the step upcasts it).

    With `on_host` (parallelism.offload=optimizer, as Molt's `--fsdp.offload optimizer`) the masters and moments are
    host copies: each step's grads go to the host, torch's fused AdamW runs there on the CPU, and the masters come
    back into the params (still on their device), rounded to the params' dtype."""

    CHUNK_BYTES = 1 << 29  # params' bytes per kernel call: bounds the transient fp32 grads of bf16 ones to 1 GiB

    def __init__(self, params, masters: dict, on_host: bool = False, **kw):
        super().__init__(params, fused=True, **kw)  # the fused kernel takes grad_scale (CUDA and CPU)
        self._grad_scale, self.on_host, self.accumulate_fp32 = None, on_host, False
        self.main_grads: dict = {}  # param -> fp32 grad sum of this step's micro-batches (accumulate_fp32 only)
        for group in self.param_groups:
            for p in group["params"]:
                p.register_post_accumulate_grad_hook(self._accumulate)
                # the whole state now, so a checkpoint's structure is known before the first step
                master = _host_copy(masters[p]) if on_host else masters[p]
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=master.device), "master": master,
                                 "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}

    @torch.no_grad()
    def _accumulate(self, p):
        if not self.accumulate_fp32:
            return
        if (main := self.main_grads.get(p)) is None:
            self.main_grads[p] = p.grad.float()  # DTensor stays DTensor (clip_grad_norm_ reduces its norm)
        else:
            add_into_fp32(local_part(main), local_part(p.grad))
        p.grad = None

    def grad(self, p):
        """The grad the step consumes: the fp32 sum over micro-batches, else the param's own grad."""
        return self.main_grads.get(p, p.grad)

    def round_into_grads(self):
        """Hands the fp32 sums back as param grads, rounded once (for a clip that reads param grads in place)."""
        for p, main in self.main_grads.items():
            p.grad = main.to(p.dtype)
        self.main_grads.clear()

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        self.main_grads.clear()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The total grad norm; the next step scales grads by min(1, max_norm / (norm + 1e-6)), as torch's clip."""
        grads = [self.grad(p) for group in self.param_groups for p in group["params"] if self.grad(p) is not None]
        # in fp32 whatever the grads' dtype (torch's get_total_norm would sum bf16 squares in bf16)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self._grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0) if max_norm > 0 else None
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [(None, p) for p in group["params"] if self.grad(p) is not None]
            for chunk in ([p for _, p in bucket] for bucket in bucket_weights(params, self.CHUNK_BYTES)):
                states = [self.state[p] for p in chunk]
                masters = [local_part(s["master"]) for s in states]
                where = masters[0].device  # the params' device, or the host (on_host)
                scale = None if self._grad_scale is None else self._grad_scale.to(where)
                adamw(
                    masters, [local_part(self.grad(p)).to(where, torch.float32) for p in chunk],
                    [local_part(s["exp_avg"]) for s in states], [local_part(s["exp_avg_sq"]) for s in states], [],
                    [s["step"] for s in states], fused=True, grad_scale=scale, found_inf=None, amsgrad=False,
                    beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                # fp32 params on their device are their own masters; any other takes its master, rounded (and moved)
                copies = [(p, m) for p, m in zip(map(local_part, chunk), masters) if p.dtype != m.dtype or self.on_host]
                if copies:
                    torch._foreach_copy_(*map(list, zip(*copies)))
        self._grad_scale = None

    def masters_by_name(self, model) -> dict[str, torch.Tensor]:
        """The fp32 master of each of `model`'s parameters, by its name: where a weights-only load (a warm start) puts
        the checkpoint's weights, so an fp32 checkpoint keeps its precision (then `params_from_masters`)."""
        return {name: self.state[p]["master"] for name, p in model.named_parameters() if p in self.state}

    @torch.no_grad()
    def params_from_masters(self) -> None:
        """Each param takes its master's value, rounded to the param's dtype (and moved to its device)."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]["master"] is not p:
                    local_part(p).copy_(local_part(self.state[p]["master"]))

    def load_state_dict(self, state_dict):
        # torch casts every floating state tensor to its param's dtype on load (bf16 here): keep the fp32 ones
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        kept = {i: {k: v for k, v in state_dict["state"].get(i, {}).items() if k in FP32_STATE} for i in ids}
        super().load_state_dict(state_dict)
        for i, p in zip(ids, (p for g in self.param_groups for p in g["params"])):
            device = "cpu" if self.on_host else p.device
            self.state[p].update({k: v.to(device=device, dtype=torch.float32) for k, v in kept[i].items()})


def add_into_fp32(main: torch.Tensor, grad: torch.Tensor) -> None:
    """main += grad in place (main fp32, grad of the params' dtype, one shape), each element as eager torch adds it.
    On CUDA a mixed-dtype add_ runs ATen's dynamic-casting, unvectorized loop (~40 % of the H200's bandwidth, ~97 ms
    of the 30B-A3B-8-layer step's 751 ms): there one fused, vectorized kernel does it (bf16 load, fp32 add, store)."""
    if (main.device.type == "cuda" and grad.dtype != main.dtype and main.numel() > 1 and main.is_contiguous()
            and grad.is_contiguous()):
        fused_add_(main, grad)
    else:
        # eager: equal dtypes (already vectorized), strided grads (no flat view to hand the kernel), sizes 0 and 1
        # (torch.compile specializes on them: a graph each), and the CPU (there every trainer process would pay
        # inductor's compile, and need a C++ compiler, for a loop its tests do not time)
        main.add_(grad)


def fused_add_(main: torch.Tensor, grad: torch.Tensor) -> None:
    """main += grad (contiguous, any shape, 2+ elements) through one compiled kernel, one graph for every shape."""
    # 1-D, and detached: not views, since a view's base enters torch.compile's guards (a graph per base shape)
    _compiled_add()(main.view(-1).detach(), grad.view(-1).detach())


def _add(main: torch.Tensor, grad: torch.Tensor) -> None:
    main.add_(grad)


@functools.cache
def _compiled_add():
    return torch.compile(_add, dynamic=True, fullgraph=True)  # dynamic: one graph for every size (per dtype pair)


def fused_add_graphs() -> int:
    """The graphs `fused_add_` has built in this process (1 per device and dtype pair: a rise is a recompile)."""
    return graphs_of(_add)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of `t` in host memory (a DTensor's shard, kept a DTensor placed as `t` for the checkpoints)."""
    local = local_part(t).detach().to("cpu", torch.float32, copy=True)
    return dtensor_in_place(local, t) if hasattr(t, "to_local") else local


def build_optimizer(model, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                    masters: dict | None = None, muon: dict | None = None, on_host: bool = False):
    """masters: {param: its fp32 master} when the params are low-precision compute weights (MasterWeightAdamW);
    on_host: those masters and the moments in host memory, the step on the CPU (parallelism.offload=optimizer).
    muon: Muon for the matrices (parallel/muon.py) with keys lr, momentum, weight_decay, nesterov, experts_adamw."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    if muon is not None:  # no fp32 masters: the config keeps Muon to master_weights=fsdp without optimizer offload
        groups = muon_param_groups(model, lr=lr, weight_decay=weight_decay, muon_lr=muon["lr"],
                                   muon_weight_decay=muon["weight_decay"], experts_adamw=muon["experts_adamw"])
        return MuonAdamW(groups, betas=betas, eps=eps, momentum=muon["momentum"], nesterov=muon["nesterov"])
    if masters is not None:
        return MasterWeightAdamW(params, masters, on_host=on_host, lr=lr, betas=tuple(betas), eps=eps,
                                 weight_decay=weight_decay)
    # multi-tensor (foreach) kernels: a per-parameter loop over hundreds of DTensors costs ~1 s of CPU per step;
    # on GPU the fused kernel does the whole update in a few launches (None, not False, keeps foreach's default)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=all(p.device.type == "cuda" for p in params) or None)


def build_scheduler(optimizer, *, name: str = "constant", total_steps: int = 1, warmup_ratio: float = 0.0,
                    min_lr_ratio: float = 0.1):
    from transformers import get_scheduler

    if total_steps < 1:
        raise ValueError(f"scheduler total_steps must be >= 1, got {total_steps}")
    warmup = math.ceil(total_steps * warmup_ratio)
    extra = {"min_lr_rate": min_lr_ratio} if name in FLOOR_SCHEDULERS else None
    # as in HF: "constant" ignores the warmup, "constant_with_warmup" uses it
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs=extra)
