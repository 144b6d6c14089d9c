"""compat/automodel.py: each reach into NeMo AutoModel refuses releases it was not written for, and (where AutoModel
is installed: the GPU device) AutoModel still has the signatures and behaviour the reaches rely on."""

from __future__ import annotations

import importlib.util
from importlib import metadata

import pytest
import torch

from molt_hydra.compat import automodel as compat
from molt_hydra.models.automodel import permute_tokens_all_local

needs_automodel = pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                                     reason="needs nemo_automodel (the GPU device's install)")


def test_releases_outside_the_written_for_ones_are_refused_naming_both(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda dist: "0.8.1")
    with pytest.raises(RuntimeError, match=r"the sync-free token permutation \(molt_hydra/compat/automodel.py\) is "
                                           r"written for nemo-automodel 0\.7\.x; nemo-automodel 0\.8\.1 is installed"):
        compat.install_sync_free_permute(8, permute_tokens_all_local)

    with pytest.raises(RuntimeError, match=r"routing replay on the engine's routed tokens .* 0\.8\.1 is installed"):
        with compat.engine_routing([], replay=True):
            pass
    with pytest.raises(RuntimeError, match=r"the HF view of grouped experts .* 0\.8\.1 is installed"):
        compat.hf_views(None)

    def missing(dist):
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(RuntimeError, match="nemo-automodel is not installed"):
        compat.has_own_model_class(None)


@needs_automodel
def test_the_patched_permutation_matches_automodels_with_every_expert_local():
    import inspect

    from nemo_automodel.components.moe import experts

    compat.install_sync_free_permute(4, permute_tokens_all_local)
    original = experts._permute_tokens_for_grouped_mm._molt_original
    assert list(inspect.signature(original).parameters) == ["indices", "weights", "token_mask", "n_local_experts",
                                                            "experts_start_idx", "return_slot_ids"]
    indices = torch.tensor([[0, 2], [3, 1], [2, 0]])
    weights, mask = torch.rand(3, 2), torch.ones(3, dtype=torch.bool)
    ours = experts._permute_tokens_for_grouped_mm(indices, weights, mask, 4, 0)
    theirs = original(indices, weights, mask, 4, 0)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.float(), b.float())


@needs_automodel
def test_automodel_has_its_own_class_for_qwen3_moe():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"])
    assert compat.has_own_model_class(config)


@needs_automodel
def test_engine_routing_replays_routed_tokens_keeps_the_gates_own_elsewhere_and_reports_each_layer():
    from nemo_automodel.components.moe.router_replay import RouterReplay

    RouterReplay.clear_registry()
    gates = [RouterReplay(), RouterReplay()]
    own = torch.tensor([[0, 1], [2, 3]])
    engine = [torch.tensor([[5, 4], [-1, -1]]), torch.tensor([[6, 7], [1, 0]])]  # layer 0's token 1: unrouted
    seen = []
    with compat.engine_routing(engine, replay=True, observe=lambda *args: seen.append(args)):
        used = [gate.apply(own) for gate in gates]
    assert [u.tolist() for u in used] == [[[5, 4], [2, 3]], [[6, 7], [1, 0]]]
    assert [layer for layer, *_ in seen] == [0, 1] and torch.equal(seen[0][3], engine[0])
    with compat.engine_routing(engine, replay=False):  # R3 off: compared only
        assert all(gate.apply(own) is own for gate in gates)
    assert gates[0].apply(own) is own and not hasattr(RouterReplay.apply, "_molt_original")  # AutoModel's own again
    RouterReplay.clear_registry()


@needs_automodel
def test_an_automodel_gate_under_engine_routing_uses_the_engines_experts_where_it_routed():
    """AutoModel's own gate (Qwen3's routing: softmax, then top-k, renormalised): AutoModel's replay of an unrouted
    (-1) row indexes the scores out of range (on a GPU: the device-side assert seen on an H100); under engine_routing
    that row keeps the gate's own top-k, and every row's weights are the gate's probabilities at the experts used."""
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.layers import Gate
    from nemo_automodel.components.moe.router_replay import RouterReplay

    RouterReplay.clear_registry()
    gate = Gate(MoEConfig(n_routed_experts=8, n_shared_experts=0, n_activated_experts=2, n_expert_groups=0,
                          n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                          score_func="softmax", route_scale=1.0, dim=16, inter_dim=32, moe_inter_dim=8,
                          norm_topk_prob=True, softmax_before_topk=True, dtype=torch.float32,
                          enable_routing_replay=True))
    torch.nn.init.normal_(gate.weight, generator=torch.Generator().manual_seed(0))
    x, mask = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)), torch.ones(3, dtype=torch.bool)
    probs = torch.softmax(x @ gate.weight.T, dim=-1)
    engine = torch.tensor([[5, 1], [-1, -1], [7, 0]])  # token 1: the engine did not route it
    with compat.engine_routing([engine], replay=True):
        weights, indices, _ = gate(x, mask, None)
    used = torch.where((engine >= 0).all(-1, keepdim=True), engine, probs.topk(2).indices)
    assert torch.equal(indices, used)
    expected = probs.gather(1, used)
    assert torch.allclose(weights, expected / expected.sum(-1, keepdim=True), atol=1e-6)
    with RouterReplay.replay([engine]), pytest.raises(RuntimeError, match="out of bounds"):  # AutoModel's own
        gate(x, mask, None)
    RouterReplay.clear_registry()


