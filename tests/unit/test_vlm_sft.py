"""VLM SFT samples: `<image>` rows rendered by the template, placeholders expanded as the engine does, loss masks
from the template's reply markers on the text only, processor outputs alongside; and one real SFT run on them."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw

from molt_hydra.data.sft_dataset import build_sft_samples, discover_reply_markers, reply_loss_mask
from molt_hydra.models import vlm
from molt_hydra.models.build import resolve_path


def _figure(path, angle):
    im = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(im).polygon([(4, 50), (28, 6), (52, 50)], outline=(0, 0, 0), width=2)
    ImageDraw.Draw(im).text((20, 30), str(angle), fill=(200, 0, 0))
    im.save(path)
    return str(path)


def _rows(tmp_path, n=4):
    return [{"input": "<image>What is angle x?", "output": f"The answer is \\boxed{{{30 + 10 * i}}}.",
             "images": [_figure(tmp_path / f"f{i}.png", 30 + 10 * i)]} for i in range(n)]


def test_vlm_sft_sample_masks_only_the_reply_and_expands_the_image(tmp_path):
    from transformers import AutoTokenizer

    model_dir = resolve_path("tiny://qwen25_vl_tiny")
    tok, images = AutoTokenizer.from_pretrained(model_dir), vlm.TrajectoryImages.for_model(model_dir)
    (row,) = _rows(tmp_path, 1)
    (s,) = build_sft_samples([row], tok, output_key="output", image_key="images", max_images_per_prompt=1,
                             images=images)
    pad = images.placeholder_id
    assert s["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56x56 -> 4x4 patches -> 4 tokens
    ids = s["input_ids"].tolist()
    # from the definition: the template's text with the single placeholder written out 4 times
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                    "text": "What is angle x?"}]}, {"role": "assistant", "content": row["output"]}],
                                   tokenize=False)
    expected = tok(text.replace("<|image_pad|>", "<|image_pad|>" * 4), add_special_tokens=False)["input_ids"]
    assert ids == expected and ids.count(pad) == 4
    markers = discover_reply_markers(tok)
    want_mask = reply_loss_mask(expected, markers, set(tok.all_special_ids))
    assert s["loss_mask"].tolist() == want_mask and sum(want_mask) > 0
    assert s["mm_token_type_ids"].tolist() == [int(t == pad) for t in ids]
    # too long once expanded: skipped (a cut would orphan image features); over the image limit: refused
    with pytest.raises(ValueError, match="no SFT samples"):
        build_sft_samples([row], tok, output_key="output", image_key="images", max_images_per_prompt=1,
                          images=images, max_len=len(ids) - 1)
    with pytest.raises(ValueError, match="max_images_per_prompt=0"):
        build_sft_samples([row], tok, output_key="output", image_key="images", images=images)
    with pytest.raises(ValueError, match="no vision tower"):
        build_sft_samples([row], tok, output_key="output", image_key="images", max_images_per_prompt=1)
    # the first row with images is named by its place in the data, even one later dropped for too many images
    text_row, over = {k: v for k, v in row.items() if k != "images"}, dict(row, images=row["images"] * 2)
    with pytest.raises(ValueError, match="SFT row 1 has images but the model has no vision tower"):
        build_sft_samples([text_row, over, text_row, row], tok, output_key="output", image_key="images",
                          max_images_per_prompt=1)


@pytest.mark.parametrize("name", ["qwen25_vl_tiny", "idefics3_tiny"])
def test_vlm_sft_run_trains_with_frozen_vision_tower(tmp_path, name):
    from molt_hydra.parallel.sft import run_sft

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _rows(tmp_path)))
    hist = run_sft(f"tiny://{name}", str(data), str(tmp_path / "out"), output_key="output",
                   image_key="images", max_images_per_prompt=1, freeze_visual_encoder=True, batch_size=2,
                   max_epochs=3, lr=3e-3, lr_warmup_ratio=0.0, param_dtype="fp32", timeout_s=300)
    losses = [h["sft_loss"] for h in hist]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) < sum(losses[:2])  # the same 4 rows, 3 epochs: the reply loss goes down

    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    init = AutoModelForImageTextToText.from_pretrained(resolve_path(f"tiny://{name}"))
    out = load_file(str(next((tmp_path / "out" / "hf").glob("*.safetensors"))))
    vis = {k: v for k, v in out.items() if any(p in f".{k}" for p in (".visual.", ".vision_model.", ".connector."))}
    ref = dict(init.state_dict())
    assert vis and all(torch.equal(v.float(), ref[k].to(v.dtype).float()) for k, v in vis.items())


def test_vlm_sft_drops_rows_with_unusable_images_and_logs_their_ids(tmp_path, caplog):
    """job=sft as prompt loading: a truncated PNG, an empty file, a 0-pixel image, more images than
    data.max_images_per_prompt each cost their row (logged with its id and counted); another mode converts."""
    import io
    import logging

    from transformers import AutoTokenizer

    model_dir = resolve_path("tiny://qwen25_vl_tiny")
    tok, images = AutoTokenizer.from_pretrained(model_dir), vlm.TrajectoryImages.for_model(model_dir)
    noise = io.BytesIO()
    Image.frombytes("RGB", (32, 32), bytes(range(256)) * 12).save(noise, format="PNG")
    truncated = noise.getvalue()[: len(noise.getvalue()) // 2]  # its header reads; its pixels do not
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    good = _rows(tmp_path, 1)[0]
    bad = {1: [truncated], 2: [str(empty)], 3: [Image.new("RGB", (0, 0))], 4: [good["images"][0]] * 2}
    rows = [good] + [dict(good, images=v) for v in bad.values()]
    rows.append(dict(good, images=[Image.new("LA", (56, 56), (200, 255))]))  # grey + alpha: converts to RGB
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        samples = build_sft_samples(rows, tok, output_key="output", image_key="images", max_images_per_prompt=1,
                                    images=images)
    assert len(samples) == 2  # rows 0 and 5
    assert rows[1]["images"] == [truncated] and rows[5]["images"][0].mode == "LA"  # the caller's rows, as given
    text = caplog.text
    assert "SFT row 1 (images): unusable image: image file is truncated" in text
    assert "SFT row 2 (images): unusable image: cannot identify image file" in text
    assert "SFT row 3 (images): unusable image: an image of size (0, 0) has no pixels" in text
    assert "SFT row 4 (images) has 2 images > data.max_images_per_prompt=1" in text
    assert "dropped 4 of 6 rows of SFT with unusable images (row ids [1, 2, 3, 4])" in text
    with pytest.raises(ValueError, match="every row of SFT was dropped for its images; the first: SFT row 0 .images.: "
                                         "unusable image: image file is truncated"):
        build_sft_samples(rows[1:5], tok, output_key="output", image_key="images", max_images_per_prompt=1,
                          images=images)


def test_vlm_sft_drops_a_row_whose_image_the_processor_refuses_naming_it(tmp_path, caplog):
    """Qwen-VL's processor refuses an image whose aspect ratio is over 200. Before: job=sft decoded the row, then the
    processor's 'absolute aspect ratio must be smaller than 200' ValueError came out of build_sft_samples on every
    trainer rank, naming no row; now the row is dropped, named, as RL prompt loading drops it."""
    import logging

    from transformers import AutoTokenizer

    model_dir = resolve_path("tiny://qwen25_vl_tiny")
    tok, images = AutoTokenizer.from_pretrained(model_dir), vlm.TrajectoryImages.for_model(model_dir)
    sizes = [(8, 6), (402, 2), (6, 8), (2, 400)]  # (width, height): ratios 1.33, 201 (refused), 1.33, 200 (taken)
    rows = [{"input": "<image>What colour?", "output": f"colour {i}", "images": [Image.new("RGB", size, (9, 9, 9))]}
            for i, size in enumerate(sizes)]
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        samples = build_sft_samples(rows, tok, output_key="output", image_key="images", max_images_per_prompt=1,
                                    images=images, source="train.jsonl")
    kept = [tok.decode(s["input_ids"][s["loss_mask"].bool()]) for s in samples]
    assert kept == ["colour 0<|im_end|>", "colour 2<|im_end|>", "colour 3<|im_end|>"]
    assert ("train.jsonl: SFT row 1 (images) image 0: the model's processor refuses it (absolute aspect ratio must be "
            "smaller than 200, got 201.0)") in caplog.text
    assert "dropped 1 of 4 rows of train.jsonl: SFT with unusable images (row ids [1])" in caplog.text


@pytest.mark.parametrize("name", ["qwen25_vl_tiny", "idefics3_tiny"])
def test_an_sft_row_whose_images_and_image_places_differ_is_named(tmp_path, name):
    """A row's images go where its user text has `<image>` (or an image part). Before: 'fewer image placeholders in
    the trajectory than its 2 images' out of every trainer rank, naming no row."""
    from transformers import AutoTokenizer

    model_dir = resolve_path(f"tiny://{name}")
    tok, images = AutoTokenizer.from_pretrained(model_dir), vlm.TrajectoryImages.for_model(model_dir)
    (good,) = _rows(tmp_path, 1)
    kw = dict(output_key="output", image_key="images", max_images_per_prompt=2, images=images, source="chats.jsonl")
    for row, count, places in ((dict(good, images=good["images"] * 2), 2, 1), (dict(good, input="Angle x?"), 1, 0),
                               (dict(good, input="<image><image>Angle x?"), 1, 2)):
        with pytest.raises(ValueError) as err:
            build_sft_samples([good, row], tok, **kw)
        assert str(err.value) == (f"chats.jsonl: SFT row 1: it has {count} image(s) in data.image_key='images' but "
                                  f"{places} place(s) for one in its messages. Fix: write one <image> in the user text "
                                  "where each image goes (or a {'type': 'image'} content part)")
    two = dict(good, input="<image>and<image>Angle x?", images=good["images"] * 2)
    assert len(build_sft_samples([good, two], tok, **kw)) == 2
