"""NeMo AutoModel backend on one GPU (run on the device: `scripts/gpu_device.sh`): a Qwen3-MoE with the real layer
shapes of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert FFN 768; 2 layers, 32k vocab) saved once as an HF
checkpoint; the project's TrainerWorker on `backend=automodel` against `backend=hf` on the same weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None, reason="needs nemo_automodel")]

SHAPE = dict(vocab_size=32768, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
             norm_topk_prob=True, decoder_sparse_step=1, tie_word_embeddings=False, max_position_embeddings=4096,
             rope_theta=1e6, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import transformers
    d = tmp_path_factory.mktemp("qwen3moe")
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE)).to(torch.float32)
    m.save_pretrained(d)
    # the checkpoint layout vLLM loads: one weight per expert (transformers 5 fuses them only in memory)
    names = {k: tuple(v.shape) for k, v in m.state_dict().items() if ".mlp.experts." not in k}
    h, i = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"]
    for layer in range(SHAPE["num_hidden_layers"]):
        for e in range(SHAPE["num_experts"]):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            names.update({p + "gate_proj.weight": (i, h), p + "up_proj.weight": (i, h), p + "down_proj.weight": (h, i)})
    del m
    torch.cuda.empty_cache()
    return str(d), names


def _samples(n=4, seed=0, vocab=SHAPE["vocab_size"]):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 16 + 8 * i, 48 + 16 * i
        ids = torch.randint(0, vocab, (p + r,), generator=g)
        mask = torch.cat([torch.zeros(p), torch.ones(r)])
        out.append({"input_ids": ids, "action_mask": mask, "advantages": torch.randn(p + r, generator=g) * mask,
                    "old_logprobs": torch.zeros(p + r)})
    return out


def _worker(path, backend, **kw):
    from molt_hydra.parallel.launch import free_port
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    import torch.distributed as dist
    port = free_port() if not dist.is_initialized() else 0
    return TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=port, model_path=path, backend=backend, lr=1e-4,
                                     param_dtype="bf16", max_tokens_per_micro_batch=1024, timeout_s=300, **kw))


@pytest.fixture(scope="module")
def am(ckpt):
    return _worker(ckpt[0], "automodel", routing_replay=True)


def test_logprobs_match_hf_backend(ckpt, am):
    samples = _samples()
    hf = _worker(ckpt[0], "hf", config_overrides={"_experts_implementation": "grouped_mm"})
    ref = hf.compute_logprobs(samples)
    del hf
    torch.cuda.empty_cache()
    got = am.compute_logprobs(samples)
    diffs = torch.cat([(a - b)[1:].abs() for a, b in zip(got, ref)])
    print(f"AutoModel vs HF log-probs (bf16): mean |diff| {diffs.mean():.4f}, p99 {diffs.quantile(0.99):.4f}, "
          f"max {diffs.max():.4f}; mean log p {torch.cat(ref).mean():.3f}")
    # bf16 compute, fp32 gate on AutoModel: a few near-tie routing flips are expected, the bulk is rounding
    assert diffs.mean() < 0.05 and diffs.quantile(0.99) < 0.5


def test_weight_sync_and_export_use_hf_names(ckpt, am, tmp_path):
    import transformers
    path, names = ckpt
    got = {n: tuple(t.shape) for bucket in am.weight_buckets(1 << 30, dtype=torch.bfloat16, device="cuda")
           for n, t in bucket}
    assert got == names  # experts un-grouped: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
    out = am.export_hf(str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).cuda()
    ids = _samples(1)[0]["input_ids"][None].cuda()
    with torch.no_grad():
        hf_lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    am_lp = am.compute_logprobs([{"input_ids": ids[0].cpu()}])[0][1:].cuda()
    d = (hf_lp - am_lp).abs()
    print(f"exported checkpoint in transformers vs AutoModel: mean |dlogp| {d.mean():.4f} max {d.max():.4f}")
    assert d.mean() < 0.05


def test_r3_replay_reproduces_recorded_selection(am):
    from nemo_automodel.components.moe.router_replay import RouterReplay
    sample = _samples(1, seed=3)[0]
    ids = sample["input_ids"][None].cuda()
    with torch.no_grad(), RouterReplay.record():
        am.model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device="cuda")[None])
    recorded = [x.clone() for x in RouterReplay.collect()]
    assert len(recorded) == SHAPE["num_hidden_layers"] and recorded[0].shape == (ids.shape[1], 8)
    # a selection the gates would not pick themselves: each token's experts shifted by 1 (mod 128)
    target = torch.stack([(x + 1) % SHAPE["num_experts"] for x in recorded], dim=1).cpu()  # [T, layers, topk]
    used = []
    orig = RouterReplay.apply

    def spy(self, indices):
        out = orig(self, indices)
        used.append(out.detach().clone())
        return out

    RouterReplay.apply = spy
    try:
        am.compute_logprobs([{"input_ids": sample["input_ids"], "routed_experts": target}])
    finally:
        RouterReplay.apply = orig
    # every gate call returned the replayed selection of its layer, and every layer was replayed
    hit = [next(i for i in range(target.shape[1]) if torch.equal(u.cpu(), target[:, i].long())) for u in used]
    assert sorted(set(hit)) == list(range(SHAPE["num_hidden_layers"]))


def test_rl_training_steps(am):
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    samples = _samples(8, seed=5)
    for s, lp in zip(samples, am.compute_logprobs(samples)):
        s["old_logprobs"] = lp * s["action_mask"]
    obj = ActorObjective(PolicyLoss("ppo", clip_eps_low=0.2, clip_eps_high=0.2))
    before = am.compute_logprobs(samples[:1])[0]
    metrics = [am.train_step(samples, obj) for _ in range(3)]
    after = am.compute_logprobs(samples[:1])[0]
    print("AutoModel RL steps:", [(round(m["policy_loss"], 5), round(m["actor_grad_norm"], 4)) for m in metrics])
    assert all(torch.isfinite(torch.tensor(m["actor_grad_norm"])) and m["actor_grad_norm"] > 0 for m in metrics)
    # first step: old = current log-probs, ratio 1, so the PPO loss is minus the token-mean advantage
    expected = -sum(float((s["advantages"] * s["action_mask"]).sum()) for s in samples) / sum(
        float(s["action_mask"].sum()) for s in samples)
    assert metrics[0]["policy_loss"] == pytest.approx(expected, abs=2e-2)
    assert (after - before).abs().max() > 1e-3  # the steps changed the policy


def test_master_weights_in_optimizer_match_fsdp_masters(ckpt):
    """model.master_weights=optimizer on AutoModel: bf16 params (one rank: no FSDP2), fp32 masters in the optimizer;
    from the same fp32 checkpoint the first PPO step sees the same bf16 compute weights (same loss, grad norm) as the
    fp32-params FSDP2 path, and its fp32 masters land where that path's fp32 params land."""

    def _full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    samples = _samples(4, seed=7)
    obj = ActorObjective(PolicyLoss("ppo", clip_eps_low=0.2, clip_eps_high=0.2))
    res = {}
    for mode in ("fsdp", "optimizer"):
        w = _worker(ckpt[0], "automodel", master_weights=mode)
        m = w.train_step(samples, obj)
        if mode == "optimizer":
            assert {p.dtype for p in w.model.parameters()} == {torch.bfloat16}
            masters = {n: w.optimizer.state[p]["master"] for n, p in w.model.named_parameters() if p.requires_grad}
            assert {t.dtype for t in masters.values()} == {torch.float32}
            for n, p in w.model.named_parameters():
                if p.requires_grad:
                    assert torch.equal(_full(p), _full(masters[n]).to(torch.bfloat16)), n
        else:
            masters = {n: p for n, p in w.model.named_parameters() if p.requires_grad}
        res[mode] = (m, {n: _full(t).float().cpu() for n, t in masters.items()})
        del w
        torch.cuda.empty_cache()
    (m0, w0), (m1, w1) = res["fsdp"], res["optimizer"]
    print("AutoModel master weights fsdp / optimizer:", m0["policy_loss"], m1["policy_loss"], m0["actor_grad_norm"],
          m1["actor_grad_norm"])
    assert m1["policy_loss"] == pytest.approx(m0["policy_loss"], rel=1e-4)
    assert m1["actor_grad_norm"] == pytest.approx(m0["actor_grad_norm"], rel=1e-3)
    assert w0.keys() == w1.keys()
    # AdamW's first step moves each weight by about lr x sign(grad): a grad near 0 whose sign the GPU's atomics flip
    # moves by up to 2 lr differently; anything else agrees to fp32 rounding
    for n in w0:
        diff = (w1[n] - w0[n]).abs()
        assert diff.max() <= 2.01e-4 and (diff > 1e-6).float().mean() < 1e-3, (n, diff.max())
