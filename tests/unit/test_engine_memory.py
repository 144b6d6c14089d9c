"""Engine memory: `rollout.kv_cache_gb` sizes the KV cache of CPU engines only, `rollout.gpu_memory_utilization` that
of GPU engines (vLLM's own rule), and the dry-run plan estimates it the same way."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.runtime.validate import validate  # noqa: E402
from molt_hydra.rollout.engine import VLLMEngine  # noqa: E402
from molt_hydra.runtime.plan import make_plan  # noqa: E402


@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu", "gpu"])
def test_engine_passes_only_the_memory_knob_of_its_platform(monkeypatch, tiny_model, on_cpu):
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    captured = {}
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: on_cpu)
    # vLLM's GPU build cannot be installed here: the GPU platform is faked, so is its version check's answer
    monkeypatch.setattr("molt_hydra.compat.vllm.check_installed",
                        lambda device: "0.24.0" if device == "cuda" else "0.32.0")

    class Front:  # what start() uses of the AsyncLLM it builds: the arguments, and the weight-version label
        model_config = SimpleNamespace(hf_config=SimpleNamespace())  # (a text model: no image placeholder)

        def __init__(self, args):
            captured["a"] = args

        async def update_weight_version(self, version):
            captured["version"] = version

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, args: Front(args)))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "untouched")
    asyncio.run(VLLMEngine(tiny_model, kv_cache_gb=2.5, gpu_memory_utilization=0.7).start())
    args = captured["a"]
    assert args.kv_cache_memory_bytes is None  # never pinned: it would override gpu_memory_utilization on GPU
    assert args.gpu_memory_utilization == 0.7
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == ("3" if on_cpu else "untouched")  # ceil(2.5) GiB on CPU
    assert captured["version"] == "0"  # the engine core stamps what it samples with the policy version


def engine_memory(overrides: list[str]) -> dict:
    cfg = validate(OmegaConf.to_object(compose_config(overrides)))
    return make_plan(cfg).memory["rollout engine"]


def test_plan_sizes_the_kv_cache_like_the_engine():
    cpu = engine_memory(["rollout.kv_cache_gb=3"])
    assert cpu["kv cache"] == 3
    gpu = engine_memory(["cluster=local_gpus", "parallelism.trainer_devices=1", "rollout.gpu_memory_utilization=0.5"])
    assert gpu["kv cache"] == pytest.approx(0.5 * 80 - gpu["weights"])  # local_gpus: 80 GiB per device
