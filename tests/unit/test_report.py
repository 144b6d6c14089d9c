"""molt-report on synthetic sweep directories: the expected values are computed here from the rows written."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import yaml
from submitit.helpers import DelayedSubmission

from molt_hydra.logging.dashboard import TABLE_METRICS
from molt_hydra.runtime import report


def _point(sweep: Path, num: int, overrides: list[str], rows: list[dict] | None, max_steps: int = 4) -> Path:
    d = sweep / f"{num}_{','.join(overrides)}"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num}}}))
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": max_steps}}))
    if rows is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _task(*args):  # stands in for the Hydra launcher a submission pickles
    return args


def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "multirun" / "sw" / "2026-01-01_00-00-00"
    base = ["+recipe=tiny_cpu", "cluster=slurm"]
    # point 0: 4 steps, reward peaks at step 3; a torn last line (still being written) is ignored
    d0 = _point(sweep, 0, base + ["algorithm.estimator=grpo"], [
        {"step": 1, "train/reward": 0.1, "train/vllm_kl": 0.03},
        {"step": 2, "train/reward": 0.5, "train/vllm_kl": 0.01},
        {"step": 3, "train/reward": 0.9, "train/vllm_kl": 0.02},
        {"step": 4, "train/reward": 0.7, "train/vllm_kl": 0.04},
    ])
    with (d0 / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "train/rew')
    # point 1: resumed after step 2 (step 2 logged twice: the later value wins), stopped at step 3 of 4
    _point(sweep, 1, base + ["algorithm.estimator=rloo"], [
        {"step": 1, "train/reward": 0.2},
        {"step": 2, "train/reward": 0.8},
        {"step": 2, "train/reward": 0.4},
        {"step": 3, "train/reward": 0.3, "eval/pass1": 1.0},
    ])
    # point 2: a submitit job that failed before writing metrics
    _point(sweep, 2, base + ["algorithm.estimator=dr_grpo"], None)
    sub = sweep / ".submitit" / "7_2"
    sub.mkdir(parents=True)
    with (sub / "7_2_submitted.pkl").open("wb") as f:
        pickle.dump(DelayedSubmission(_task, base + ["algorithm.estimator=dr_grpo"], "hydra.sweep.dir", 2, "x", {}), f)
    with (sub / "7_2_0_result.pkl").open("wb") as f:
        pickle.dump(("error", "Traceback (most recent call last):\n  File x\nValueError: boom\n"), f)
    return sweep


def test_final_best_and_step():
    rows = [{"step": 1, "k": 3.0}, {"step": 2, "k": 1.0}, {"step": 3, "k": 2.0}, {"step": 4, "other": 9.0}]
    assert report.final_and_best(rows, "k", "max") == (2.0, 3.0, 1)
    assert report.final_and_best(rows, "k", "min") == (2.0, 1.0, 2)
    assert report.final_and_best(rows, "missing", "max") == (None, None, None)


def test_points_status_and_table(tmp_path):
    sweep = _sweep(tmp_path)
    points = report.load_points(sweep)
    assert [p.num for p in points] == [0, 1, 2]
    assert [p.status for p in points] == ["completed", "stopped at step 3", "failed: ValueError: boom"]
    assert points[2].job_id == "7_2"

    header, rows = report.table(points, [("train/reward", "max"), ("train/vllm_kl", "min")])
    assert header == ["#", "overrides", "status", "steps",
                      "final train/reward", "best train/reward (max)", "@step",
                      "final train/vllm_kl", "best train/vllm_kl (min)", "@step"]
    # only the swept override is shown; values: point 0 final 0.7, best 0.9 @3, kl final 0.04, min 0.01 @2
    assert rows[0] == ["0", "algorithm.estimator=grpo", "completed", "4", "0.7", "0.9", "3", "0.04", "0.01", "2"]
    # point 1: step 2's later value (0.4) replaced 0.8, so best is 0.4 @2; no kl logged
    assert rows[1] == ["1", "algorithm.estimator=rloo", "stopped at step 3", "3", "0.3", "0.4", "2", "-", "-", "-"]
    assert rows[2][:4] == ["2", "algorithm.estimator=dr_grpo", "failed: ValueError: boom", "-"]


def test_cli_prints_rows_and_writes_png(tmp_path, capsys):
    sweep = _sweep(tmp_path)
    assert report.main([str(sweep), "--metric", "train/reward"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["#", "overrides", "status", "steps"]
    assert lines[2].split() == ["0", "algorithm.estimator=grpo", "completed", "4", "0.7", "0.9", "3"]
    assert lines[3].split()[:2] == ["1", "algorithm.estimator=rloo"]
    png = sweep / "report_train_reward.png"
    assert f"plot of train/reward: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_cli_errors_on_an_empty_dir(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "no sweep points" in capsys.readouterr().err


def test_the_best_vllm_kl_is_the_one_closest_to_zero():
    """vllm_kl is the k1 estimate (mean of rollout - train log-probs): signed, its sign is sampling noise, and the
    least drift is the value nearest 0. The runs table's best (and the W&B summary's best/train/vllm_kl, and
    molt-report's default column) goes by |value|, shown with its sign. Before: by min, the most negative value, here
    -0.05 at step 2, the step of the largest drift."""
    rows = [{"step": 1, "train/vllm_kl": 0.02}, {"step": 2, "train/vllm_kl": -0.05},
            {"step": 3, "train/vllm_kl": -0.001}, {"step": 4, "train/vllm_kl": 0.003}]
    closest = min((r for r in rows), key=lambda r: abs(r["train/vllm_kl"]))  # from the definition: least |drift|
    assert report.final_and_best(rows, "train/vllm_kl", "absmin") == (0.003, closest["train/vllm_kl"], closest["step"])
    assert dict(TABLE_METRICS)["train/vllm_kl"] == "absmin"  # the W&B summary's best/train/vllm_kl
    assert "train/vllm_kl:absmin" in report.DEFAULT_METRICS
    assert report._parse_metric("train/vllm_kl:absmin") == ("train/vllm_kl", "absmin")


def test_a_mistyped_metric_is_named_not_an_empty_column(tmp_path, capsys):
    """`--metric KEY:MODE` with a mode that is none of max / min / absmin is refused naming them; a key no point logged
    is named with the logged keys nearest it (its columns stay empty: a pending point has logged nothing yet). Before:
    `train/vllm_kl:mn` was taken as the key "train/vllm_kl:mn" and `train/rewrd` as itself, each an empty column and an
    empty plot, without a word."""
    sweep = _sweep(tmp_path)
    assert report.main([str(sweep), "--metric", "train/vllm_kl:mn"]) == 2
    assert ("molt-report: --metric train/vllm_kl:mn: 'mn' is not one of max, min, absmin (how the best value is "
            "chosen). Fix: one of them; a key holding a colon takes its mode after it: --metric train/vllm_kl:mn:max"
            ) in capsys.readouterr().err
    # an eval key holds its data source's name, which may hold a colon (gsm8k:main): with its mode it is a key
    assert report._parse_metric("eval/eval_gsm8k:main_pass1:max") == ("eval/eval_gsm8k:main_pass1", "max")
    assert not list(sweep.glob("report_*.png"))
    assert report.main([str(sweep), "--metric", "train/rewrd"]) == 0
    assert ("molt-report: no point logged train/rewrd (its columns are empty); the nearest logged: train/reward"
            in capsys.readouterr().err)


def _run(root: Path, name: str, rows: list[dict] | None, max_steps: int | None = 4) -> Path:
    """A run's directory as `molt-run` leaves it: run_record.json written at its start, then its metrics rows."""
    d = root / name
    d.mkdir(parents=True)
    (d / "resolved_config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": max_steps}}))
    (d / "run_record.json").write_text(json.dumps({"job": "rl", "name": name}))
    if rows is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", **r}) + "\n" for r in rows))
    return d


