"""The metric sinks and the progress line with values a faulty run produces: NaN is shown, never dropped or fatal;
a resumed run keeps one row per step."""

import contextlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wandb_offline import history  # noqa: E402

from molt_hydra.logging.progress import Progress  # noqa: E402
from molt_hydra.logging.sinks import MetricSinks  # noqa: E402


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_non_finite_values_are_logged_not_dropped(tmp_path):
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    sinks.log({"reward": float("nan"), "loss": float("inf"), "ok": 1.0, "flag": True, "name": "x"}, step=1)
    sinks.close()
    (row,) = rows(tmp_path / "metrics.jsonl")
    assert math.isnan(row["train/reward"]) and row["train/loss"] == math.inf and row["train/ok"] == 1.0
    assert "train/flag" not in row and "train/name" not in row  # only numbers are metrics


def test_a_metric_going_non_finite_is_named_on_the_console_once(tmp_path, capsys):
    """A NaN / inf reaches W&B and the jsonl as logged, and the console names the metric and the step where it turned
    non-finite (once while it stays so; again after it recovered). Before: only reward, vllm_kl and policy_loss showed
    it (the progress line); e.g. a NaN actor_grad_norm went to W&B without a word."""
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    for step, grad in enumerate([1.0, float("nan"), float("nan"), 2.0, float("inf")], start=1):
        sinks.log({"actor_grad_norm": grad, "reward": 0.5}, step)
    sinks.log({"eval_x_pass1": float("nan")}, 5, prefix="eval")
    sinks.close()
    assert [math.isfinite(r["train/actor_grad_norm"]) for r in rows(tmp_path / "metrics.jsonl")[:5]] == [
        True, False, False, True, False]
    lines = [line for line in capsys.readouterr().err.splitlines() if "non-finite" in line]
    assert lines == ["step 2: non-finite metric train/actor_grad_norm = nan (logged as is)",
                     "step 5: non-finite metric train/actor_grad_norm = inf (logged as is)",
                     "step 5: non-finite metric eval/eval_x_pass1 = nan (logged as is)"]


def test_progress_line_survives_a_nan_reward(capsys):
    progress = Progress(total_steps=2)
    progress.step(1, {"reward": float("nan"), "timing/step_total": 1.0})
    progress.step(2, {"reward": 0.5})
    out = capsys.readouterr().out
    assert "reward    nan" in out and "reward  0.500 " + "█" * 10 in out


def test_the_eval_line_prints_datasource_names_as_they_are(capsys):
    """A data source's name is the user's (the eval rows' `datasource`): printed verbatim. Before: rich read brackets
    in it as markup: `eval_math[hard]_pass1` was shown as `eval_math_pass1`, and a `[/...]` in a name failed the eval
    with rich's MarkupError."""
    Progress(total_steps=2).eval(1, {"eval_math[hard]_pass1": 0.5, "eval_a[/b]_pass1": 0.25})
    assert capsys.readouterr().out == "eval @ step 1: eval_a[/b]_pass1 0.250, eval_math[hard]_pass1 0.500\n"


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


def test_wandb_rows_logged_again_after_a_resume_are_marked(tmp_path):
    """W&B history cannot be rewritten: the steps a resumed run logs again (past its checkpoint, up to where the
    interrupted run got) are marked, the rest are not."""
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="offline")
    run_id = sinks.wandb_id
    for step in (1, 2, 3, 4):  # interrupted after logging step 4; its last checkpoint is step 2
        sinks.log({"reward": float(step)}, step)
    sinks.close()
    resumed = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="offline", resume_wandb_id=run_id)
    resumed.rewind(2)
    for step in (3, 4, 5):
        resumed.log({"reward": 10.0 * step}, step)
    resumed.close()
    marked = []
    for wandb_file in sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb")):
        marked += [(r["train/global_step"], r.get("train/replayed_after_resume")) for r in history(wandb_file)
                   if "train/reward" in r]
    assert sorted(marked, key=lambda m: (m[0], m[1] or 0)) == [(1, None), (2, None), (3, None), (3, 1.0),
                                                                (4, None), (4, 1.0), (5, None)]


