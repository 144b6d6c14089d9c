"""A prompt sent as text, without a chat template (/v1/completions; an Env's text prompt), reaches the engine with the
BOS token a Llama / Gemma / Mistral-style tokenizer adds, as vLLM's /v1/completions tokenizes it; one BOS where the
text starts with it already (a chat render) or a chat template writes it. The tokenizer is built here (byte-level
BPE trained on a few words, a `<s> $A` post-processor as Llama's); the engine is a stand-in that records the prompt
ids it is sent (the real openai SDK and the real loopback server around it)."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from molt_hydra.agents import Env, Episode, Result, StepEnvRunner
from molt_hydra.agents.tool_parser import reply_parser
from molt_hydra.agents.wire.server import ChatServer
from molt_hydra.agents.wire.session import ChatSession
from molt_hydra.rollout.generation import Generation, Sampling

# ChatML behind the BOS, as Llama 3's template writes `{{ bos_token }}` first
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(["hello world, the answer is yes"] * 20, trainer=trainer)
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>" if bos else None, eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = TEMPLATE if bos else TEMPLATE.removeprefix("{{ bos_token }}")
    return tok


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(bos=True)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class Recording:
    """A stand-in engine: records each request's prompt ids, answers "yes" then the end token."""

    def __init__(self, tok):
        self.prompts, self.reply = [], ids(tok, "yes") + [tok.eos_token_id]

    async def generate(self, request):
        self.prompts.append(list(request.prompt_ids))
        return [Generation(list(self.reply), [-0.5] * len(self.reply), [0] * len(self.reply), "stop")]


def test_the_tokenizer_adds_its_bos_to_text(tok):
    bos = tok.bos_token_id
    assert tok("hello")["input_ids"] == [bos, *ids(tok, "hello")] and bos not in ids(tok, "hello")


def serve(tok, calls):
    """The prompt ids the engine got for each `calls(client)` request, through the real openai SDK."""
    async def go():
        engine, server = Recording(tok), ChatServer(api_key="k")
        await server.start()
        try:
            server.open_session(ChatSession("s", engine, tok, Sampling(max_tokens=8), 256, reply_parser(tok, "hermes")))
            client = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key="k", max_retries=0)
            replies = [await call(client) for call in calls]
            await client.close()
            return engine.prompts, replies
        finally:
            await server.stop()
    return asyncio.run(go())


def test_completions_prompt_gets_the_tokenizers_bos_once(tok):
    """Before: /v1/completions tokenized the prompt without special tokens, so a BOS model (Llama, Gemma, Mistral)
    generated from a prompt without its BOS, unlike vLLM's own /v1/completions (and unlike its training)."""
    bos, text = tok.bos_token_id, "hello world"
    prompts, replies = serve(tok, [
        lambda c: c.completions.create(model="policy", prompt=text, max_tokens=4),
        lambda c: c.completions.create(model="policy", prompt="<s>" + text, max_tokens=4),  # already there: no second
        lambda c: c.chat.completions.create(model="policy", messages=[{"role": "user", "content": text}]),
    ])
    assert prompts[0] == [bos, *ids(tok, text)]
    assert replies[0].usage.prompt_tokens == len(ids(tok, text)) + 1 and replies[0].choices[0].text == "yes"
    assert prompts[1] == prompts[0]
    # a chat turn: the template's own BOS, once
    assert prompts[2] == ids(tok, tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True))
    assert prompts[2].count(bos) == 1 and prompts[2][0] == bos


def test_a_tokenizer_without_bos_gets_the_text_as_it_is():
    tok = build_tokenizer(bos=False)
    prompts, _ = serve(tok, [lambda c: c.completions.create(model="policy", prompt="hello world", max_tokens=4)])
    assert prompts == [ids(tok, "hello world")]


class TwoTurns(Env):
    async def step(self, state):
        if state["turn"] == 0:
            return Result(reward=0.0, observation=" world", terminated=False)
        return Result(reward=1.0)


@pytest.mark.parametrize("prompt", ["hello", "<s>hello", [{"role": "user", "content": "hello"}]])
def test_an_env_text_prompt_gets_the_bos_once_and_feedback_none(tok, prompt):
    """Before: an Env's text prompt (data.apply_chat_template=false) was tokenized without special tokens: a BOS model
    generated without its BOS. Text starting with it and a chat render keep theirs, once; an observation, which
    continues the sequence, gets none."""
    bos, engine = tok.bos_token_id, Recording(tok)
    ep = Episode(prompt=prompt, sampling=Sampling(max_tokens=4), max_length=64)
    outcome = asyncio.run(StepEnvRunner(TwoTurns).run_group([ep], engine, tok))
    (traj,) = outcome.trajectories
    first = (ids(tok, tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
             if isinstance(prompt, list) else [bos, *ids(tok, "hello")])
    assert engine.prompts[0] == first and first.count(bos) == 1
    assert engine.prompts[1] == first + engine.reply + ids(tok, " world")
    assert traj.token_ids == engine.prompts[1] + engine.reply


def test_a_text_prompt_cut_to_its_room_keeps_its_bos(tok):
    """A prompt over the room max_length leaves beside max_tokens is cut from the left (Molt's): its BOS, the model's
    first token, stays in front of the last tokens that fit (was: cut away with the rest)."""
    bos, engine = tok.bos_token_id, Recording(tok)
    text = "hello world, the answer is yes " * 4
    body = ids(tok, text)
    room = 10  # max_length - max_tokens
    ep = Episode(prompt=text, sampling=Sampling(max_tokens=4), max_length=room + 4)
    asyncio.run(StepEnvRunner(TwoTurns).run_group([ep], engine, tok))
    assert len(body) + 1 > room
    assert engine.prompts[0] == [bos, *body[-(room - 1):]]


def test_the_load_count_of_a_text_prompt_counts_its_bos(tok):
    """The count at load (runtime/roles.py first_prompt_lengths) sees a text prompt as the step runner sends it: with
    the tokenizer's BOS. A text of exactly the room's tokens is one over it; a chat render counts the template's."""
    from molt_hydra.runtime.roles import first_prompt_lengths

    text = "hello world, the answer is yes"
    room = len(ids(tok, text))
    chat = [{"role": "user", "content": text}]
    rendered = len(ids(tok, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)))
    assert first_prompt_lengths(tok, False, [(text, None, room), (chat, None, 1), ("hi", None, 1000)]) == [
        room + 1, rendered, len("hi") + 2]  # the last: fits for sure, by its bytes (at most one token each, + 2)
