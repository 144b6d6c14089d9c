"""A dataset row's image column as PIL images: what the engine's multimodal input and the image processor take.

Accepted per image: a PIL image, a `datasets` Image struct (`{"bytes": ..., "path": ...}`), raw encoded bytes, or
a file path. A single image or a list of them. Every image is decoded here, in full, and converted to RGB (any PIL
mode: palette, alpha, CMYK, 16-bit grey), so an unreadable one (truncated or empty file, no pixels) fails here with
its row named, never later inside an engine's processor.
"""

from __future__ import annotations

import io
# imported where used: PIL (only for image rows)


def to_pil_images(value, max_images: int, where: str) -> list:
    """`value` -> list of RGB PIL images. Raises ValueError naming `where` for an unreadable image or more than
    `max_images` (the knob named in the message); prompt loading drops and counts such rows."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if len(items) > max_images:
        raise ValueError(f"{where} has {len(items)} images > data.max_images_per_prompt={max_images}. "
                         f"Fix: raise data.max_images_per_prompt or filter the dataset")
    return [_decode(item, where) for item in items]


def _decode(item, where: str):
    from PIL import Image

    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    try:
        if isinstance(item, (bytes, bytearray)):
            item = Image.open(io.BytesIO(item))
        elif isinstance(item, str):
            item = Image.open(item)
        if not isinstance(item, Image.Image):
            raise ValueError(f"an image must be a PIL image, bytes, a path or an Image struct, "
                             f"got {type(item).__name__}")
        if 0 in item.size:
            raise ValueError(f"an image of size {item.size} has no pixels")
        return item.convert("RGB")  # decodes the whole file: a truncated one fails here
    # PIL's UnidentifiedImageError (empty or non-image file) is an OSError; a header claiming more pixels than PIL
    # decodes (a damaged GIF or BMP, a huge image) raises DecompressionBombError, an Exception of its own
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: unusable image: {e}") from e


def blank_like(image):
    """A mid-grey RGB image of `image`'s size: what `data.blank_images` sends instead (same tokens, no content)."""
    from PIL import Image

    return Image.new("RGB", image.size, (128, 128, 128))
