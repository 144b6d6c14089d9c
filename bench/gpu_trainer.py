"""GPU trainer benchmark: one FSDP2 bf16 training step (PPO objective on synthetic experiences, random init) for
Qwen3-shaped models; tokens/s and MFU against the bf16 matmul peak measured in the same run; peak memory; the
weight-sync send side's full gather time; and the plain-HF ceiling of the same shape in the same run (transformers
model in bf16, no FSDP / optimizer, forward + backward of a log-prob objective on the same [B, S] tokens), so every
row carries trainer / ceiling. Run one world size per torchrun:

    torchrun --standalone --nproc_per_node=N bench/gpu_trainer.py --out results_N.json [--shapes 4b:0:hf,...]

A row is SHAPE:AC[:VARIANT[:SEQUENCES]] (SEQUENCES per GPU per step, default --mbs); AC 0 / 1 (full) / sel
(selective, AutoModel only); VARIANT hf (default), am (NeMo AutoModel backend), with +compile (torch.compile per
decoder block), +packed (one packed stream per micro-batch), +ep2 (AutoModel experts sharded over 2 ranks), +logits
(full logits then chunked log-probs instead of the fused chunked lm_head + log-prob head), +mw (model.master_weights=
optimizer: bf16 params and grads in FSDP2, fp32 masters and moments in the optimizer; without it fp32 params in FSDP2),
and for MoE on the HF backend +grouped / +loop (model.moe_experts_impl; neither: auto) or +tfexperts (transformers' own
grouped_mm experts, the HF path before models/moe_experts.py). The rows end in one summary table (MFU, tok/s, the
same-run ceiling); a --profile row also prints its step's device time per phase (`phase_breakdown`). +lora: a PEFT
LoRA adapter of rank --lora-rank on the family's default modules, docs/lora.md: every decoder linear of
a dense model, the attention of an MoE; the base frozen. MFU counts 6 x N x T over the whole model in every row,
LoRA included (prime-rl's convention: the throughput as if every weight were trained).

`--shapes tiny` (dense) / `tiny-moe` run 2-layer models on CPU/gloo (smoke check of this script). Weak scaling:
every rank gets the same micro-batches (`--mbs` sequences of `--seq` tokens), so scaling efficiency =
tok/s(N) / (N · tok/s(1)).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

V = 151936
SHAPES = {  # Qwen3 release configs (hidden, layers, heads, kv heads, head_dim 128, FFN)
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=6144, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, tie_word_embeddings=True),
    # 30B-A3B has 48 layers; the full model's fp32 master + AdamW (~490 GB) cannot train on 1-2 GPUs, so the
    # benchmark keeps its exact layer shape (128 experts, top-8, moe FFN 768) with 8 of the 48 layers.
    "30b-a3b-8l": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                       intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                       norm_topk_prob=True, decoder_sparse_step=1, tie_word_embeddings=False, moe=True),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, tie_word_embeddings=True),
    "tiny-moe": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, decoder_sparse_step=1, tie_word_embeddings=True, moe=True),
}


def shape(name: str) -> dict:
    """SHAPES[name]; `30b-a3b-<N>l` is the 30B-A3B layer shape with N layers (the memory study's rows)."""
    if name in SHAPES:
        return dict(SHAPES[name])
    if re.fullmatch(r"30b-a3b-\d+l", name):
        return {**SHAPES["30b-a3b-8l"], "num_hidden_layers": int(name[len("30b-a3b-"):-1])}
    raise SystemExit(f"--shapes: unknown shape {name!r}; one of {sorted(SHAPES)} or 30b-a3b-<N>l")


def write_config(name: str, rank: int) -> str:
    import transformers
    kw = shape(name)
    cls = transformers.Qwen3MoeConfig if kw.pop("moe", False) else transformers.Qwen3Config
    tiny = name.startswith("tiny")
    cfg = cls(vocab_size=512 if tiny else V, head_dim=32 if tiny else 128,
              max_position_embeddings=40960, rope_theta=1e6, **kw)
    d = Path(tempfile.gettempdir()) / f"molt_bench_{name}_r{rank}"
    cfg.save_pretrained(d)
    return str(d)


def peak_bf16_tflops(device) -> float:
    if device.type != "cuda":
        return 0.0
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16),
            torch.randn(n, n, device=device, dtype=torch.bfloat16))
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    iters, t = 50, time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e12


