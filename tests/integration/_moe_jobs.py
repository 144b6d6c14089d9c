"""Rank functions for the MoE routing tests (spawned by molt_hydra.parallel.launch.run_ranks, FSDP2 over gloo).
Rank 0 writes what the tests compare into `out` with torch.save."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _worker(rank, world_size, port, **kw):
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    args = dict(model_path="tiny://qwen3_moe_tiny", lr=1e-2, max_tokens_per_micro_batch=256, total_steps=10,
                lr_scheduler="constant", timeout_s=120)
    return TrainerWorker(TrainerSpec(rank=rank, world_size=world_size, master_port=port, **{**args, **kw}))


def _perturb_routers(w, scale: float) -> None:
    """Add seeded noise to every router weight of the trainer only: its routing now disagrees with the engine's."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from molt_hydra.models import moe_routing
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in moe_routing.routers(w.model):
            full = r.weight.full_tensor() if isinstance(r.weight, DTensor) else r.weight  # one rank: a plain module
            noise = torch.randn(r.weight.shape, generator=g) * scale * full.std()
            r.weight.add_(distribute_tensor(noise, r.weight.device_mesh, r.weight.placements)
                          if isinstance(r.weight, DTensor) else noise)


def replay_job(rank, world_size, port, samples_path, out, replay: bool, perturb: float = 0.0, steps: int = 1,
               freeze: bool = False):
    """Per sample: the experts each trainer MoE layer used vs the engine's; then the batch recompute (routing
    metrics, log-probs) and `steps` PPO steps."""
    from molt_hydra.models import moe_routing

    from _trainer_jobs import ppo_objective, full_state
    w = _worker(rank, world_size, port, routing_replay=replay, freeze_moe_router=freeze)
    if perturb:
        _perturb_routers(w, perturb)
    samples = torch.load(samples_path, weights_only=False)
    local = samples[rank::world_size]
    used: list = []
    hooks = [r.register_forward_hook(lambda m, i, o: used.append((m.layer_index, o[2].detach().clone())))
             for r in moe_routing.routers(w.model)]
    counts = torch.zeros(2)  # [matching token x layer selections, known engine selections]
    for s in local:
        used.clear()
        w.compute_logprobs([s])
        engine = s["routed_experts"].long()
        for layer, sel in used:
            known = (engine[:, layer] >= 0).all(-1)
            same = (sel.sort(-1).values == engine[:, layer].sort(-1).values).all(-1)
            counts += torch.tensor([float((same & known).sum()), float(known.sum())])
    for h in hooks:
        h.remove()
    dist.all_reduce(counts)
    lps = w.compute_logprobs(local)
    before = {k: v.clone() for k, v in full_state(w)[0].items()}
    g = torch.Generator().manual_seed(3)
    train = [{**s, "old_logprobs": lp * s["action_mask"], "advantages": torch.randn(len(lp), generator=g)
              * s["action_mask"]} for s, lp in zip(local, lps)]
    metrics = [w.train_step(train, ppo_objective())]
    for _ in range(steps - 1):
        w.compute_logprobs(local)
        metrics.append(w.train_step(train, ppo_objective()))
    after, optim = full_state(w)
    if rank == 0:
        gate_names = [k for k in after if k.endswith("mlp.gate.weight")]
        torch.save({"counts": counts, "lps": lps, "metrics": metrics, "gate_names": gate_names,
                    "gate_moved": {k: (after[k] - before[k]).abs().max().item() for k in gate_names},
                    "other_moved": max((after[k] - before[k]).abs().max().item() for k in after
                                       if k not in gate_names),
                    "optim_keys": sorted(optim["state"]),
                    "synced": sorted(n for b in w.weight_buckets(1 << 20) for n, _ in b)}, out)
    else:
        for _ in w.weight_buckets(1 << 20):  # the gathers are collectives
            pass
    w.shutdown()
