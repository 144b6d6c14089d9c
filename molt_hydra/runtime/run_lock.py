"""One run per directory: a run holds an exclusive lock on each directory it writes (runtime/writable.py `run_dirs`: its
output, checkpoint and export directories, train.rollout_dump_dir) from before its first write to its end. A second
run started on one of them while the first runs (the same hydra.run.dir twice, two runs sharing a checkpoint.dir or a
checkpoint.export_dir) fails before it writes anything, naming the directory, the run holding it and the fix;
unlocked, the two had written each other's checkpoints (one saved the other's half-written step, the other's save
failed with a FileNotFoundError), exports (one removed the other's half-written .tmp- copy) and metrics. The lock is
the kernel's (flock): it goes with the process that holds it, also when that one is killed, so a crashed run never
blocks its resume. Its file is beside the directory (`lock_file`), so removing the directory does not remove it."""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from molt_hydra.runtime.watchdog import EXIT_FAILED

LOCK_NAME = ".molt-run.lock"
# replaced whole at each export (parallel/checkpoint.py `_replace_dir`): a lock inside would go with the old copy, and
# the directory, made at the start, would read as exported (entrypoint._nothing_left): its lock is in its parent
BESIDE = ("checkpoint.export_dir",)


@contextmanager
def run_lock(dirs: dict[str, str]):
    """Holds the lock of each of `dirs` (config key -> directory, each made if missing) for the `with` block; one
    already held by another run prints why and exits non-zero."""
    held, seen = [], set()
    try:
        for key, path in dirs.items():
            directory = Path(path).resolve()  # made, or its parent where it is made whole later (`lock_file` looks)
            (directory.parent if key in BESIDE else directory).mkdir(parents=True, exist_ok=True)
            lock = lock_file(key, directory)
            if lock in seen:  # two keys naming one directory: one lock (a second flock would block on the first)
                continue
            seen.add(lock)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            held.append(fd)
            _refuse_if_held(fd, key, path)
            os.ftruncate(fd, 0)
            os.pwrite(fd, _holder().encode(), 0)
        yield
    finally:
        for fd in held:
            os.close(fd)  # releases its lock


def refuse_if_held(dirs: dict[str, str]) -> None:
    """`run_lock`'s refusal, before Hydra writes the run directory (.hydra/, cli.log): before, a run refused there
    had replaced the running run's .hydra/overrides.yaml and config.yaml with its own, and logged into its cli.log.
    Each lock is let go at once: `run_lock` takes them (two runs started at once: one is refused there)."""
    for key, path in dirs.items():
        try:
            fd = os.open(lock_file(key, path), os.O_RDONLY)
        except OSError:  # none: no run ever held it (or none this user may read: `run_lock` says so)
            continue
        try:
            _refuse_if_held(fd, key, path, fcntl.LOCK_SH)
        finally:
            os.close(fd)


# A look at a lock opened read-only takes it shared: it conflicts with a run's exclusive one as well, where an NFS
# client (flock emulated as a byte-range lock) refuses an exclusive lock of a file not opened for writing (EBADF)
def in_use(key: str, path: str | os.PathLike) -> bool:
    """Whether another run holds the lock of `path` (set by `key`); none is held after. False where the file system
    takes no lock at all (Lustre without flock: ENOSYS): unknown, as an unlocked run's."""
    try:
        fd = os.open(lock_file(key, path), os.O_RDONLY)
    except OSError:  # none: no run ever held it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _refuse_if_held(fd: int, key: str, path: str, how: int = fcntl.LOCK_EX) -> None:
    """Locks `fd` (`how`), or prints that another run holds it, naming it, and exits non-zero."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        print(f"\nRun not started: {key}={path} is in use by another run ({holder}). Fix: wait for that run "
              f"to end, or point {key} at another directory.", file=sys.stderr)
        sys.exit(EXIT_FAILED)


def lock_file(key: str, path: str | os.PathLike) -> Path:
    """Where the lock of the directory `path` is, whatever key names it: every run on it finds the same file. In its
    parent: a directory removed whole while its run goes on (a user freeing space: `rm -rf` of checkpoint.dir) took a
    lock inside with it, and a second run on it then started. Inside where this user cannot write the parent
    (checkpoint.dir=/scratch/$USER), unless the directory is replaced whole (BESIDE: its parent is checked writable)."""
    directory = Path(path).resolve()
    beside = directory.parent / f".{directory.name}{LOCK_NAME}"
    if key in BESIDE or beside.exists() or os.access(directory.parent, os.W_OK):
        return beside
    return directory / LOCK_NAME


def _holder() -> str:
    return f"pid {os.getpid()} on {os.uname().nodename}"


@contextmanager
def unless_another_run(key: str, directory: str | os.PathLike) -> Iterator[bool]:
    """Whether no other run writes `directory`, set by `key` (its lock is free, and held for the `with` block so none
    starts, or held by this process's `run_lock`): what a crash left there may be put back then. Another run may be
    between the two renames of a save (parallel/checkpoint.py `_replace_dir`): its step put back under it fails its
    save."""
    try:
        fd = os.open(lock_file(key, directory), os.O_RDONLY)
    except FileNotFoundError:  # no run ever wrote it
        yield True
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (held shared, a run's exclusive lock waits: none starts)
        free = True
    except BlockingIOError:  # (a lock of this process's is refused too: another open file)
        free = os.pread(fd, 200, 0).decode(errors="replace").strip() == _holder()
    try:
        yield free
    finally:
        os.close(fd)
