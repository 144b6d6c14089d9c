"""MoE experts on the HF backend (`model.moe_experts_impl`): every expert of a layer in one grouped GEMM per
projection, tokens permuted once per layer, without a device -> host sync; or the per-expert loop.

Grouped forward of one layer, for T tokens that each picked k experts (S = T * k slots, slot = token * k + j):
1. `order`: the slots sorted by expert (stable, so token order inside an expert), and the per-expert counts by a
   scatter-add into E zeros (`torch.bincount` would size its output from the largest id, a sync on CUDA) whose
   cumsum are the grouped GEMM's group ends (`offs`);
2. the tokens' hidden states gathered once into expert order (`RowsInExpertOrder`: its backward sums each token's k
   slot gradients with one fp32-accumulating reduction, deterministic, instead of k racing bf16 atomic adds);
3. gate_up GEMM, SiLU(gate) * up times the slot's routing weight (the down projection is linear, so weighting before
   it is the same product), down GEMM: two `grouped_mm` calls for all E experts;
4. the slot outputs put back in slot order (a copy, whose backward is a gather) and summed over each token's k.

`grouped_mm` is torch's (`torch.nn.functional.grouped_mm`, torch >= 2.10): the CUTLASS grouped kernel on Hopper
in bf16, a CPU kernel in fp32 (torch 2.13). The per-expert loop (`loop`) is transformers' own eager forward: one
`nonzero` (a sync) per layer and two small GEMMs per expert hit. R3 replay, the fp32 gate and the router freeze live
in the router (`models/moe_routing.py`), before the experts: the experts only see the selected ids and weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from molt_hydra.models.moe_routing import expert_counts

log = logging.getLogger(__name__)
IMPLS = ("auto", "grouped", "loop")


class RowsInExpertOrder(torch.autograd.Function):
    """x [T, H] -> x[order // k] [S, H]; the backward reduces the k copies of each token in fp32 (deterministic)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        per_slot = torch.empty_like(grad).index_copy_(0, order, grad)  # row token * k + j
        return per_slot.view(-1, ctx.k, grad.shape[-1]).sum(1), None, None


def expert_order(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots sorted by expert, int32 group ends for grouped_mm), both computed on the device without a sync."""
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    return order, expert_counts(flat, num_experts, torch.int64).cumsum(0).to(torch.int32)


def grouped_experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5 fused experts (`gate_up_proj` [E, 2I, H] gate rows first, `down_proj` [E, H, I], `act_fn`)
    on [T, H] hidden states routed to `top_k_index` [T, k] with `top_k_weights` [T, k]; returns [T, H]."""
    tokens, k = top_k_index.shape
    order, offs = expert_order(top_k_index, experts.gate_up_proj.shape[0])
    weight = experts.gate_up_proj
    x = RowsInExpertOrder.apply(hidden_states.to(weight.dtype), order, k)
    gate, up = F.grouped_mm(x, weight.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    slot_weights = top_k_weights.reshape(-1).index_select(0, order).to(weight.dtype)
    h = experts.act_fn(gate) * up * slot_weights[:, None]
    y = F.grouped_mm(h, experts.down_proj.transpose(-2, -1), offs=offs)
    per_slot = torch.empty_like(y).index_copy_(0, order, y)  # in place: no clone of the empty buffer
    return per_slot.view(tokens, k, -1).sum(1).to(hidden_states.dtype)


def grouped_unavailable(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...],
                        compiled: bool = False) -> str | None:
    """Why torch's grouped GEMM cannot run the experts here (None: it can). `widths`: hidden and expert FFN sizes;
    `compiled`: the decoder blocks go through torch.compile (model.compile_blocks)."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm (torch >= 2.10)"
    if compiled and device.type == "cpu":  # the op's fake (tracing) kernel accepts bf16 only; the CPU kernel is fp32
        return "model.compile_blocks=true on CPU: torch.compile cannot trace the float32 grouped GEMM"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (9, 0):
            return f"the GPU is sm_{cap[0]}{cap[1]}; torch's grouped GEMM kernel is Hopper's (sm_90+)"
        if dtype != torch.bfloat16:
            return f"compute dtype {dtype} on CUDA; torch's grouped GEMM runs bf16 (model.param_dtype=bfloat16)"
    elif device.type == "cpu" and dtype != torch.float32:
        return f"compute dtype {dtype} on CPU; torch's CPU grouped GEMM is used here in float32 only"
    elif device.type != "cpu":
        return f"no grouped GEMM on {device.type}"
    size = torch.finfo(dtype).bits // 8
    if any(w * size % 16 for w in widths):  # the kernels' rows must start on 16-byte boundaries
        return f"widths {widths} are not multiples of {16 // size} elements (16-byte rows)"
    return None


def choose(impl: str, device: torch.device, dtype: torch.dtype, widths: tuple[int, ...], compiled: bool = False) -> str:
    """`model.moe_experts_impl` -> "grouped" | "loop": auto takes grouped where it runs and says once why not;
    grouped forced where it cannot run is a ValueError naming the key, the reason and the fix."""
    if impl not in IMPLS:
        raise ValueError(f"model.moe_experts_impl must be one of {list(IMPLS)}, got {impl!r}")
    if impl == "loop":
        return "loop"
    if (reason := grouped_unavailable(device, dtype, widths, compiled)) is None:
        return "grouped"
    if impl == "grouped":
        raise ValueError(f"model.moe_experts_impl=grouped: {reason}. Set model.moe_experts_impl=auto (per-expert "
                         "loop where the grouped GEMM cannot run) or loop")
    log.warning("model.moe_experts_impl=auto: MoE experts run the per-expert loop: %s", reason)
    return "loop"