def test_tensorboard_drops_the_interrupted_runs_points_past_the_checkpoint(tmp_path):
    """TensorBoard after a resume shows one point per step: the resumed run's, from the checkpoint's step + 1 on
    (before: steps 3 and 4 twice, the interrupted run's and the resumed run's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled", tensorboard=True)
    for step in (1, 2, 3, 4):  # interrupted after logging step 4; its last checkpoint is step 2
        sinks.log({"vllm_kl": float(step)}, step)
    sinks.close()
    resumed = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled", tensorboard=True)
    resumed.rewind(2)
    for step in (3, 4, 5):
        resumed.log({"vllm_kl": 10.0 * step}, step)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "t"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/vllm_kl")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                                                                          (5, 50.0)]


def test_rewind_survives_a_row_cut_short(tmp_path, capsys):
    """A run killed mid-write (node failure, disk full) leaves a torn last row: the resume drops it, says so, and the
    next row starts on a line of its own (before: the resume failed with a JSONDecodeError)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n{"step": 2, "kind": "train"}\n'
                                            '{"step": 3, "ki')
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "prompt": "p"}\n{"step": 2, "prompt": "lo')
    resumed = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    resumed.rewind(2)
    resumed.log({"reward": 3.0}, 3)
    resumed.close()
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in rows(tmp_path / "samples.jsonl")] == [1]
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}: 1 unreadable row(s) dropped on resume" in err
    assert f"{tmp_path / 'samples.jsonl'}: 1 unreadable row(s) dropped on resume" in err


KILLED_RUN = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from wandb_offline import history
from molt_hydra.logging.sinks import MetricSinks
sinks = MetricSinks(sys.argv[1], run_name="t", config={}, wandb_mode="offline")
for step in (1, 2, 3):
    sinks.log({"vllm_kl": 0.1 * step, "reward": 1.0}, step)


def written():  # step 3's row in the .wandb file, read while wandb-core writes it
    try:
        return any(r.get("train/global_step") == 3 for f in Path(sys.argv[1]).glob("wandb/offline-run-*/run-*.wandb")
                   for r in history(f))
    except Exception:  # a record half written
        return False


until = time.monotonic() + 10  # W&B's own interval (15 s) writes none by then
while not written() and time.monotonic() < until:
    time.sleep(0.1)
os.killpg(0, signal.SIGKILL)  # what Slurm does to a requeued or cancelled job's step: wandb-core goes too
"""


def test_wandb_rows_survive_a_kill_seconds_later(tmp_path):
    """A job killed seconds after logging (requeue, preemption, scancel) keeps those rows in its .wandb file: W&B writes
    it every second (compat/wandb.py), and the job is killed once they are there, or at 10 s (was: at 2.5 s, a race
    with that second's write on a loaded box). Before: every 15 s; the rows were lost, and a resume from a checkpoint
    past them never logged them again."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(tmp_path), str(Path(__file__).resolve().parents[1])],
                          start_new_session=True, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    logged = [(r["train/global_step"], r["train/vllm_kl"], r["train/reward"]) for r in history(wandb_file)
              if "train/vllm_kl" in r]
    assert logged == [(1, 0.1, 1.0), (2, 0.2, 1.0), (3, 0.1 * 3, 1.0)]


def test_start_from_scratch_over_an_attempt_without_checkpoint(tmp_path, capsys):
    """A Slurm point requeued before its first checkpoint starts again at step 1 in the same directory (rewind(0)):
    the earlier attempt's rows move aside (before: steps 1, 2 twice in metrics.jsonl), and its W&B run goes on
    (before: a second W&B run of the same name in the sweep's group), the steps logged again marked."""
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="offline")
    first_id = sinks.wandb_id
    for step in (1, 2):
        sinks.log({"reward": float(step)}, step)
    sinks.close()
    again = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="offline")
    assert again.wandb_id == first_id
    again.rewind(0)
    for step in (1, 2, 3):
        again.log({"reward": 10.0 * step}, step)
    again.close()
    assert [(r["step"], r["train/reward"]) for r in rows(tmp_path / "metrics.jsonl")] == [(1, 10.0), (2, 20.0),
                                                                                         (3, 30.0)]
    (aside,) = tmp_path.glob("metrics.earlier-*.jsonl")  # the earlier attempt's rows, kept
    assert [(r["step"], r["train/reward"]) for r in rows(aside)] == [(1, 1.0), (2, 2.0)]
    assert f"moved aside to {aside.name}; this run starts at step 0 and goes on in the last W&B run" \
        in capsys.readouterr().out
    marked = [(r["train/global_step"], r.get("train/replayed_after_resume"))
              for f in sorted(tmp_path.glob(f"wandb/offline-run-*-{first_id}*/run-{first_id}.wandb"))
              for r in history(f) if "train/reward" in r]
    assert marked == [(1, None), (2, None), (1, 1.0), (2, 1.0), (3, None)]


