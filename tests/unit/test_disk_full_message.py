"""A driver write that fills a disk (metrics.jsonl, samples.jsonl: an open file, so the OSError names no path) ends
the run naming the free space of the run's directories, so the full one is seen (runtime/entrypoint.py
`_report_failure`). Before: `Run failed: driver (I/O): OSError: [Errno 28] No space left on device.` and nothing
told which disk (the traceback file could not be written either)."""

from __future__ import annotations

import asyncio
import errno
import re
import shutil
from types import SimpleNamespace as value

from molt_hydra.runtime.entrypoint import _report_failure


def test_a_full_disk_names_the_free_space_of_the_runs_directories(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    cfg = value(output_dir=str(out), job=value(value="rl"), checkpoint=value(dir=str(ckpt)))
    lines = asyncio.run(_report_failure(cfg, None, OSError(errno.ENOSPC, "No space left on device")))
    free = shutil.disk_usage(out).free / 1e9
    found = re.fullmatch(rf"Run failed: driver \(I/O\): OSError: \[Errno 28\] No space left on device \(free: "
                         rf"output_dir={re.escape(str(out))} ([\d.e+]+) GB\)\.", lines[0])
    assert found, lines[0]  # (checkpoint.dir does not exist yet: not named)
    assert abs(float(found.group(1)) - free) <= max(0.01 * free, 0.01)
