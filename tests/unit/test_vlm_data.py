"""data.image_key / data.max_images_per_prompt: a parquet written by `datasets` with an image column (as a
geometry3k preparation writes it) loads as PIL images; a row over the per-prompt limit is dropped."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from molt_hydra.data.images import to_pil_images
from molt_hydra.data.prompts import load_prompts


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buf, format="PNG")
    return buf.getvalue()


def test_image_column_loads_as_pil_and_limit_is_enforced(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({
        "problem": ["<image>Find x.", "<image><image>Find y."],
        "answer": ["3", "4"],
        "images": [[Image.new("RGB", (8, 6), "red")], [Image.new("RGB", (8, 6), "blue"), Image.new("RGB", (4, 4))]],
    }).cast_column("images", datasets.Sequence(datasets.Image()))
    path = tmp_path / "geo.parquet"
    ds.to_parquet(str(path))

    rows = load_prompts(str(path), input_key="problem", label_key="answer", image_key="images",
                        max_images_per_prompt=2)
    assert [len(r["images"]) for r in rows] == [1, 2]
    assert rows[0]["images"][0].getpixel((0, 0)) == (255, 0, 0) and rows[1]["images"][1].size == (4, 4)
    # over the limit: that row is dropped (and logged by id), the others load
    rows = load_prompts(str(path), input_key="problem", label_key="answer", image_key="images",
                        max_images_per_prompt=1)
    assert [r["label"] for r in rows] == ["3"]


def test_image_struct_bytes_and_paths(tmp_path):
    p = tmp_path / "a.png"
    p.write_bytes(_png((0, 255, 0)))
    images = to_pil_images([{"bytes": _png((1, 2, 3)), "path": None}, _png((4, 5, 6)), str(p)], 3, "row 0")
    assert [im.getpixel((0, 0)) for im in images] == [(1, 2, 3), (4, 5, 6), (0, 255, 0)]
    with pytest.raises(ValueError, match="row 0: unusable image: an image must be"):
        to_pil_images([3], 1, "row 0")
