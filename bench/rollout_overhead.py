"""Tokens/s of the full path (StepEnvRunner agent -> SamplesGenerator -> Router -> Ray engine actor) divided by raw
vLLM `AsyncLLM.generate` on the same prompts, sampling and engine settings, measured in this process, for the tiny
Qwen3 and (when `smollm2://` resolves) SmolLM2-135M-Instruct. Appends one row per model to RESULTS.md.

    flock /tmp/molt_heavy.lock .venv/bin/python bench/rollout_overhead.py [--models tiny,smollm2] [--repeats 10]
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row, resolve_smollm2  # noqa: E402

GROUPS, N, MAX_TOKENS = 16, 4, 64
WARMUP = 3
ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gb=1, seed=0)


def prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": f"What is {i}+{i * 3}?"}], tokenize=False,
                                    add_generation_prompt=True) for i in range(GROUPS)]


async def raw_vllm(model_dir, texts, tok, repeats):
    from vllm.sampling_params import SamplingParams

    from molt_hydra.rollout.engine import VLLMEngine

    engine = VLLMEngine(model_dir, **ENGINE_ARGS)
    await engine.start()
    llm = engine._llm
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, temperature=1.0)

    async def one(ids, rid):
        async for out in llm.generate({"prompt_token_ids": ids}, params, request_id=rid):
            pass
        return len(out.outputs[0].token_ids)

    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    for w in range(WARMUP):
        await asyncio.gather(*(one(i, f"w{w}-{k}") for k, i in enumerate(ids)))
    rates = []
    for r in range(repeats):
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, f"r{r}-{k}-{j}") for k, i in enumerate(ids) for j in range(N)))
        rates.append(sum(counts) / (time.perf_counter() - start))
    engine.shutdown()
    return rates


async def full_path(model_dir, texts, tok, repeats):
    import ray

    from molt_hydra.agents.base import Env, Episode, Result
    from molt_hydra.agents.step_runner import StepEnvRunner
    from molt_hydra.rollout.engine import VLLMEngine
    from molt_hydra.rollout.generation import Sampling
    from molt_hydra.rollout.generator import SamplesGenerator
    from molt_hydra.rollout.router import Router

    class OneTurn(Env):
        async def step(self, state):
            return Result(reward=1.0)

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    engine = ray.remote(VLLMEngine).options(max_concurrency=256, num_cpus=1).remote(model_dir, **ENGINE_ARGS)
    ray.get(engine.start.remote())
    router = Router([engine], timeout_s=300)
    runner = StepEnvRunner(OneTurn)

    class AgentGroups:  # the runtime's adapter: prompt row -> episodes -> (trajectory, drop reason) pairs
        async def run_group(self, row, n, sampling):
            episodes = [Episode(prompt=row["prompt"], sampling=sampling, max_length=1024) for _ in range(n)]
            outcome = await runner.run_group(episodes, router, tok)
            return [(t, None) for t in outcome.trajectories] + [
                (None, r) for r, c in outcome.failures.items() for _ in range(c)]

    sampling = Sampling(max_tokens=MAX_TOKENS, ignore_eos=True)
    rows = [{"prompt": t} for t in texts]

    async def run():
        gen = SamplesGenerator(rows, AgentGroups(), batch_size=GROUPS, n_samples_per_prompt=N, sampling=sampling)
        start = time.perf_counter()
        batch = await gen.generate_batch()
        tokens = sum(t.num_generated for g in batch.groups for t in g.trajectories)
        return tokens / (time.perf_counter() - start)

    for _ in range(WARMUP):  # also lets the Ray worker processes that ray.init starts finish their imports
        await run()
    rates = [await run() for _ in range(repeats)]
    ray.get(engine.shutdown.remote())
    ray.shutdown()
    return rates


def bench(label, model_dir, repeats):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = prompts(tok)
    raws = asyncio.run(raw_vllm(model_dir, texts, tok, repeats))
    ourss = asyncio.run(full_path(model_dir, texts, tok, repeats))
    print("raw tok/s per repeat:", [round(r) for r in raws], "\nours tok/s per repeat:", [round(r) for r in ourss])
    raw, ours = statistics.median(raws), statistics.median(ourss)
    return append_row(
        "rollout_overhead", f"{label} fp32, {GROUPS}x{N} samples x {MAX_TOKENS} tok (ignore_eos), 1 engine, "
        f"median of {repeats} after {WARMUP} warm-ups", f"raw vLLM AsyncLLM.generate {raw:.0f} tok/s (best {max(raws):.0f})",
        f"agent->generator->router->Ray engine {ours:.0f} tok/s (best {max(ourss):.0f})",
        f"ratio {ours / raw:.2f} median, {max(ourss) / max(raws):.2f} best (goal >= 0.90)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    from molt_hydra.models.tiny import resolve_model_path

    for name in args.models.split(","):
        if name == "tiny":
            bench("tiny qwen3", resolve_model_path("tiny://qwen3_tiny"), args.repeats)
        elif name == "smollm2":
            path, why = resolve_smollm2()
            if path is None:
                print(f"| skipped | rollout_overhead | SmolLM2-135M: {why} |")
            else:
                bench("SmolLM2-135M-Instruct", path, args.repeats)


if __name__ == "__main__":
    main()
