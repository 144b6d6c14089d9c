"""Vision-language (Qwen2.5-VL family) support on the trainer side: processor outputs for a trajectory's images, the
placeholder expansion the engine applies, the trainer's per-sample multimodal forward inputs, and vision freezing.

Why these pieces: the trainer's log-prob recompute must see exactly the engine's inputs. The engine expands each
`<|image_pad|>` of the prompt into one token per merged vision patch, and embeds the image from the processor's
`pixel_values`; the M-RoPE positions are a pure function of (input_ids, image_grid_thw, config), so a sample carries
`pixel_values` + `image_grid_thw` + `mm_token_type_ids` (1 on image tokens) and the HF model derives the 3-D
positions itself (`position_ids=None`). Without `mm_token_type_ids` transformers silently falls back to 1-D positions.

A Qwen2_5_VLProcessor cannot be constructed without torchvision (its video processor), so the image processor and
the tokenizer are used part by part here.
"""

from __future__ import annotations

import torch
from torch import nn

MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")  # per-sample forward inputs, never packed


def image_parts(messages: list[dict]) -> list[dict]:
    """`<image>` markers in user strings → `{"type": "image"}` parts, in order."""
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "user" and isinstance(content, str) and "<image>" in content:
            parts = []
            for i, chunk in enumerate(content.split("<image>")):
                if i:
                    parts.append({"type": "image"})
                if chunk:
                    parts.append({"type": "text", "text": chunk})
            m = dict(m, content=parts)
        out.append(m)
    return out


def is_vlm(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_image_processor(model_dir: str):
    """The model directory's image processor with the PIL backend (no torchvision)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir, backend="pil")


def process_images(image_processor, images: list) -> dict[str, torch.Tensor]:
    """PIL images -> {"pixel_values": [patches, C*T*P*P] fp32, "image_grid_thw": [n_images, 3] long}."""
    out = image_processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}


def mm_token_type_ids(token_ids, image_token_id: int) -> torch.Tensor:
    """[T] long: 1 on image tokens, 0 on text (the processor's `mm_token_type_ids`; M-RoPE needs it)."""
    return (torch.as_tensor(token_ids) == image_token_id).long()


def multimodal_kwargs(samples: list[dict]) -> dict[str, torch.Tensor]:
    """The forward's multimodal inputs of a micro-batch; {} for text samples. One VLM sample per micro-batch:
    the model derives M-RoPE positions per row, and a packed row would continue positions across samples."""
    with_images = [s for s in samples if s.get("pixel_values") is not None]
    if not with_images:
        return {}
    if len(samples) != 1:
        raise ValueError(f"a VLM micro-batch holds one sample, got {len(samples)}")
    s = with_images[0]
    return {"pixel_values": s["pixel_values"], "image_grid_thw": s["image_grid_thw"],
            "mm_token_type_ids": s["mm_token_type_ids"][None]}  # [1, T] like the packed input_ids


def visual_encoder(model: nn.Module) -> nn.Module:
    for name, mod in model.named_modules():
        if name.endswith("visual"):
            return mod
    raise ValueError(f"{type(model).__name__} has no `visual` module (not a Qwen-VL model?)")


def freeze_visual_encoder(model: nn.Module) -> int:
    """Vision tower out of training (and so out of the optimizer, which takes requires_grad params). Returns the
    number of frozen parameters."""
    visual = visual_encoder(model)
    visual.requires_grad_(False)
    return sum(p.numel() for p in visual.parameters())


def keep_visual_encoder_in_every_backward(model: nn.Module) -> None:
    """A text-only forward of a VLM whose vision tower trains adds 0 x (the tower on one blank merged patch) to the
    logits, so the tower gets (zero) gradients and its FSDP reduce-scatter runs on every DP rank; without it a rank
    with images and a rank without desynchronise the collectives (gloo aborts on a size mismatch). A forward hook
    placed before FSDP's own, so the tower's parameters are still gathered."""
    visual = visual_encoder(model)
    c = visual.config
    merge = c.spatial_merge_size

    def hook(module, args, kwargs, output):
        if kwargs.get("pixel_values") is not None or not torch.is_grad_enabled():
            return output
        logits = output.logits
        patch = torch.zeros(merge * merge, c.in_channels * c.temporal_patch_size * c.patch_size**2,
                            device=logits.device, dtype=logits.dtype)
        out = visual(patch, grid_thw=torch.tensor([[1, merge, merge]], device=logits.device))
        output.logits = logits + 0.0 * out.pooler_output.sum()
        return output

    model.register_forward_hook(hook, with_kwargs=True, prepend=True)


class TrajectoryImages:
    """Turns a trajectory's images into the trainer's inputs: the trajectory keeps one `<|image_pad|>` per image
    (what the chat template renders and the engine is sent); here each is expanded as the engine expands it, the
    per-token arrays grow with context-only entries, and the processor outputs ride along."""

    def __init__(self, image_processor, image_token_id: int, merge_size: int):
        self.image_processor, self.image_token_id, self.merge_size = image_processor, image_token_id, merge_size

    @classmethod
    def for_model(cls, model_dir: str) -> "TrajectoryImages | None":
        """None for a text-only model."""
        from pathlib import Path

        from transformers import AutoConfig

        if not (Path(model_dir) / "config.json").is_file():  # e.g. a tokenizer-only directory
            return None
        config = AutoConfig.from_pretrained(model_dir)
        if not is_vlm(config):
            return None
        return cls(load_image_processor(model_dir), config.image_token_id, config.vision_config.spatial_merge_size)

    @property
    def max_tokens_per_image(self) -> int:
        """The most tokens one image expands to: the processor's largest image in merged patches."""
        ip = self.image_processor
        return ip.size["longest_edge"] // (ip.patch_size * self.merge_size) ** 2

    def expand(self, token_ids: list[int], logprobs: list[float], versions: list[int],
               action_ranges: list[tuple[int, int]], images: list):
        """-> (token_ids, logprobs, versions, action_ranges, multimodal) with every image placeholder expanded.
        Raises ValueError when the placeholders and the images do not match one to one."""
        from molt_hydra.agents.base import NOT_GENERATED

        mm = process_images(self.image_processor, images)
        counts = iter((mm["image_grid_thw"].prod(-1) // self.merge_size**2).tolist())
        ids, lps, vers, new_index = [], [], [], []
        for t, lp, v in zip(token_ids, logprobs, versions):
            new_index.append(len(ids))
            n = next(counts, None) if t == self.image_token_id else 1
            if n is None:
                raise ValueError(f"more image placeholders in the trajectory than its {len(images)} images")
            if n > 1 or t == self.image_token_id:
                if v != NOT_GENERATED:
                    raise ValueError("the policy generated an image placeholder token")
                lp, v = 0.0, NOT_GENERATED
            ids.extend([t] * n)
            lps.extend([lp] * n)
            vers.extend([v] * n)
        if next(counts, None) is not None:
            raise ValueError(f"fewer image placeholders in the trajectory than its {len(images)} images")
        new_index.append(len(ids))
        ranges = [(new_index[s], new_index[e]) for s, e in action_ranges]
        mm["mm_token_type_ids"] = mm_token_type_ids(ids, self.image_token_id)
        return ids, lps, vers, ranges, mm
