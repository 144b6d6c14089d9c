"""The tiled copy of transposed views (weight_sync/transposed_copy.py) on a GPU: bit-equal to torch's `copy_` for
the shapes and casts the weight sync meets, and through a recorded copy plan's CUDA graph (AutoModel's transposed
experts into vLLM's fused-MoE layout). Its speed: bench/expert_copy.py."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.weight_sync.copy_plan import record_copy_plan
from molt_hydra.weight_sync.transposed_copy import is_transposed, transposed_copy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch, rows, cols", [(None, 67, 130), (3, 64, 128), (5, 130, 67)])
def test_tiled_copy_equals_torch_copy(src_dtype, batch, rows, cols):
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    source = torch.randn(*shape[:-2], cols, rows, device="cuda", dtype=src_dtype).transpose(-1, -2)  # rows contiguous
    ours = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    assert is_transposed(ours, source)
    transposed_copy(ours, source)
    assert torch.equal(ours, torch.empty_like(ours).copy_(source))


def test_transposed_experts_replay_through_the_plan_graph():
    E, I, H = 8, 96, 160
    gate_and_up = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16)
    w13 = torch.zeros(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    w2 = torch.zeros(E, H, I, device="cuda", dtype=torch.bfloat16)

    def load():  # vLLM's FusedMoE loader, expert by expert
        for e in range(E):
            w13[e, :I].copy_(gate_and_up[e, :, :I].T)
            w13[e, I:].copy_(gate_and_up[e, :, I:].T)
            w2[e].copy_(down[e].T)

    plan = record_copy_plan(load, [("gate_and_up", gate_and_up), ("down", down)], [w13, w2], ())
    assert len(plan.replayed) == 3 and all(is_transposed(dst, src) for dst, src, _ in plan.replayed)
    for _ in range(2):  # the first replay captures the graph, the second replays it
        gate_and_up.mul_(-1.5)
        down.add_(0.25)
        w13.fill_(float("nan"))
        w2.fill_(float("nan"))
        plan.replay()
        torch.cuda.synchronize()
        assert torch.equal(w13, gate_and_up.transpose(1, 2)) and torch.equal(w2, down.transpose(1, 2))
