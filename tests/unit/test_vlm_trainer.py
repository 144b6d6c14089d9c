"""Trainer side of a vision-language model (tiny random-init Qwen2.5-VL and Idefics3, fp32, CPU, FSDP2 over gloo,
1 rank): the placeholder expansion equals the model's processor, the log-prob recompute on an image sample equals an
HF forward with the same processor outputs (M-RoPE positions included), and model.freeze_visual_encoder keeps the
vision tower out of training."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from molt_hydra.models import vlm
from molt_hydra.models.build import build_model, resolve_path

from _vlm_helpers import hf_logprobs, vlm_worker, one_rank_process_group  # noqa: F401 (module fixture)

MODEL = "tiny://qwen25_vl_tiny"
IDEFICS3 = "tiny://idefics3_tiny"
VISION_PARTS = (".visual.", ".vision_model.", ".connector.")


def _triangle(size=(84, 56), color=(200, 30, 30)) -> Image.Image:
    im = Image.new("RGB", size, "white")
    ImageDraw.Draw(im).polygon([(5, 50), (40, 5), (78, 50)], outline=color, width=3)
    return im


@pytest.fixture(scope="module")
def model_dir():
    return resolve_path(MODEL)


def _is_vision(name: str) -> bool:
    return any(part in f".{name}" for part in VISION_PARTS)


def _sample(model_dir, image):
    from transformers import AutoConfig, AutoTokenizer

    tok, cfg = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the angle x?"}]},
            {"role": "assistant", "content": "The answer is \\boxed{60}."}]
    ids = tok.apply_chat_template(msgs, tokenize=True)["input_ids"]
    ids, _, _, _, mm = vlm.TrajectoryImages.for_model(model_dir).expand(ids, [0.0] * len(ids), [-1] * len(ids), [],
                                                                        [image])
    return {"input_ids": torch.tensor(ids), **mm}, cfg


def test_image_placeholders_expand_to_merged_patches(model_dir):
    sample, cfg = _sample(model_dir, _triangle((84, 56)))
    # 84x56 px -> 6x4 patches of 14 px -> 2x2 merge -> 6 image tokens
    assert sample["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert int((sample["input_ids"] == cfg.image_token_id).sum()) == 6
    images = vlm.TrajectoryImages.for_model(model_dir)
    with pytest.raises(ValueError, match="fewer image placeholders in the trajectory than its 2 images"):
        images.expand([cfg.image_token_id], [0.0], [-1], [], [_triangle(), _triangle()])
    with pytest.raises(ValueError, match="the policy generated an image placeholder token"):
        images.expand([5, cfg.image_token_id], [0.0, -1.0], [-1, 3], [(1, 2)], [_triangle()])


def test_build_model_accepts_vlm_and_refuses_vlm_critic(model_dir):
    model = build_model(model_dir, role="actor")
    assert vlm.is_vlm(model.config) and sum(p.numel() for m in vlm.visual_encoder(model) for p in m.parameters()) > 0
    with pytest.raises(NotImplementedError, match="vision-language critic"):
        build_model(model_dir, role="critic")


@pytest.mark.parametrize("name,text_layers", [(MODEL, "model.language_model.layers"),
                                               (IDEFICS3, "model.text_model.layers")])
def test_fsdp_units_are_the_language_models_blocks(name, text_layers):
    # the vision tower's blocks come first in the module tree; the FSDP2 (and compile) unit is the decoder block
    from molt_hydra.models.build import decoder_layers

    model = build_model(resolve_path(name))
    assert decoder_layers(model) is model.get_submodule(text_layers)


def test_trainer_logprobs_equal_hf_forward_with_processor_outputs(model_dir):
    from transformers import AutoModelForImageTextToText

    sample, _ = _sample(model_dir, _triangle())
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        mm = {k: sample[k] for k in ("pixel_values", "image_grid_thw")}
        types = sample["mm_token_type_ids"][None]
        expected = hf_logprobs(hf, sample, **mm, mm_token_type_ids=types)
        other_image, _ = vlm.TrajectoryImages.for_model(model_dir).process([_triangle(color=(20, 20, 220))])
        with_other_image = hf_logprobs(hf, sample, **other_image, mm_token_type_ids=types)
        # 1-D text positions instead of M-RoPE: what a trainer without the token types would compute
        flat_positions = hf_logprobs(hf, sample, **mm)
    # the comparison can fail: the image content and the 3-D positions both change the log-probs
    assert (expected - with_other_image).abs().max() > 1e-4
    assert (expected - flat_positions).abs().max() > 1e-4

    w = vlm_worker(model_dir)
    text_sample = {"input_ids": sample["input_ids"][:5]}  # a text sample in the same call keeps working
    got, got_text = w.compute_logprobs([sample, text_sample])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_text, hf_logprobs(hf, text_sample), atol=1e-5, rtol=0)


def test_idefics3_expansion_equals_the_hf_processor():
    """The trajectory's one `<image>` per image, expanded, is token for token what Idefics3Processor makes of the
    rendered prompt; the pixels are the processor's."""
    from transformers import AutoConfig, AutoProcessor

    model_dir = resolve_path(IDEFICS3)
    cfg, proc = AutoConfig.from_pretrained(model_dir), AutoProcessor.from_pretrained(model_dir, backend="pil")
    tok = proc.tokenizer
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Now this:"}, {"type": "image"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    images = [_triangle((84, 56)), _triangle((40, 70), color=(0, 0, 200))]
    got, lps, vers, ranges, mm = vlm.TrajectoryImages.for_model(model_dir).expand(
        ids, [0.0] * len(ids), [-1] * len(ids), [], images)
    hf = proc(text=[text], images=[images], return_tensors="pt")
    assert got == hf["input_ids"][0].tolist()
    torch.testing.assert_close(mm["pixel_values"], hf["pixel_values"][0], atol=0, rtol=0)
    assert torch.equal(mm["pixel_attention_mask"], hf["pixel_attention_mask"][0].bool())
    # the span per image from the config: fake, global tag, (56/14)^2 / 2^2 image tokens, fake
    seq_len = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2 // cfg.scale_factor**2
    fake, glob = (tok.convert_tokens_to_ids(t) for t in ("<fake_token_around_image>", "<global-img>"))
    first = got.index(fake)
    assert got[first:first + seq_len + 3] == [fake, glob] + [cfg.image_token_id] * seq_len + [fake]
    assert len(got) == len(ids) + 2 * (seq_len + 2) and len(lps) == len(vers) == len(got)


