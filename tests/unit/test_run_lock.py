"""runtime/run_lock.py: one run per output / checkpoint directory. Before it, two runs started on one hydra.run.dir
both ran: one failed saving ('FileNotFoundError: .../.tmp-step_5/dcp/.metadata.tmp', the other had removed its
half-written save), the other exited 0 with checkpoints the two had written over each other."""

from __future__ import annotations

import json
import shutil
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from molt_hydra.runtime.run_lock import LOCK_NAME, run_lock
from molt_hydra.runtime.watchdog import EXIT_FAILED

MOLT_RUN = Path(sys.executable).with_name("molt-run")
HOLD = ("import sys, time\nfrom molt_hydra.runtime.run_lock import run_lock\n"
        "with run_lock({'output_dir': sys.argv[1]}):\n    print('held', flush=True)\n    time.sleep(600)")
SECOND = ("import json, sys\nfrom molt_hydra.runtime.run_lock import run_lock\n"  # another run: its directories
          "with run_lock(json.loads(sys.argv[1])):\n    print('held')")


def _holder(path: Path) -> subprocess.Popen:
    """Another process holding `path`'s lock, as a run in progress would."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_directory_held_by_another_run_is_refused_naming_the_key_and_the_holder(tmp_path, capsys):
    holder = _holder(tmp_path / "out")
    try:
        with pytest.raises(SystemExit) as e, run_lock({"output_dir": str(tmp_path / "elsewhere"),
                                                       "checkpoint.dir": str(tmp_path / "out")}):
            pass
        assert e.value.code == EXIT_FAILED
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == (f"Run not started: checkpoint.dir={tmp_path / 'out'} is in use by another run (pid {holder.pid} "
                       f"on {os.uname().nodename}). Fix: wait for that run to end, or point checkpoint.dir at another "
                       "directory.")
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_goes_with_a_killed_run_and_one_directory_named_twice_is_locked_once(tmp_path):
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)  # a crashed run: its resume must not be blocked
    holder.wait()
    with run_lock({"output_dir": str(tmp_path), "checkpoint.dir": str(tmp_path)}):  # checkpoint.dir = output_dir
        lock = tmp_path.parent / f".{tmp_path.name}{LOCK_NAME}"  # beside it (a directory removed keeps its lock)
        assert lock.read_text() == f"pid {os.getpid()} on {os.uname().nodename}"
    holder = _holder(tmp_path)  # released at the block's end (several runs in one process: a sweep)
    holder.kill()
    holder.wait()


def test_molt_run_on_a_directory_in_use_stops_before_writing_anything(tmp_path):
    """The real CLI: the second run's last line names the directory; it writes no run record and starts no Ray, and
    is refused before Hydra writes the directory: before, its .hydra/ (config.yaml, overrides.yaml) replaced the
    running run's, and its log went into that run's cli.log."""
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        proc = subprocess.run([MOLT_RUN, f"hydra.run.dir={out}", "train.max_steps=1"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == EXIT_FAILED, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"Run not started: output_dir={out} is in use by another "
                                                           f"run (pid {holder.pid} on ")
    assert sorted(p.name for p in out.iterdir()) == []  # (the holder's lock is beside it)


def test_a_multirun_point_on_a_directory_in_use_writes_nothing_there(tmp_path):
    """The real CLI, a sweep (one point) whose point's directory a running run holds (the same sweep started again,
    hydra.sweep.dir named): Hydra's launcher made the point's log and .hydra/ there before the run lock refused it, so
    the running run's cli.log took the point's lines and its .hydra/overrides.yaml and config.yaml were replaced."""
    sweep = tmp_path / "sweep"
    point = sweep / "0_seed=1"  # hydra.sweep.subdir: <job num>_<its overrides>
    holder = _holder(point)
    (point / ".hydra").mkdir()
    (point / ".hydra" / "overrides.yaml").write_text("- the running run's\n")
    try:
        proc = subprocess.run([MOLT_RUN, "-m", f"hydra.sweep.dir={sweep}", "seed=1"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == EXIT_FAILED, proc.stderr[-2000:]
    assert (f"Run not started: output_dir={point} is in use by another run (pid {holder.pid} on "
            f"{os.uname().nodename})") in proc.stderr
    assert "sweep point #0 (seed=1): failed (exit 4), for the reason above; the sweep goes on." in proc.stderr
    assert [p.name for p in point.iterdir()] == [".hydra"]  # no log of the point's
    assert [p.name for p in (point / ".hydra").iterdir()] == ["overrides.yaml"]
    assert (point / ".hydra" / "overrides.yaml").read_text() == "- the running run's\n"


def _second_run(dirs: dict[str, str]) -> subprocess.CompletedProcess:
    """Another process taking the run lock of `dirs` (SECOND): prints "held" if it got it."""
    return subprocess.run([sys.executable, "-c", SECOND, json.dumps(dirs)], capture_output=True, text=True,
                          timeout=120)


def _assert_refused(proc: subprocess.CompletedProcess, key: str, path: Path) -> None:
    """The second run was refused, naming `key`'s directory and this process as its holder."""
    assert proc.returncode == EXIT_FAILED and "held" not in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"Run not started: {key}={path} is in use by another run (pid {os.getpid()} on {os.uname().nodename}). "
        f"Fix: wait for that run to end, or point {key} at another directory.")


