"""Rank function for the sync-probe test (spawned by molt_hydra.parallel.launch.run_ranks; gloo on CPU): a real
policy trainer rank's side of the probe, before and after one optimizer step. Rank 0 writes it into `out`."""

from __future__ import annotations

import torch


def probe_sides(rank, world_size, port, out, tokens):
    import _trainer_jobs as jobs

    from molt_hydra.parallel.trainer import TrainerWorker

    from molt_hydra.parallel.trainer_spec import TrainerSpec
    from molt_hydra.runtime.roles import PolicyWorkerMixin

    policy = type("PolicyWorker", (PolicyWorkerMixin, TrainerWorker), {})
    w = policy(TrainerSpec(rank=rank, world_size=world_size, master_port=port, model_path="tiny://qwen3_tiny", lr=1e-2,
                           max_tokens_per_micro_batch=64, total_steps=10, timeout_s=120, temperature=0.7))
    before = (w.sync_probe_sums("float32"), w.sync_probe_logprobs(tokens))
    samples = jobs.with_old_logprobs(w, jobs.make_samples(4 * world_size))[rank::world_size]
    w.train_step(samples, jobs.ppo_objective())
    after = (w.sync_probe_sums("float32"), w.sync_probe_logprobs(tokens))
    state = jobs.full_state(w)[0]
    if rank == 0:
        torch.save({"before": before, "after": after, "temperature": w.temperature,
                    "state": {k: v.float() for k, v in state.items()}}, out)