def test_idefics3_trainer_logprobs_equal_hf_forward_with_processor_outputs():
    from transformers import AutoModelForImageTextToText

    model_dir = resolve_path(IDEFICS3)
    sample, _ = _sample(model_dir, _triangle())
    assert sample["pixel_values"].shape == (1, 3, 56, 56)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_logprobs(hf, sample, pixel_values=sample["pixel_values"][None],
                               pixel_attention_mask=sample["pixel_attention_mask"][None])
        other, _ = vlm.TrajectoryImages.for_model(model_dir).process([_triangle(color=(20, 20, 220))])
        with_other_image = hf_logprobs(hf, sample, pixel_values=other["pixel_values"][None],
                                       pixel_attention_mask=other["pixel_attention_mask"][None])
    assert (expected - with_other_image).abs().max() > 1e-4  # the image content reaches the log-probs

    w = vlm_worker(model_dir)
    text_sample = {"input_ids": sample["input_ids"][:5]}
    got, got_text = w.compute_logprobs([sample, text_sample])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_text, hf_logprobs(hf, text_sample), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", [MODEL, IDEFICS3])
def test_freeze_visual_encoder_keeps_vision_tower_out_of_training(name):
    model_dir = resolve_path(name)
    sample, cfg = _sample(model_dir, _triangle())
    sample["loss_mask"] = torch.zeros_like(sample["input_ids"], dtype=torch.bool)
    sample["loss_mask"][-8:] = True  # the answer tokens

    def visual_and_text(w):
        params = dict(w.model.named_parameters())
        vis = {k: v.detach().clone() for k, v in params.items() if _is_vision(k)}
        txt = {k: v.detach().clone() for k, v in params.items() if not _is_vision(k)}
        return vis, txt

    for freeze in (True, False):
        w = vlm_worker(model_dir, freeze_visual_encoder=freeze)
        opt_params = {id(p) for g in w.optimizer.param_groups for p in g["params"]}
        vis_params = [p for k, p in w.model.named_parameters() if _is_vision(k)]
        assert vis_params and all((id(p) in opt_params) != freeze for p in vis_params)
        vis0, txt0 = visual_and_text(w)
        w.train_step([sample])
        vis1, txt1 = visual_and_text(w)
        vis_moved = max((vis1[k] - vis0[k]).abs().max().item() for k in vis0)
        txt_moved = max((txt1[k] - txt0[k]).abs().max().item() for k in txt0)
        assert txt_moved > 0
        assert (vis_moved == 0) == freeze, (freeze, vis_moved)


@pytest.mark.slow
@pytest.mark.parametrize("freeze,model", [(False, MODEL), (True, MODEL), (False, IDEFICS3)])
def test_two_dp_ranks_one_with_images_one_without_train_together(tmp_path, freeze, model):
    """A trainable vision tower gets gradients on the image rank only; the text rank still joins its reduce-scatter
    (else gloo aborts on a collective size mismatch)."""
    import json

    from _vlm_helpers import mixed_dp_rank

    from molt_hydra.parallel.launch import run_ranks

    run_ranks(mixed_dp_rank, 2, str(tmp_path), freeze, model, timeout_s=240)
    losses = [json.loads((tmp_path / f"rank{r}.json").read_text())["sft_loss"] for r in (0, 1)]
    assert losses[0] == losses[1] and losses[0] > 0  # DP-reduced metric: the same on both ranks


def test_a_vlm_trains_with_optimizer_held_masters(model_dir):
    """model.master_weights=optimizer (what `auto` picks on one GPU rank) on a VLM: bf16 params (FSDP2 keeps the VLM's
    input cast), fp32 masters in AdamW, and one step moves every trainable parameter, vision tower included, to its
    master rounded to bf16."""
    sample, _ = _sample(model_dir, _triangle())
    sample["loss_mask"] = torch.zeros_like(sample["input_ids"], dtype=torch.bool)
    sample["loss_mask"][-8:] = True
    w = vlm_worker(model_dir, param_dtype="bf16", master_weights="optimizer")
    params = dict(w.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    before = {k: p.detach().clone() for k, p in params.items()}
    w.train_step([sample])
    for k, p in params.items():
        master = w.optimizer.state[p]["master"]
        assert master.dtype == torch.float32 and torch.equal(p.detach(), master.to(torch.bfloat16)), k
        assert not torch.equal(p.detach(), before[k]), k
    assert any(_is_vision(k) for k in params)
