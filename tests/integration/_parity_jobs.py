"""Rank functions for tests/integration/test_trainer_parity.py (gloo, the tiny Qwen3 in fp32): warm start
(checkpoint.load_model_only), determinism, deferred gradient sync and per-parameter grad norms. Rank 0 saves what
the tests compare."""

from __future__ import annotations

import torch

from _muon_jobs import _full
from _trainer_jobs import make_samples, ppo_objective, with_old_logprobs, worker


def warm_start(rank, world_size, port, root, out):
    """Train two steps (linear warmup: the first at lr 0) and save; then a fresh worker loads that checkpoint
    weights-only, and another fully."""
    w = worker(rank, world_size, port)
    samples = with_old_logprobs(w, make_samples(4, seed=5))
    for _ in range(2):
        w.train_step(samples, ppo_objective())
    w.save_checkpoint(root)
    trained = {n: _full(p) for n, p in w.model.named_parameters()}
    res = {"trained": trained, "lr_trained": w.scheduler.get_last_lr()[0]}
    for name, model_only in (("warm", True), ("resumed", False)):
        v = worker(rank, world_size, port)
        v.load_checkpoint(root, model_only=model_only)
        res[name] = {"params": {n: _full(p) for n, p in v.model.named_parameters()},
                     "optim_state": {k: dict(s) for k, s in v.optimizer.state.items()},
                     "step": v.global_step, "lr": v.scheduler.get_last_lr()[0],
                     "sched_epoch": v.scheduler.last_epoch}
    res["deterministic_before"] = torch.are_deterministic_algorithms_enabled()
    worker(rank, world_size, port, full_determinism=True)  # train.full_determinism
    res["deterministic_after"] = torch.are_deterministic_algorithms_enabled()
    if rank == 0:
        torch.save(res, out)
    w.shutdown()


def deferred_sync(rank, world_size, port, out, defer):
    """One optimizer step over several micro-batches (40-token budget) with deferred grad sync on or off, grad-norm
    debugging on self-attention weights (top 3), no clipping. Counts the sharded grads' arrivals per parameter."""
    w = worker(rank, world_size, port, defer_grad_sync=defer, max_norm=0.0,
               debug_grad_norms=(("*self_attn.*_proj.weight",), 3))
    arrivals = []
    probe = w.model.model.layers[0].self_attn.q_proj.weight
    probe.register_post_accumulate_grad_hook(lambda p: arrivals.append(1))
    grads, step = {}, w.optimizer.step

    def spy():
        grads.update({n: _full(p.grad) for n, p in w.model.named_parameters() if p.grad is not None})
        step()

    w.optimizer.step = spy
    samples = with_old_logprobs(w, make_samples(8))
    metrics = w.train_step(samples[rank::world_size], ppo_objective())
    params = {n: _full(p) for n, p in w.model.named_parameters()}
    if rank == 0:
        torch.save({"arrivals": len(arrivals), "metrics": metrics, "params": params, "grads": grads}, out)
    w.shutdown()
