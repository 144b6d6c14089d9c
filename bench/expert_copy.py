"""The copy-plan replay of a MoE's experts into vLLM's fused layout, on a GPU: per-expert copies (the plan as
recorded: one copy per expert and projection, in one CUDA graph on 4 streams) against the merged plan (one copy per
layer and projection; a transposed pair through the tiled kernel, weight_sync/transposed_copy.py), both against a
device copy of the same bytes in the same process. Two trainer layouts: AutoModel's grouped experts ([E, H, 2I] /
[E, I, H]: every expert view transposed) and transformers-5's ([E, 2I, H] / [E, H, I]: rows as vLLM's).
Qwen3-30B-A3B's expert widths (E 128, hidden 2048, I 768), 8 layers: the MoE recipe's 9.7 GB of experts.

    python bench/expert_copy.py [--layers 8] [--no-append]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_row  # noqa: E402

from molt_hydra.weight_sync.copy_plan import CopyPlan, record_copy_plan  # noqa: E402

E, HIDDEN, INTER = 128, 2048, 768


def layers_of(n: int, automodel: bool):
    """Per layer: the trainer's (gate_and_up, down), the engine's (w13, w2), and the loader's per-expert views."""
    out = []
    for _ in range(n):
        if automodel:
            gate_and_up = torch.randn(E, HIDDEN, 2 * INTER, device="cuda", dtype=torch.bfloat16)
            down = torch.randn(E, INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
            views = [(gate_and_up[e, :, :INTER].T, gate_and_up[e, :, INTER:].T, down[e].T) for e in range(E)]
        else:
            gate_and_up = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
            down = torch.randn(E, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16)
            views = [(gate_and_up[e, :INTER], gate_and_up[e, INTER:], down[e]) for e in range(E)]
        w13 = torch.empty(E, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
        w2 = torch.empty(E, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16)
        out.append(((gate_and_up, down), (w13, w2), views))
    return out


def plan_of(layers) -> CopyPlan:
    def load():  # vLLM's FusedMoE loader: expert by expert, projection by projection
        for _, (w13, w2), views in layers:
            for e, (gate, up, down) in enumerate(views):
                w13[e, :INTER].copy_(gate)
                w13[e, INTER:].copy_(up)
                w2[e].copy_(down)

    weights = [(str(i), t) for i, (trainer, _, _) in enumerate(layers) for t in trainer]
    engine = [t for _, tensors, _ in layers for t in tensors]
    return record_copy_plan(load, weights, engine, ())


def seconds(run, repeats: int = 10) -> float:
    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def device_copy_seconds(nbytes: int) -> float:
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    return seconds(lambda: dst.copy_(src))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args, _ = parser.parse_known_args()
    for automodel in (True, False):
        layers = layers_of(args.layers, automodel)
        nbytes = sum(t.numel() * t.element_size() for _, tensors, _ in layers for t in tensors)
        copy_s = device_copy_seconds(nbytes)
        merged = plan_of(layers)
        per_expert = plan_of(layers)
        per_expert.replayed = per_expert.copies  # the plan as recorded: one copy per expert and projection
        before, after = seconds(per_expert.replay), seconds(merged.replay)
        for (gate_and_up, down), (w13, w2), _ in layers:  # the merged replay wrote what the loader writes
            assert torch.equal(w13, gate_and_up.transpose(1, 2) if automodel else gate_and_up)
            assert torch.equal(w2, down.transpose(1, 2) if automodel else down)
        trainer = "AutoModel [E, H, 2I] / [E, I, H]" if automodel else "transformers-5 [E, 2I, H] / [E, H, I]"
        append_row("expert_copy", f"{trainer} -> vLLM w13 / w2, bf16, {args.layers} layers x {E} experts, "
                   f"{nbytes / 1e9:.2f} GB, {torch.cuda.get_device_name()}, CUDA graph, best of 10",
                   f"device copy {copy_s * 1e3:.2f} ms", f"per-expert ({len(per_expert.copies)} copies) "
                   f"{before * 1e3:.2f} ms = {copy_s / before:.2f} of the copy; merged ({len(merged.replayed)} "
                   f"copies) {after * 1e3:.2f} ms = {copy_s / after:.2f}", f"{before / after:.2f}x faster")
        del layers, merged, per_expert
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
