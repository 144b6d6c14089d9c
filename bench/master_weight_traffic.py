"""Why `model.master_weights=optimizer` beats `fsdp` on one GPU with several micro-batches per step: the bytes each mode
moves outside the model's own math, per parameter per micro-batch, counted on CPU (the count does not depend on the
device), then turned into milliseconds at the H200's copy bandwidth (an extrapolation, printed as one).

Setup: one gloo rank, a random Qwen3 (the tiny one widened, `SHAPE`), `TrainerWorker` with param_dtype=bf16, K = 4
micro-batches of one sample each per optimizer step, one warm-up step, then one counted step per mode, both in one
rank process. `fsdp`: fp32 params in FSDP2 (MixedPrecisionPolicy bf16 / fp32 reduce, reshard_after_forward=False on one
rank). `optimizer`: bf16 params, no FSDP2 on one rank, fp32 masters in MasterWeightAdamW. The fsdp mode's AdamW is
made fused here, as the trainer makes it on a GPU (on CPU it picks torch's per-tensor loop, whose temporaries are a CPU
artifact).

Counting: a TorchDispatchMode sees every aten / fsdp / c10d op; an op is attributed to the innermost Python frame that
is FSDP2 (`torch/distributed/fsdp/`), the optimizer (`parallel/optim.py`, `torch/optim/`, `clip_grad`) or the model
(transformers, torch.nn, autograd's own backward kernels, the loss). Model ops are the model's math and are not
counted. An op's bytes: every tensor it reads plus every tensor it writes (an `out=` / `copy_` destination is written,
not read; an in-place `add_` reads and writes its self; views move nothing). Phases: (a) weight = FSDP2 ops outside
backward, (b) grad = FSDP2 ops inside backward and MasterWeightAdamW's accumulate hook, (c) step = clip + AdamW +
master copy-back, once per step.

EXPECTED bytes per parameter (R read + W written), from torch 2.13's FSDP2 and `parallel/optim.py`. On one rank this
FSDP2 skips its collectives (pytorch#160135 / #162021, Aug-Sep 2025, before the torch 2.11 of the H200 rows; that
build was not checked): no flat all-gather buffer, no all-gather, no split_with_sizes_copy, no reduce-scatter; but it
still casts and copies every micro-batch:

fsdp, (a) weight, every micro-batch (`FSDPParamGroup.wait_for_unshard`, world_size == 1): `fsdp_param.all_gather_inputs`
casts the fp32 shard to bf16 (`_to_copy`, R4 W2 = 6), then `all_gather_outputs[0].copy_(...)`, the unsharded
param's storage (R2 W2 = 4): 10 B.
(b) grad (`foreach_reduce`): `chunk_cat` of the bf16 grad into the fp32 reduce buffer (R2 W4 = 6);
`reduce_output.copy_(reduce_scatter_input)` in place of the reduce-scatter (R4 W4 = 8); from the 2nd micro-batch on,
`sharded_grad += reduce_output` (R8 W4 = 12): 14 B on the 1st micro-batch, 26 B after, 23 B on average over K = 4.
optimizer, (a): 0 (the bf16 params are used as they are). (b) (`MasterWeightAdamW._accumulate`): 1st micro-batch
`p.grad.float()` (R2 W4 = 6), then `main.add_(p.grad)` (R4+2 W4 = 10): 9 B on average over K = 4.
(c) step, once per optimizer step: fsdp: clip (`_foreach_norm` R4, `_foreach_mul_` R4 W4) + fused AdamW (R p g m v
16, W p m v 12) = 40 B; optimizer: norm of the fp32 sums (R4) + fused AdamW on the masters (28) + `_foreach_copy_`
master -> bf16 param (R4 W2 = 6) = 38 B.
Per micro-batch: fsdp 10 + 23 = 33 B, optimizer 9 B (3.67x); with the step spread over K = 4: 43 vs 18.5 B (2.32x).
Collectives (c10d ops, counted as input + output bytes) are listed apart: none are expected on one rank.

    .venv/bin/python bench/master_weight_traffic.py [--no-append]
"""

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row  # noqa: E402

K, TOKENS = 4, 128
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, layer_types=["full_attention"] * 4)
EXPECTED = {  # (mode, phase) -> bytes per param per micro-batch (step: per step), see the docstring
    ("fsdp", "weight"): 10.0, ("fsdp", "collective"): 0.0, ("fsdp", "grad"): 23.0, ("fsdp", "step"): 40.0,
    ("optimizer", "weight"): 0.0, ("optimizer", "collective"): 0.0, ("optimizer", "grad"): 9.0,
    ("optimizer", "step"): 38.0}
