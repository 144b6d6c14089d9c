"""Rank function for the single-pass weight-sync test (spawned by molt_hydra.parallel.launch.run_ranks; gloo on CPU):
what a real FSDP2 trainer rank hands the single-pass CUDA IPC path. Rank 0 writes the checks into `out`."""

from __future__ import annotations

import torch


def single_pass_tensors(rank, world_size, port, out):
    import _trainer_jobs as jobs
    from torch.distributed.tensor import DTensor

    from molt_hydra.weight_sync.buckets import local_full_weights, parameter_addresses

    # bf16 compute over fp32 storage: FSDP2 wraps even one rank (one fp32 rank trains the plain module)
    w = jobs.worker(rank, world_size, port, param_dtype="bf16")
    shared = local_full_weights(w.model, to_hf=w._to_hf())
    result = {"shared": shared is not None}
    if shared is not None:
        optimized = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                     for g in w.optimizer.param_groups for p in g["params"]}
        before = {n: t.clone() for n, t in shared}
        key = parameter_addresses(w.model)
        # a forward alone: the rank reshards after it (no backward frees the gathered params), so the parameters sit
        # where they were and the single pass's token stays valid
        samples = jobs.with_old_logprobs(w, jobs.make_samples(8))
        result["key_after_forward"] = parameter_addresses(w.model) == key
        for _ in range(2):  # the first step's lr is 0 (warm-up)
            w.train_step(samples, jobs.ppo_objective())
        full = jobs.full_state(w)[0]
        result.update(
            names=[n for n, _ in shared], state_names=list(w.model.state_dict()),
            in_optimizer_storages=all(t.untyped_storage().data_ptr() in optimized for _, t in shared),
            key_after_step=parameter_addresses(w.model) == key,
            changed=[n for n, t in shared if not torch.equal(t, before[n])],
            equal_full_state=all(torch.equal(t.cpu(), full[n].to(t.dtype)) for n, t in shared))
    if rank == 0:
        torch.save(result, out)