def _failed(run: Path, message: str, after_start: bool = True) -> None:
    """failure.txt as entrypoint._with_details writes it: the message, a blank line, the traceback."""
    (run / "failure.txt").write_text(f"{message}\nLast checkpoint: none\n\nTraceback (most recent call last):\n")
    record = (run / "run_record.json").stat().st_mtime
    os.utime(run / "failure.txt", (record + 5, record + 5) if after_start else (record - 5, record - 5))


ROWS = [{"step": 1, "train/reward": 0.25}, {"step": 2, "train/reward": 0.5}]


def test_a_crashed_run_is_failed_with_the_cause_its_failure_txt_starts_with(tmp_path):
    """Before: "stopped at step 2", as a run killed or still going; a run that failed at its start (no metrics yet)
    was no run at all ("no sweep points under ...", exit 2)."""
    crashed = _run(tmp_path, "crashed", ROWS)
    _failed(crashed, "Run failed: actor rank 0: train_step failed: the process died.")
    assert [p.status for p in report.load_points(crashed)] == ["failed: actor rank 0: train_step failed: the process "
                                                               "died"]
    at_start = _run(tmp_path, "at_start", None)
    _failed(at_start, "Run failed: rollout engine 0: its start failed: ValueError: no KV cache.")
    assert report.main([str(at_start)]) == 0
    assert report.table(report.load_points(at_start), [("train/reward", "max")])[1] == [
        ["0", "-", "failed: rollout engine 0: its start failed: ValueError: no KV cache", "-", "-", "-", "-"]]
    # a resume of it started since (run_record.json written again, after failure.txt): that failure is not its own
    resumed = _run(tmp_path, "resumed", ROWS)
    _failed(resumed, "Run failed: actor rank 0: train_step failed: the process died.", after_start=False)
    assert [p.status for p in report.load_points(resumed)] == ["stopped at step 2"]


