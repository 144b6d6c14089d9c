"""LoRA on the real GPU loop (run on the device): `qwen3_toy_gpu` (one GPU, colocated, real vLLM 0.24) with
`model.lora.rank=16`. Every sync moves exactly the adapter (rank x (in + out) per adapted module of the 0.6B shape,
bf16), the engine sleeps at level 1 (its base kept: a LoRA sync does not bring it back) and the sync probe finds its
log-probs under the synced adapter equal to the trainer's; the sampler's log-probs agree with the trainer's."""

from __future__ import annotations

from molt_hydra.models.tiny import GPU_SHAPES, TINY_SHAPE

from test_colocated_vllm import molt_run, pytestmark  # noqa: F401 -- the same markers, skips and runner

RANK = 16


def adapter_bytes() -> int:
    s = {**TINY_SHAPE, **GPU_SHAPES["qwen3_0p6b_shape"]}
    h, d, inter = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + inter)  # the dense default: every decoder linear
    return RANK * s["num_hidden_layers"] * per_layer * 2  # bf16 engine


def test_lora_on_the_colocated_gpu_loop(tmp_path):
    m = molt_run(tmp_path, "+recipe=qwen3_toy_gpu", f"model.lora.rank={RANK}", "train.max_steps=6",
                 "train.optimizer.lr=2e-3")
    assert len(m) == 6
    assert {r["train/weight_sync/bytes"] for r in m.values()} == {float(adapter_bytes())}
    gap = "train/weight_sync/probe_logprob_gap"
    probed = [r[gap] for r in m.values() if gap in r]
    assert probed and max(probed) < 5e-2  # LOGPROB_FLOOR["bfloat16"]: the run would have stopped above it
    assert all(abs(r["train/vllm_kl"]) < 1e-2 for r in m.values())
    # asleep at level 1 while the trainer steps: the weights go to host memory and come back (engine/wake_weights_s)
    assert all(r.get("train/engine/freed_gib", 0) > 0 for r in list(m.values())[1:])

