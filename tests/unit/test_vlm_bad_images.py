"""Bad image rows cost one sample, never the run: a truncated PNG, an empty file, an image without pixels, a value
that is no image, or more images than data.max_images_per_prompt is dropped at prompt loading, counted and logged
with its row id; other PIL modes are converted to RGB and kept. `data.blank_images` sends a grey image of the same
size in place of every image (the pixel task's control)."""

from __future__ import annotations

import io
import logging

import pytest
from PIL import Image

from molt_hydra.data.prompts import load_prompts


def _png(color, size=(8, 6), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG" if mode != "CMYK" else "JPEG")
    return buf.getvalue()


def _write_rows(tmp_path, images: list) -> str:
    import datasets

    ds = datasets.Dataset.from_dict({"prompt": [f"<image>row {i}" for i in range(len(images))],
                                     "label": [str(i) for i in range(len(images))], "images": images})
    path = tmp_path / "rows.parquet"
    ds.to_parquet(str(path))
    return str(path)


def test_unusable_images_drop_their_row_with_its_id_logged(tmp_path, caplog):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    good = _png((10, 20, 30))
    noise = io.BytesIO()
    Image.frombytes("RGB", (32, 32), bytes(range(256)) * 12).save(noise, format="PNG")
    truncated = noise.getvalue()[: len(noise.getvalue()) // 2]  # its header reads; its pixels do not
    images = [[good], [truncated], [str(empty)], [good, good], [good]]
    path = _write_rows(tmp_path, [[{"bytes": b if isinstance(b, bytes) else None,
                                    "path": b if isinstance(b, str) else None} for b in row] for row in images])
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        rows = load_prompts(path, image_key="images", max_images_per_prompt=1)
    assert [r["label"] for r in rows] == ["0", "4"]  # rows 1 (truncated), 2 (empty file), 3 (two images) dropped
    assert rows[0]["images"][0].getpixel((0, 0)) == (10, 20, 30)
    text = caplog.text
    assert f"{path} row 1 (images): unusable image: image file is truncated" in text
    assert f"{path} row 2 (images): unusable image: cannot identify image file" in text
    assert f"{path} row 3 (images) has 2 images > data.max_images_per_prompt=1" in text
    assert f"dropped 3 of 5 rows of {path} with unusable images (row ids [1, 2, 3])" in text


def test_in_memory_rows_without_pixels_or_not_images_drop_and_other_modes_convert(caplog):
    from molt_hydra.data.prompts import usable_image_rows

    rows = [{"prompt": "a", "images": [Image.new("RGB", (0, 0))]}, {"prompt": "b", "images": [3]},
            {"prompt": "c", "images": [Image.new("LA", (4, 4), (200, 255))]},
            {"prompt": "d", "images": Image.new("P", (4, 4), 0)}, {"prompt": "e"}]
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        kept = usable_image_rows(rows, "mem", "images", 1, blank=False)
    assert [r["prompt"] for r in kept] == ["c", "d", "e"]
    assert "mem row 0 (images): unusable image: an image of size (0, 0) has no pixels" in caplog.text
    assert "mem row 1 (images): unusable image: an image must be a PIL image" in caplog.text
    assert kept[0]["images"][0].mode == "RGB" and kept[0]["images"][0].getpixel((0, 0)) == (200, 200, 200)
    assert kept[1]["images"][0].mode == "RGB" and kept[1]["images"][0].getpixel((0, 0)) == (0, 0, 0)
    with pytest.raises(ValueError, match="every row of mem was dropped for its images; the first: mem row 0"):
        usable_image_rows(rows[:2], "mem", "images", 1, blank=False)


def test_a_cmyk_jpeg_converts_and_16_bit_grey_converts(tmp_path):
    path = _write_rows(tmp_path, [[{"bytes": _png((0, 0, 0, 0), mode="CMYK"), "path": None}],
                                  [{"bytes": _png(300, mode="I;16"), "path": None}]])
    rows = load_prompts(path, image_key="images", max_images_per_prompt=1)
    assert [r["images"][0].mode for r in rows] == ["RGB", "RGB"]
    assert rows[0]["images"][0].getpixel((0, 0)) == (255, 255, 255)  # CMYK 0,0,0,0 is white


def test_blank_images_keep_size_and_label_and_drop_content():
    real = load_prompts("builtin://colors_eval", max_images_per_prompt=1)
    blank = load_prompts("builtin://colors_eval", max_images_per_prompt=1, blank_images=True)
    assert [r["label"] for r in blank] == [r["label"] for r in real]
    assert all(b["images"][0].size == r["images"][0].size == (56, 56) for b, r in zip(blank, real))
    # one image for every row: nothing in it tells one row from another (the engine takes repeats: rollout/engine.py)
    assert {b["images"][0].tobytes() for b in blank} == {Image.new("RGB", (56, 56), (128, 128, 128)).tobytes()}
    # the real images differ by colour: the shape's centre pixel is nearest its label's colour
    from molt_hydra.data.prompts import COLORS

    for r in real:
        px = r["images"][0].getpixel((28, 28))
        assert min(COLORS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLORS[c], px)))[0].upper() == r["label"]


def test_an_image_claiming_more_pixels_than_pil_decodes_drops_its_row(tmp_path, caplog):
    """A 20000x20000 image (or a damaged GIF / BMP header that claims one): PIL's DecompressionBombError is no OSError
    or ValueError. Before: it escaped prompt loading, the run's traceback; now its row is dropped like any other."""
    huge = io.BytesIO()
    Image.new("1", (20000, 20000)).save(huge, format="PNG")  # 400M pixels, > 2 * Image.MAX_IMAGE_PIXELS
    path = _write_rows(tmp_path, [[{"bytes": huge.getvalue(), "path": None}],
                                  [{"bytes": _png((1, 2, 3)), "path": None}]])
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        rows = load_prompts(path, image_key="images", max_images_per_prompt=1)
    assert [r["label"] for r in rows] == ["1"] and rows[0]["images"][0].getpixel((0, 0)) == (1, 2, 3)
    assert (f"{path} row 0 (images): unusable image: Image size (400000000 pixels) exceeds limit of "
            f"{2 * Image.MAX_IMAGE_PIXELS} pixels") in caplog.text


