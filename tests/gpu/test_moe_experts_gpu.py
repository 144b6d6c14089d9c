"""Grouped-GEMM MoE experts on a Hopper GPU (models/moe_experts.py): one Qwen3-30B-A3B MoE layer (hidden 2048, 128
experts of FFN 768, top-8) in bf16, grouped vs transformers' per-expert loop against the fp32 loop: the output and
every gradient as close to fp32 as the loop's; the grouped forward and backward never wait for the host; and
`auto` picks grouped here. Run on the device: `pytest -m gpu tests/gpu/test_moe_experts_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.compat.transformers import expert_widths, install_experts
from molt_hydra.models import moe_experts, moe_routing

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper (sm_90+) CUDA device")]
BF16_U = 2.0 ** -8  # bf16 unit roundoff


def _layer(impl: str, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True)
    torch.manual_seed(seed)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = Qwen3MoeSparseMoeBlock(cfg).cuda()
    for p in holder.parameters():
        torch.nn.init.normal_(p, std=0.02)
        p.data = p.data.bfloat16().float()  # bf16-exact weights: the fp32 reference routes every token the same
    moe_routing.install(holder, "float32")  # the fp32 gate, as the trainer runs it
    install_experts(holder, impl, moe_experts.grouped_experts_forward)
    return holder.to(dtype)


def _run(holder, x, g):
    x = x.detach().to(next(holder.parameters()).dtype).requires_grad_()
    y = holder.layers[0].mlp(x)
    (y.float() * g).sum().backward()
    return {"out": y.float(), "x": x.grad.float(),
            **{n: p.grad.float() for n, p in holder.named_parameters()}}


def test_grouped_bf16_is_as_close_to_fp32_as_the_loop():
    torch.manual_seed(1)
    x = torch.randn(2, 4096, 2048, device="cuda").bfloat16().float()  # bf16-exact too, for the same reason
    g = torch.randn(2, 4096, 2048, device="cuda")
    truth = _run(_layer("loop", torch.float32), x, g)
    loop = _run(_layer("loop", torch.bfloat16), x, g)
    grouped = _run(_layer("grouped", torch.bfloat16), x, g)
    for name, ref in truth.items():
        scale = ref.norm().item()
        loop_err, grouped_err = ((t[name] - ref).norm().item() / scale for t in (loop, grouped))
        print(f"{name}: relative error bf16 loop {loop_err:.2e}, grouped {grouped_err:.2e}")
        # bf16 rounds inputs, weights and outputs (a few u each); the grouped kernel accumulates in fp32 like the loop
        assert loop_err <= 4 * BF16_U, name
        assert grouped_err <= 4 * BF16_U, name


def test_grouped_forward_and_backward_never_sync():
    experts = _layer("grouped", torch.bfloat16).layers[0].mlp.experts
    tokens = 8192
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(0, 128, (tokens, 8), device="cuda")
    w = torch.rand(tokens, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    experts(x, idx, w).sum().backward()  # warm-up: allocator, cuBLAS / CUTLASS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device -> host wait raises
    try:
        y = experts(x, idx, w)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert x.grad.abs().sum() > 0 and experts.gate_up_proj.grad.abs().sum() > 0


def test_auto_is_grouped_on_hopper_bf16():
    holder = _layer("loop", torch.bfloat16)
    widths = expert_widths(holder)
    assert moe_experts.choose("auto", torch.device("cuda"), torch.bfloat16, widths) == "grouped"
    assert moe_experts.choose("auto", torch.device("cuda"), torch.float32, widths) == "loop"
