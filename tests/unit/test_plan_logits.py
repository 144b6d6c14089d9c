"""The dry-run plan's logits memory follows how the trainer takes log-probs (runtime/plan.py): the HF backend's text
actor runs the lm_head a chunk of 2048 tokens at a time (models/logprobs.py `linear_logprobs_entropy`), so its working
set is ~3 fp32 [chunk x vocab] arrays (logits, softmax, their gradient) plus the fp32 lm_head gradient, the same for
any micro-batch; AutoModel and vision-language actors hold fp32 logits of the whole micro-batch."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.runtime.validate import validate  # noqa: E402
from molt_hydra.runtime.plan import make_plan, model_shape  # noqa: E402

GIB = 1 << 30
GPU = ["cluster=local_gpus", "parallelism.trainer_devices=2", "model.param_dtype=bfloat16",
       "train.dynamic_batch=false", "train.batch_size=32", "data.max_len=1024"]


def plan_for(overrides):
    cfg = validate(OmegaConf.to_object(compose_config([*GPU, *overrides])))
    return make_plan(cfg), model_shape(cfg.model.path)


def logits_entries(plan):
    return {k: v for k, v in plan.memory["actor"].items() if k.startswith("logits")}


def test_hf_text_actor_holds_a_chunk_of_logits_whatever_the_micro_batch():
    for micro in (4, 8):  # 4096 and 8192 tokens per micro-batch: both above one chunk
        plan, shape = plan_for(["model.backend=hf", f"train.micro_batch_size={micro}"])
        want = (3 * 4 * 2048 * shape.vocab + 4 * shape.vocab * shape.hidden) / GIB
        assert logits_entries(plan) == {"logits fp32, 2048 tokens at a time": want}
        assert "log-probs through the lm_head" in plan.render()


def test_a_micro_batch_smaller_than_a_chunk_bounds_it():
    plan, shape = plan_for(["model.backend=hf", "train.micro_batch_size=1", "data.max_len=512"])
    assert logits_entries(plan) == {"logits fp32, 512 tokens at a time":
                                    (3 * 4 * 512 * shape.vocab + 4 * shape.vocab * shape.hidden) / GIB}


def test_automodel_actor_holds_the_whole_micro_batch_of_logits():
    plan, shape = plan_for(["model.backend=automodel", "parallelism.packing=false", "train.micro_batch_size=4"])
    assert logits_entries(plan) == {"logits fp32": 4 * shape.vocab * 4 * 1024 / GIB}
    assert "fp32 logits of the whole micro-batch" in plan.render()


def test_vlm_actor_holds_the_whole_micro_batch_of_logits():
    plan, shape = plan_for(["model.backend=hf", "model.path=tiny://qwen25_vl_tiny", "train.micro_batch_size=4",
                            "data.max_images_per_prompt=1", "parallelism.packing=false"])
    assert shape.vision
    assert logits_entries(plan) == {"logits fp32": 4 * shape.vocab * 4 * 1024 / GIB}
