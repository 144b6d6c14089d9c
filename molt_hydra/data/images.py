"""A dataset row's image column as PIL images: what the engine's multimodal input and the image processor take.

Accepted per image: a PIL image, a `datasets` Image struct (`{"bytes": ..., "path": ...}`), raw encoded bytes, or
a file path. A single image or a list of them.
"""

from __future__ import annotations

import io


def to_pil_images(value, max_images: int, where: str) -> list:
    """`value` -> list of RGB PIL images; more than `max_images` is an error naming the knob."""
    from PIL import Image

    items = value if isinstance(value, (list, tuple)) else [value]
    images = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            item = Image.open(io.BytesIO(item))
        elif isinstance(item, str):
            item = Image.open(item)
        if not isinstance(item, Image.Image):
            raise TypeError(f"{where}: an image must be a PIL image, bytes, a path or an Image struct, "
                            f"got {type(item).__name__}")
        images.append(item.convert("RGB"))
    if len(images) > max_images:
        raise ValueError(f"{where} has {len(images)} images > data.max_images_per_prompt={max_images}. "
                         f"Fix: raise data.max_images_per_prompt or filter the dataset")
    return images
