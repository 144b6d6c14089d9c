"""compat/transformers.py: each reach refuses a transformers release it was not written for, and the installed
transformers still has the modules and behaviour the reaches rely on (the experts patch:
tests/unit/test_moe_experts.py)."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch
import transformers

from molt_hydra.compat import transformers as compat
from molt_hydra.models import moe_routing


def tiny_moe_config():
    return transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def test_another_major_release_is_refused_naming_both(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda dist: "6.0.0")
    with pytest.raises(RuntimeError, match=r"the MoE router patch \(molt_hydra/compat/transformers.py\) is written "
                                           r"for transformers 5\.x; transformers 6\.0\.0 is installed"):
        compat.install_routers(torch.nn.Module(), moe_routing.ReplayableRouter)


def test_the_replayable_router_is_the_upstream_routers_forward_when_nothing_is_replayed():
    """The swapped-in forward reads the upstream router's `weight`, `top_k`, `hidden_dim`, `norm_topk_prob` and
    returns what it returns, (logits, top-k weights, top-k indices): equal to upstream's own in float32."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_moe_config()).float()
    hidden = torch.randn(5, 16)
    routers = [m for _, m in compat.router_modules(model)]
    assert len(routers) == 2
    expected = [r(hidden) for r in routers]
    assert moe_routing.install(model) == routers and compat.install_routers(model, moe_routing.ReplayableRouter) == []
    for r, (logits, weights, indices) in zip(routers, expected):
        ours = r(hidden)
        assert type(r).__name__ == "ReplayableQwen3MoeTopKRouter"
        assert torch.allclose(ours[0], logits) and torch.equal(ours[2], indices)
        assert torch.allclose(ours[1], weights, atol=1e-6)
    assert [n for n, _ in compat.router_modules(model)] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def test_the_pil_image_processors_and_the_causal_lm_mapping():
    from PIL import Image

    qwen = compat.qwen2_vl_image_processor(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
                                           patch_size=14, temporal_patch_size=2, merge_size=2)
    out = qwen(images=[Image.new("RGB", (56, 56))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    edge = {"longest_edge": 56}
    idefics = compat.idefics3_image_processor(size=edge, max_image_size=edge, do_image_splitting=False)
    assert idefics(images=[[Image.new("RGB", (56, 56))]], return_tensors="pt")["pixel_values"].shape[-2:] == (56, 56)
    assert compat.causal_lm_architecture("qwen3_moe") == "Qwen3MoeForCausalLM"