def samples(n: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        mask = torch.zeros(seq)
        mask[seq // 4:] = 1  # a quarter prompt, the rest response
        out.append({"input_ids": ids, "action_mask": mask, "advantages": torch.randn(seq, generator=g) * mask,
                    "old_logprobs": torch.zeros(seq)})
    return out


def ceiling(name, ac, args, rank, peak):
    """Plain transformers model of the same shape: bf16 weights, no FSDP, no optimizer; fwd+bwd of mean log p over
    the same B x S tokens as one trainer micro-batch. MFU with the trainer's own FLOP count (parallel/perf.py)."""
    import transformers

    from molt_hydra.models.logprobs import logprobs_from_logits
    from molt_hydra.parallel.perf import flops_per_token
    cfg = transformers.AutoConfig.from_pretrained(write_config(name, rank))
    if "a3b" in name:
        cfg._experts_implementation = "grouped_mm"
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    b = max(1, args.mb_tokens // args.seq)
    ids = torch.randint(0, cfg.vocab_size, (b, args.seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for i in range(5):
        if i == 2:
            torch.cuda.synchronize()
            t = time.perf_counter()
        lp = logprobs_from_logits(model(input_ids=ids).logits, ids)
        lp.mean().backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / 3
    tok = b * args.seq
    rec = {"ceiling_tok_s": tok / dt, "ceiling_mfu": tok * flops_per_token(cfg, args.seq) / dt / (peak * 1e12),
           "ceiling_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "ceiling_batch": f"{b}x{args.seq}"}
    del model, ids, lp
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def bench_one(name, ac, variant, args, rank, world, port, peak):
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.compat.torch import compiled_graphs
    from molt_hydra.parallel.objectives import ActorObjective
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    path = write_config(name, rank)
    flags = set(variant.split("+"))
    backend = "automodel" if "am" in flags else "hf"
    overrides = {"_experts_implementation": "grouped_mm"} if "a3b" in name and backend == "hf" else None
    experts_impl = "grouped" if "grouped" in flags else "loop" if "loop" in flags else "auto"
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    t = time.perf_counter()
    spec = TrainerSpec(rank=rank, world_size=world, master_port=port, model_path=path, random_init=True,
                       gradient_checkpointing=ac, lr=1e-6,
                       param_dtype="bf16" if torch.cuda.is_available() else "fp32",  # CPU: the fp32 smoke run
                       max_tokens_per_micro_batch=args.mb_tokens, backend=backend, packing="packed" in flags,
                       compile_blocks="compile" in flags, ep_size=2 if "ep2" in flags else 1,
                       master_weights="optimizer" if "mw" in flags else "fsdp",
                       peak_tflops=peak or None, config_overrides=overrides, fused_head="logits" not in flags,
                       moe_experts_impl=experts_impl, timeout_s=300,
                       lora=dict(rank=args.lora_rank, alpha=2.0 * args.lora_rank, dropout=0.0, init="default",
                                 target_modules=None) if "lora" in flags else None)
    w = TrainerWorker(spec)
    if "tfexperts" in flags:  # the HF path before models/moe_experts.py: transformers' own grouped_mm experts
        restore_transformers_experts(w.model)
    build_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in w.model.parameters())  # DTensor numel = global numel
    n_trained = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
    obj = ActorObjective(PolicyLoss("ppo"))
    data = samples(args.mbs, args.seq, w.model.config.vocab_size, seed=rank)
    runs, graphs = [], []
    for i in range(args.steps + 1):
        m = w.train_step(data, obj)
        graphs.append(compiled_graphs())  # torch.compile's graphs so far (compat/torch.py)
        if i:
            runs.append(m)
    row = f"{name}:{args_ac(ac)}:{variant}"
    profiled = row in args.profile.split("|")
    phases = None
    if profiled and rank == 0:  # torch profiler over one more step: where the step time goes
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            w.train_step(data, obj)
        print(f"== profile {row}: {len(prof.events())} events", flush=True)
        for key in ("self_cpu_time_total", "self_device_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70), flush=True)
        phases = phase_breakdown(prof)
    elif profiled:
        w.train_step(data, obj)
    rec = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k.startswith("perf/")}
    rec["policy_loss"] = runs[-1]["policy_loss"]
    # graphs torch.compile built in the first step, and after it (a recompile: a new shape or a failed guard)
    rec["compiled_graphs_first_step"], rec["recompiles_after_first_step"] = graphs[0], graphs[-1] - graphs[0]
    # weight-sync send side: full bf16 tensors, bucket 1 GiB, to GPU (NCCL-broadcast source) and to host
    # (shm/object store)
    for dev in (("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)) if args.gather else ():
        dist.barrier()
        t = time.perf_counter()
        nbytes = 0
        for bucket in w.weight_buckets(1 << 30, dtype=torch.bfloat16, device=dev):
            nbytes += sum(x.numel() * x.element_size() for _, x in bucket)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        rec[f"gather_{dev}_s"] = time.perf_counter() - t
        rec[f"gather_{dev}_gb"] = nbytes / 1e9
    if phases:
        rec["phases_ms"] = phases
    rec.update(model=name, ac=ac, variant=variant, world=world, params_b=n_params / 1e9, build_s=build_s,
               experts_impl="transformers" if "tfexperts" in flags else w.moe_experts_impl,
               trained_params_b=n_trained / 1e9,
               tokens_per_gpu_step=args.mbs * args.seq, mb_tokens=args.mb_tokens, peak_tflops=peak)
    del w, obj
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def restore_transformers_experts(model) -> None:
    from molt_hydra.compat.transformers import PatchedExperts
    for m in model.modules():
        if isinstance(m, PatchedExperts):
            m.__class__ = next(c for c in type(m).__mro__[1:] if c is not PatchedExperts)


# step phases from the profiler: each kernel's device time goes to the aten op that launched it (self time), the op
# to the first phase one of whose name fragments it contains; "dense matmul" also holds the loop's per-expert GEMMs
PHASES = (
    ("optimizer", ("adam", "_foreach_", "clip_grad", "_amp_")),
    ("experts GEMM", ("_grouped_mm",)),
    ("permute", ("argsort", "sort", "scatter_add", "cumsum", "index_select", "index_copy", "index_add", "nonzero",
                 "where", "aten::index", "index_put", "histc", "one_hot")),
    ("router", ("topk", "softmax_backward", "aten::_softmax", "aten::softmax")),
    ("attention", ("attention", "flash", "cudnn", "sdpa", "_efficient")),
    ("loss / log-probs", ("log_softmax", "logsumexp", "nll", "cross_entropy", "aten::gather")),
    ("dense matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("casts / copies", ("aten::copy_", "aten::_to_copy", "aten::to", "chunk_cat", "aten::cat", "fill_", "zero_")),
)


def phase_breakdown(prof) -> dict[str, float]:
    ms = {phase: 0.0 for phase, _ in PHASES} | {"other": 0.0}
    other = {}
    clock = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"  # CPU: the smoke run
    for ev in prof.key_averages():
        t = getattr(ev, clock) / 1e3
        # a kernel is also its own event whose time its launching op's self device time already holds: count it once;
        # "Command Buffer Full" is CUPTI's time of the host blocked on a full launch queue, not device work
        if t <= 0 or ev.device_type != torch.autograd.DeviceType.CPU or ev.key == "Command Buffer Full":
            continue
        phase = next((p for p, frags in PHASES if any(f in ev.key for f in frags)), "other")
        ms[phase] += t
        if phase == "other":
            other[ev.key] = other.get(ev.key, 0.0) + t
    total = sum(ms.values())
    print(f"== phases ({clock[5:8]} ms, share): " + ", ".join(f"{p} {v:.1f} ({v / total:.0%})" for p, v in ms.items()
                                                     if v > 0) + f"; total {total:.1f}", flush=True)
    print("   largest in other: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                            sorted(other.items(), key=lambda kv: -kv[1])[:16]), flush=True)
    return {p: round(v, 2) for p, v in ms.items()}


def print_summary(results) -> None:
    """The rows side by side: MFU, tok/s, and the same-run plain-HF ceiling (same shape, AC, tokens)."""
    print("== summary: row | experts | tok/s | MFU % | ceiling MFU % | trainer / ceiling | step s | peak GB | loss | "
          "compiled graphs (recompiles after step 1)")
    for r in results:
        head = f"{r['model']}:{args_ac(r['ac'])}:{r['variant']}"
        if "error" in r:
            print(f"== {head} | ERROR {r['error'][:200]}")
            continue
        ceiling = f"{100 * r['ceiling_mfu']:.1f}" if "ceiling_mfu" in r else r.get("ceiling_error", "-")[:80]
        ratio = f"{r['trainer_over_ceiling']:.2f}" if "trainer_over_ceiling" in r else "-"
        print(f"== {head} | {r.get('experts_impl')} | {r['perf/train_tokens_per_sec']:,.0f} | "
              f"{100 * r.get('perf/mfu', 0):.1f} | {ceiling} | {ratio} | {r['perf/step_time_s']:.3f} | "
              f"{r.get('perf/gpu_mem_peak_gb', 0):.1f} | {r['policy_loss']:.6f} | "
              f"{r['compiled_graphs_first_step']} ({r['recompiles_after_first_step']})", flush=True)


def args_ac(ac):
    return {False: "0", True: "1", "selective": "sel"}[ac]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="0.6b:0,4b:0,4b:1,30b-a3b-8l:1",
                    help="comma list of SHAPE:AC[:VARIANT] (AC 0 / 1 / sel; VARIANT hf, am, +compile, +packed)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4, help="sequences per GPU per step")
    ap.add_argument("--mb-tokens", type=int, default=0, help="token budget per micro-batch (0: all mbs sequences)")
    ap.add_argument("--ceiling", type=int, default=1, help="measure the plain-HF ceiling per shape (1 GPU runs)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--profile", default="",
                    help="SHAPE:AC:VARIANT rows, '|'-separated, whose extra step is profiled (torch profiler tables)")
    ap.add_argument("--gather", type=int, default=1, help="time the weight-sync send side's full gathers")
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of the +lora rows' adapter")
    args = ap.parse_args()
    base_mbs, base_mb_tokens = args.mbs, args.mb_tokens
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    from molt_hydra.parallel.distributed import init_distributed
    device = init_distributed(rank, world, os.environ["MASTER_ADDR"], port, timeout_s=300)
    peak = torch.tensor(peak_bf16_tflops(device))
    dist.all_reduce(peak, op=dist.ReduceOp.MIN)
    results, ceilings = [], {}
    for item in args.shapes.split(","):
        parts = item.split(":")
        name, ac = parts[:2]
        variant, mbs = (parts[2] if len(parts) > 2 else "hf"), (parts[3] if len(parts) > 3 else "")
        args.mbs = int(mbs) if mbs else base_mbs
        args.mb_tokens = base_mb_tokens or args.mbs * args.seq
        ac = {"0": False, "1": True, "sel": "selective"}[ac]
        try:
            rec = bench_one(name, ac, variant, args, rank, world, port, float(peak))
            if args.ceiling and torch.cuda.is_available() and world == 1:
                key = (name, bool(ac), args.mb_tokens)
                if key not in ceilings:
                    try:
                        ceilings[key] = ceiling(name, bool(ac), args, rank, float(peak))
                    except Exception as e:
                        ceilings[key] = {"ceiling_error": f"{type(e).__name__}: {e}"[:300]}
                        gc.collect()
                        torch.cuda.empty_cache()
                rec.update(ceilings[key])
                if "ceiling_mfu" in rec and "perf/mfu" in rec:
                    rec["trainer_over_ceiling"] = rec["perf/mfu"] / rec["ceiling_mfu"]
        except Exception as e:  # record and go on: one OOM must not lose the other rows
            rec = {"model": name, "ac": ac, "variant": variant, "world": world,
                   "error": f"{type(e).__name__}: {e}"[:500]}
            if rank == 0:
                traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        results.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    if rank == 0:
        print_summary(results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
