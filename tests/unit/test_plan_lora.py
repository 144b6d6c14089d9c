"""The dry-run plan under LoRA (runtime/plan.py): the frozen base keeps its fp32 weights, but grads and AdamW's two
moments exist for the adapter only: rank x (in + out) parameters per adapted module, from the tiny Qwen3's shape."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.runtime.validate import validate  # noqa: E402
from molt_hydra.models.tiny import TINY_MODELS, TINY_SHAPE  # noqa: E402
from molt_hydra.runtime.plan import make_plan, model_shape  # noqa: E402

GIB = 1 << 30


def test_adapter_grads_and_moments_replace_the_full_models():
    s = {**TINY_SHAPE, **TINY_MODELS["qwen3_tiny"]}
    h, d, inter = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + inter)  # q, k, v, o, gate, up, down
    rank = 4
    adapter = rank * s["num_hidden_layers"] * per_layer  # the dense default: every decoder linear, no lm_head
    cfg = validate(OmegaConf.to_object(compose_config([f"model.lora.rank={rank}"])))
    actor = make_plan(cfg).memory["actor"]
    full = model_shape(cfg.model.path).params
    assert actor["grads fp32"] * GIB == 4 * adapter
    assert actor["adamw moments"] * GIB == 8 * adapter
    assert actor["weights fp32"] * GIB == 4 * full  # the base is still held, frozen
