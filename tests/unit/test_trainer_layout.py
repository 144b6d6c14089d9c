"""Micro-batch layouts of the trainer (right-padded rows vs packed streams), the chunked log-prob / entropy head, and
the GPU-free parts of the NeMo AutoModel backend (mesh sizes, R3 index layout, backend choice)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from molt_hydra.models.automodel import parallel_sizes, per_layer_replay_indices, permute_tokens_all_local
from molt_hydra.models.build import resolve_backend
from molt_hydra.models.logprobs import entropy_from_logits, linear_logprobs_entropy, logprobs_from_logits
from molt_hydra.parallel.batching import pad_rows, partition_padded

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from test_validation import assert_fires  # noqa: E402


def test_partition_padded_respects_padded_budget_and_groups_similar_lengths():
    lengths = [100, 10, 90, 12, 50, 11]
    bins = partition_padded(lengths, 200)
    assert sorted(i for b in bins for i in b) == list(range(6))
    for b in bins:  # B * L_max (padding included) within budget
        assert len(b) * max(lengths[i] for i in b) <= 200
    # longest first: [100, 90] share a bin (2 x 100), then [50, 12, 11, 10] (4 x 50)
    assert sorted(map(sorted, bins)) == [[0, 2], [1, 3, 4, 5]]
    assert partition_padded([300], 200) == [[0]]  # a sample over budget gets its own bin
    # the budget's bound (>= 1) is the config's: a zero budget never reaches the trainer
    assert_fires(["train.max_tokens_per_micro_batch=0"], "train.max_tokens_per_micro_batch", "must be >= 1")


def test_pad_rows_right_pads_every_token_key():
    s = [{"input_ids": torch.tensor([5, 6, 7]), "mask": torch.tensor([0., 1., 1.]),
          "routed_experts": torch.arange(12).view(3, 2, 2)},
         {"input_ids": torch.tensor([8]), "mask": torch.tensor([1.]), "routed_experts": torch.ones(1, 2, 2).long()}]
    out = pad_rows(s)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    # routed experts pad with -1 ("unknown"): routers fall back to their own top-k and statistics skip them
    assert out["routed_experts"].shape == (2, 3, 2, 2) and (out["routed_experts"][1, 1:] == -1).all()


@pytest.mark.parametrize("chunk", [1, 5, 7, 1000])
def test_chunked_logprobs_and_entropy_equal_plain_fp32(chunk):
    g = torch.Generator().manual_seed(0)
    logits, ids, temp = torch.randn(3, 11, 50, generator=g) * 4, torch.randint(0, 50, (3, 11), generator=g), 0.7
    logp = torch.log_softmax(logits[:, :-1] / temp, -1)  # the definition, unchunked
    want_lp = torch.zeros(3, 11)
    want_lp[:, 1:] = logp.gather(-1, ids[:, 1:, None])[..., 0]
    want_ent = torch.zeros(3, 11)
    want_ent[:, 1:] = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, ids, temp, chunk), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits, ids, temp, chunk), want_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk,with_entropy", [(1, True), (4, True), (7, False), (1000, True)])
def test_fused_linear_head_equals_logits_then_logprobs_in_values_and_gradients(chunk, with_entropy):
    """The chunked lm_head + log-prob / entropy head against the definition (full logits = h @ W^T, then log_softmax),
    fp32, 1e-5: forward values and the gradients of a loss using both outputs w.r.t. hidden states and the weight."""
    g = torch.Generator().manual_seed(1)
    b, t, hdim, vocab, temp = 2, 9, 6, 40, 0.7
    ids = torch.randint(0, vocab, (b, t), generator=g)
    h0, w0 = torch.randn(b, t, hdim, generator=g), torch.randn(vocab, hdim, generator=g)
    coef_lp, coef_ent = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)

    def run(fused):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if fused:
            lp, ent = linear_logprobs_entropy(h, w, ids, temp, chunk, with_entropy)
        else:
            logits = h @ w.T
            logp = torch.log_softmax(logits[:, :-1] / temp, -1)
            lp = torch.zeros(b, t)
            lp[:, 1:] = logp.gather(-1, ids[:, 1:, None])[..., 0]
            ent = torch.zeros(b, t)
            ent[:, 1:] = -(logp.exp() * logp).sum(-1)
        loss = (coef_lp * lp).sum() + ((coef_ent * ent).sum() if with_entropy else 0.0)
        loss.backward()
        return lp, (ent if with_entropy else None), h.grad, w.grad

    got, want = run(True), run(False)
    for a, e in zip(got, want):
        if e is not None:
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    assert got[1] is None or with_entropy


@pytest.mark.parametrize("chunk,with_entropy", [(1, True), (3, False), (1000, True)])
def test_fused_head_computes_only_the_needed_tokens(chunk, with_entropy):
    """`needed`: the head's matmuls run on the needed rows only (4 vocab-wide matmuls per row: forward, recompute,
    grad_h, grad_w, counted by torch's FLOP counter), values there equal the definition (full logits, log_softmax),
    0 elsewhere, and the gradients of a loss over the needed tokens equal the definition's."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(2)
    b, t, hdim, vocab, temp = 3, 10, 6, 40, 0.8
    ids = torch.randint(0, vocab, (b, t), generator=g)
    h0, w0 = torch.randn(b, t, hdim, generator=g), torch.randn(vocab, hdim, generator=g)
    needed = torch.rand(b, t, generator=g) < 0.4
    needed[:, 0] = False  # token 0 has no prediction
    needed[2] = False  # a row with nothing needed (all prompt)
    coef_lp, coef_ent = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)

    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    with FlopCounterMode(display=False) as flops:
        lp, ent = linear_logprobs_entropy(h, w, ids, temp, chunk, with_entropy, needed=needed)
        (coef_lp * lp + (coef_ent * ent if with_entropy else 0.0)).sum().backward()
    assert flops.get_total_flops() == 4 * 2 * int(needed.sum()) * vocab * hdim

    hd, wd = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    logp = torch.log_softmax((hd @ wd.T)[:, :-1] / temp, -1)  # the definition, every token
    want_lp = torch.zeros(b, t)
    want_lp[:, 1:] = logp.gather(-1, ids[:, 1:, None])[..., 0]
    want_ent = torch.zeros(b, t)
    want_ent[:, 1:] = -(logp.exp() * logp).sum(-1)
    m = needed.float()
    (m * coef_lp * want_lp + (m * coef_ent * want_ent if with_entropy else 0.0)).sum().backward()
    torch.testing.assert_close(lp, torch.where(needed, want_lp, 0.0), atol=1e-5, rtol=1e-5)
    assert (lp[~needed] == 0).all()
    if with_entropy:
        torch.testing.assert_close(ent, torch.where(needed, want_ent, 0.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad, hd.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, wd.grad, atol=1e-5, rtol=1e-5)
    assert (h.grad[2] == 0).all() and h.grad[:, 1:].abs().sum() > 0


def test_parallel_sizes_follow_automodel_mesh_rules():
    assert parallel_sizes(8, dp=4, tp=2) == dict(dp_size=4, tp_size=2, cp_size=1, ep_size=1)
    assert parallel_sizes(8, dp=8, ep=8)["ep_size"] == 8  # experts over all data-parallel ranks
    assert parallel_sizes(4, dp=2, cp=2, ep=4)["ep_size"] == 4  # ep taken from dp x cp
    with pytest.raises(ValueError, match="trainer_devices"):
        parallel_sizes(8, dp=2, tp=2)  # 2 x 2 != 8
    with pytest.raises(ValueError, match="ep 3 must divide dp x cp = 4"):
        parallel_sizes(4, dp=4, ep=3)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        parallel_sizes(4, dp=4, tp=0)


def test_replay_indices_follow_the_gates_token_order_and_keep_unrouted_rows():
    routed = torch.tensor([[[[3, 1]], [[4, 0]]], [[[7, 2]], [[-1, -1]]]], dtype=torch.int16)  # [B=2, L=2, 1, topk=2]
    (layer0,) = per_layer_replay_indices(routed)
    # rows flattened (row 0 then row 1), as the MoE block flattens [B, L, H] -> [B*L, H]; the padded row stays -1
    assert layer0.tolist() == [[3, 1], [4, 0], [7, 2], [-1, -1]] and layer0.dtype == torch.int64
    two = per_layer_replay_indices(torch.arange(16).view(1, 2, 2, 4))
    assert [t.tolist() for t in two] == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]