def test_a_new_wandb_run_marks_nothing_replayed(tmp_path):
    """W&B off in the attempt before (no W&B run to go on): its rows move aside from metrics.jsonl, and the new W&B
    run's rows, the only ones it has, are not marked as logged again."""
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    sinks.log({"reward": 1.0}, 1)
    sinks.close()
    again = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="offline")
    again.rewind(0)
    again.log({"reward": 2.0}, 1)
    new_id = again.wandb_id
    again.close()
    (wandb_file,) = tmp_path.glob(f"wandb/offline-run-*-{new_id}/run-{new_id}.wandb")
    assert [(r["train/global_step"], r.get("train/replayed_after_resume")) for r in history(wandb_file)
            if "train/reward" in r] == [(1, None)]


def test_a_run_from_step_0_moves_an_earlier_runs_metrics_aside_named(tmp_path, capsys):
    """A new run in an output_dir an earlier run logged to, with no checkpoint to go on from (a new, empty
    checkpoint.dir; or a Slurm requeue before the first save), starts at step 0 (rewind(0)): the earlier run's rows,
    samples, TensorBoard events and dumps are moved aside whole, named after their last write, and one line names
    them. Before: its rows were dropped from metrics.jsonl and samples.jsonl, TensorBoard's restart marker at step 1
    hid its points, and the new run overwrote its dumps of the same steps: the earlier run's metrics were gone."""
    import calendar
    import os

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(run):
        events = EventAccumulator(str(tmp_path / "tensorboard" / run))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("train/reward")]

    earlier = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled", tensorboard=True)
    for step in (1, 2):
        earlier.log({"reward": float(step)}, step)
        earlier.log_samples([("p", "r", float(step))], step)
    earlier.close()
    last_write = calendar.timegm((2026, 12, 6, 12, 0, 0))  # the earlier run's last row: 2026-12-06 12:00:00 UTC
    for name in ("metrics.jsonl", "samples.jsonl"):
        os.utime(tmp_path / name, (last_write, last_write))
    (tmp_path / "trajectories").mkdir()  # logger.dump_trajectories' (a run from step 0 would overwrite its steps)
    (tmp_path / "trajectories" / "step2.jsonl").write_text('{"reward": 2.0}\n')
    fresh = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled", tensorboard=True)
    fresh.rewind(0)
    fresh.log({"reward": 10.0}, 1)
    fresh.close()
    aside = "earlier-20261206T120000Z"
    assert [(r["step"], r["train/reward"]) for r in rows(tmp_path / f"metrics.{aside}.jsonl")] == [(1, 1.0), (2, 2.0)]
    assert [(r["step"], r["reward"]) for r in rows(tmp_path / f"samples.{aside}.jsonl")] == [(1, 1.0), (2, 2.0)]
    assert [(r["step"], r["train/reward"]) for r in rows(tmp_path / "metrics.jsonl")] == [(1, 10.0)]
    assert not (tmp_path / "samples.jsonl").exists()
    assert scalars(f"t.{aside}") == [(1, 1.0), (2, 2.0)] and scalars("t") == [(1, 10.0)]
    assert (tmp_path / f"trajectories.{aside}" / "step2.jsonl").read_text() == '{"reward": 2.0}\n'
    assert not (tmp_path / "trajectories").exists()
    assert (f"{tmp_path}: an earlier attempt's metrics, with no checkpoint to go on from, moved aside to "
            f"metrics.{aside}.jsonl, samples.{aside}.jsonl, trajectories.{aside}, t.{aside}; this run starts at "
            "step 0\n"
            ) in capsys.readouterr().out
    os.utime(tmp_path / "metrics.jsonl", (last_write, last_write))  # another start over, its last write that second
    (tmp_path / "logprobs").mkdir()  # (its dumps: moved aside as the metrics, never over a name taken)
    (tmp_path / "logprobs" / "step1.pt").write_bytes(b"1")
    again = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    again.rewind(0)
    again.close()
    assert [r["train/reward"] for r in rows(tmp_path / f"metrics.{aside}-2.jsonl")] == [10.0]
    assert [r["train/reward"] for r in rows(tmp_path / f"metrics.{aside}.jsonl")] == [1.0, 2.0]
    assert rows(tmp_path / "metrics.jsonl") == []
    assert (tmp_path / f"logprobs.{aside}-2" / "step1.pt").read_bytes() == b"1"
    # a third, whose metrics are gone but whose dump directory holds the name its stamp would take (the collision
    # was checked against .jsonl files alone: the dump's rename failed, OSError, Directory not empty)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    os.utime(tmp_path / "metrics.jsonl", (last_write, last_write))
    (tmp_path / f"trajectories.{aside}-3").mkdir()
    (tmp_path / f"trajectories.{aside}-3" / "x").write_text("x")
    (tmp_path / "trajectories").mkdir()
    third = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="disabled")
    third.rewind(0)
    third.close()
    assert (tmp_path / f"metrics.{aside}-4.jsonl").exists() and (tmp_path / f"trajectories.{aside}-4").is_dir()