def _locked_dirs(out: Path, *overrides: str) -> dict[str, str]:
    """What `molt-run` locks for this config (runtime/entrypoint.py run: the validated config's run_dirs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from omegaconf import OmegaConf

    from molt_hydra.runtime.validate import validate
    from molt_hydra.runtime.writable import run_dirs

    return run_dirs(validate(OmegaConf.to_object(compose_config(list(overrides), output_dir=str(out)))))


def test_two_runs_exporting_to_one_directory_are_refused_and_the_export_keeps_its_lock(tmp_path, capsys):
    """Two runs of their own output_dir with one checkpoint.export_dir: their exports removed each other's .tmp-
    copy and replaced each other's export. Before, only output_dir and checkpoint.dir were locked: the second ran.
    The lock is beside the export (in its parent), which it neither makes nor loses when an export replaces it."""
    from molt_hydra.parallel.checkpoint import _replace_dir

    export = tmp_path / "shared" / "final"
    first = _locked_dirs(tmp_path / "a", f"checkpoint.export_dir={export}")
    with run_lock(first):
        assert not export.exists()  # (a resume reads an export made after its checkpoint as done: none made here)
        (tmp_path / "shared" / ".tmp-final").mkdir()
        _replace_dir(tmp_path / "shared" / ".tmp-final", export)  # the first run's export
        second = _locked_dirs(tmp_path / "b", f"checkpoint.export_dir={export}")
        proc = _second_run(second)
    _assert_refused(proc, "checkpoint.export_dir", export)
    assert sorted(p.name for p in export.iterdir()) == []  # nothing of the lock's inside the export


def test_a_checkpoint_dir_removed_while_its_run_goes_on_is_still_refused_to_a_second_run(tmp_path):
    """A user frees space by removing a running run's checkpoint.dir (`rm -rf`): its lock was inside and went with it,
    so a second run on that checkpoint.dir (its own output_dir: a resume from another run directory) started beside
    the first. The lock is in the directory's parent, which the removal leaves; the run's directory is still made."""
    ckpt = tmp_path / "ckpt"
    second = {"output_dir": str(tmp_path / "b"), "checkpoint.dir": str(ckpt)}
    with run_lock({"output_dir": str(tmp_path / "a"), "checkpoint.dir": str(ckpt)}):
        assert ckpt.is_dir() and sorted(p.name for p in ckpt.iterdir()) == []
        shutil.rmtree(ckpt)
        proc = _second_run(second)
    _assert_refused(proc, "checkpoint.dir", ckpt)
    proc = _second_run(second)
    assert proc.returncode == 0 and proc.stdout == "held\n", proc.stderr[-2000:]  # released with the first run


def test_a_checkpoint_dir_in_a_directory_its_user_cannot_write_keeps_its_lock_inside(tmp_path, monkeypatch, capsys):
    """checkpoint.dir made for the user in a directory it cannot write (/scratch/$USER itself): its lock is inside, as
    before, and refuses a second run there. Stand-in: os.access says so (these tests run as root, who writes all)."""
    from molt_hydra.runtime import run_lock as module

    ckpt = tmp_path / "alice"
    monkeypatch.setattr(module.os, "access", lambda path, mode: Path(path) != tmp_path)
    with run_lock({"checkpoint.dir": str(ckpt)}):
        assert sorted(p.name for p in tmp_path.iterdir()) == ["alice"] and (ckpt / LOCK_NAME).is_file()
        with pytest.raises(SystemExit), run_lock({"output_dir": str(tmp_path / "b"), "checkpoint.dir": str(ckpt)}):
            pass
    assert capsys.readouterr().err.strip().startswith(f"Run not started: checkpoint.dir={ckpt} is in use")


def test_a_look_at_a_lock_works_where_an_exclusive_lock_needs_a_file_open_for_writing(tmp_path, monkeypatch, capsys):
    """An NFS client emulates flock as a byte-range lock, and refuses an exclusive one on a file opened read-only
    (EBADF, flock(2)): a stand-in flock that does so, as NFS cannot run here. molt-report's look (`in_use`), the check
    before Hydra writes (`refuse_if_held`) and `unless_another_run` open the lock read-only: each still tells a held
    lock (was: the EBADF traceback, e.g. out of molt-report on every run of an NFS home)."""
    import errno
    import fcntl

    from molt_hydra.runtime import run_lock as lock_module

    real = fcntl.flock

    def nfs_flock(fd, how):
        if how & fcntl.LOCK_EX and os.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, how)

    holder = _holder(tmp_path / "out")
    monkeypatch.setattr(lock_module.fcntl, "flock", nfs_flock)
    try:
        assert lock_module.in_use("output_dir", tmp_path / "out") is True
        with lock_module.unless_another_run("output_dir", tmp_path / "out") as free:
            assert free is False
        with pytest.raises(SystemExit) as e:
            lock_module.refuse_if_held({"output_dir": str(tmp_path / "out")})
        assert e.value.code == EXIT_FAILED and "is in use by another run" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert lock_module.in_use("output_dir", tmp_path / "out") is False
