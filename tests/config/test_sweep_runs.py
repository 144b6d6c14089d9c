"""How `molt-run` starts runs and sweeps: each gets a directory of its own (and a sweep's points a W&B group of
their own), and a local sweep's failed point leaves the others to run."""

from __future__ import annotations

import datetime as _datetime
import logging
from pathlib import Path

import hydra.core.utils
from test_cli_errors import _main_in_process


class _Frozen(_datetime.datetime):
    """Hydra's ${now:...} clock, stopped: two sweeps started within the same second."""

    @classmethod
    def now(cls, tz=None):
        return cls(2026, 12, 7, 6, 40, 0)


def _sweep(monkeypatch, tmp_path, *extra: str) -> list:
    """`molt-run -m seed=1,2` in this process (the runtime stubbed: no Ray here): the RunConfig each point ran."""
    import molt_hydra.runtime.entrypoint as entrypoint

    runs = []
    monkeypatch.setattr(entrypoint, "run", runs.append)
    handlers = logging.root.handlers[:]
    try:
        assert _main_in_process(["-m", "seed=1,2", *extra], monkeypatch, tmp_path) is None
    finally:
        logging.root.handlers[:] = handlers  # (Hydra's job logging, in this process)
    assert len(runs) == 2
    return runs


def test_two_sweeps_started_in_the_same_second_get_their_own_directories(monkeypatch, tmp_path):
    """Before: the default sweep directory, multirun/<name>/<time to the second>, was the same for two sweeps started
    within one second: their points ran in the same directories (the second's locked out of the first's, or resuming
    from them) and logged into the same W&B group."""
    monkeypatch.setattr(hydra.core.utils, "datetime", _Frozen)
    runs = [_sweep(monkeypatch, tmp_path), _sweep(monkeypatch, tmp_path)]
    sweeps = sorted((tmp_path / "multirun" / "default").iterdir())
    assert [s.name for s in sweeps] == ["2026-12-07_06-40-00", "2026-12-07_06-40-00_2"]  # readable: the time, then #
    for sweep, points in zip(sweeps, runs):
        assert [run.output_dir for run in points] == [str(sweep / "0_seed=1"), str(sweep / "1_seed=2")]
        assert [run.seed for run in points] == [1, 2]
        assert (sweep / "1_seed=2" / ".hydra" / "config.yaml").exists()
    groups = [{run.logger.wandb.group for run in points} for points in runs]
    assert len(groups[0]) == 1 and len(groups[1]) == 1 and groups[0] != groups[1], groups


def test_a_sweep_directory_given_without_a_time_is_used_as_given(monkeypatch, tmp_path):
    """A fixed hydra.sweep.dir is how a sweep is resumed (README: submitted again with the same hydra.sweep.dir): it
    is not renamed, and its points keep their W&B group."""
    runs = [_sweep(monkeypatch, tmp_path, f"hydra.sweep.dir={tmp_path / 'mine'}") for _ in range(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["0_seed=1", "1_seed=2", "multirun.yaml"]
    mine = tmp_path / "mine"
    assert [run.output_dir for run in runs[1]] == [str(mine / "0_seed=1"), str(mine / "1_seed=2")]
    assert len({run.logger.wandb.group for points in runs for run in points}) == 1


def test_two_runs_started_in_the_same_second_get_their_own_directories(monkeypatch, tmp_path):
    """Before: outputs/<name>/<time to the second> was the same for two runs started within one second
    (`for s in 1 2; do molt-run seed=$s & done`): the second failed as locked out by the first, or, the first ended,
    resumed from its checkpoints."""
    import molt_hydra.runtime.entrypoint as entrypoint

    monkeypatch.setattr(hydra.core.utils, "datetime", _Frozen)
    runs = []
    monkeypatch.setattr(entrypoint, "run", runs.append)
    handlers = logging.root.handlers[:]
    try:
        for seed in (1, 2):
            assert _main_in_process([f"seed={seed}"], monkeypatch, tmp_path) is None
    finally:
        logging.root.handlers[:] = handlers
    made = tmp_path / "outputs" / "default"
    assert [(run.seed, run.output_dir) for run in runs] == [(1, str(made / "2026-12-07_06-40-00")),
                                                             (2, str(made / "2026-12-07_06-40-00_2"))]
    assert all((Path(run.output_dir) / ".hydra" / "config.yaml").exists() for run in runs)


def test_a_failed_point_of_a_local_sweep_leaves_the_others_to_run(monkeypatch, tmp_path, capsys):
    """Before: the first point that failed (the runtime's `Run failed: ...`, exit 4) ended `molt-run -m` with Hydra's
    basic launcher: the points after it never ran, and no line named the point that failed. Points #0 and #2 fail in
    the real runtime (resume=never over an earlier run's checkpoints: before Ray starts); #1 is recorded instead of
    run (a stand-in for the RL loop, minutes here)."""
    import molt_hydra.runtime.entrypoint as entrypoint
    import molt_hydra.runtime.sweep as sweep_module

    old_a, fresh, old_b = tmp_path / "old_a", tmp_path / "fresh", tmp_path / "old_b"
    (old_a / "step_1").mkdir(parents=True)
    (old_b / "step_2").mkdir(parents=True)
    ran = []
    monkeypatch.setattr(entrypoint, "run", lambda cfg, real=entrypoint.run: ran.append(cfg.checkpoint.dir)
                        if cfg.checkpoint.dir == str(fresh) else real(cfg))
    monkeypatch.setattr(sweep_module, "_LOCAL_POINTS", [], raising=False)  # (no stale points of another test)
    handlers = logging.root.handlers[:]
    try:
        code = _main_in_process(["-m", f"checkpoint.dir={old_a},{fresh},{old_b}", f"hydra.sweep.dir={tmp_path / 's'}"],
                                monkeypatch, tmp_path)
    finally:
        logging.root.handlers[:] = handlers
    err = capsys.readouterr().err
    assert code == 4 and ran == [str(fresh)], err[-3000:]
    assert err.count("Run failed: checkpoint.resume=never") == 2
    assert err.strip().splitlines()[-3:] == [
        f"sweep point #0 (checkpoint.dir={old_a}): failed (exit 4)",
        f"sweep point #2 (checkpoint.dir={old_b}): failed (exit 4)",
        f"Run failed: sweep {tmp_path / 's'}: 2 of 3 point(s) failed (listed above); the others completed. Fix: see "
        "each point's reason above (the `Run failed:` line before its own), then run those points again."]


def test_a_glob_sweep_with_its_flag_last_gets_its_own_directory(monkeypatch, tmp_path):
    """Before: the sweep's own directory was added to the command line after the glob()-expanded overrides, which are
    on no command line: it went after the trailing -m, "unrecognized arguments: hydra.sweep.dir=...", exit 2, once every
    point had passed its check (the claimed directory left behind, empty)."""
    import molt_hydra.runtime.entrypoint as entrypoint

    runs = []
    monkeypatch.setattr(entrypoint, "run", runs.append)
    handlers = logging.root.handlers[:]
    try:
        assert _main_in_process(["model=glob(qwen3_tiny)", "seed=1,2", "-m"], monkeypatch, tmp_path) is None
    finally:
        logging.root.handlers[:] = handlers
    (sweep,) = (tmp_path / "multirun" / "default").iterdir()
    assert sorted(Path(run.output_dir).parent for run in runs) == [sweep, sweep] and [r.seed for r in runs] == [1, 2]
