"""Rank functions for the FSDP2 trainer tests (spawned by molt_hydra.parallel.launch.run_ranks; gloo on CPU,
NCCL on the GPU device). Rank 0 writes what the tests compare into `out` with torch.save."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def make_samples(n: int = 8, seed: int = 0, vocab: int = 512) -> list[dict]:
    """RL experiences of varied lengths: prompt (mask 0) + response (mask 1), random advantages, old log-probs
    offset from the current policy so PPO ratios are not all 1 (filled in by `with_old_logprobs`)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 4 + i % 3, 5 + (3 * i) % 7
        ids = torch.randint(0, vocab, (p + r,), generator=g)
        mask = torch.cat([torch.zeros(p), torch.ones(r)])
        adv = torch.randn(p + r, generator=g) * mask
        out.append({"input_ids": ids, "action_mask": mask, "advantages": adv,
                    "old_logprobs": torch.zeros(p + r)})
    return out


def ppo_objective():
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    return ActorObjective(PolicyLoss("ppo", clip_eps_low=0.2, clip_eps_high=0.2, entropy_coef=0.01))


def worker(rank, world_size, port, **kw):
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    args = dict(model_path="tiny://qwen3_tiny", lr=1e-3, max_tokens_per_micro_batch=40, max_norm=1.0,
                total_steps=10, lr_scheduler="linear", lr_warmup_ratio=0.1, timeout_s=120)
    return TrainerWorker(TrainerSpec(rank=rank, world_size=world_size, master_port=port, **{**args, **kw}))


