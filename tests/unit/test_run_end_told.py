"""How a run ended, told by its directory (molt-report's status) when the user interrupted it or a role stalled, not
only when it completed or failed. Before: both were "stopped at step N", as a run killed -9 or whose driver crashed
(no failure.txt, no end in run_record.json), though the console said "Interrupted" / "Run stopped: ... stalled"."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace as value

import pytest

from molt_hydra.config.schema import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_STALLED, Job, RunConfig
from molt_hydra.runtime import entrypoint, report
from molt_hydra.runtime.watchdog import RoleStalled

ROWS = [{"kind": "train", "step": 1, "train/reward": 0.25}, {"kind": "train", "step": 2, "train/reward": 0.5}]


def _config(tmp_path: Path, job: str = "rl") -> RunConfig:
    cfg = RunConfig()
    cfg.job = Job[job]
    cfg.output_dir = str(tmp_path / "run")
    cfg.checkpoint.dir, cfg.checkpoint.export_dir = f"{cfg.output_dir}/checkpoints", f"{cfg.output_dir}/hf_final"
    return cfg


def _started(cfg: RunConfig) -> None:
    """What a run's start and its first two steps leave in its directory: run_record.json, then the metrics rows."""
    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "run_record.json").write_text(json.dumps({"job": cfg.job.value, "name": cfg.name}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))


def _interrupted_in_the_loop(cfg, notice):  # _main's exit 130 (the loop took Ctrl-C / SIGTERM), through `_run`
    _started(cfg)
    sys.exit(EXIT_INTERRUPTED)


def _interrupted_before_the_loop(cfg, notice):  # _stoppable's (the resume check, the model's build; job=sft)
    _started(cfg)
    raise KeyboardInterrupt


def _failed(cfg, notice):
    _started(cfg)
    sys.exit(EXIT_FAILED)


@pytest.mark.parametrize("body", [_interrupted_in_the_loop, _interrupted_before_the_loop])
def test_an_interrupted_run_is_interrupted_at_its_last_step(monkeypatch, tmp_path, body):
    cfg = _config(tmp_path)
    monkeypatch.setattr(entrypoint, "_run", body)
    with pytest.raises(SystemExit) as stopped:
        entrypoint.run(cfg)
    assert stopped.value.code == EXIT_INTERRUPTED
    assert json.loads((tmp_path / "run" / "run_record.json").read_text()) == {"job": "rl", "name": cfg.name,
                                                                                "interrupted": True}
    assert [p.status for p in report.load_points(tmp_path / "run")] == [f"interrupted at step {ROWS[-1]['step']}"]


def test_a_failed_run_is_not_told_interrupted(monkeypatch, tmp_path):
    cfg = _config(tmp_path)
    monkeypatch.setattr(entrypoint, "_run", _failed)
    with pytest.raises(SystemExit):
        entrypoint.run(cfg)
    assert "interrupted" not in json.loads((tmp_path / "run" / "run_record.json").read_text())


REASON = "actor stalled: train_step did not finish within 30 s"


def test_a_stalled_rl_run_is_failed_with_the_stall(tmp_path):
    cfg = _config(tmp_path)
    _started(cfg)
    last_words: list[str] = []
    assert entrypoint._stalled(cfg, {}, REASON, [], last_words) == EXIT_STALLED
    assert last_words[0] == f"Run stopped: {REASON}."  # (the console's, unchanged)
    assert (tmp_path / "run" / "failure.txt").read_text().splitlines() == last_words
    assert [p.status for p in report.load_points(tmp_path / "run")] == [f"failed: {REASON}"]


def test_a_stalled_sft_run_is_failed_with_the_stall(monkeypatch, tmp_path, capsys):
    from molt_hydra.runtime import sft_job

    cfg = _config(tmp_path, "sft")
    said = "Run stopped: sft trainer rank 1 stalled: its process has made no progress for 60 s."

    def stalls(*_):
        _started(cfg)
        raise RoleStalled("sft trainer rank 1", "", 0, f"{said}\nStacks of every role: (none)")

    monkeypatch.setattr(sft_job, "run_sft_job", stalls)
    with pytest.raises(SystemExit) as stopped:
        entrypoint._run_sft(cfg, None, value(received=value(is_set=lambda: False)), {})
    assert stopped.value.code == EXIT_STALLED
    assert said in capsys.readouterr().err
    assert (tmp_path / "run" / "failure.txt").read_text().splitlines()[0] == said
    assert [p.status for p in report.load_points(tmp_path / "run")] == [
        "failed: sft trainer rank 1 stalled: its process has made no progress for 60 s"]


class FunctionTimedOut(BaseException):
    """As func_timeout's: a BaseException, no Exception (Ray re-raises a remote one as its own kind)."""


def test_a_base_exception_reaching_the_driver_fails_the_run_in_one_message(monkeypatch, capsys, tmp_path):
    """Before: it passed `_main`'s `except Exception`: the run ended in a traceback (exit 1), no failure.txt."""
    from molt_hydra.runtime import reaper, roles
    from molt_hydra.runtime.preemption import PreemptionNotice

    async def starting(*_):
        raise FunctionTimedOut("grading ran past 5 s")

    monkeypatch.setattr(roles, "build_roles", starting)
    for name in ("descendants", "shutdown_ray", "kill"):  # (this process's children are pytest's, not a run's)
        monkeypatch.setattr(entrypoint, name, lambda *a: [])
    monkeypatch.setattr(reaper, "stop", lambda: None)
    cfg = _config(tmp_path)
    Path(cfg.output_dir).mkdir(parents=True)
    code = asyncio.run(entrypoint._main(cfg, {}, None, value(stop=lambda: None), PreemptionNotice()))
    assert code == EXIT_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-3:] == ["Run failed: driver: FunctionTimedOut: grading ran past 5 s.",
                          "Last checkpoint: none (the run starts from step 0 again)",
                          f"Details (traceback): {tmp_path / 'run' / 'failure.txt'}"], lines