def test_a_run_in_progress_is_running(tmp_path):
    """The run's lock (runtime/run_lock.py), held while it runs. Before: "stopped at step 2"."""
    from molt_hydra.runtime.run_lock import run_lock

    going = _run(tmp_path, "going", ROWS)
    with run_lock({"output_dir": str(going)}):
        assert [p.status for p in report.load_points(going)] == ["running (step 2)"]
    assert [p.status for p in report.load_points(going)] == ["stopped at step 2"]  # its process gone, no end recorded


@pytest.mark.parametrize("max_steps", [4, None])
def test_a_run_whose_data_ran_out_before_max_steps_is_completed(tmp_path, max_steps):
    """The run records its end (runtime/entrypoint.py `_train`: run_record.record_end); steps 2 of train.max_steps=4
    (the prompts ran out), or no train.max_steps at all (num_episodes over the data). Before: "stopped at step 2"."""
    from molt_hydra.runtime.run_record import record_end

    run = _run(tmp_path, "ran_out", ROWS, max_steps=max_steps)
    record_end(run, 2)
    assert json.loads((run / "run_record.json").read_text()) == {"job": "rl", "name": "ran_out", "ended": {"step": 2}}
    assert [p.status for p in report.load_points(run)] == ["completed"]
    (run / "run_record.json").unlink()  # removed since the start: a finished run's end is recorded all the same
    record_end(run, 2)
    assert json.loads((run / "run_record.json").read_text()) == {"ended": {"step": 2}}


def test_a_sweep_of_finished_failed_and_running_points_tells_each(tmp_path):
    from molt_hydra.runtime.run_lock import run_lock
    from molt_hydra.runtime.run_record import record_end

    sweep = tmp_path / "sweep"
    done = _point(sweep, 0, ["seed=1"], ROWS)  # max_steps 4: its data ran out at step 2
    (done / "run_record.json").write_text("{}")
    record_end(done, 2)
    crashed = _point(sweep, 1, ["seed=2"], ROWS[:1])
    (crashed / "run_record.json").write_text("{}")
    _failed(crashed, "Run failed: agent runner: every rollout of the last 4 prompt groups (16 rollouts) failed; "
                     "nothing can be trained.")
    going = _point(sweep, 2, ["seed=3"], ROWS)
    with run_lock({"output_dir": str(going)}):
        points = report.load_points(sweep)
    assert [p.status for p in points] == [
        "completed", "failed: agent runner: every rollout of the last 4 prompt groups (16 rollouts) failed; nothing "
                     "can be trained", "running (step 2)"]


def test_a_metric_that_turned_nan_shows_nan_as_its_final_value(tmp_path):
    """A NaN is logged as is (docs/metrics.md): the final column is the last step's value, the best the best finite
    one. Before: the final column showed step 2's 0.5, the diverged run read as healthy."""
    nan, inf = float("nan"), float("inf")
    rows = [{"step": 1, "k": 0.25}, {"step": 2, "k": 0.5}, {"step": 3, "k": nan}]
    final, best, at = report.final_and_best(rows, "k", "max")
    assert math.isnan(final) and (best, at) == (0.5, 2)
    assert report.final_and_best([{"step": 1, "k": nan}, {"step": 2, "k": inf}], "k", "max") == (inf, None, None)
    run = _run(tmp_path, "diverged", [{"step": s, "train/reward": r} for s, r in enumerate([0.25, 0.5, nan], 1)])
    assert report.table(report.load_points(run), [("train/reward", "max")])[1][0][4:] == ["nan", "0.5", "2"]