def full_state(w):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(w.model, w.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def with_old_logprobs(w, samples):
    """old_logprobs = the actor's own log-probs minus a per-token perturbation, as a stale policy would give."""
    lps = w.compute_logprobs(samples)
    g = torch.Generator().manual_seed(1)
    for s, lp in zip(samples, lps):
        s["old_logprobs"] = (lp + 0.1 * torch.randn(lp.shape, generator=g)) * s["action_mask"]
    return samples


def dp_step(rank, world_size, port, out, param_dtype="fp32", master_weights="fsdp"):
    """Two optimizer windows of a PPO step over 8 samples; rank r of R holds samples of each window strided by R."""
    if param_dtype == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    w = worker(rank, world_size, port, param_dtype=param_dtype, master_weights=master_weights)
    samples = with_old_logprobs(w, make_samples(8))
    windows = [samples[:4], samples[4:]]
    local = [s for win in windows for s in win[rank::world_size]]
    metrics = w.train_step(local, ppo_objective(), num_optimizer_steps=2)
    msd, _ = full_state(w)
    if rank == 0:
        torch.save({"metrics": metrics, "model": msd}, out)
    w.shutdown()


def moe_step(rank, world_size, port, out):
    """The tiny Qwen3-MoE actor: log-probs equal HF's, and a PPO step with the router aux loss runs."""
    w = worker(rank, world_size, port, model_path="tiny://qwen3_moe_tiny", aux_loss_coef=0.01, lr_scheduler="constant")
    samples = with_old_logprobs(w, make_samples(4))
    lps = w.compute_logprobs(samples)
    metrics = [w.train_step(samples[rank::world_size], ppo_objective()) for _ in range(2)]
    experts = sorted({type(m).__name__ for m in w.model.modules() if type(m).__name__.startswith("Qwen3MoeExperts")})
    if rank == 0:
        torch.save({"lps": lps, "metrics": metrics, "experts_impl": w.moe_experts_impl, "experts": experts}, out)
    w.shutdown()


def moe_dummy_micro_batch(rank, world_size, port, out):
    """One MoE sample's step with a large router aux loss, trained as its one micro-batch, then as that micro-batch
    beside a dummy one (what a rank with fewer micro-batches than its peers runs), from the same weights: the
    gradient norms of both, before clipping."""
    norms = []
    for bins in ([[0]], [[0], []]):
        w = worker(rank, world_size, port, model_path="tiny://qwen3_moe_tiny", aux_loss_coef=10.0, max_norm=0.0,
                   lr_scheduler="constant")
        samples = with_old_logprobs(w, make_samples(1))
        w._micro_batches = lambda *a, bins=bins, **k: bins
        norms.append(w.train_step(samples, ppo_objective())["actor_grad_norm"])
        w.shutdown()
    if rank == 0:
        torch.save(norms, out)


def moe_layout_step(rank, world_size, port, out, packing, model_path="tiny://qwen3_moe_tiny", checkpointing="none"):
    """Two MoE samples of different lengths in one micro-batch with a large router aux loss, right-padded
    (packing=False) or packed, under `checkpointing` (activation checkpointing: none / full): the step's gradient norm
    before clipping and its routing metrics."""
    w = worker(rank, world_size, port, model_path=model_path, aux_loss_coef=10.0, max_norm=0.0,
               lr_scheduler="constant", packing=packing, max_tokens_per_micro_batch=1000,
               gradient_checkpointing=checkpointing)
    samples = with_old_logprobs(w, make_samples(2))
    m = w.train_step(samples, ppo_objective())
    if rank == 0:
        torch.save(m, out)
    w.shutdown()


def logprobs_and_roles(rank, world_size, port, out):
    """Actor log-probs at T=0.7 (three samples packed in one micro-batch), a reference forward, a critic step."""
    from molt_hydra.parallel.objectives import CriticObjective
    samples = make_samples(3)
    actor = worker(rank, world_size, port, temperature=0.7, max_tokens_per_micro_batch=1000)
    res = {"lp_t07": actor.compute_logprobs(samples, with_entropy=True)}
    actor.temperature = 1.0
    res["lp_t1"] = actor.compute_logprobs(samples)
    ref = worker(rank, world_size, port, role="ref", temperature=0.7)
    res["ref_t07"] = ref.compute_logprobs(samples)
    critic = worker(rank, world_size, port, role="critic", lr=1e-2)
    for s in samples:
        s["returns"] = s["action_mask"] * 1.0
        s["values"] = torch.zeros_like(s["returns"])
    res["critic"] = [critic.train_step(samples, CriticObjective(value_clip=None)) for _ in range(5)]
    res["values"] = critic.compute_logprobs(samples)  # a critic's forward returns its values
    if rank == 0:
        torch.save(res, out)
    actor.shutdown()


def checkpoint_dropout(rank, world_size, port, out):
    """A checkpoint whose config.json sets attention_dropout = 0.3 (config_overrides stands in for that file): the
    actor's, the reference's and the critic's recomputes twice, the same actor's with its dropout set to 0, and each
    model's train/eval mode after its recompute."""
    samples = make_samples(3)
    res = {}
    for role in ("actor", "ref", "critic"):
        w = worker(rank, world_size, port, role=role, config_overrides={"attention_dropout": 0.3})
        res[role] = [w.compute_logprobs(samples) for _ in range(2)]
        res[f"{role}_training"] = w.model.training
        if role == "actor":
            for module in w.model.modules():  # the same weights, the dropout removed
                if hasattr(module, "attention_dropout"):
                    module.attention_dropout = 0.0
            res["actor_plain"] = w.compute_logprobs(samples)
        w.shutdown()
    if rank == 0:
        torch.save(res, out)


def ckpt_uninterrupted(rank, world_size, port, root, out, export_dir):
    w = worker(rank, world_size, port)
    samples = with_old_logprobs(w, make_samples(8, seed=3))  # all 8 on every rank; each trains its stride
    w.train_step(samples[rank::world_size], ppo_objective())
    w.save_checkpoint(root, client_state={"episode": 7}, keep=2)
    rng = torch.rand(4)
    m2 = w.train_step(samples[rank::world_size], ppo_objective())
    msd, osd = full_state(w)
    w.export_hf(export_dir, dtype="fp32")
    if rank == 0:
        torch.save({"rng": rng, "metrics": m2, "model": msd, "optim": osd, "samples": samples}, out)
    w.shutdown()


def ckpt_killed(rank, world_size, port, root, samples_file):
    """Resume from step 1, train, then die inside the next save after the shards are written (rank 0 exits)."""
    import molt_hydra.parallel.checkpoint as ck
    w = worker(rank, world_size, port)
    w.load_checkpoint(root)
    samples = torch.load(samples_file, weights_only=False)["samples"]
    w.train_step(samples[rank::world_size], ppo_objective())
    ck._write_extra = lambda *a: os._exit(17)  # test hook: the process dies between shard write and rename
    w.save_checkpoint(root)


def _bytes_read() -> int:
    return int(next(line for line in open("/proc/self/io") if line.startswith("rchar:")).split()[1])


def ckpt_resumed(rank, world_size, port, root, samples_file, out):
    w = worker(rank, world_size, port)
    before = _bytes_read()
    client = w.load_checkpoint(root)
    Path(f"{out}.rank{rank}.read").write_text(str(_bytes_read() - before))  # what this rank's load read
    rng = torch.rand(4)
    samples = torch.load(samples_file, weights_only=False)["samples"]
    m2 = w.train_step(samples[rank::world_size], ppo_objective())
    msd, osd = full_state(w)
    if rank == 0:
        torch.save({"client": client, "rng": rng, "metrics": m2, "model": msd, "optim": osd}, out)
    w.shutdown()


def layout_step(rank, world_size, port, out, packing):
    """Log-probs, entropy and one PPO step with right-padded [B, L] micro-batches (packing=False) or packed streams."""
    w = worker(rank, world_size, port, packing=packing)
    samples = with_old_logprobs(w, make_samples(8))
    lps = w.compute_logprobs(samples, with_entropy=True)
    m = w.train_step(samples, ppo_objective())
    if rank == 0:
        torch.save({"lps": lps, "metrics": m, "model": full_state(w)[0]}, out)
    w.shutdown()


def forward_only_reshards(rank, world_size, port, out):
    """One rank gathers its bf16 compute params in forward and keeps them for the backward; after a forward-only
    pass (old-logprob recompute, the sync probe) they must be freed: every parameter is its sharded DTensor again."""
    from torch.distributed.tensor import DTensor

    w = worker(rank, world_size, port, param_dtype="bf16")
    before = all(isinstance(p, DTensor) for p in w.model.parameters())
    w.compute_logprobs(make_samples(2))
    after = sum(isinstance(p, DTensor) for p in w.model.parameters())
    torch.save({"before": before, "after": after, "params": sum(1 for _ in w.model.parameters())}, out)
    w.shutdown()


def compiled_steps(rank, world_size, port, out, compile_blocks, checkpointing=False, moe_replay=False):
    """Four RL steps of varied lengths (each its own micro-batch shapes) with the decoder blocks compiled or eager,
    activation checkpointing on or off; with `moe_replay`, the tiny Qwen3-MoE replaying random engine experts (R3)
    with the routing statistics on. Saves each step's policy loss (and replayed share) and, compiled, the graphs
    torch.compile has built after it."""
    import logging
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("molt_hydra.parallel.trainer").addHandler(handler)
    moe = dict(model_path="tiny://qwen3_moe_tiny", routing_replay=True) if moe_replay else {}
    w = worker(rank, world_size, port, compile_blocks=compile_blocks, param_dtype="fp32",
               gradient_checkpointing=checkpointing, **moe)
    rows = []
    for step in range(4):
        samples = make_samples(8, seed=step)
        for i, s in enumerate(samples if moe_replay else ()):
            c, g = w.model.config, torch.Generator().manual_seed(100 * step + i)
            s["routed_experts"] = torch.stack([torch.randperm(c.num_experts, generator=g)[:c.num_experts_per_tok]
                                               for _ in range(len(s["input_ids"]) * c.num_hidden_layers)]
                                              ).view(len(s["input_ids"]), c.num_hidden_layers, -1)
        m = w.train_step(with_old_logprobs(w, samples), ppo_objective())
        rows.append((m["policy_loss"], m.get("perf/compiled_graphs"), m.get("routing/replayed")))
    if rank == 0:
        torch.save({"rows": rows, "warnings": warned}, out)
    w.shutdown()


def nonfinite_step(rank, world_size, port, out, debug=None):
    """A NaN in the forward (one embedding row): the step's gradient norm is NaN. The step raises, naming it, before
    the optimizer writes it into the weights: the final norm's weight and the optimizer's step count stay. `debug`:
    logger.debug_grad_norms' (patterns, top k)."""
    w = worker(rank, world_size, port, debug_grad_norms=debug)
    samples = with_old_logprobs(w, make_samples(4))
    emb, norm = w.model.get_input_embeddings().weight, dict(w.model.named_parameters())["model.norm.weight"]

    def full(p):
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()

    before = full(norm)
    with torch.no_grad():
        local = emb.to_local() if hasattr(emb, "to_local") else emb
        local[0].fill_(float("nan"))
    samples[0]["input_ids"][0] = 0  # (rank 0's row 0 of the vocabulary, on every rank's shard layout)
    try:
        w.train_step(samples, ppo_objective())
        error = None
    except FloatingPointError as e:
        error = str(e)
    if rank == 0:
        torch.save({"error": error, "global_step": w.global_step, "norm_same": torch.equal(before, full(norm))}, out)
