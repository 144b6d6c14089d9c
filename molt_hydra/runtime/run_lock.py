"""One run per directory: a run holds an exclusive lock on its output and checkpoint directories from before its first
write to its end. A second run started on either while the first runs (the same hydra.run.dir twice, two runs sharing
a checkpoint.dir) fails before it writes anything, naming the directory, the run holding it and the fix; unlocked,
the two had written each other's checkpoints (one saved the other's half-written step, the other's save failed with
a FileNotFoundError) and interleaved their metrics. The lock is the kernel's (flock): it goes with the process that
holds it, also when that one is killed, so a crashed run never blocks its resume."""

from __future__ import annotations

import fcntl
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from molt_hydra.runtime.watchdog import EXIT_FAILED

LOCK_NAME = ".molt-run.lock"


@contextmanager
def run_lock(dirs: dict[str, str]):
    """Holds the lock of each of `dirs` (config key -> directory, each made if missing) for the `with` block; one
    already held by another run prints why and exits non-zero."""
    held, seen = [], set()
    try:
        for key, path in dirs.items():
            directory = Path(path).resolve()
            if directory in seen:  # checkpoint.dir = output_dir: one lock (a second flock would block on the first)
                continue
            seen.add(directory)
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            held.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                print(f"\nRun not started: {key}={path} is in use by another run ({holder}). Fix: wait for that run "
                      f"to end, or point {key} at another directory.", file=sys.stderr)
                sys.exit(EXIT_FAILED)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        yield
    finally:
        for fd in held:
            os.close(fd)  # releases its lock