def test_the_last_wandb_run_id_is_read_from_its_file_not_its_directory_name(tmp_path):
    """wandb names a run started again within the same second `<...>-<id>-1`: the id is the `run-<id>.wandb` file's
    (the directory name's last part would be "1", and the next attempt would start a W&B run of that id)."""
    from molt_hydra.compat.wandb import last_run_id

    assert last_run_id(tmp_path) is None
    run = tmp_path / "wandb" / "offline-run-20261205_140737-u2kixbff-1"
    run.mkdir(parents=True)
    (run / "run-u2kixbff.wandb").write_bytes(b"")
    (tmp_path / "wandb" / "latest-run").symlink_to(run.name)
    assert last_run_id(tmp_path) == "u2kixbff"
    # the directory copied without links (cp -rL: latest-run a plain copy): the newest run's, by its start time
    (tmp_path / "wandb" / "latest-run").unlink()
    older = tmp_path / "wandb" / "run-20261205_120000-a1b2c3d4"  # (an online run's directory: its own prefix)
    older.mkdir()
    (older / "run-a1b2c3d4.wandb").write_bytes(b"")
    assert last_run_id(tmp_path) == "u2kixbff"


def test_a_row_logged_after_a_sinks_directory_vanished_stops_the_run_naming_it(tmp_path):
    """Before: the rows went on to the removed metrics.jsonl (and W&B's removed .wandb file, TensorBoard's removed
    event file) without a word."""
    import shutil

    import pytest

    for gone in ("output_dir removed", "output_dir moved", "wandb", "tensorboard"):
        out = tmp_path / gone.replace(" ", "_")
        sinks = MetricSinks(out, run_name="r", config={}, wandb_mode="offline" if gone == "wandb" else "disabled",
                            tensorboard=gone == "tensorboard")
        sinks.log({"reward": 1.0}, 1)
        if sinks.tb is not None:
            sinks.tb.flush()  # (its writer thread would write row 1 to the removed file: a thread's traceback)
        named = out / "metrics.jsonl"
        if gone == "output_dir removed":
            shutil.rmtree(out)
        elif gone == "output_dir moved":
            out.rename(tmp_path / "elsewhere")
        else:
            named = next((out / gone).rglob("run-*.wandb")) if gone == "wandb" else out / "tensorboard" / "r"
            shutil.rmtree(out / gone)
        with pytest.raises(FileNotFoundError) as err:
            sinks.log({"reward": 2.0}, 2)
        assert err.value.filename == str(named) and "removed or replaced while the run" in str(err.value), gone
        with contextlib.suppress(OSError):  # (TensorBoard's close: its file is gone)
            sinks.close()


