"""Rank functions for the multi-GPU AutoModel tests (spawned by molt_hydra.parallel.launch.run_ranks over NCCL)."""

from __future__ import annotations

import torch


def samples(n, vocab, layers=0, topk=0, seed=0):
    """RL experiences; with `layers` > 0 each carries `routed_experts` [T, layers, topk]: a fixed random selection
    (distinct experts per token) for R3 replay, the same on every world size."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 16 + 4 * i, 40 + 8 * i
        ids = torch.randint(0, vocab, (p + r,), generator=g)
        mask = torch.cat([torch.zeros(p), torch.ones(r)])
        s = {"input_ids": ids, "action_mask": mask, "advantages": torch.randn(p + r, generator=g) * mask,
             "old_logprobs": -10.0 * mask}
        if layers:
            s["routed_experts"] = torch.stack([torch.stack([torch.randperm(128, generator=g)[:topk]
                                                            for _ in range(layers)]) for _ in range(p + r)])
        out.append(s)
    return out


def step(rank, world_size, port, path, out, tp, ep, moe, master_weights="fsdp"):
    from nemo_automodel.components.moe.router_replay import RouterReplay

    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    w = TrainerWorker(TrainerSpec(rank=rank, world_size=world_size, master_port=port, model_path=path,
                                  backend="automodel", dp_size=world_size // tp, tp_size=tp, ep_size=ep, lr=1e-4,
                                  param_dtype="bf16",
                                  max_tokens_per_micro_batch=1024, timeout_s=300,
                                  routing_replay=moe, master_weights=master_weights))
    data = samples(8, w.model.config.vocab_size, 2 if moe else 0, 8)
    dp = world_size // tp
    local = data[(rank // tp) % dp::dp] if dp > 1 else data
    used, orig = [], RouterReplay.apply

    def spy(self, indices):
        res = orig(self, indices)
        used.append(res.detach().cpu())
        return res

    RouterReplay.apply = spy
    try:
        m = w.train_step(local, ActorObjective(PolicyLoss("ppo", clip_eps_low=0.2, clip_eps_high=0.2)))
    finally:
        RouterReplay.apply = orig
    if moe:  # every gate call returned a selection of the replayed data (rows of this rank's tokens)
        want = {tuple(x.tolist()) for s in local for x in s["routed_experts"].reshape(-1, 8)}
        want |= {(-1,) * 8}  # padded positions: unrouted (the gate's own top-k there)
        got = {tuple(x.tolist()) for u in used for x in u}
        m["r3_exact"] = bool(used) and got <= want
    if rank == 0:
        torch.save(m, out)
    w.shutdown()
