"""The plan's count of a VLM's vision tower (runtime/plan.py): a config.json read from a directory or a cached hub
snapshot has a `vision_config` and no `vision_params` (the known-shape tables' key), so the tower counted as 0 and a
VLM recipe's memory was planned ~0.6 B parameters low. Now the tower is estimated from its config (12 x depth x
width^2), or taken from the known shape of that name."""

from __future__ import annotations

import copy

from molt_hydra.runtime import plan


def test_a_read_vlm_configs_tower_is_counted():
    text = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    alone = plan.ModelShape.from_hf_config(copy.deepcopy(text))
    with_tower = plan.ModelShape.from_hf_config({"text_config": text, "vision_config": {"depth": 3, "hidden_size": 32}})
    assert with_tower.vision and with_tower.params - alone.params == 12 * 3 * 32 ** 2


def test_a_known_vlms_tower_size_stands_beside_its_read_config(monkeypatch):
    name = "Qwen/Qwen3-VL-30B-A3B-Instruct"
    known = plan.KNOWN_SHAPES[name]
    read = {"text_config": {k: v for k, v in known.items() if k != "vision_params"},
            "vision_config": {"depth": 27, "hidden_size": 1152}}
    monkeypatch.setattr(plan, "model_fields", lambda path: copy.deepcopy(read) if path == name else None)
    from_tables = plan.ModelShape.from_hf_config(dict(known))
    assert plan.model_shape(name).params == from_tables.params  # the table's 0.6 B tower, not the estimate
