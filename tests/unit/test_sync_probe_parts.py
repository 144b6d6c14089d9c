"""The sync probe's pure parts (weight_sync/probe.py): which layer group a weight counts in, on HF and on vLLM names
alike; sums that ignore how vLLM fuses tensors; the float64 tolerance; the verdict's floor per engine dtype."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.weight_sync.probe import (LOGPROB_FLOOR, comparable_groups, differing_groups, group_sums, layer_group,
                                           logprob_gap, probe_tokens, verdict)


def test_hf_and_vllm_names_fall_into_the_same_groups():
    assert layer_group("model.layers.3.self_attn.q_proj.weight") == "layers.3"
    assert layer_group("model.layers.3.self_attn.qkv_proj.weight") == "layers.3"  # vLLM's fused name
    assert layer_group("language_model.model.layers.12.mlp.experts.w13_weight") == "layers.12"
    assert layer_group("model.embed_tokens.weight") == "embed_tokens"
    assert layer_group("model.norm.weight") == "norm"
    assert layer_group("lm_head.weight") == "lm_head"
    assert layer_group("model.visual.blocks.0.attn.qkv.weight") == "vision/layers.0"


def test_a_fused_tensor_sums_as_its_parts_and_a_cast_rounds_as_the_sync_does():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 4, generator=g) for _ in range(3))
    hf = group_sums([("model.layers.0.self_attn.q_proj.weight", q), ("model.layers.0.self_attn.k_proj.weight", k),
                     ("model.layers.0.self_attn.v_proj.weight", v)], torch.bfloat16)
    fused = group_sums([("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v]).to(torch.bfloat16))], None)
    expected = float(sum(t.to(torch.bfloat16).double().sum() for t in (q, k, v)))
    assert hf["layers.0"][0] == expected and hf["layers.0"][2] == 96
    assert not differing_groups(hf, fused)
    fp32 = group_sums([("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v]))], None)
    assert differing_groups(hf, fp32) == ["layers.0"]  # the trainer's fp32 values are not what a bf16 engine holds


def test_one_changed_element_is_found_and_unsummable_groups_are_left_out():
    w = torch.full((1000, 100), 0.02)
    trainer = group_sums([("model.layers.0.mlp.down_proj.weight", w), ("model.norm.weight", torch.ones(100))], None)
    w2 = w.clone()
    w2[7, 7] = 0.0200001  # one element moved by 1e-7
    engine = group_sums([("model.layers.0.mlp.down_proj.weight", w2), ("model.norm.weight", torch.ones(100))], None)
    assert differing_groups(trainer, engine) == ["layers.0"]
    packed = group_sums([("model.layers.0.mlp.down_proj.weight", torch.empty(0)), ("model.norm.weight",
                                                                                   torch.ones(100))], None)
    assert packed["layers.0"][3] == 1  # an empty (repacked) weight: its group's sum is incomplete
    assert comparable_groups(trainer, packed) == ["norm"] and not differing_groups(trainer, packed)
    kv_scale = group_sums([("model.layers.0.self_attn.attn.k_scale", torch.ones(1))], None)
    assert kv_scale == {}  # vLLM's KV scales are no checkpoint weights


def test_the_verdict_names_the_version_the_engine_and_the_layers_with_the_dtype_floor():
    assert logprob_gap([0.0, -1.0, -2.0], [0.0, -1.5, -2.5]) == 0.5 / 1.5  # the first token has no log-prob
    assert logprob_gap([0.0, -0.2, -0.4], [0.0, -0.3, -0.5]) == pytest.approx(0.1)  # scale at least 1
    assert verdict(3, 1, "bfloat16", LOGPROB_FLOOR["bfloat16"], []) is None
    stale = verdict(3, 1, "bfloat16", 0.01, ["layers.2", "layers.10"])
    assert stale.startswith("after weight sync version 3, rollout engine 1: layer groups layers.2, layers.10 differ")
    cached = verdict(4, 0, "float32", 2 * LOGPROB_FLOOR["float32"], [])
    assert "computes differently" in cached and "floor for float32 0.001" in cached


def test_the_probe_sequence_is_fixed_and_avoids_the_low_special_ids():
    tokens = probe_tokens(512)
    assert tokens == probe_tokens(512) and len(tokens) == 64
    assert min(tokens) >= 512 // 20 and max(tokens) < 512


@pytest.mark.parametrize("max_model_len", [2, 16, 64, 65, 4096])
def test_the_probe_sequence_leaves_the_engine_room_for_its_one_generated_token(max_model_len):
    """The engine scores the probe as a prompt and generates one token: with data.max_len=64 (rollout.max_model_len
    64) the 64-token probe was refused by vLLM at the first weight sync ('The decoder prompt (length 64) plus ... is
    longer than the maximum model length of 64'), failing the run as a rollout engine error."""
    tokens = probe_tokens(512, max_model_len)
    assert len(tokens) == min(64, max_model_len - 1) and tokens == probe_tokens(512)[:len(tokens)]
