"""Rank functions for tests/integration/test_master_weights.py (gloo, FSDP2, the tiny Qwen3 in bf16 with fp32
masters in the optimizer). Every rank calls the collectives (full_tensor); rank 0 saves what the tests compare."""

from __future__ import annotations

import torch

from _trainer_jobs import make_samples, ppo_objective, with_old_logprobs, worker


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def master_worker(rank, world_size, port):
    return worker(rank, world_size, port, param_dtype="bf16", master_weights="optimizer", weight_decay=0.1,
                  lr_scheduler="constant")


def snapshot(w) -> dict:
    """Full (unsharded) params, masters and moments by parameter name."""
    out = {"params": {}, "master": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    for name, p in w.model.named_parameters():
        out["params"][name] = _full(p)
        st = w.optimizer.state[p]
        for k in ("master", "exp_avg", "exp_avg_sq"):
            out[k][name] = _full(st[k])
        out["step"][name] = st["step"].clone()
    return out


def update_steps(rank, world_size, port, out):
    """Two optimizer steps; around each, the grads it was given, lr, and the state before and after. Step 1 runs
    unclipped (max_norm 0), step 2 with max_norm 0.05, which clips."""
    w = master_worker(rank, world_size, port)
    records, step = [], w.optimizer.step

    def spy():
        names = {p: n for n, p in w.model.named_parameters()}
        # the grads the step consumes: fp32 sums over the micro-batches (several here, see accumulation_step)
        grads = {names[p]: _full(w.optimizer.grad(p)) for g in w.optimizer.param_groups for p in g["params"]}
        rec = {"grads": grads, "lr": w.optimizer.param_groups[0]["lr"], "before": snapshot(w)}
        step()
        rec["after"] = snapshot(w)
        records.append(rec)

    w.optimizer.step = spy
    samples = with_old_logprobs(w, make_samples(8))
    metrics = []
    for max_norm in (0.0, 0.05):
        w.spec.max_norm = max_norm
        metrics.append(w.train_step(samples[rank::world_size], ppo_objective()))
    if rank == 0:
        torch.save({"records": records, "metrics": metrics,
                    "dtypes": {n: p.dtype for n, p in w.model.named_parameters()}}, out)
    w.shutdown()


def resume_run(rank, world_size, port, root, out, resume, optimizer_offload=False):
    """resume=False: step, save, step; resume=True: load that save, step. Both record the state after the last step,
    and where the optimizer's state tensors live (optimizer_offload: parallelism.offload=optimizer, fp32 params)."""
    w = (worker(rank, world_size, port, optimizer_offload=True, weight_decay=0.1, lr_scheduler="constant")
         if optimizer_offload else master_worker(rank, world_size, port))
    samples = with_old_logprobs(w, make_samples(8, seed=3)) if not resume else torch.load(
        f"{root}/samples.pt", weights_only=False)
    if resume:
        w.load_checkpoint(root)
    else:
        if rank == 0:
            torch.save(samples, f"{root}/samples.pt")
        w.train_step(samples[rank::world_size], ppo_objective())
        w.save_checkpoint(root)
    m = w.train_step(samples[rank::world_size], ppo_objective())
    snap = snapshot(w)
    # where each state tensor's memory is (a DTensor's shard: `full_tensor()` would gather it onto the mesh)
    devices = {str(getattr(v, "_local_tensor", v).device) for st in w.optimizer.state.values() for v in st.values()}
    if rank == 0:
        torch.save({"metrics": m, "state": snap, "devices": devices}, out)
    w.shutdown()


def accumulation_step(rank, world_size, port, out):
    """One optimizer step over several micro-batches. A hook placed before the optimizer's records every
    micro-batch's grad as it arrives (bf16; FSDP2: this rank's reduced shard); a spy on the step records the grads
    the step consumes. Rank 0 saves its local shards."""
    w = master_worker(rank, world_size, port)
    names = {p: n for n, p in w.model.named_parameters()}
    per_micro = {n: [] for n in names.values()}

    def record(p):
        per_micro[names[p]].append(p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone())

    for p in names:
        hooks = dict(p._post_accumulate_grad_hooks)
        p._post_accumulate_grad_hooks.clear()  # re-inserted after the recorder (C++ walks the plain dict order)
        p.register_post_accumulate_grad_hook(record)
        p._post_accumulate_grad_hooks.update(hooks)
    consumed, step = {}, w.optimizer.step

    def spy():
        for p, n in names.items():
            g = w.optimizer.grad(p)
            consumed[n] = (g.to_local() if hasattr(g, "to_local") else g).clone()
        step()

    w.optimizer.step = spy
    w.spec.max_norm = 0.0
    samples = with_old_logprobs(w, make_samples(8))
    w.train_step(samples[rank::world_size], ppo_objective())
    if rank == 0:
        torch.save({"per_micro": per_micro, "consumed": consumed}, out)
    w.shutdown()


def compute_dtype(rank, world_size, port, out, param_dtype):
    """The dtype the decoder layers compute in on CPU for a given trainer param_dtype (None: the default)."""
    from molt_hydra.models.build import decoder_layers
    w = worker(rank, world_size, port, **({"param_dtype": param_dtype} if param_dtype else {}))
    seen = []
    decoder_layers(w.model)[0].register_forward_hook(lambda m, args, output: seen.append(
        (output[0] if isinstance(output, tuple) else output).dtype))
    w.compute_logprobs(make_samples(2))
    if rank == 0:
        torch.save(seen, out)
    w.shutdown()


def offload_steps(rank, world_size, port, out, optimizer_offload):
    """Two optimizer steps of the fp32 tiny Qwen3 (computing in fp32 on a GPU too) with the optimizer on the host
    (parallelism.offload=optimizer) or not; rank 0 saves the full params after and, offloaded, where the masters live
    and whether they equal the params."""
    w = worker(rank, world_size, port, optimizer_offload=optimizer_offload, weight_decay=0.1, lr_scheduler="constant",
               param_dtype="fp32")
    samples = with_old_logprobs(w, make_samples(8, seed=5))
    for _ in range(2):
        w.train_step(samples[rank::world_size], ppo_objective())
    saved = {"params": {n: _full(p).cpu() for n, p in w.model.named_parameters()},
             "param_devices": {str(p.device) for p in w.model.parameters()}, "optimizer": type(w.optimizer).__name__,
             "peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0}
    if optimizer_offload:
        local = {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in w.model.named_parameters()}
        state = {n: w.optimizer.state[p] for n, p in w.model.named_parameters()}
        masters = {n: s["master"].to_local() if hasattr(s["master"], "to_local") else s["master"]
                   for n, s in state.items()}
        # where each state tensor's memory is (a DTensor's shard: `full_tensor()` would gather it onto the mesh)
        devices = {str(getattr(v, "_local_tensor", v).device) for s in state.values() for v in s.values()}
        saved.update(state_devices=devices,
                     master_is_param={n: masters[n].data_ptr() == local[n].data_ptr() for n in masters},
                     master_equals_param={n: torch.equal(masters[n], local[n].to(masters[n].device)) for n in masters})
    if rank == 0:
        torch.save(saved, out)
    w.shutdown()
