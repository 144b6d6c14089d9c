"""The metric sinks and the progress line with values a faulty run produces: NaN is shown, never dropped or fatal;
a resumed run keeps one row per step."""

import json
import math

from molt_hydra.logging.progress import Progress
from molt_hydra.logging.sinks import MetricSinks


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_non_finite_values_are_logged_not_dropped(tmp_path):
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    sinks.log({"reward": float("nan"), "loss": float("inf"), "ok": 1.0, "flag": True, "name": "x"}, step=1)
    sinks.close()
    (row,) = rows(tmp_path / "metrics.jsonl")
    assert math.isnan(row["train/reward"]) and row["train/loss"] == math.inf and row["train/ok"] == 1.0
    assert "train/flag" not in row and "train/name" not in row  # only numbers are metrics


def test_progress_line_survives_a_nan_reward(capsys):
    progress = Progress(total_steps=2)
    progress.step(1, {"reward": float("nan"), "timing/step_total": 1.0})
    progress.step(2, {"reward": 0.5})
    out = capsys.readouterr().out
    assert "reward    nan" in out and "reward  0.500 " + "█" * 10 in out


def test_rewind_keeps_one_row_per_step_after_a_resume(tmp_path):
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    for step in (1, 2, 3):  # the interrupted run got past its step-2 checkpoint
        sinks.log({"reward": float(step)}, step)
        sinks.log_samples([("p", "r", 0.0)], step)
    sinks.close()
    resumed = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    resumed.rewind(2)
    resumed.log({"reward": 30.0}, 3)
    resumed.close()
    assert [(r["step"], r["train/reward"]) for r in rows(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [r["step"] for r in rows(tmp_path / "samples.jsonl")] == [1, 2]
