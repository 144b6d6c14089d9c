"""Run by test_uni_engine.py in a fresh interpreter (this process's first engine starts the forkserver): starts an
engine, reports its process tree as JSON, then starts a second one whose KV cache size differs from the server's."""

import asyncio
import json
import logging
import os
import sys

import psutil

from molt_hydra.rollout.engine import VLLMEngine
from molt_hydra.rollout.generation import GenerationRequest, Sampling


def tree(engine_core_only: bool = False) -> list[dict]:
    out = []
    for p in psutil.Process().children(recursive=True):
        if engine_core_only and p.name() != "VLLM::EngineCore":
            continue
        try:
            out.append({"pid": p.pid, "ppid": p.ppid(), "name": p.name(), "cmdline": " ".join(p.cmdline()),
                        "env": {k: v for k, v in p.environ().items() if k in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE")},
                        "vllm_ext": any("vllm/_C" in m.path for m in p.memory_maps())})
        except psutil.Error:  # a process that ended meanwhile
            pass
    return out


def main(model: str) -> None:
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("molt_hydra.compat.vllm").addHandler(handler)
    args = dict(dtype="float32", enforce_eager=True, max_model_len=256,
                extra_engine_args={"distributed_executor_backend": "uni"})
    first, second = VLLMEngine(model, kv_cache_gb=1, **args), VLLMEngine(model, kv_cache_gb=2, **args)

    async def run():
        await first.start()
        (out,) = await first.generate(GenerationRequest("f", [1, 5, 17, 42], Sampling(max_tokens=4, ignore_eos=True)))
        report = {"tokens": out.token_ids, "first": tree()}
        first.shutdown()
        await second.start()  # the server's VLLM_CPU_KVCACHE_SPACE is the first engine's: vLLM's spawn
        report.update(second=tree(engine_core_only=True), warnings=warnings, pid=os.getpid())
        second.shutdown()
        return report

    print("REPORT " + json.dumps(asyncio.run(run())), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
