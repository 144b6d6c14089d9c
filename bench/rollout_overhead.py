"""Tokens/s of the full path (StepEnvRunner agent -> SamplesGenerator -> Router -> Ray engine actor) divided by raw
vLLM `AsyncLLM.generate` on the same prompts, sampling and engine settings, measured in this process, for the tiny
Qwen3 and (when `smollm2://` resolves) SmolLM2-135M-Instruct. Both engines are built as a run builds its engines: the
run config composed as `molt-run` composes it (the default recipe; `model=smollm2_135m` for SmolLM2), Ray started by
`init_ray`, each engine's arguments from `runtime/roles.py engine_args` (so `rollout.executor=auto`: uni for this
one-worker CPU engine), and raw vLLM gets the sampling parameters our engine sends (finished output only, no text).
Both paths run with Ray up and are alternated pair by pair; the row gives the median of the
per-pair ratios and their spread, the engine processes' niceness and the load average. Appends one row per model to
RESULTS.md.

    flock /tmp/molt_heavy.lock .venv/bin/python bench/rollout_overhead.py [--models tiny,smollm2] [--repeats 10]
"""

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row, resolve_smollm2  # noqa: E402

GROUPS, N, MAX_TOKENS = 16, 4, 64
WARMUP = 3
MODEL_OVERRIDES = {"tiny": [], "smollm2": ["model=smollm2_135m"]}


def run_config(model: str):
    """The run config `molt-run` would compose for this model (the default recipe otherwise)."""
    import tempfile

    from molt_hydra.cli import compose_checked, to_run_config
    from molt_hydra.runtime.validate import validate

    composed, problems = compose_checked([f"output_dir={tempfile.mkdtemp(prefix='molt_bench_rollout_')}",
                                          *MODEL_OVERRIDES[model]])
    if problems:
        raise ValueError("\n".join(problems))
    return validate(to_run_config(composed))


def prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": f"What is {i}+{i * 3}?"}], tokenize=False,
                                    add_generation_prompt=True) for i in range(GROUPS)]


def niceness_of_engines() -> str:
    """Niceness of every vLLM engine process this run started (the raw engine's and the Ray engine's)."""
    import psutil

    seen = []
    for p in psutil.Process().children(recursive=True):
        try:
            name = " ".join(p.cmdline())[:40] if p.name() == "python" else p.name()
            if "VLLM" in name or "VLLMEngine" in name:
                seen.append(f"{name.split()[0]} nice {p.nice()}")
        except psutil.Error:
            pass
    return ", ".join(sorted(seen))


