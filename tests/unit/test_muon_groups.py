"""Molt's Muon parameter groups (parallel/muon.py muon_param_groups) on the tiny models: 2-D decoder weights and
grouped experts on Muon (experts on AdamW under muon_experts_adamw), norms on AdamW, embeddings on AdamW without weight
decay, a critic's value head and an untied lm_head on AdamW at muon_lr / sqrt(d_in) without weight decay."""

from __future__ import annotations

import math

from molt_hydra.models.build import build_model
from molt_hydra.parallel.muon import muon_param_groups

KW = dict(lr=1e-3, weight_decay=0.1, muon_lr=0.02, muon_weight_decay=0.05)


def _groups(model, **kw):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g.get("muon", False), g["lr"], g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
            for g in muon_param_groups(model, **KW, **kw)]


def test_critic_value_head_and_embedding():
    groups = _groups(build_model("tiny://qwen3_tiny", role="critic"))
    by_name = {n: (muon, lr, wd) for muon, lr, wd, names in groups for n in names}
    assert by_name["value_head.weight"] == (False, 0.02 / math.sqrt(128), 0.0)  # hidden 128
    assert by_name["backbone.embed_tokens.weight"] == (False, 1e-3, 0.0)
    assert by_name["backbone.layers.0.self_attn.q_proj.weight"] == (True, 0.02, 0.05)
    assert by_name["backbone.norm.weight"] == (False, 1e-3, 0.1)
    assert sum(len(n) for *_, n in groups) == len(list(build_model("tiny://qwen3_tiny", role="critic").parameters()))


def test_untied_lm_head_and_grouped_experts():
    model = build_model("tiny://qwen3_moe_tiny", config_overrides={"tie_word_embeddings": False})
    by_name = {n: muon for muon, _, _, names in _groups(model) for n in names}
    assert by_name["model.layers.0.mlp.experts.gate_up_proj"] and by_name["model.layers.0.mlp.gate.weight"]
    assert by_name.get("lm_head.weight") is False
    head = [g for g in _groups(model) if "lm_head.weight" in g[3]][0]
    assert head[:3] == (False, 0.02 / math.sqrt(128), 0.0)
    by_name = {n: muon for muon, _, _, names in _groups(model, experts_adamw=True) for n in names}
    assert by_name["model.layers.0.mlp.experts.gate_up_proj"] is False
    assert by_name["model.layers.0.mlp.gate.weight"] is True  # the router is a 2-D matrix, not an expert


def test_lora_adapter_matrices_all_go_to_muon():
    """LoRA with Muon (honoured: config rules refuse only the AdamW knobs it leaves unread): every trainable tensor of
    an adapter, the tied lm_head's too, is a 2-D lora_A / lora_B matrix, so the Muon group holds all of them and no
    AdamW group is left."""
    from molt_hydra.models import lora

    spec = dict(rank=4, alpha=8.0, dropout=0.0, init="default", target_modules=[*lora.ATTENTION, *lora.MLP, "lm_head"])
    model = lora.add_adapter(build_model("tiny://qwen3_tiny"), spec)
    groups = _groups(model)
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert groups == [(True, 0.02, 0.05, trained)]
    assert any(n.startswith("lm_head.lora_B.") for n in trained) and all(lora.is_adapter_param(n) for n in trained)
