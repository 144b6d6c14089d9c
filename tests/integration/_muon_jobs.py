"""Rank functions for tests/integration/test_muon.py (gloo, FSDP2 on 2 ranks, the tiny Qwen3 / Qwen3-MoE in fp32).
Every rank calls the collectives (full_tensor); rank 0 saves what the tests compare."""

from __future__ import annotations

import torch

from _trainer_jobs import make_samples, ppo_objective, with_old_logprobs, worker

MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True, experts_adamw=False)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def muon_worker(rank, world_size, port, **kw):
    return worker(rank, world_size, port, muon=dict(MUON, **kw.pop("muon", {})), lr_scheduler="constant",
                  weight_decay=0.1, **kw)


def snapshot(w) -> dict:
    """Full params and optimizer state by parameter name."""
    names = {p: n for n, p in w.model.named_parameters()}
    state = {names[p]: {k: _full(v) for k, v in s.items()} for p, s in w.optimizer.state.items()}
    return {"params": {n: _full(p) for n, p in w.model.named_parameters()}, "state": state}


def spy_step(w, records):
    """Records the full grads each optimizer step receives (after clipping), the lrs, and the params around it."""
    step = w.optimizer.step

    def spy():
        names = {p: n for n, p in w.model.named_parameters()}
        rec = {"grads": {names[p]: _full(p.grad) for p in names if p.grad is not None}, "before": snapshot(w),
               "groups": [{"names": [names[p] for p in g["params"]], "lr": g["lr"], "muon": g["muon"],
                           "weight_decay": g["weight_decay"]} for g in w.optimizer.param_groups]}
        step()
        rec["after"] = snapshot(w)
        records.append(rec)

    w.optimizer.step = spy


def muon_run(rank, world_size, port, root, out, resume):
    """resume=False: step (recorded), save, step; resume=True: load that save, step. Both record the last state."""
    w = muon_worker(rank, world_size, port)
    records = []
    spy_step(w, records)
    if resume:
        samples = torch.load(f"{root}/samples.pt", weights_only=False)
        w.load_checkpoint(root)
    else:
        samples = with_old_logprobs(w, make_samples(8, seed=3))
        if rank == 0:
            torch.save(samples, f"{root}/samples.pt")
        w.train_step(samples[rank::world_size], ppo_objective())
        w.save_checkpoint(root)
    m = w.train_step(samples[rank::world_size], ppo_objective())
    snap = snapshot(w)
    if rank == 0:
        torch.save({"metrics": m, "state": snap, "records": records}, out)
    w.shutdown()


def moe_experts(rank, world_size, port, out):
    """One step of the tiny Qwen3-MoE with Muon, experts on Muon and (muon_experts_adamw) on AdamW."""
    res = {}
    for experts_adamw in (False, True):
        w = muon_worker(rank, world_size, port, model_path="tiny://qwen3_moe_tiny",
                        muon={"experts_adamw": experts_adamw})
        records = []
        spy_step(w, records)
        samples = with_old_logprobs(w, make_samples(4))
        w.train_step(samples[rank::world_size], ppo_objective())
        res[experts_adamw] = records[0]
    if rank == 0:
        torch.save(res, out)
    w.shutdown()