def test_an_image_the_models_processor_refuses_drops_its_row_at_load(tmp_path, caplog):
    """Qwen-VL's processor refuses an image whose aspect ratio is over 200. Before: the row was loaded, and each of
    its rollouts failed as agent_exception ('absolute aspect ratio must be smaller than 200'), every epoch; now the
    run's loader (runtime/roles.py `_load_rows`, with the agent runners' processor) drops it, named."""
    from types import SimpleNamespace as ns

    from molt_hydra.runtime.roles import _load_rows

    sizes = [(8, 6), (402, 2), (6, 8), (2, 400)]  # (width, height): ratios 1.33, 201 (refused), 1.33, 200 (taken)
    path = _write_rows(tmp_path, [[{"bytes": _png((10, 20, 30), size), "path": None}] for size in sizes])
    data = ns(input_key="prompt", label_key="label", tools_key=None, image_key="images", max_images_per_prompt=1,
              blank_images=False, train_path=path, split="train", config_name=None, max_samples=None, train_probs=None,
              apply_chat_template=True, max_len=2048)
    cfg = ns(data=data, model=ns(path="tiny://qwen25_vl_tiny", tokenizer_path=None), eval=ns(data_path=None),
             job=ns(value="rl"), rollout=ns(batch_size=1, max_new_tokens=None), seed=0)
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        prompts, _ = _load_rows(cfg, scoring=False)
    assert [r["label"] for r in prompts] == ["0", "2", "3"]
    assert (f"{path} row 1 (images) image 0: the model's processor refuses it (absolute aspect ratio must be smaller "
            "than 200, got 201.0)") in caplog.text
    # a text-only run reads no image, so nothing is screened; its prompts' <image> would reach the model without one
    # (before: taken without a word): refused, naming data.image_key (tests/unit/test_prompt_files.py)
    cfg.data.max_images_per_prompt, cfg.data.image_key = 0, None
    with pytest.raises(ValueError, match=f"{path} row 0: its prompt places an image .* data.image_key=null reads no "
                                         "image"):
        _load_rows(cfg, scoring=False)


def test_image_paths_that_are_nowhere_are_found_at_validation(tmp_path, monkeypatch):
    """Image paths relative to the data file's directory, read from another directory: every row would be dropped at
    load. Before: a dry run passed, and the run failed at its start ('every row ... was dropped for its images'),
    naming no fix; now validation refuses it, naming a path and the directory relative paths are read from. One row
    whose image is there keeps the data (the others are dropped at load, each named)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from test_validation import config_errors

    (tmp_path / "imgs").mkdir()
    for i in range(8):
        Image.new("RGB", (8, 8), (30 * i, 0, 0)).save(tmp_path / "imgs" / f"{i}.png")
    data = tmp_path / "rows.jsonl"

    def write(paths: list[str]) -> list[str]:
        data.write_text("".join(json.dumps({"prompt": "<image>colour?", "label": "R", "images": [p]}) + "\n"
                                for p in paths))
        return config_errors(["+recipe=tiny_vlm_colors_cpu", f"data.train_path={data}", "data.image_key=images",
                              "rollout.batch_size=8", "train.batch_size=32", "train.micro_batch_size=8"])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert write([f"imgs/{i}.png" for i in range(8)]) == [
        f"data.train_path: {data}: every row with images has one that is not there, e.g. 'imgs/0.png' (data.image_key="
        "'images'); each would be dropped. Fix: give each row readable images in data.image_key: PIL images, encoded "
        f"bytes, or paths, a relative one read from the directory the run starts in ({elsewhere})"]
    assert write([str(tmp_path / "imgs" / f"{i}.png") for i in range(8)]) == []
    assert write([str(tmp_path / "imgs" / "0.png")] + [f"imgs/{i}.png" for i in range(1, 8)]) == []
    monkeypatch.chdir(tmp_path)
    assert write([f"imgs/{i}.png" for i in range(8)]) == []


def test_a_row_placing_other_than_one_image_per_image_drops_naming_both_counts(caplog):
    """Each `<image>` marker (or bare image part) takes the row's next image, in the Envs (models.vlm.image_parts) and
    the chat agents (prompt_messages) alike. Before: kept, and each of its rollouts, every epoch, was vLLM's error
    (an image with no place) or a sample the trainer dropped as image_placeholder_mismatch (a place with no image)."""
    from molt_hydra.data.prompts import usable_image_rows

    im = Image.new("RGB", (4, 4), "red")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    rows = [{"prompt": "<image><image>two places", "images": [im]}, {"prompt": parts, "images": [im, im]},
            {"prompt": "<image>one place", "images": [im]}, {"prompt": parts, "images": [im]},
            {"prompt": "no place: the agent puts it", "images": [im]}]
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        kept = usable_image_rows(rows, "mem", "images", 2, blank=False)
    assert [r["prompt"] for r in kept] == [r["prompt"] for r in rows[2:]]
    assert "mem row 0 (images): its prompt places 2 image(s) (<image> markers, image parts) for its 1 image(s)" \
        in caplog.text
    assert "mem row 1 (images): its prompt places 1 image(s) (<image> markers, image parts) for its 2 image(s)" \
        in caplog.text