def test_a_metric_nothing_near_names_what_was_logged(tmp_path, capsys):
    """Before: "the nearest logged: none" for `pass1` (difflib finds nothing near eval/eval_toy_pass1), and for a key
    like nothing logged, what to ask for untold."""
    run = _run(tmp_path, "run", [{"step": 0, "kind": "eval", "eval/eval_toy_pass1": 0.5, "eval/eval_toy_pass2": 1.0},
                                 {"step": 1, "train/reward": 0.25, "train/rollout/pass1": 0.25}])
    assert report.main([str(run), "--metric", "pass1", "--metric", "zzz"]) == 0
    err = capsys.readouterr().err
    logged = ["eval/eval_toy_pass1", "eval/eval_toy_pass2", "train/reward", "train/rollout/pass1"]
    assert ("molt-report: no point logged pass1 (its columns are empty); the nearest logged: "
            f"{logged[0]}, {logged[3]}") in err
    assert f"molt-report: no point logged zzz (its columns are empty); none is near it; the 4 logged: " \
           f"{', '.join(logged)}" in err
    empty = _run(tmp_path, "empty", None)
    assert report.main([str(empty), "--metric", "train/reward"]) == 0
    assert "no point logged train/reward (its columns are empty); no point logged any metric yet" in \
           capsys.readouterr().err


def test_a_plot_path_or_directory_it_cannot_write_is_told_not_a_traceback(tmp_path, capsys):
    """Before: matplotlib's FileNotFoundError / ValueError traceback after the table."""
    run = _run(tmp_path, "run", ROWS)
    assert report.main([str(run), "--png", str(tmp_path / "missing" / "r.png")]) == 2
    assert capsys.readouterr().err == (f"molt-report: --png {tmp_path / 'missing' / 'r.png'}: {tmp_path / 'missing'} "
                                       "is no directory. Fix: a .png path in an existing directory\n")
    assert report.main([str(run), "--png", str(tmp_path / "r.xyz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"molt-report: --png {tmp_path / 'r.xyz'}: no image format ends it (") and ", png, " in err
    assert report.main([str(run), "--png", str(tmp_path / "r.svg")]) == 0  # another format matplotlib writes
    assert (tmp_path / "r.svg").read_text().lstrip().startswith("<?xml")
    other = _run(tmp_path, "other", ROWS)
    (other / "report").write_text("")  # where the sections' page goes: a file, not a directory
    assert report.main([str(other)]) == 1
    assert (f"molt-report: cannot write {other / 'report'}: File exists. Fix: make {other} writable"
            in capsys.readouterr().err)


def test_a_directory_of_runs_is_tabled_one_row_per_run(tmp_path, capsys):
    """outputs/<name>/ holds one directory per `molt-run` (Hydra's hydra.job.num is '???' there: no sweep numbered
    them): each is a row, numbered in the order of their names (their start times). Before: ValueError traceback."""
    outputs = tmp_path / "outputs" / "default"
    for name, seed, rows in (("2026-01-01_00-00-00", 1, ROWS), ("2026-01-01_00-05-00", 2, ROWS[:1])):
        run = _run(outputs, name, rows)
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"seed={seed}", "train.max_steps=4"]))
        (run / ".hydra" / "hydra.yaml").write_text("hydra:\n  job:\n    num: ???\n")
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": 4}}))
    assert report.main([str(outputs), "--metric", "train/reward"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines[2:4]] == [["0", "seed=1", "stopped", "at", "step", "2", "2", "0.5", "0.5",
                                                      "2"],
                                                     ["1", "seed=2", "stopped", "at", "step", "1", "1", "0.25", "0.25",
                                                      "1"]]


def test_a_path_that_is_no_run_or_sweep_is_told_with_the_fix(tmp_path, capsys):
    """Before: the reason alone ("... is not a directory", "no sweep points under ..."), what to give untold."""
    fix = "Fix: give a run's directory (outputs/<name>/<time>) or a sweep's (multirun/<name>/<time>)"
    (tmp_path / "metrics.jsonl").write_text("")
    assert report.main([str(tmp_path / "metrics.jsonl")]) == 2
    assert capsys.readouterr().err == f"molt-report: {tmp_path / 'metrics.jsonl'} is not a directory. {fix}\n"
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err == (f"molt-report: no sweep points under {tmp_path / 'empty'} (no metrics.jsonl, "
                                       f"run_record.json, */.hydra/overrides.yaml or .submitit/). {fix}\n")
