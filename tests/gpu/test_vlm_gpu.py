"""The geo3k recipe's model family on real vLLM on one GPU (run on the device):
`source .stage/bin/env.sh && python -m pytest -m gpu -s tests/gpu/test_vlm_gpu.py`.

One `molt-run +recipe=qwen3_vl_moe_geo_gpu` (random-init Qwen3-VL-MoE built locally; one vLLM engine + the FSDP2
trainer colocated; GRPO through the multi-turn python-tool chat agent; every prompt carries its triangle figure), and
what issue 37 asks of it, per step: the sampler's log-probs agree with the trainer's on these image-bearing sequences
(`vllm_kl`), vLLM captured the routed experts of every token, image tokens included, and under R3 the trainer used
exactly them (`routing/replayed` 1.0 overall, on image tokens and on text tokens: `mm_token_type_ids` tells them
apart), and the step time. The run's metrics and console go to $OUT (the device's returned folder) when it is set."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM's GPU build (make install-gpu; on the device: the staged site)")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RECIPE = "qwen3_vl_moe_geo_gpu"
QUIET = ["logger.progress=false", "logger.wandb.mode=disabled", "checkpoint.export_final=false",
         "checkpoint.save_steps=0"]


@pytest.fixture(scope="module")
def run():
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp()) / RECIPE
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "molt_hydra.cli", *QUIET, f"hydra.run.dir={out}", f"+recipe={RECIPE}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (out / "console.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    m = {r["step"]: r for r in rows if r["kind"] == "train"}
    summary = summarize(m)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{RECIPE}: {json.dumps(summary, indent=2)}")
    return m


def summarize(m: dict[int, dict]) -> dict:
    """What RESULTS.md's H200 row reports (every value per step, or its median over the steps after the first)."""
    steady = [m[s] for s in sorted(m)][1:] or list(m.values())
    keys = ["vllm_kl", "drift/abs_logp_diff_max", "routing/agreement", "routing/replayed", "routing/agreement_image",
            "routing/replayed_image", "routing/agreement_text", "routing/replayed_text", "routing/image_tokens",
            "reward", "rollout/num_samples", "rollout/dropped/total"]
    out = {k: [m[s].get(f"train/{k}") for s in sorted(m)] for k in keys}
    for key in ("timing/step_total", "timing/generation", "timing/policy_train", "timing/weight_sync",
                "perf/step_time_s"):
        out[f"median {key}"] = statistics.median(r.get(f"train/{key}", 0.0) for r in steady)
    out["steps"] = sorted(m)
    return out


def test_every_prompt_of_the_task_carries_its_image():
    # so every sequence vllm_kl averages over below is image-bearing
    from molt_hydra.data.prompts import load_prompts

    rows = load_prompts("builtin://geo_triangles", image_key="images", max_images_per_prompt=1)
    assert rows and all(len(r["images"]) == 1 for r in rows)


def test_ten_grpo_steps_with_images_and_sampler_logprobs_agree(run):
    m = run
    assert sorted(m) == list(range(1, 11))
    for step, row in m.items():
        assert row["train/rollout/num_samples"] > 0, step
        # bf16 engine vs the trainer's bf16 forward of its fp32 masters, images included (qwen3_toy_gpu: < 1e-2)
        assert abs(row["train/vllm_kl"]) < 1e-2, (step, row["train/vllm_kl"])


def test_vllm_routes_image_and_text_tokens_and_r3_replays_them(run):
    for step, row in run.items():
        # vLLM's capture covered the image tokens (their share of the routed tokens is reported) and the text ones
        assert 0 < row["train/routing/image_tokens"] < 1, step
        assert 0.5 < row["train/routing/agreement"] <= 1.0, step
        for part in ("", "_image", "_text"):  # R3: the trainer used exactly vLLM's experts on every routed token
            assert row[f"train/routing/replayed{part}"] == 1.0, (step, part)
        assert row["train/timing/step_total"] > 0
