"""`molt-run +recipe=tiny_lora_cpu`, CI-sized (15 steps): GRPO on a LoRA adapter learns the toy task, every weight sync
moves exactly the adapter's bytes (from the recipe's definition: rank x (in + out) per adapted module, fp32), the
engines stay in step with the trainer (vllm_kl ~ 0 on the first sync, before anything is off-policy), and the final
export is the adapter in PEFT's format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from molt_hydra.models.tiny import TINY_MODELS, TINY_SHAPE

pytestmark = pytest.mark.timeout(900)
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_lora_cpu.yaml"


def adapter_bytes(lora: dict) -> int:
    s = {**TINY_SHAPE, **TINY_MODELS["qwen3_tiny"]}
    h, d = s["hidden_size"], s["head_dim"]
    q, kv, inter = s["num_attention_heads"] * d, s["num_key_value_heads"] * d, s["intermediate_size"]
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    per_layer = sum(i + o for name, (i, o) in shapes.items() if name in lora["target_modules"])
    head = h + s["vocab_size"] if "lm_head" in lora["target_modules"] else 0
    return lora["rank"] * (s["num_hidden_layers"] * per_layer + head) * 4


def test_tiny_lora_recipe_learns_and_syncs_only_the_adapter(tmp_path):
    cmd = [sys.executable, "-m", "molt_hydra.cli", "+recipe=tiny_lora_cpu", f"hydra.run.dir={tmp_path}",
           "train.max_steps=15", "logger.wandb.mode=disabled", "logger.progress=false", "checkpoint.save_steps=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=800, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [r for r in rows if r.get("kind") == "train"]
    rewards = [r["train/reward"] for r in train]
    assert len(rewards) == 15
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first >= 0.3, rewards
    lora = yaml.safe_load(RECIPE.read_text())["model"]["lora"]
    assert {r["train/weight_sync/bytes"] for r in train} == {float(adapter_bytes(lora))}
    assert abs(train[0]["train/vllm_kl"]) < 1e-4
    export = tmp_path / "hf_final"
    assert json.loads((export / "adapter_config.json").read_text())["r"] == lora["rank"]
    assert not (export / "model.safetensors").exists() and (export / "adapter_model.safetensors").is_file()