async def measure(cfg, model_dir, texts, tok, repeats):
    """Raw vLLM and the full path, alternated repeat by repeat (the order flips each time) so the noise of a shared
    machine hits both alike. Both run with Ray's daemons up: the same background processes in both."""
    import ray
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from molt_hydra.agents.base import Env, Episode, Result
    from molt_hydra.agents.step_runner import StepEnvRunner
    from molt_hydra.rollout.engine import VLLMEngine
    from molt_hydra.rollout.generation import Sampling
    from molt_hydra.rollout.generator import SamplesGenerator
    from molt_hydra.rollout.router import Router

    from molt_hydra.runtime.roles import engine_args, init_ray

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Ray's workers inherit this process's environment
    init_ray(cfg)  # as a run starts it
    args = engine_args(cfg, model_dir, capture_routing=False, index=0)
    raw_engine = VLLMEngine(**args)
    await raw_engine.start()
    llm = raw_engine._llm
    # What our engine sends vLLM for these requests (rollout/engine.py `_outputs`): the finished completion only, token
    # ids without text; so the ratio is the cost of our path alone, not of a different way of calling vLLM.
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, temperature=1.0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    async def one(prompt_ids, rid):
        async for out in llm.generate({"prompt_token_ids": prompt_ids}, params, request_id=rid):
            pass
        return len(out.outputs[0].token_ids)

    async def raw(tag):
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, f"{tag}-{k}-{j}") for k, i in enumerate(ids) for j in range(N)))
        return sum(counts) / (time.perf_counter() - start)

    class OneTurn(Env):
        async def step(self, state):
            return Result(reward=1.0)

    engine = ray.remote(VLLMEngine).options(num_cpus=0).remote(**args)  # as runtime/roles.py places it
    ray.get(engine.start.remote())
    router = Router([engine], timeout_s=300)
    runner = StepEnvRunner(OneTurn)

    class AgentGroups:  # the runtime's adapter: prompt row -> episodes -> (trajectory, drop reason) pairs
        async def run_group(self, row, n, sampling):
            episodes = [Episode(prompt=row["prompt"], sampling=sampling, max_length=cfg.data.max_len)
                        for _ in range(n)]
            outcome = await runner.run_group(episodes, router, tok)
            return [(t, None) for t in outcome.trajectories] + [
                (None, r) for r, c in outcome.failures.items() for _ in range(c)]

    sampling = Sampling(max_tokens=MAX_TOKENS, ignore_eos=True)
    rows = [{"prompt": t} for t in texts]

    async def ours(tag):
        gen = SamplesGenerator(rows, AgentGroups(), batch_size=GROUPS, n_samples_per_prompt=N, sampling=sampling)
        start = time.perf_counter()
        batch = await gen.generate_batch()
        tokens = sum(t.num_generated for g in batch.groups for t in g.trajectories)
        return tokens / (time.perf_counter() - start)

    for w in range(WARMUP):  # also lets the Ray worker processes that ray.init starts finish their imports
        await raw(f"w{w}")
        await ours(f"w{w}")
    nice = niceness_of_engines()
    raws, ourss = [], []
    for r in range(repeats):
        for path in ((raw, ours) if r % 2 == 0 else (ours, raw)):
            (raws if path is raw else ourss).append(await path(f"r{r}"))
    ray.get(engine.shutdown.remote())
    raw_engine.shutdown()
    ray.shutdown()
    return raws, ourss, nice


def bench(label, model, repeats):
    from transformers import AutoTokenizer

    from molt_hydra.models.build import resolve_path
    from molt_hydra.runtime.roles import engine_args

    cfg = run_config(model)
    model_dir = resolve_path(cfg.model.path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    raws, ourss, nice = asyncio.run(measure(cfg, model_dir, prompts(tok), tok, repeats))
    r = cfg.rollout
    executor = engine_args(cfg, model_dir, False, 0)["extra_engine_args"].get("distributed_executor_backend", "auto")
    ratios = sorted(o / r for o, r in zip(ourss, raws))  # each pair measured back to back
    print("raw tok/s per repeat:", [round(r) for r in raws], "\nours tok/s per repeat:", [round(r) for r in ourss],
          "\nengine processes:", nice)
    raw, ours = statistics.median(raws), statistics.median(ourss)
    load = os.getloadavg()
    return append_row(
        "rollout_overhead", f"{label} {r.dtype.value}, engine as a run builds it (executor {executor}, "
        f"enforce_eager {r.enforce_eager}, kv {r.kv_cache_gb} GB), {GROUPS}x{N} samples x {MAX_TOKENS} tok "
        f"(ignore_eos), 1 engine, {repeats} alternated pairs after {WARMUP} warm-ups, Ray up in both; {nice}",
        f"raw vLLM AsyncLLM.generate {raw:.0f} tok/s median",
        f"agent->generator->router->Ray engine {ours:.0f} tok/s median",
        f"ratio {statistics.median(ratios):.2f} median of pairs (min {ratios[0]:.2f}, max {ratios[-1]:.2f}; "
        f"goal >= 0.90)", note=f"load avg {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--repeats", type=int, default=10)
    args, _ = p.parse_known_args()  # --no-append is read by _common.append_row
    for name in args.models.split(","):
        if name == "tiny":
            bench("tiny qwen3", "tiny", args.repeats)
        elif name == "smollm2":
            path, why = resolve_smollm2()
            if path is None:
                print(f"| skipped | rollout_overhead | SmolLM2-135M: {why} |")
            else:
                bench("SmolLM2-135M-Instruct", "smollm2", args.repeats)


if __name__ == "__main__":
    main()