PHASES = ("weight", "collective", "grad", "step")
COPY_BW = 4.26e12  # bytes read + written per second: a device copy at 2.13 TB/s (H200, session 15)
# the GPU rows (bench/RESULTS.md): params, micro-batches a step, step seconds, MFU %
ROWS = {"Qwen3-4B (step: session 15's AutoModel eager row)": (4.02e9, 4, 0.680, None),
        "30B-A3B shape, 8 layers (session 15, AutoModel compiled, fsdp mode, 4 x 8,192 tokens)":
            (5.61e9, 4, 0.828, 26.0)}
CALL_D = (8192 / 6625, 8192 / 9529)  # session 4 call D, Qwen3-4B, 4 x 2,048 tokens: s/step fsdp, optimizer (1.44x)

FRAMES = (("torch/distributed/fsdp/", "fsdp"), ("molt_hydra/parallel/optim.py", "optim"), ("torch/optim/", "optim"),
          ("torch/nn/utils/clip_grad", "optim"), ("transformers/", "model"), ("torch/nn/", "model"),
          ("torch/autograd/", "model"), ("molt_hydra/models/", "model"), ("molt_hydra/algorithm/", "model"),
          ("molt_hydra/parallel/objectives", "model"))
PURE_WRITES = {"copy_", "_foreach_copy_", "fill_", "zero_", "_foreach_zero_"}  # self is written, never read
READ_ONLY = {("_fused_adamw_", "grads")}  # marked mutable in the schema, only read by the kernel
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _tensors(v):
    return [t for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]


def _storage(t) -> int:
    t = getattr(t, "_local_tensor", t)  # a DTensor's shard (one rank: the whole tensor)
    return t.untyped_storage().data_ptr()


def op_bytes(func, args, kwargs, out) -> tuple[str, int]:
    """(kind, bytes read + written) of one op: kind "collective" for c10d ops (their input + output buffers)."""
    name = func._schema.name.split("::")[1]
    values = [(a, args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
              for i, a in enumerate(func._schema.arguments)]
    if func.is_view or name in ALLOCATIONS:  # no element read or written
        return "copy", 0
    if func.namespace == "c10d":
        return "collective", sum(_nbytes(t) for _, v in values for t in _tensors(v))
    if name == "all_gather_copy_in":  # writes its inputs, cast to the buffer's dtype, into its second argument
        inputs, buf = _tensors(values[0][1]), values[1][1]
        return "copy", sum(_nbytes(t) + t.numel() * buf.element_size() for t in inputs)
    total, seen = 0, set()
    for a, v in values:
        ts = _tensors(v)
        seen.update(_storage(t) for t in ts)
        written = a.alias_info is not None and a.alias_info.is_write and (name, a.name) not in READ_ONLY
        read = not written or not (a.name == "out" or (name in PURE_WRITES and a.name == "self"))
        total += sum(_nbytes(t) for t in ts) * (written + read)
    # results in new memory are written; views and out= results alias an argument's storage
    total += sum(_nbytes(t) for t in _tensors(out) if _storage(t) not in seen)
    return "copy", total


class Traffic(TorchDispatchMode):
    """Bytes of FSDP2's and the optimizer's ops by (micro-batch or "step", phase, op); the model's ops by op."""

    def __init__(self):
        super().__init__()
        self.micro, self.bytes, self.where = 0, defaultdict(int), {}
        self.model_bytes = self.other_bytes = 0

    def owner(self) -> tuple[str, str] | None:
        f = sys._getframe(2)
        while f is not None:
            code = f.f_code
            if code not in self.where:
                path = code.co_filename.replace("\\", "/")
                self.where[code] = next((who for key, who in FRAMES if key in path), None)
            if (who := self.where[code]) is not None:
                return who, code.co_name
            f = f.f_back
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        who = self.owner()
        kind, n = op_bytes(func, args, kwargs, out)
        if who is None:  # the trainer's own bookkeeping (batches, token counts, metrics): not counted
            self.other_bytes += n
            return out
        if who[0] == "model":
            self.model_bytes += n
            return out
        backward = torch._C._current_graph_task_id() != -1
        if kind == "collective":
            phase = "collective"
        elif who[0] == "fsdp":
            phase = "grad" if backward else "weight"
        else:
            phase = "grad" if who[1] == "_accumulate" else "step"
        self.bytes[("step" if phase == "step" else self.micro, phase, func._schema.name)] += n
        return out


def samples(vocab: int) -> list[dict]:
    """K samples of TOKENS tokens (a quarter prompt), one per micro-batch (the budget is TOKENS)."""
    g, prompt = torch.Generator().manual_seed(0), TOKENS // 4
    mask = torch.cat([torch.zeros(prompt), torch.ones(TOKENS - prompt)])
    return [{"input_ids": torch.randint(0, vocab, (TOKENS,), generator=g), "action_mask": mask,
             "advantages": torch.randn(TOKENS, generator=g) * mask, "old_logprobs": torch.zeros(TOKENS)}
            for _ in range(K)]


def count_mode(port: int, mode: str) -> dict:
    """One warm-up step, then one counted step of K micro-batches in `mode`."""
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    from molt_hydra.parallel.optim import build_scheduler
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    w = TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=port, model_path="tiny://qwen3_tiny",
                                  random_init=True, config_overrides=SHAPE, param_dtype="bf16", master_weights=mode,
                                  max_tokens_per_micro_batch=TOKENS, lr=1e-5, max_norm=1.0, total_steps=10,
                                  timeout_s=600))
    if mode == "fsdp":  # fused, as the trainer's AdamW on a GPU (CPU params get torch's per-tensor loop)
        w.optimizer = torch.optim.AdamW(list(w.model.parameters()), lr=1e-5, betas=(0.9, 0.95), fused=True)
        w.scheduler = build_scheduler(w.optimizer, total_steps=10)
    batch, objective = samples(w.model.config.vocab_size), ActorObjective(PolicyLoss("ppo"))
    w.train_step(batch, objective)  # FSDP2's lazy init, the optimizer's state
    traffic = Traffic()
    w.model.register_forward_pre_hook(lambda *_: setattr(traffic, "micro", traffic.micro + 1), prepend=True)
    with traffic:
        metrics = w.train_step(batch, objective)
    return {"params": sum(p.numel() for p in w.model.parameters()), "micro": traffic.micro,
            "model_bytes": traffic.model_bytes, "other_bytes": traffic.other_bytes,
            "loss": {k: v for k, v in metrics.items() if "loss" in k},
            "bytes": [[str(k[0]), k[1], k[2], v] for k, v in traffic.bytes.items()],
            "param_dtypes": sorted({str(p.dtype) for p in w.model.parameters()}),
            "fsdp": type(w.model).__name__}


