"""MasterWeightAdamW's fp32 grad sums on one GPU (several micro-batches per step; `parallel/optim.py: add_into_fp32`):
eager `main.add_(grad)` (fp32 += bf16: ATen's dynamic-casting loop), torch._foreach_add_ over the list, and the fused
compiled add, each over the same tensors: every parameter of the 30B-A3B shape (`--layers`, 8: 5.61 B parameters, the
profiled step's) or `--gb` GB of fp32 sums in 64 odd-sized tensors. A pass is one add per tensor, as the hooks run
them; its bytes: 10 per parameter (fp32 read and written, bf16 read). The fused add first compiles and is checked bit
for bit against eager add_; then each path's best of `--repeats` passes (CUDA events, after a warm-up pass), as GB/s
and against a device copy measured here (bytes read + written, as above). The grads are views into one flat bf16
buffer, as FSDP2's reduced shards are; `--grad-offset 1` misaligns them all.

    python bench/grad_accumulate.py [--layers 8 | --gb 10] [--grad-offset 0] [--repeats 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from molt_hydra.compat.torch import compiled_graphs  # noqa: E402
from molt_hydra.parallel.optim import add_into_fp32, fused_add_graphs  # noqa: E402

V = 151936  # as bench/gpu_trainer.py's 30b-a3b-8l: H 2048, 32 q / 4 kv heads of 128, 128 experts of 768, untied head


def moe_shapes(layers: int) -> list[tuple[int, ...]]:
    h, q, kv, d, e, i = 2048, 32 * 128, 4 * 128, 128, 128, 768
    layer = [(q, h), (kv, h), (kv, h), (h, q), (d,), (d,), (h,), (h,), (e, h), (e, 2 * i, h), (e, h, i)]
    return [(V, h)] + layer * layers + [(h,), (V, h)]


def best_seconds(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


@torch.no_grad()  # as the optimizer's hook runs it (grad mode is part of torch.compile's guards)
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gb", type=float, help="instead of the model: this many GB of fp32 sums, 64 tensors")
    ap.add_argument("--grad-offset", type=int, default=0, help="elements before the first grad in the flat buffer")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/grad_accumulate.py needs a CUDA GPU (on CPU the sums stay eager add_: nothing to time)")
    shapes = [(int(args.gb * 1e9 / 4 / 64) | 1,)] * 64 if args.gb else moe_shapes(args.layers)
    sizes = [torch.Size(s).numel() for s in shapes]
    flat = torch.empty(args.grad_offset + sum(sizes), dtype=torch.bfloat16, device="cuda").normal_()
    grads = [g.view(s) for g, s in zip(flat[args.grad_offset:].split(sizes), shapes)]
    mains = [torch.zeros(s, device="cuda") for s in shapes]
    t0 = time.perf_counter()
    for g in grads[:12]:  # the fused kernel (compiled on the first) adds as eager torch does, bit for bit
        want = torch.randn(g.shape, device="cuda")
        got = want.clone()
        add_into_fp32(got, g)
        assert torch.equal(got, want.add_(g)), f"fused add differs from eager add_ on {tuple(g.shape)}"
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    paths = {"eager_add_": lambda: [m.add_(g) for m, g in zip(mains, grads)],
             "foreach_add_": lambda: torch._foreach_add_(mains, grads),
             "fused": lambda: [add_into_fp32(m, g) for m, g in zip(mains, grads)]}
    n = sum(sizes)
    seconds = {name: best_seconds(fn, args.repeats + 1) for name, fn in paths.items()}
    copy_bytes = min(4 << 30, 10 * n // 2)  # a copy moves twice its size
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gb_s = 2 * copy_bytes / best_seconds(lambda: dst.copy_(src), args.repeats + 1) / 1e9
    gb_s = {name: 10 * n / s / 1e9 for name, s in seconds.items()}
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "params": n, "tensors": len(shapes),
           "grad_offset": args.grad_offset, "ms": {k: round(s * 1e3, 3) for k, s in seconds.items()},
           "gb_s": {k: round(v, 1) for k, v in gb_s.items()}, "device_copy_gb_s": round(copy_gb_s, 1),
           "fused_vs_eager": round(seconds["eager_add_"] / seconds["fused"], 3),
           "vs_copy": {k: round(v / copy_gb_s, 3) for k, v in gb_s.items()},
           "fused_graphs": fused_add_graphs(), "compiled_graphs": compiled_graphs(),
           "compile_and_check_s": round(compile_s, 2)}
    for name in paths:
        print(f"{name:13s} {seconds[name] * 1e3:8.2f} ms  {gb_s[name]:7.1f} GB/s  {rec['vs_copy'][name]:.2f} of a copy")
    print(f"{n / 1e9:.2f} B params in {len(shapes)} tensors; device copy {copy_gb_s:.1f} GB/s; fused "
          f"{rec['fused_vs_eager']:.2f}x eager; fused graphs {rec['fused_graphs']} (compiled in {compile_s:.1f} s)")
    print(json.dumps(rec))
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
