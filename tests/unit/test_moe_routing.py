"""MoE routing in the trainer (models/moe_routing.py) on transformers' Qwen3-MoE blocks: R3 replay with a live gate,
gate precision, router freeze, routing statistics. Module level, no engine."""

import math

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from molt_hydra.models import moe_routing


def _router(hidden=3, experts=4, top_k=2, norm=True, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm,
                         moe_intermediate_size=4)
    parent = torch.nn.Module()
    parent.layers = torch.nn.ModuleList([torch.nn.Module()])
    parent.layers[0].mlp = torch.nn.Module()
    parent.layers[0].mlp.gate = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(parent.layers[0].mlp.gate.weight)
    return parent, parent.layers[0].mlp.gate


def test_replayed_gate_gradient_matches_hand_derivation():
    model, gate = _router()
    moe_routing.install(model, "float32", replay=True)
    x = torch.tensor([[0.3, -1.2, 0.7]])
    z = (x @ gate.weight.detach().T)[0]
    own = set(torch.topk(z, 2).indices.tolist())
    a, b = [e for e in range(4) if e not in own]  # replay the two experts the trainer would NOT pick
    with moe_routing.engine_routing(model, torch.tensor([[[a, b]]])):
        _, weights, used = gate(x)
    assert used.tolist() == [[a, b]]
    c = torch.tensor([2.0, -0.5])  # L = c0 * w_a + c1 * w_b
    (weights[0] * c).sum().backward()
    # w_a = p_a / (p_a + p_b) = sigmoid(z_a - z_b): dL/dz_a = (c0 - c1) w_a w_b = -dL/dz_b, 0 for other experts
    wa = 1 / (1 + math.exp(-(z[a] - z[b]).item()))
    dz = torch.zeros(4)
    dz[a], dz[b] = (c[0] - c[1]) * wa * (1 - wa), -(c[0] - c[1]) * wa * (1 - wa)
    expected = dz[:, None] * x  # dL/dW = dL/dz outer x
    assert gate.weight.grad.abs().sum() > 0
    torch.testing.assert_close(gate.weight.grad, expected, rtol=1e-5, atol=1e-7)


def test_unknown_rows_use_own_topk_and_without_replay_engine_is_only_compared():
    model, gate = _router()
    moe_routing.install(model, "float32", replay=False)
    x = torch.randn(5, 3)
    own = torch.topk(x @ gate.weight.detach().T, 2).indices
    engine = torch.tensor([[0, 1]] * 5)
    stats = moe_routing.RoutingStats(1, 4)
    with moe_routing.engine_routing(model, engine[:, None], stats):
        _, _, used = gate(x)
    assert torch.equal(used, own)  # no replay: the trainer's own choice
    same = (own.sort(-1).values == torch.tensor([0, 1])).all(-1).float().mean().item()
    assert stats.metrics()["routing/agreement"] == pytest.approx(same)

    gate.replay = True
    engine[2] = -1  # the engine did not route this token (e.g. the last generated one)
    with moe_routing.engine_routing(model, engine[:, None]):
        _, _, used = gate(x)
    assert used[2].tolist() == own[2].tolist() and used[[0, 1, 3, 4]].tolist() == [[0, 1]] * 4


def test_replay_forward_matches_block_forced_to_the_same_experts():
    """The MoE block output under replay equals the HF block whose router returns those experts with renormalised
    softmax weights (what vLLM's fused MoE computes for norm_topk_prob)."""
    cfg = Qwen3MoeConfig(hidden_size=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                         norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(1, 6, 8)
    forced = torch.randint(0, 8, (6,))
    forced = torch.stack([forced, (forced + 3) % 8], -1)
    probs = torch.softmax(x[0] @ block.gate.weight.T, -1)
    w = probs.gather(-1, forced)
    w = w / w.sum(-1, keepdim=True)
    expected = block.experts(x[0], forced, w)[None]
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].mlp = block
    moe_routing.install(holder, "float32", replay=True)
    with moe_routing.engine_routing(holder, forced[None, :, None]):
        out = block(x)
    torch.testing.assert_close(out, expected)


def _tiny_moe_lm(layers=2, experts=8, top_k=2):
    from transformers import Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=experts, num_experts_per_tok=top_k, output_router_logits=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    for r in moe_routing.install(model, "float32", replay=True):
        torch.nn.init.normal_(r.weight)  # distinct router probabilities: top-k ties would make "own" ambiguous
    return model