def job(rank, world_size, port, out):
    Path(out).write_text(json.dumps({mode: count_mode(port, mode) for mode in ("fsdp", "optimizer")}))


def summarise(r: dict) -> tuple[dict, dict]:
    """({phase: [bytes per param of micro-batch 1..K]} with "step" per step, {(phase, op): bytes per param per
    micro-batch, the step's per step})."""
    n, per, ops = r["params"], {p: [0.0] * K for p in PHASES}, defaultdict(float)
    for micro, phase, op, b in r["bytes"]:
        if micro == "step":
            per["step"][0] += b / n
        else:
            per[phase][int(micro) - 1] += b / n
        ops[(phase, op)] += b / n / (1 if micro == "step" else K)
    per["step"] = per["step"][:1]
    return per, ops


def report(res: dict) -> dict:
    """Prints measured vs expected per phase and mode, and the ops behind them; returns {mode: (B/param per
    micro-batch, B/param per step)}."""
    sums, fmt = {}, lambda xs: " ".join(f"{x:6.2f}" for x in xs)
    print(f"\nbytes read + written per parameter outside the model's math ({res['fsdp']['params'] / 1e6:.2f} M params,"
          f" K = {K} micro-batches of {TOKENS} tokens, param_dtype bf16, one gloo rank)")
    for mode, r in res.items():
        per, ops = summarise(r)
        mb = sum(sum(per[p]) / K for p in PHASES if p != "step")
        sums[mode] = (mb, per["step"][0])
        print(f"\n{mode}: params {'/'.join(r['param_dtypes'])}, model {r['fsdp']}, policy loss "
              f"{r['loss'].get('policy_loss', float('nan')):.6f}, {r['micro']} forwards counted")
        print(f"  {'phase':<34}{'micro-batch 1..' + str(K):>{7 * K}}   mean  expected")
        for phase in PHASES:
            label = {"weight": "(a) weight, per micro-batch", "collective": "    collectives, per micro-batch",
                     "grad": "(b) grad, per micro-batch", "step": "(c) optimizer step, per step"}[phase]
            mean = per[phase][0] if phase == "step" else sum(per[phase]) / K
            cells = "" if phase == "step" else fmt(per[phase])
            print(f"  {label:<34}{cells:>{7 * K}} {mean:6.2f}  {EXPECTED[(mode, phase)]:6.2f}")
        print(f"  {'(a) + (b), per micro-batch':<34}{'':>{7 * K}} {mb:6.2f}  "
              f"{sum(EXPECTED[(mode, p)] for p in PHASES if p != 'step'):6.2f}")
        for phase in PHASES:
            named = [f"{op} {v:.2f}" for (ph, op), v in sorted(ops.items()) if ph == phase and v >= 0.005]
            print(f"    {phase}: " + (", ".join(named) or "-"))
        print(f"  not counted above: the model's own ops (matmuls included) {r['model_bytes'] / K / 1e6:.1f} MB, the "
              f"trainer's bookkeeping {r['other_bytes'] / K / 1e3:.1f} kB per micro-batch")
    (f_mb, f_st), (o_mb, o_st) = sums["fsdp"], sums["optimizer"]
    print(f"\nfsdp / optimizer: {f_mb / o_mb:.2f}x per micro-batch, {(f_mb + f_st / K) / (o_mb + o_st / K):.2f}x with "
          f"the step spread over the {K} micro-batches")
    return sums