def test_sync_free_permutation_groups_assignments_by_expert_and_zeroes_padding():
    """The grouped-GEMM input order: every (token, k) assignment sorted by expert, offsets = cumulative counts; an
    MoE layer computed through it equals the per-token definition sum_k w[t, k] * E_{idx[t, k]}(x[t])."""
    g = torch.Generator().manual_seed(0)
    n_tok, topk, n_exp, dim = 13, 3, 5, 4
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:topk] for _ in range(n_tok)])
    w = torch.rand(n_tok, topk, generator=g, requires_grad=True)
    mask = torch.ones(n_tok, dtype=torch.bool)
    mask[[4, 11]] = False  # padding
    x, experts = torch.randn(n_tok, dim, generator=g), torch.randn(n_exp, dim, dim, generator=g)
    token_ids, slot_ids, weights, counts, offs = permute_tokens_all_local(idx, w, mask, n_exp, return_slot_ids=True)
    assert counts.tolist() == [int((idx == e).sum()) for e in range(n_exp)]
    assert offs.tolist() == counts.cumsum(0).tolist() and offs.dtype == torch.int32
    assert (slot_ids // topk == token_ids).all() and sorted(slot_ids.tolist()) == list(range(n_tok * topk))
    expert_of_row = idx.reshape(-1)[slot_ids]
    assert (expert_of_row.diff() >= 0).all()  # grouped by expert
    y = torch.zeros(n_tok, dim)
    for e, (a, b) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist())):  # what torch._grouped_mm does
        y.index_add_(0, token_ids[a:b], weights[a:b, None] * (x[token_ids[a:b]] @ experts[e]))
    want = torch.stack([sum(w[t, k] * (x[t] @ experts[idx[t, k]]) for k in range(topk)) * mask[t]
                        for t in range(n_tok)])
    torch.testing.assert_close(y, want)
    y.sum().backward()
    assert (w.grad[~mask] == 0).all() and (w.grad[mask] != 0).all()  # padding sends no gradient to its weights


