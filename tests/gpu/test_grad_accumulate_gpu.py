"""MasterWeightAdamW's fp32 grad sums on a GPU (parallel/optim.py `add_into_fp32`): the post-accumulate-grad hooks run
in autograd's device thread, where the fused, compiled add takes every bf16 grad of more than one element; the step
consumes exactly the left-to-right fp32 sum of the micro-batches' grads, and one graph served every size. The CPU
test of the kernel's arithmetic: tests/unit/test_torch_compat.py. Run on the device: `pytest -m gpu` on this file;
bench/grad_accumulate.py times it."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.parallel.optim import MasterWeightAdamW, fused_add_graphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_fp32_grad_sums_add_in_backward_as_eager_fp32_and_compile_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 37), torch.nn.GELU(), torch.nn.Linear(37, 1))
    model = model.cuda().bfloat16()  # sizes 37000, 37, 37 and a bias of 1 element (eager: torch.compile specializes 1)
    params = list(model.parameters())
    seen = {p: [] for p in params}
    for p in params:  # registered first: runs before the optimizer's hook takes the grad
        p.register_post_accumulate_grad_hook(lambda q: seen[q].append(q.grad.clone()))
    opt = MasterWeightAdamW(params, {p: p.detach().float() for p in params}, lr=1e-3)
    opt.accumulate_fp32 = True
    for _ in range(4):
        model(torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    for p in params:
        want = seen[p][0].float()
        for g in seen[p][1:]:
            want = want + g.float()
        assert torch.equal(opt.grad(p), want), tuple(p.shape)
    assert fused_add_graphs() == 1
