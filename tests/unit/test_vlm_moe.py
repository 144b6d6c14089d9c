"""The geo3k recipe's model family on the trainer side (CPU, fp32): the tiny random-init Qwen3-VL-MoE builds and
loads in transformers, the engine's routed experts line up with the expanded image trajectory, and R3 replays them
on image and text tokens in the FSDP2 trainer (the same router code as Qwen3-MoE), counted apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from molt_hydra.models import moe_routing, vlm
from molt_hydra.models.build import resolve_path
from molt_hydra.models.tiny_vlm import TINY_QWEN3_VL_MOE_TEXT, TINY_QWEN3_VL_VISION

from _vlm_helpers import vlm_worker, one_rank_process_group  # noqa: F401 (module fixture)

MODEL = "tiny://qwen3_vl_moe_tiny"
TEXT = TINY_QWEN3_VL_MOE_TEXT


@pytest.fixture(scope="module")
def model_dir():
    return resolve_path(MODEL)


def test_tiny_qwen3_vl_moe_is_saved_in_the_released_expert_layout_vllm_reads(model_dir):
    """vLLM's Qwen3-VL-MoE loader transposes the fused experts unconditionally (released checkpoints store
    gate_up_proj [E, H, 2I], down_proj [E, I, H]); transformers 5 holds [E, 2I, H] / [E, H, I] and transposes on load.
    H != 2I, or transformers' Transpose(check_dims=True) would skip a square gate_up_proj."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    E, H, I = TEXT["num_experts"], TEXT["hidden_size"], TEXT["moe_intermediate_size"]
    assert H != 2 * I
    prefix = "model.language_model.layers.0.mlp.experts."
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(prefix + k) for k in ("gate_up_proj", "down_proj")}
    assert saved["gate_up_proj"].shape == (E, H, 2 * I) and saved["down_proj"].shape == (E, I, H)
    experts = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).model.language_model \
        .layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj.detach(), saved["gate_up_proj"].transpose(-1, -2))
    assert torch.equal(experts.down_proj.detach(), saved["down_proj"].transpose(-1, -2))


def _image_tokens(side: int) -> int:
    # Qwen3-VL's resize rounds each side to the nearest multiple of patch x merge; 2x2 patches merge into one token
    unit = TINY_QWEN3_VL_VISION["patch_size"] * TINY_QWEN3_VL_VISION["spatial_merge_size"]
    return (round(side / unit) * unit // TINY_QWEN3_VL_VISION["patch_size"]) ** 2 // 4


def _sample(model_dir, side=56):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]},
            {"role": "assistant", "content": "The answer is \\boxed{60}."}]
    ids = list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    image = Image.new("RGB", (side, side), (200, 30, 30))
    return ids, image, vlm.TrajectoryImages.for_model(model_dir)