def extrapolate(sums: dict) -> list[str]:
    """EXTRAPOLATION to the H200 rows: these bytes at a device copy's bandwidth, assuming the traffic neither overlaps
    the matmuls nor runs slower than one large copy (small per-parameter copies do: so this is a floor), and that
    AutoModel's one-rank FSDP2 (the 30B row) takes the same path per parameter as the HF path counted here."""
    print(f"\nEXTRAPOLATION (not measured): the bytes above at {COPY_BW / 2e12:.2f} TB/s of copied bytes "
          f"({COPY_BW / 1e12:.2f} TB/s read + written, H200 device copy, session 15); per optimizer step")
    lines = []
    for label, (n, k, step_s, mfu) in ROWS.items():
        ms = {mode: ((k * mb) * n / COPY_BW * 1e3, st * n / COPY_BW * 1e3) for mode, (mb, st) in sums.items()}
        (f_mb, f_st), (o_mb, o_st) = ms["fsdp"], ms["optimizer"]
        line = (f"{label}, {n / 1e9:.2f} B params, step {step_s:.3f} s: fsdp {f_mb:.0f} ms of micro-batch traffic + "
                f"{f_st:.0f} ms step = {f_mb + f_st:.0f} ms ({100 * (f_mb + f_st) / 1e3 / step_s:.0f} % of the step); "
                f"optimizer {o_mb:.0f} + {o_st:.0f} = {o_mb + o_st:.0f} ms; saved {f_mb + f_st - o_mb - o_st:.0f} ms")
        if mfu:
            at = lambda saved_ms: mfu * step_s / (step_s - saved_ms / 1e3)  # noqa: E731
            line += (f"; MFU {mfu:.1f} % -> {at(f_mb):.1f} % without fsdp's micro-batch traffic, "
                     f"{at(f_mb + f_st - o_mb - o_st):.1f} % with the optimizer mode's traffic instead")
        print("  " + line)
        lines.append(line)
    gap = CALL_D[0] - CALL_D[1]
    saved = next(iter(ROWS.values()))[0] * (K * (sums["fsdp"][0] - sums["optimizer"][0]) + sums["fsdp"][1]
                                            - sums["optimizer"][1]) / COPY_BW
    lines.append(f"Qwen3-4B call D (session 4) measured {CALL_D[0]:.3f} vs {CALL_D[1]:.3f} s/step: the traffic saved "
                 f"({1e3 * saved:.0f} ms) is {100 * saved / gap:.0f} % of its {1e3 * gap:.0f} ms gap")
    print("  " + lines[-1])
    return lines


def main():
    from molt_hydra.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "traffic.json"
        run_ranks(job, 1, str(out), timeout_s=600, threads_per_rank=2)
        res = json.loads(out.read_text())
    sums = report(res)
    lines = extrapolate(sums)
    (f_mb, f_st), (o_mb, o_st) = sums["fsdp"], sums["optimizer"]
    off = ", ".join(f"{mode} {phase} {value:.2f} (expected {EXPECTED[(mode, phase)]:.2f})"
                    for mode in res for phase, values in summarise(res[mode])[0].items()
                    if abs((value := sum(values) / (1 if phase == "step" else K)) - EXPECTED[(mode, phase)]) > 0.01)
    append_row("master_weight_traffic", f"random Qwen3 {res['fsdp']['params'] / 1e6:.2f} M params (tiny widened: "
               f"{SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}), TrainerWorker param_dtype bf16, "
               f"1 gloo rank, 1 step of {K} micro-batches x {TOKENS} tokens after a warm-up, bytes read + written "
               "by FSDP2's / the optimizer's ops (TorchDispatchMode), per param",
               f"fsdp: (a) weight {sum(summarise(res['fsdp'])[0]['weight']) / K:.2f} + (b) grad "
               f"{sum(summarise(res['fsdp'])[0]['grad']) / K:.2f} = {f_mb:.2f} B per micro-batch, step {f_st:.2f} B",
               f"optimizer: (a) 0 + (b) {o_mb:.2f} B per micro-batch, step {o_st:.2f} B",
               f"fsdp/optimizer {f_mb / o_mb:.2f}x per micro-batch, {(f_mb + f_st / K) / (o_mb + o_st / K):.2f}x with "
               f"the step; {off or 'every phase equals the expected value (within 0.01 B)'}",
               note="EXTRAPOLATION at 4.26 TB/s read + written (not measured): " + "; ".join(lines))


if __name__ == "__main__":
    main()