def test_an_eval_logged_first_after_a_resume_is_not_marked_replayed(tmp_path):
    """A Slurm notice at step 2 saves before that step's eval (the eval runs first thing on resume, at step 2): the
    resumed run's eval row at step 2 is the only one, so it is not marked logged again; its train step 3 is not
    either, and an eval the interrupted run did log (step 0) would be. Before: the mark went by the last step of any
    kind (2, a train row), so the eval at step 2, never logged before, carried eval/replayed_after_resume = 1 and a
    chart filtering the marked rows lost it; and every fresh run's at-start eval (step 0) was marked."""
    sinks = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="offline")
    run_id = sinks.wandb_id
    sinks.log({"eval_toy_pass1": 0.1}, 0, prefix="eval")  # eval.at_start
    for step in (1, 2):
        sinks.log({"reward": float(step)}, step)
    sinks.close()  # the notice: saved at step 2, its eval skipped
    resumed = MetricSinks(tmp_path, run_name="t", config={}, wandb_mode="offline", resume_wandb_id=run_id)
    resumed.rewind(2)
    resumed.log({"eval_toy_pass1": 0.5}, 2, prefix="eval")
    resumed.log({"eval_toy_pass1": 0.7}, 0, prefix="eval")  # (an eval row of a step the interrupted run logged)
    resumed.log({"reward": 3.0}, 3)
    resumed.close()
    first, resumed_file = sorted(tmp_path.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"))

    def logged(wandb_file):
        return [(r.get("eval/global_step", r.get("train/global_step")), r.get("eval/replayed_after_resume"),
                 r.get("train/replayed_after_resume")) for r in history(wandb_file)
                if "eval/eval_toy_pass1" in r or "train/reward" in r]
    # (before: a fresh run's at-start eval, step 0, was marked too: 0 <= the 0 of "no step logged before")
    assert logged(first) == [(0, None, None), (1, None, None), (2, None, None)]
    assert logged(resumed_file) == [(2, None, None), (0, 1.0, None), (3, None, None)]


def test_every_steps_thins_wandb_only_and_the_last_step_reaches_it(tmp_path):
    """logger.every_steps=4 over 6 steps: metrics.jsonl gets all 6 (docs/metrics.md: it always gets every step), W&B
    steps 4 and 6 (the loop's end flushes its last step), and molt-report calls the run completed. Before: the jsonl
    and W&B held step 4 alone, the report said "stopped at step 4", and the W&B summary (final values) ended there. A
    failure that ends the run sends its last step to W&B too (close)."""
    from types import SimpleNamespace

    import yaml

    from molt_hydra.config.schema import LoggerConfig
    from molt_hydra.logging.run_log import RunLog
    from molt_hydra.runtime import report

    def run(out: Path, steps: int, end) -> tuple[list[int], list[int]]:
        log = RunLog(LoggerConfig(every_steps=4), out, None, MetricSinks(out, run_name="t", config={},
                                                                             wandb_mode="offline"), Progress(6, False))
        for step in range(1, steps + 1):
            log.step(step, {"reward": float(step)}, SimpleNamespace(groups=[]))
        end(log)
        log.close()
        (wandb_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
        logged = [r["train/global_step"] for r in history(wandb_file) if "train/reward" in r]
        return [r["step"] for r in rows(out / "metrics.jsonl")], logged

    assert run(tmp_path / "failed", 5, lambda log: None) == ([1, 2, 3, 4, 5], [4, 5])  # a failure: closed only
    assert run(tmp_path / "done", 6, RunLog.flush) == ([1, 2, 3, 4, 5, 6], [4, 6])  # the loop's end (controller)
    (tmp_path / "done" / "resolved_config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": 6}}))
    (point,) = report.load_points(tmp_path / "done")
    assert point.status == "completed"


def test_every_metric_name_the_code_logs_is_in_docs_metrics():
    """docs/metrics.md names every metric: the namespaced keys the code spells out (an f-string's by its literal
    prefix, e.g. `drift/abs_logp_diff_`), and the keys the algorithm layer's losses and the experience means emit."""
    import ast
    import re

    import torch

    from molt_hydra.algorithm.drift import drift_metrics
    from molt_hydra.algorithm.is_correction import ISCorrection
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.algorithm.value_loss import value_loss

    repo = Path(__file__).resolve().parents[2]
    doc = (repo / "docs" / "metrics.md").read_text()
    # backticked names, `a/{b,c}` expanded; a `<...>` placeholder stands for any tail
    named = set()
    for tok in re.findall(r"`([^`\s]+)`", doc):
        head, _, rest = tok.partition("{")
        named |= {head + alt + rest.partition("}")[2] for alt in rest.partition("}")[0].split(",")} if rest else {tok}
    namespaced = re.compile(r"(timing|perf|rollout|engine|routing|drift|weight_sync|agent|memory)/\w[\w/]*")
    exact, prefixes = set(), set()
    for path in (repo / "molt_hydra").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and namespaced.fullmatch(node.value):
                (prefixes if node.value.endswith(("/", "_")) else exact).add(node.value)
            elif isinstance(node, ast.JoinedStr) and isinstance(first := node.values[0], ast.Constant):
                if namespaced.fullmatch(first.value):
                    prefixes.add(first.value)
    mask = torch.tensor([[True, True, False]])
    lp, old = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    emitted = {*PolicyLoss("ppo", entropy_coef=0.1, kl_use_loss=True, kl_estimator="k3", is_correction=ISCorrection(
        "token"))(lp, old, torch.ones(1, 3), mask, rollout_log_probs=old, ref_log_probs=old, entropy=torch.ones(1, 3),
                  kl_coef=0.1)[1],
        *value_loss(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), mask)[1],
        *drift_metrics(lp, old, mask, is_correction=ISCorrection("seq"), policy_versions=torch.zeros(1, 3),
                       current_version=1)}
    missing = sorted(k for k in exact | emitted if k not in named and not any(
        n.endswith(">") and k.startswith(n.partition("<")[0]) for n in named))
    missing += sorted(p for p in prefixes if not any(n.startswith(p) for n in named))
    assert len(exact) > 60 and not missing, f"logged but not in docs/metrics.md: {missing}"
