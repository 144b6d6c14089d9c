"""SFT job on 2 gloo ranks with the tiny model: loss falls, eval loss falls, resume continues exactly."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from molt_hydra.parallel.sft import run_sft

pytestmark = pytest.mark.timeout(300)


def rows(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        out.append({"input": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"What is {a}+{b}?"}],
                    "output": f"The answer is \\boxed{{{a + b}}}."})
    return out


COMMON = dict(input_key="input", output_key="output", batch_size=8, lr=3e-3, num_ranks=2, lr_warmup_ratio=0.0,
              max_tokens_per_micro_batch=64, max_len=64, timeout_s=120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    train, evals = rows(16, 0), rows(8, 1)
    # (an earlier run in the output_dir the next two share: `first`, with no checkpoint, moves its metrics aside)
    full = run_sft("tiny://qwen3_tiny", train, str(d / "part"), eval_data=evals, max_epochs=3, eval_steps=2,
                   export_hf=False, **COMMON)
    first = run_sft("tiny://qwen3_tiny", train, str(d / "part"), max_epochs=2, save_steps=3,  # 3, then the last: 4
                    ckpt_path=str(d / "ckpt"), export_hf=False, **COMMON)
    rest = run_sft("tiny://qwen3_tiny", train, str(d / "part"), max_epochs=3, save_steps=2,
                   ckpt_path=str(d / "ckpt"), resume=True, export_hf=True, **COMMON)
    return full, first, rest, d


def test_sft_lowers_train_and_eval_loss(runs):
    full, _, _, _ = runs
    assert len(full) == 6  # 16 rows // batch 8 = 2 steps per epoch, 3 epochs
    losses = [r["sft_loss"] for r in full]
    assert losses[-1] < 0.7 * losses[0], losses
    evals = [r["eval sft_loss"] for r in full if "eval sft_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0], evals


def test_sft_resume_continues_where_it_stopped(runs):
    full, first, rest, d = runs
    assert [r["global_step"] for r in first] == [1, 2, 3, 4]
    assert [r["global_step"] for r in rest] == [5, 6]  # resumed after the last step's checkpoint (4, not 3)
    for a, b in zip(full, first + rest):
        assert b["sft_loss"] == pytest.approx(a["sft_loss"], rel=1e-5)
    # one row per step, this run's (the ranks' history is read from the file, after the rows an earlier run left)
    assert [json.loads(line) for line in (d / "part" / "sft_metrics.jsonl").read_text().splitlines()] == first + rest
    (aside,) = (d / "part").glob("sft_metrics.earlier-*.jsonl")
    assert [json.loads(line) for line in aside.read_text().splitlines()] == full
    cfg = json.loads((d / "part" / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_sft_metrics_keep_the_debug_grad_norms_nonfinite_count(tmp_path):
    """logger.debug_grad_norms in job=sft: each row has the top-k parameter grad norms and the count of parameters with
    a NaN / inf gradient (docs/metrics.md). Before: the count was computed and left out of sft_metrics.jsonl."""
    (rec,) = run_sft("tiny://qwen3_tiny", rows(8, 0), str(tmp_path), max_epochs=1, export_hf=False,
                     debug_grad_norms=((), 2), **{**COMMON, "num_ranks": 1})
    norms = {k: v for k, v in rec.items() if k.startswith("actor_grad_norm/")}
    assert len(norms) == 2 and all(v > 0 for v in norms.values())  # top 2 of every parameter (no filter)
    assert rec["actor_grad_nonfinite_params"] == 0.0  # a finite loss: every gradient finite
    assert json.loads((tmp_path / "sft_metrics.jsonl").read_text()) == rec
    # every key of the row is documented (was: none of the SFT keys was in docs/metrics.md)
    doc = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    documented = set(re.findall(r"`([^`]+)`", doc.read_text()))
    assert {k.split("/")[0] + "/<param name>" if "/" in k else k for k in rec} <= documented


def test_a_finished_sft_run_records_its_end_for_molt_report(tmp_path):
    """molt-report tells a finished run by the end its run_record.json records (an RL run's and job=eval's did;
    job=sft's did not, so a finished SFT run read as one that stopped)."""
    import os
    import subprocess
    import sys

    data = tmp_path / "chats.jsonl"
    data.write_text((json.dumps({"messages": [{"role": "user", "content": "1+1?"},
                                              {"role": "assistant", "content": "2"}]}) + "\n") * 8)
    out = tmp_path / "run"
    proc = subprocess.run([str(Path(sys.executable).with_name("molt-run")), "job=sft", f"data.train_path={data}",
                           "data.input_key=messages", "train.batch_size=8", "train.micro_batch_size=4",
                           "train.epochs=1", f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["global_step"] for line in open(out / "sft_metrics.jsonl") if '"sft_loss"' in line]
    assert json.loads((out / "run_record.json").read_text())["ended"] == {"step": max(steps)} and max(steps) == 1