def test_backend_choice_without_gpu():
    assert resolve_backend("auto") == "hf"  # this CI has no CUDA device
    assert resolve_backend("hf") == "hf"
    with pytest.raises(RuntimeError, match="model.backend=automodel needs the nemo_automodel package and a CUDA"):
        resolve_backend("automodel")
    with pytest.raises(ValueError, match="auto, hf or automodel"):
        resolve_backend("megatron")


def test_hf_name_mapper_strips_wrappers_and_delegates_to_the_adapter():
    from torch import nn

    from molt_hydra.models.automodel import hf_name_mapper

    class Adapter:  # AutoModel's contract: one own tensor -> [(hf_name, tensor), ...]
        def convert_single_tensor_to_hf(self, fqn, tensor):
            if fqn.endswith("experts.down_projs"):
                return [(fqn.replace("down_projs", f"{e}.down_proj.weight"), tensor[e].T) for e in range(2)]
            return [(fqn, tensor)]

    plain, wrapped = nn.Module(), nn.Module()
    wrapped.state_dict_adapter = Adapter()
    t = torch.arange(12.).view(2, 3, 2)
    assert hf_name_mapper(plain)("model.layers.0._checkpoint_wrapped_module.mlp.w", t)[0][0] == "model.layers.0.mlp.w"
    out = hf_name_mapper(wrapped)("model.layers.0._orig_mod.mlp.experts.down_projs", t)
    assert [n for n, _ in out] == ["model.layers.0.mlp.experts.0.down_proj.weight",
                                   "model.layers.0.mlp.experts.1.down_proj.weight"]
    assert torch.equal(out[1][1], t[1].T)