@needs_automodel
def test_grouped_experts_reach_the_weight_sync_as_views_of_the_trainers_own_storage():
    """The sync's HF tensors of AutoModel's grouped experts are views of its parameters, equal to what AutoModel's
    export gives (gate = [:, :I].T, up = [:, I:].T, down = .T per expert), so the single pass can share them (before,
    the export's contiguous copies sent every AutoModel MoE down the bucketed path); the adapter is left unmarked."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
    from nemo_automodel.components.moe.config import MoEConfig
    from torch import nn

    from molt_hydra.models.automodel import hf_name_mapper
    from molt_hydra.weight_sync.buckets import local_full_weights

    experts, hidden, inter = 4, 6, 3
    moe = MoEConfig(n_routed_experts=experts, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1,
                    n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                    score_func="softmax", route_scale=1.0, dim=hidden, inter_dim=inter, moe_inter_dim=inter,
                    norm_topk_prob=True)
    model = nn.Module()
    model.state_dict_adapter = Qwen3MoeStateDictAdapter(None, moe, BackendConfig())
    model.gate_and_up_projs = nn.Parameter(torch.randn(experts, hidden, 2 * inter))
    model.down_projs = nn.Parameter(torch.randn(experts, inter, hidden))
    prefix = "model.layers.0.mlp.experts."
    views, export = hf_name_mapper(model, views=True), hf_name_mapper(model)
    for own, tensor in ((f"{prefix}gate_and_up_projs", model.gate_and_up_projs.detach()),
                        (f"{prefix}down_projs", model.down_projs.detach())):
        shared, copied = views(own, tensor), export(own, tensor)
        assert [n for n, _ in shared] == [n for n, _ in copied] and len(shared) == experts * (2 if "gate" in own else 1)
        for (name, view), (_, copy) in zip(shared, copied):
            e = int(name.split(".")[-3])
            expected = {"gate_proj": tensor[e][:, :inter].T, "up_proj": tensor[e][:, inter:].T,
                        "down_proj": tensor[e].T}[name.split(".")[-2]]
            assert torch.equal(view, expected) and torch.equal(copy, expected), name
            assert view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr(), name
    assert not getattr(model.state_dict_adapter, "_inplace_loaded_native_keys", None)  # no from_hf skips a rebuild

    class MarksInPlace:  # AutoModel's load form on CUDA: views, and the key marked for `from_hf` to skip
        _inplace_loaded_native_keys = {"earlier"}

        def convert_single_tensor_to_hf(self, fqn, tensor, for_checkpoint_load=False):
            self._inplace_loaded_native_keys.add(fqn)
            return [(fqn, tensor.T)]

    marking = MarksInPlace()
    view = compat.hf_views(marking)("w", tensor)[0][1]
    assert view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    assert marking._inplace_loaded_native_keys == {"earlier"}  # the mark undone, the adapter's own kept

    class FreshDestinations:  # a load form that hands out tensors to be filled later (not the values)
        def convert_single_tensor_to_hf(self, fqn, tensor, for_checkpoint_load=False):
            return [(fqn, torch.empty_like(tensor) if for_checkpoint_load else tensor.clone())]

    w = torch.randn(3, 2)
    (_, got), = compat.hf_views(FreshDestinations())("w", w)
    assert torch.equal(got, w)  # the export form's values, not an uninitialized destination

    # the state walk names the parameters by their attribute: map them under the layer's prefix
    def under_prefix(to_hf):
        return lambda name, t: to_hf(prefix + name, t)

    assert local_full_weights(model, to_hf=under_prefix(hf_name_mapper(model))) is None  # copies: the bucketed path
    shared = local_full_weights(model, to_hf=under_prefix(views))
    assert len(shared) == 3 * experts


@needs_automodel
def test_clipping_off_still_measures_the_gradient_norm():
    """max_grad_norm=0 (clipping off) must still give the norm: the trainer's non-finite check and actor_grad_norm
    read it (AutoModel's None skips the norm and returns 0.0)."""
    import math
    import types

    from molt_hydra.models.automodel import clip_grad_norm

    layer = torch.nn.Linear(3, 2)
    layer._molt_mesh = types.SimpleNamespace(moe_mesh=None, device_mesh=None)
    layer.weight.grad, layer.bias.grad = torch.full((2, 3), 2.0), torch.full((2,), 1.0)
    norm = math.sqrt(6 * 2.0 ** 2 + 2 * 1.0 ** 2)
    assert float(clip_grad_norm(layer, 0.0, 1)) == pytest.approx(norm)
    assert torch.equal(layer.weight.grad, torch.full((2, 3), 2.0))  # not clipped
    layer.bias.grad = torch.tensor([float("nan"), 1.0])
    assert math.isnan(float(clip_grad_norm(layer, 0.0, 1)))  # what the step's check refuses
    layer.weight.grad, layer.bias.grad = torch.full((2, 3), 2.0), torch.full((2,), 1.0)
    assert float(clip_grad_norm(layer, 1.0, 1)) == pytest.approx(norm)
    assert layer.weight.grad[0, 0].item() == pytest.approx(2.0 / norm, rel=1e-5)  # clipped to norm 1