def test_load_balancing_loss_without_replay_is_transformers_own():
    model, ids = _tiny_moe_lm(), torch.randint(0, 32, (2, 5))
    with moe_routing.load_balancing(model) as balance:
        hf = model(input_ids=ids).aux_loss  # transformers' load_balancing_loss_func on the router logits
    torch.testing.assert_close(balance.value(), hf)


def test_load_balancing_loss_counts_the_replayed_experts():
    model, ids = _tiny_moe_lm(), torch.randint(0, 32, (1, 6))
    routed = torch.stack([torch.arange(6) % 8, (torch.arange(6) + 4) % 8], -1)  # [tokens, top_k], every layer
    routed = routed[None, :, None].expand(1, 6, 2, 2)
    captured = []
    for r in moe_routing.routers(model):
        r.register_forward_hook(lambda m, args, out: captured.append(torch.softmax(out[0], -1)))
    with moe_routing.engine_routing(model, routed), moe_routing.load_balancing(model) as balance:
        hf = model(input_ids=ids).aux_loss
    # E * sum_e f_e P_e over both layers' 12 rows: f_e = the replayed selections of e / rows, P_e = the mean softmax
    probs = torch.cat(captured)
    f = torch.bincount(routed.reshape(-1), minlength=8).float() / probs.shape[0]
    expected = 8 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(balance.value(), expected.detach())
    assert not torch.allclose(balance.value(), hf)  # HF's counts the trainer's own top-k instead
    balance.value().backward()  # the gate learns through P
    assert all(r.weight.grad.abs().sum() > 0 for r in moe_routing.routers(model))


