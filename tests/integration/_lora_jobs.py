"""Rank functions for the LoRA tests (spawned by molt_hydra.parallel.launch.run_ranks; FSDP2 over gloo on CPU): a real
policy trainer rank with a PEFT adapter. Rank 0 writes what the tests compare into `out` with torch.save."""

from __future__ import annotations

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
SPEC = dict(rank=8, alpha=16.0, dropout=0.0, init="default", target_modules=ALL)


def lora_worker(rank, world_size, port, **kw):
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    from molt_hydra.runtime.roles import PolicyWorkerMixin

    policy = type("PolicyWorker", (PolicyWorkerMixin, TrainerWorker), {})
    args = dict(model_path="tiny://qwen3_tiny", lr=2e-2, max_tokens_per_micro_batch=40, total_steps=10,
                timeout_s=120, lora=dict(SPEC))
    return policy(TrainerSpec(rank=rank, world_size=world_size, master_port=port, **{**args, **kw}))


def base_state(w) -> dict:
    """Every base weight, full (gathered over the FSDP2 ranks), keyed by its name."""
    import _trainer_jobs as jobs

    from molt_hydra.models.lora import is_adapter_param

    state = jobs.full_state(w)[0]
    return {n: t.clone() for n, t in state.items() if not is_adapter_param(n)}


def adapted_shapes(model) -> dict[str, tuple[int, int]]:
    """{module name: (in_features, out_features)} of every module PEFT wrapped (its base layer's shape)."""
    return {name: (m.base_layer.in_features, m.base_layer.out_features) for name, m in model.named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def train_and_sync_sides(rank, world_size, port, out, tokens, export_dir):
    """Two PPO steps on the adapter; before and after: the base, the probe's log-probs; the adapter as the sync
    sends it (trainer.weight_buckets, in the engine's fp32) and its export (PEFT dir + merged model)."""
    import _trainer_jobs as jobs

    w = lora_worker(rank, world_size, port)
    before = base_state(w)
    probe_before = w.sync_probe_logprobs(tokens)
    samples = jobs.with_old_logprobs(w, jobs.make_samples(4 * world_size))[rank::world_size]
    for _ in range(2):
        w.train_step(samples, jobs.ppo_objective())
    after = base_state(w)
    buckets = list(w.weight_buckets(1 << 20, torch.float32, "cpu"))
    probe_after = w.sync_probe_logprobs(tokens)
    optimized = [p for group in w.optimizer.param_groups for p in group["params"]]
    trainable = sorted(n for n, p in w.model.named_parameters() if p.requires_grad)
    w.export_hf(export_dir, dtype="fp32", merged=True)
    sums = w.sync_probe_sums("float32")  # collective
    if rank == 0:
        torch.save({"before": before, "after": after, "buckets": buckets, "config": w.adapter_config(),
                    "probe_before": probe_before, "probe_after": probe_after, "num_optimized": len(optimized),
                    "trainable": trainable, "shapes": adapted_shapes(w.model), "sync_probe_sums": sums}, out)
    w.shutdown()


def ckpt_uninterrupted(rank, world_size, port, root, out):
    """Step, save (a resumable checkpoint), step again: the reference the resumed run must equal."""
    import _trainer_jobs as jobs

    w = lora_worker(rank, world_size, port, lr_scheduler="linear", lr_warmup_ratio=0.1)
    samples = jobs.with_old_logprobs(w, jobs.make_samples(8, seed=3))
    w.train_step(samples[rank::world_size], jobs.ppo_objective())
    w.save_checkpoint(root, keep=2)
    m2 = w.train_step(samples[rank::world_size], jobs.ppo_objective())
    msd, osd = jobs.full_state(w)
    if rank == 0:
        torch.save({"metrics": m2, "model": msd, "optim": osd, "samples": samples}, out)
    w.shutdown()


def ckpt_resumed(rank, world_size, port, root, samples_file, out):
    """New processes (the first run is gone): load the checkpoint, take the same second step."""
    import _trainer_jobs as jobs

    w = lora_worker(rank, world_size, port, lr_scheduler="linear", lr_warmup_ratio=0.1)
    w.load_checkpoint(root)
    samples = torch.load(samples_file, weights_only=False)["samples"]
    m2 = w.train_step(samples[rank::world_size], jobs.ppo_objective())
    msd, osd = jobs.full_state(w)
    if rank == 0:
        torch.save({"metrics": m2, "model": msd, "optim": osd}, out)
    w.shutdown()


def dropout_logprobs(rank, world_size, port, out):
    """model.lora.dropout=0.5: the log-prob recomputes run without dropout (two calls agree; they equal the same
    adapter's at dropout 0), while training keeps it (the model is back in train mode after each)."""
    import _trainer_jobs as jobs

    samples = jobs.make_samples(4)
    w = lora_worker(rank, world_size, port, lora={**SPEC, "dropout": 0.5})
    w.train_step(jobs.with_old_logprobs(w, jobs.make_samples(4)), jobs.ppo_objective())  # B != 0 from here
    first, second = w.compute_logprobs(samples), w.compute_logprobs(samples)
    training = w.model.training
    for module in w.model.modules():  # the same adapter with its dropout removed
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    w.model.train()
    plain = w.compute_logprobs(samples)
    if rank == 0:
        torch.save({"first": list(first), "second": list(second), "plain": list(plain), "training": training}, out)
    w.shutdown()


def export_with_tokenizer(rank, world_size, port, export_dir, tokenizer_path):
    """model.tokenizer_path set: the LoRA export (merged too) of an untrained adapter."""
    w = lora_worker(rank, world_size, port, tokenizer_path=tokenizer_path)
    w.export_hf(export_dir, dtype="fp32", merged=True)
    w.shutdown()
