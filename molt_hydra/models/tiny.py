"""Tiny random-init Qwen3 (dense) and Qwen3-MoE models, each with a locally trained byte-level BPE tokenizer and a
ChatML chat template that renders tools and Hermes-style `<tool_call>` blocks. No downloads.

`model.path=tiny://qwen3_tiny` (or `tiny://qwen3_moe_tiny`) resolves here: the model is built once into a cache
directory keyed by name and seed. `scripts/make_tiny_model.py OUT_DIR` writes both to a directory of your choice.
The GPU recipes' models (`GPU_SHAPES`: Qwen3-0.6B / 4B and a Qwen3-30B-A3B cut to 8 layers, with the same small
tokenizer and vocabulary) are random-init at full width, built one at a time, in bf16, on a GPU when there is one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from molt_hydra.models import tiny_vlm
from molt_hydra.models.tiny_tokenizer import VOCAB_SIZE, build_tokenizer, save_random_init, special_ids
# imported where used: torch and transformers (heavy; only to build once)

TINY_SHAPE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
)
# name -> config values beyond the shared shape
TINY_MODELS = {
    "qwen3_tiny": dict(intermediate_size=256),
    "qwen3_moe_tiny": dict(
        intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, norm_topk_prob=True,
    ),
}
# Decoder shapes of published Qwen3 models (their config.json), on the tiny vocabulary: what the GPU recipes train.
GPU_SHAPES = {
    "qwen3_0p6b_shape": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                             head_dim=128, intermediate_size=3072),
    "qwen3_4b_shape": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=9728),
    "qwen3_moe_30b_a3b_8l": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                                 head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                 num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
                                 tie_word_embeddings=False),
}
# the same widths in 2 layers (1.3 B parameters): the MoE GPU recipes on an 80 GB card
GPU_SHAPES["qwen3_moe_30b_a3b_2l"] = {**GPU_SHAPES["qwen3_moe_30b_a3b_8l"], "num_hidden_layers": 2}
TINY_MODELS.update(GPU_SHAPES)


def build(out_dir: Path, seed: int = 0, names: tuple[str, ...] = ("qwen3_tiny", "qwen3_moe_tiny")) -> dict[str, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_tokenizer()
    special = special_ids(tok)
    for name in names:
        values = {**TINY_SHAPE, **special, **TINY_MODELS[name]}
        cfg_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if "num_experts" in values else (
            Qwen3Config, Qwen3ForCausalLM)
        large = name in GPU_SHAPES
        config = cfg_cls(**values, **({"torch_dtype": "bfloat16"} if large else {}))
        save_random_init(out_dir / name, seed, model_cls, config, special, large)
        tok.save_pretrained(out_dir / name)
    return {name: out_dir / name for name in names}


TINY_SCHEME = "tiny://"


def tiny_config_dict(name: str) -> dict:
    """The HF config values of a tiny model, without building it (the plan's memory estimate reads these)."""
    return TINY_SHAPE | TINY_MODELS[name]


def build_once(root: Path, names: tuple[str, ...], build_into) -> None:
    """`build_into(staging)` writes the models `names` into a private staging directory under `root`; each is then
    published by rename, so readers never see half a model. One builder at a time, under a file lock: the ranks of
    a run resolve the same path at once, and a second builder replacing a published model would pull it from under
    a process already reading it."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [name for name in names if not (root / name / "config.json").exists()]
        if not missing:  # built by another process meanwhile
            return
        staging = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
        staging.chmod(0o755)  # mkdtemp makes it private; the published model directory is not
        try:
            build_into(staging)
            for name in missing:
                shutil.rmtree(root / name, ignore_errors=True)  # what a killed build left
                os.replace(staging / name, root / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _build_in_subprocess(staging: Path, name: str) -> None:
    """A GPU-shape model, built on the GPU in a process of its own: a run's driver never holds GPU memory."""
    code = f"from molt_hydra.models.tiny import build; build(__import__('pathlib').Path({str(staging)!r}), " \
           f"names=({name!r},))"
    if (built := subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)).returncode != 0:
        raise RuntimeError(f"building tiny://{name} failed: {built.stderr[-2000:]}")


def resolve_model_path(path: str) -> str:
    """Map `tiny://NAME` to a built directory (building it once, atomically); any other path is returned as is."""
    if not path.startswith(TINY_SCHEME):
        return path
    name = path[len(TINY_SCHEME) :]
    if name not in TINY_MODELS and name not in tiny_vlm.TINY_VLM_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(TINY_MODELS) + list(tiny_vlm.TINY_VLM_MODELS)}")
    if name == tiny_vlm.COLORS_WARM:
        return tiny_vlm.warm_start(name)
    vlm = name in tiny_vlm.TINY_VLM_MODELS
    # the cache key includes the shapes, so a changed tiny config never reuses a stale build
    shapes = [TINY_SHAPE, TINY_MODELS, *([tiny_vlm.tiny_config_dict(name)] if vlm else [])]
    root = Path.home() / ".cache" / "molt_hydra" / "tiny" / hashlib.sha256(
        json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:10]
    if (root / name / "config.json").exists():
        return str(root / name)
    if vlm:
        build_once(root, (name,), lambda staging: tiny_vlm.build(staging / name, name=name))
    elif name in GPU_SHAPES:
        build_once(root, (name,), lambda staging: _build_in_subprocess(staging, name))
    else:  # the small pair: together
        build_once(root, ("qwen3_tiny", "qwen3_moe_tiny"), build)
    return str(root / name)