def test_padding_counts_in_neither_the_load_balancing_loss_nor_the_routing_statistics():
    """Right-padded rows (the trainer's default micro-batches): the padding's router rows counted in the balancing
    loss and the load / probability statistics. Expected: transformers' `load_balancing_loss_func` given the
    attention mask, and the statistics of the same two samples run unpadded (one row each)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from molt_hydra.parallel.batching import pad_rows
    model = _tiny_moe_lm()
    samples = [{"input_ids": torch.randint(1, 32, (n,), generator=torch.Generator().manual_seed(n))} for n in (7, 3)]
    mb = pad_rows(samples)
    assert mb["real_tokens"].tolist() == [[True] * 7, [True] * 3 + [False] * 4]
    padded = moe_routing.routing_stats(model.config)
    with moe_routing.engine_routing(model, None, padded, real_tokens=mb["real_tokens"]), \
            moe_routing.load_balancing(model) as balance:
        res = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"])
    hf = load_balancing_loss_func(res.router_logits, 8, 2, mb["real_tokens"].long())
    torch.testing.assert_close(balance.value(), hf)
    assert not torch.allclose(hf, load_balancing_loss_func(res.router_logits, 8, 2))  # the padding would move it
    alone = moe_routing.routing_stats(model.config)
    with torch.no_grad(), moe_routing.engine_routing(model, None, alone):
        for s in samples:
            model(input_ids=s["input_ids"][None])
    got, want = padded.metrics(), alone.metrics()
    assert set(got) == set(want) == {"routing/aux_loss", "routing/expert_load_entropy"}
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6), k


@pytest.mark.parametrize("precision,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_gate_precision_under_bf16_compute(precision, dtype):
    model, gate = _router(hidden=16, experts=8)
    model.to(torch.bfloat16)  # bf16 weights and activations, as under FSDP2's bf16 mixed precision
    moe_routing.install(model, precision)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    logits, weights, _ = gate(x)
    assert logits.dtype == dtype
    assert weights.dtype == torch.bfloat16  # combine weights follow the activations
    if precision == "float32":
        exact = x.float() @ gate.weight.float().T
        torch.testing.assert_close(logits, exact, rtol=1e-6, atol=1e-6)  # an fp32 matmul, not a rounded bf16 one


def test_freeze_names_router_weights_only():
    model, gate = _router()
    model.other = torch.nn.Linear(2, 2)
    assert moe_routing.freeze(model) == ["layers.0.mlp.gate.weight"]
    assert not gate.weight.requires_grad and model.other.weight.requires_grad


def test_routing_metrics_from_definitions():
    stats = moe_routing.RoutingStats(num_layers=2, num_experts=4)
    probs = torch.full((2, 4), 0.25)
    own = torch.tensor([[0, 1], [2, 3]])
    # layer 0: both tokens match the engine; layer 1: one of two
    stats.add(0, probs, own, own, torch.tensor([[1, 0], [2, 3]]))
    stats.add(1, probs, own, own, torch.tensor([[0, 1], [0, 3]]))
    m = stats.metrics()
    assert m["routing/agreement"] == pytest.approx(3 / 4)
    assert m["routing/agreement_worst_layer"] == pytest.approx(1 / 2)
    # a layer that saw tokens none of which the engine routed is left out of the worst layer, not a 0
    partial = moe_routing.RoutingStats(num_layers=3, num_experts=4)
    partial.add(0, probs, own, own, torch.tensor([[1, 0], [2, 3]]))
    partial.add(1, probs, own, own, torch.tensor([[0, 1], [0, 3]]))
    partial.add(2, probs, own, own, torch.full((2, 2), -1))
    assert partial.metrics()["routing/agreement_worst_layer"] == pytest.approx(1 / 2)
    # every expert got 1/4 of the selections and mean prob 1/4: E * sum f P = 4 * 4 * 1/16 = 1, entropy = log 4
    assert m["routing/aux_loss"] == pytest.approx(1.0)
    assert m["routing/expert_load_entropy"] == pytest.approx(1.0)


def test_replayed_counts_the_experts_used_against_the_engines():
    stats = moe_routing.RoutingStats(num_layers=1, num_experts=4)
    probs, engine = torch.full((3, 4), 0.25), torch.tensor([[1, 0], [2, 3], [-1, -1]])  # the last token: unrouted
    own = torch.tensor([[0, 2], [2, 3], [0, 1]])
    stats.add(0, probs, own, torch.tensor([[0, 1], [3, 2], [0, 1]]), engine)  # R3: used = engine where known
    assert stats.metrics()["routing/replayed"] == 1.0  # both routed tokens used the engine's pair (any order)
    assert stats.metrics()["routing/agreement"] == 0.5  # the router itself agreed on one of the two
    off = moe_routing.RoutingStats(num_layers=1, num_experts=4)
    off.add(0, probs, own, own, engine)  # no replay: used = own
    assert off.metrics()["routing/replayed"] == off.metrics()["routing/agreement"] == 0.5


def test_gates_without_probabilities_count_agreement_and_load_but_no_balancing_loss():
    """AutoModel's gates report selections only (compat/automodel.py `engine_routing`): agreement, replayed share and
    load entropy from them; no load-balancing loss, which needs the router probabilities."""
    stats = moe_routing.RoutingStats(num_layers=1, num_experts=4)
    own, engine = torch.tensor([[0, 1], [2, 3], [0, 2]]), torch.tensor([[1, 0], [2, 1], [-1, -1]])
    stats.add(0, None, own, torch.tensor([[1, 0], [2, 1], [0, 2]]), engine)
    m = stats.metrics()
    assert m["routing/agreement"] == 0.5 and m["routing/replayed"] == 1.0  # of the 2 routed tokens
    assert "routing/aux_loss" not in m
    load = torch.tensor([2.0, 2.0, 2.0, 0.0]) / 6  # experts used: 1,0 / 2,1 / 0,2
    expected = float(-(load[:3] * load[:3].log()).sum() / math.log(4))
    assert m["routing/expert_load_entropy"] == pytest.approx(expected)


def test_automodel_gates_count_expert_loads_over_real_tokens_only(monkeypatch):
    """models/automodel.py `replay_routed_experts` on right-padded rows (AutoModel's only micro-batches): the gates'
    statistics skip the padding, as the HF routers' (above). Before: no mask reached them, and each padding token's own
    top-k counted in the expert loads. AutoModel's gates are a stand-in here (nemo_automodel is the GPU device's
    install): each reports its own top-k and the experts used, as compat/automodel.py `engine_routing` has them do."""
    from contextlib import contextmanager

    from molt_hydra.compat import automodel as automodel_compat
    from molt_hydra.models.automodel import replay_routed_experts
    from molt_hydra.parallel.batching import pad_rows

    own = torch.full((6, 1), 3)  # every token's own top-1 is expert 3 (2 rows of 3 tokens, flattened)

    @contextmanager
    def gates(per_layer, *, replay, observe=None):
        for layer, engine in enumerate(per_layer):
            observe(layer, own, torch.where((engine >= 0).all(-1, keepdim=True), engine, own) if replay else own,
                    engine)
        yield

    monkeypatch.setattr(automodel_compat, "engine_routing", gates)
    samples = [{"input_ids": torch.ones(3, dtype=torch.long), "routed_experts": torch.tensor([[[0]], [[1]], [[-1]]])},
               {"input_ids": torch.ones(1, dtype=torch.long), "routed_experts": torch.tensor([[[2]]])}]
    mb = pad_rows(samples)  # row 1: one token, then 2 of padding (routed -1: their own expert 3 is used)
    stats = moe_routing.RoutingStats(num_layers=1, num_experts=4)
    with replay_routed_experts(mb["routed_experts"], stats=stats, real_tokens=mb["real_tokens"]):
        pass
    # the experts the 4 real tokens used: 0, 1, 3 (row 0's last: not routed, its own), 2
    assert stats.sums["load"][0].tolist() == [1.0, 1.0, 1.0, 1.0] and stats.sums["tokens"].tolist() == [4.0]
    assert stats.metrics()["routing/expert_load_entropy"] == pytest.approx(1.0)  # a uniform load


def test_routing_travels_with_tokens_through_experience_collate_and_packing():
    from molt_hydra.agents.base import Trajectory
    from molt_hydra.algorithm.experience import collate
    from molt_hydra.parallel.batching import pack
    from molt_hydra.rollout.generation import Generation
    from molt_hydra.algorithm.experience import to_experience

    traj = Trajectory()
    traj.append_feedback([5, 6, 7])
    # the engine routes every computed position: prompt + generated but the last token (2 layers, top-2)
    rows = [[[p, p + 1], [p + 2, p + 3]] for p in range(4)]
    traj.append_action(Generation(token_ids=[8, 9], logprobs=[-1.0, -2.0], versions=[0, 0], finish_reason="stop",
                                  routed_experts=rows))
    exp, reason = to_experience(traj, max_len=16)
    assert reason is None
    assert exp.routed_experts.shape == (5, 2, 2)
    assert exp.routed_experts[:4].tolist() == rows and (exp.routed_experts[4] == -1).all()
    short = to_experience(Trajectory(token_ids=[1, 2], logprobs=[0.0, -1.0], versions=[-1, 0],
                                     action_ranges=[(1, 2)]), max_len=16)[0]
    batch = collate([exp, short])
    assert batch.routed_experts.shape == (2, 5, 2, 2)
    assert (batch.routed_experts[1] == -1).all() and torch.equal(batch.routed_experts[0], exp.routed_experts)
    packed = pack([{"input_ids": exp.token_ids, "routed_experts": exp.routed_experts},
                   {"input_ids": exp.token_ids[:2], "routed_experts": exp.routed_experts[:2]}])
    assert packed["routed_experts"].shape == (1, 7, 2, 2)
    assert torch.equal(packed["routed_experts"][0, 5:], exp.routed_experts[:2])


def test_fused_experts_travel_under_the_checkpoints_per_expert_names(tiny_moe_model):
    """What the trainer syncs and exports (parallel/trainer.py `_to_hf`): transformers 5 fuses each layer's experts,
    the checkpoint (and every vLLM loader: 0.24 silently drops fused names) names them per expert."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32)
    state = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # fused in the model
    sent = dict(pair for name, t in state.items() for pair in moe_routing.checkpoint_expert_tensors(name, t))
    checkpoint = {k: v for f in Path(tiny_moe_model).glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(sent) - {"lm_head.weight"} == set(checkpoint) - {"lm_head.weight"}  # tied head: the sync skips it
    for name, t in checkpoint.items():
        assert torch.equal(sent[name], t), name
    fused = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert sent["model.layers.1.mlp.experts.5.up_proj.weight"].data_ptr() == fused[5, fused.shape[1] // 2:].data_ptr()


def test_the_balancing_loss_gradient_reaches_real_rows_only():
    """E * sum_e f_e * P_e over the 3 real rows of 5: d/dprobs[i, e] = E * f_e / 3 on a real row, 0 on padding."""
    probs = torch.rand(5, 4).softmax(-1).requires_grad_()
    used = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    balance = moe_routing.LoadBalancingLoss(num_experts=4)
    balance.add(probs, used, torch.tensor([1, 1, 1, 0, 0]))
    balance.value().backward()
    f = torch.tensor([1.0, 2.0, 2.0, 1.0]) / 3  # selections per expert over the real rows, per row
    expected = torch.cat([(4 * f / 3).expand(3, 4), torch.zeros(2, 4)])
    torch.testing.assert_close(probs.grad, expected)
