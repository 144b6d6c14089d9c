"""Tiny random-init Qwen2.5-VL (vision tower + Qwen2 decoder with M-RoPE) with the tiny byte-level BPE tokenizer of
`models/tiny.py` (plus the Qwen vision special tokens) and a local PIL-backed Qwen2-VL image processor. No downloads.

`model.path=tiny://qwen25_vl_tiny` resolves here (through `tiny.resolve_model_path`). Images are small: a 56x56
image is 4x4 patches of 14 px, merged 2x2 into 4 `<|image_pad|>` tokens.
"""

from __future__ import annotations

from pathlib import Path

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
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
TINY_VLM_MODELS = ("qwen25_vl_tiny",)


def vlm_chat_template() -> str:
    from molt_hydra.models.tiny import CHAT_TEMPLATE

    # Qwen-VL renders an image part as the vision span the processor expands to one pad per merged patch
    return CHAT_TEMPLATE.replace("<|image|>", "<|vision_start|><|image_pad|><|vision_end|>")


def build_tokenizer_and_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from molt_hydra.models import tiny

    tok = tiny.build_tokenizer(None, extra_specials=VISION_SPECIALS)
    tok.chat_template = vlm_chat_template()
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=14, temporal_patch_size=2,
        merge_size=2,
    )
    return tok, image_processor


def build(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok, image_processor = build_tokenizer_and_image_processor()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_SPECIALS}
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    config = Qwen2_5_VLConfig(
        text_config=dict(TINY_VLM_TEXT, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad),
        vision_config=TINY_VLM_VISION, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # saved part by part: a Qwen2_5_VLProcessor cannot be constructed without torchvision (its video processor)
    tok.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    return out_dir