def test_tiny_qwen3_vl_moe_builds_and_loads_in_transformers(model_dir):
    from transformers import AutoModelForImageTextToText

    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_moe"
    text = config["text_config"]
    # what vLLM reads: M-RoPE only with mrope_section present; its Qwen3-MoE block reads norm_topk_prob
    assert text["rope_parameters"]["mrope_section"] == [24, 20, 20] and text["norm_topk_prob"] is True
    assert sum(text["rope_parameters"]["mrope_section"]) == TEXT["head_dim"] // 2
    video = json.loads((Path(model_dir) / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["patch_size"] == 16
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    assert moe_routing.is_moe_config(model.config)
    routers = moe_routing.install(model)
    assert [r.layer_index for r in routers] == list(range(TEXT["num_hidden_layers"]))  # every decoder layer sparse
    assert all(r.norm_topk_prob for r in routers)
    ids, image, images = _sample(model_dir)
    assert images.expand(ids, [0.0] * len(ids), [-1] * len(ids), [], [image])[0].count(
        images.placeholder_id) == _image_tokens(56)


def _own_experts(model_dir, sample) -> torch.Tensor:
    """[T, layers, top_k]: the experts an HF forward of the same weights picks per token (what the engine would
    return for them)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    picked = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "Qwen3VLMoeTextTopKRouter":
            layer = int(name.split(".")[name.split(".").index("layers") + 1])
            m.register_forward_hook(lambda mod, args, out, layer=layer: picked.__setitem__(layer, out[2]))
    with torch.no_grad():
        model(input_ids=sample["input_ids"][None], **vlm.multimodal_kwargs([sample]))
    return torch.stack([picked[i] for i in sorted(picked)], dim=1)


def test_engine_routing_over_image_spans_lines_up_with_the_expanded_trajectory(model_dir):
    from molt_hydra.agents.base import Trajectory
    from molt_hydra.rollout.generation import Generation
    from molt_hydra.algorithm.experience import to_experience

    ids, image, images = _sample(model_dir)
    prompt, reply = ids[:-4], ids[-4:]
    n_img = _image_tokens(56)
    engine_prompt = len(prompt) - 1 + n_img  # the engine's prompt: the placeholder is n_img image tokens
    layers, k = TEXT["num_hidden_layers"], TEXT["num_experts_per_tok"]
    # the engine routes every computed position (prompt + generated but the last); row p names position p
    rows = [[[p % 8, (p + 1) % 8]] * layers for p in range(engine_prompt + len(reply) - 1)]
    traj = Trajectory(images=[image])
    traj.append_feedback(prompt)
    traj.append_action(Generation(token_ids=reply, logprobs=[-1.0] * 4, versions=[0] * 4, finish_reason="stop",
                                  routed_experts=rows))
    exp, reason = to_experience(traj, max_len=256, images=images)
    assert reason is None and len(exp.token_ids) == engine_prompt + len(reply)
    assert exp.routed_experts.shape == (len(exp.token_ids), layers, k)
    assert exp.routed_experts[:-1].tolist() == rows  # image tokens included: position by position
    assert (exp.routed_experts[-1] == -1).all()


def test_r3_replays_the_engines_experts_on_image_and_text_tokens(model_dir):
    ids, image, images = _sample(model_dir)
    ids, _, _, _, mm = images.expand(ids, [0.0] * len(ids), [-1] * len(ids), [], [image])
    sample = {"input_ids": torch.tensor(ids), **mm}
    own = _own_experts(model_dir, sample)
    is_image = mm["mm_token_type_ids"].bool()
    engine = own.clone()
    # the engine chose otherwise on image tokens in the last layer (each expert id + 2 (mod 8) is never the same
    # pair); every earlier layer agrees, so replaying changes no router's input and the text tokens' choice stays
    # exactly the HF forward's (a replay in an earlier layer would move later hidden states: near-ties could flip)
    last = TEXT["num_hidden_layers"] - 1
    engine[is_image, last] = (own[is_image, last] + 2) % TEXT["num_experts"]
    n, n_img, layers = len(ids), int(is_image.sum()), TEXT["num_hidden_layers"]
    sample |= {"routed_experts": engine.to(torch.int16), "loss_mask": torch.ones(n, dtype=torch.bool)}

    for replay in (True, False):
        w = vlm_worker(model_dir, routing_replay=replay)
        m = w.train_step([sample], return_logprobs=True)
        # every token is known to the engine; the router's own top-k agrees on text tokens, and on image tokens in
        # every layer but the last (agreement counts token-layer pairs)
        assert m["routing/agreement_text"] == 1.0
        assert m["routing/agreement_image"] == pytest.approx((layers - 1) / layers)
        assert m["routing/agreement"] == pytest.approx(1 - n_img / (n * layers))
        assert m["routing/image_tokens"] == pytest.approx(n_img / n)
        # R3 used the engine's experts there
        assert m["routing/replayed_image"] == pytest.approx(1.0 if replay else (layers - 1) / layers)
        assert m["routing/replayed_text"] == 1.0

