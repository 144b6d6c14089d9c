"""The real GPU loop (run on the device: scripts/gpu_e2e.sh): real vLLM engines + Ray + the FSDP2 trainer + weight
sync, colocated on one GPU through `molt-run` itself. Each run is one GPU recipe; its metrics show what the issue asks:
the loop learns, the engine's memory is released while the trainer steps, the weights arrive by CUDA IPC (single
pass from the trainer's own parameters) and the sync probe finds them equal layer by layer, the sampler's log-probs
agree with the trainer's after every sync, and R3 replays vLLM's own routed experts. bench/gpu_colocated.py turns the
same runs' metrics into bench/RESULTS.md rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm", reason="needs vLLM's GPU build (make install-gpu; on the device: the staged site)")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MOLT_RUN = [sys.executable, "-m", "molt_hydra.cli"]
QUIET = ["logger.progress=false", "logger.wandb.mode=disabled", "checkpoint.export_final=false"]
# the MoE recipe's 8 layers need ~90 GiB colocated (its plan): an 80 GB card runs the same widths in 2 layers
MOE_FITS = [] if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else [
    "model.path=tiny://qwen3_moe_30b_a3b_2l"]


def molt_run(out: Path, *overrides: str, timeout: float = 900) -> dict[int, dict]:
    cmd = [*MOLT_RUN, *QUIET, f"hydra.run.dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (out / "console.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_toy_gpu")
    # the HF trainer, whatever is installed (model.backend=auto would pick AutoModel where it imports)
    return out, molt_run(out, "+recipe=qwen3_toy_gpu", "model.backend=hf")


def test_colocated_loop_learns_on_one_gpu(toy):
    _, m = toy
    assert sorted(m) == list(range(1, 21))
    rewards = [m[s]["train/reward"] for s in sorted(m)]
    assert mean(rewards[-5:]) - mean(rewards[:5]) > 0.1, rewards


def test_engine_sleep_releases_its_memory_and_the_push_wakes_it(toy):
    out, m = toy
    cfg = yaml.safe_load((out / "resolved_config.yaml").read_text())
    engine_gib = cfg["rollout"]["gpu_memory_utilization"] * cfg["cluster"]["memory_gb_per_device"]
    for row in m.values():
        # weights and KV cache are released (vLLM keeps its context, CUDA graphs and activations' workspace)
        assert row["train/engine/freed_gib"] > 0.5 * engine_gib, row["train/engine/freed_gib"]
        assert row["train/engine/wake_weights_s"] > 0 and row["train/engine/wake_kv_cache_s"] > 0


def test_weights_arrive_by_cuda_ipc_in_one_pass_and_the_probe_finds_them_equal(toy):
    _, m = toy
    for step, row in m.items():
        assert row["train/weight_sync/single_pass"] == 1.0, step  # the engine read the trainer's own parameters
        # the first sync records the loaders' copies (vocab padding fills included); every later one replays them
        assert row["train/weight_sync/replayed"] == (0.0 if step == 1 else 1.0), step
        # driven from the driver: one call per engine, whose two legs and the engine's own time make up the push
        legs = row["train/weight_sync/to_engine_seconds"] + row["train/weight_sync/from_engine_seconds"]
        assert 0 < legs < row["train/weight_sync/push_seconds"] - row["train/weight_sync/engine_call_seconds"], step
    probed = [s for s, row in m.items() if "train/weight_sync/probe_groups" in row]
    assert probed == [1, 5, 10, 15, 20]  # the first sync, then every probe_every=5
    for s in probed:  # every decoder layer + embedding + final norm summed equal on both sides (bf16 sums)
        assert m[s]["train/weight_sync/probe_groups"] == 28 + 2


def test_sampler_logprobs_agree_with_the_trainer_after_every_sync(toy):
    _, m = toy
    for step, row in m.items():  # bf16 engine vs the trainer's bf16 forward of its fp32 masters
        assert abs(row["train/vllm_kl"]) < 1e-2, (step, row["train/vllm_kl"])


def test_the_trainer_compiles_by_default_on_a_gpu_and_stops_recompiling(toy):
    """model.compile_blocks unset: the HF trainer's blocks compile on a GPU (the toy runs without activation
    checkpointing); the lengths change every step, yet after the first steps no graph is built again."""
    _, m = toy
    graphs = [m[s]["train/perf/compiled_graphs"] for s in sorted(m)]
    assert graphs[0] > 0 and len(set(graphs[5:])) == 1, graphs  # 20 steps: flat from step 6 on


def test_automodel_trainer_learns_colocated_and_its_weights_arrive_equal(tmp_path_factory):
    """The same toy recipe with NeMo AutoModel as the trainer's backend: the engine sleeps, wakes, takes AutoModel's
    weights over CUDA IPC (in one pass or bucketed, as its parameters allow), the probe finds them equal, and the
    loop learns as with the HF trainer."""
    pytest.importorskip("nemo_automodel", reason="needs NeMo AutoModel (make install-gpu; on the device: .whl)")
    out = tmp_path_factory.mktemp("qwen3_toy_gpu_automodel")
    m = molt_run(out, "+recipe=qwen3_toy_gpu", "model.backend=automodel")
    assert yaml.safe_load((out / "resolved_config.yaml").read_text())["model"]["backend"] == "automodel"
    rewards = [m[s]["train/reward"] for s in sorted(m)]
    assert sorted(m) == list(range(1, 21)) and mean(rewards[-5:]) - mean(rewards[:5]) > 0.1, rewards
    for step, row in m.items():
        assert abs(row["train/vllm_kl"]) < 1e-2 and row["train/engine/freed_gib"] > 0, (step, row)
    assert m[20]["train/weight_sync/probe_groups"] == 28 + 2


@pytest.mark.parametrize("replay,backend", [(True, "hf"), (False, "hf"), (True, "automodel")],
                         ids=["r3_on", "r3_off", "r3_on_automodel"])
def test_r3_replays_vllms_own_routed_experts_on_gpu(tmp_path_factory, replay, backend):
    """One run per setting, same seeds (`-k r3_off` runs one); bench/gpu_colocated.py puts the pair side by side.
    `r3_on_automodel`: the same with NeMo AutoModel's MoE as the trainer (its RouterReplay; no aux loss there)."""
    if backend == "automodel":
        pytest.importorskip("nemo_automodel", reason="needs NeMo AutoModel (make install-gpu; on the device: .whl)")
    out = tmp_path_factory.mktemp(f"qwen3_moe_r3_gpu_{'on' if replay else 'off'}_{backend}")
    m = molt_run(out, "+recipe=qwen3_moe_r3_gpu", *MOE_FITS, f"rollout.routing_replay={str(replay).lower()}",
                 f"model.backend={backend}", *(["model.aux_loss_coef=0"] if backend == "automodel" else []),
                 "train.max_steps=3", "checkpoint.save_steps=0")  # a 60 GB checkpoint: the device's disk is 64 GB
    assert sorted(m) == [1, 2, 3]
    for row in m.values():  # vLLM captured every token's experts: the trainer compares its own top-8 with them
        assert 0.5 < row["train/routing/agreement"] <= 1.0
        if replay:  # and, under R3, used exactly them
            assert row["train/routing/replayed"] == 1.0
        else:
            assert row["train/routing/replayed"] == row["train/routing/agreement"]
