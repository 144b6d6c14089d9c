"""Images in canonical messages: where they are, how a source becomes a PIL image, how a PIL image becomes a source.
PIL is imported where an image is opened (deferred: the server's text path never needs it)."""

from __future__ import annotations

import base64
import binascii
import io

from molt_hydra.agents.wire.request import bad


def image_sources(messages: list[dict]) -> list[str]:
    """Image sources of these messages, in the order the template renders their placeholders."""
    return [p["source"] for m in messages if isinstance(m["content"], list) for p in m["content"]
            if p["type"] == "image"]


def load_image(source: str, where: str | None = None):
    """A data: URI (base64) or a local file path → PIL image. The loopback server fetches nothing over the network.
    `where`: the part's position in the request (`messages[2].content[1]`), which a 400 names (was: param null)."""
    from PIL import Image, UnidentifiedImageError

    at = f"{where}: " if where else ""
    if source.startswith(("http://", "https://")):
        raise bad(f"{at}image URLs are not fetched; send images as base64 data URIs", where)
    is_data_uri, path = source.startswith("data:"), source.removeprefix("file://")
    header, _, data = source.partition(",")
    if is_data_uri and ";base64" not in header:
        raise bad(f"{at}image data URI must be base64-encoded", where)
    try:
        img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)) if is_data_uri else path)
        img.load()
    except Exception as e:  # a client's bad bytes or path, not a server failure; said without PIL's object reprs
        why = (f"not valid base64 ({e})" if isinstance(e, binascii.Error)
               else "not an image format PIL reads (PNG, JPEG, GIF, WebP, ...)" if isinstance(e, UnidentifiedImageError)
               else e.strerror if isinstance(e, OSError) and e.strerror else str(e))
        what = "image data URI is not a decodable image" if is_data_uri else f"cannot open image {path!r}"
        raise bad(f"{at}{what}: {why}", where) from None
    return img.convert("RGB")  # palette, alpha, CMYK, 16-bit grey: RGB, as prompt loading converts


def image_data_uri(img) -> str:
    """PIL image → PNG data URI (how datasets' images reach a ChatAgent's messages)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
