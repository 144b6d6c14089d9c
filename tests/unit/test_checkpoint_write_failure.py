"""A checkpoint that cannot be written (disk full, quota, file-size limit) names the cause, not only DCP's
'CheckpointException ranks:dict_keys([0])' — the message a run printed on the H200 when a 56 GB checkpoint met a
64 GB disk. The failure here is real: a file-size limit the shard exceeds, in a child process."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import resource, signal, sys, torch
from molt_hydra.parallel.checkpoint import save_checkpoint
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the 256x256 fp32 shard is 262 kB
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing the process
try:
    save_checkpoint(sys.argv[1], 1, torch.nn.Linear(256, 256))
except RuntimeError as e:
    print("ERROR:", e)
"""


def test_a_failed_checkpoint_write_names_its_rank_and_cause(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120)
    line = next(line for line in out.stdout.splitlines() if line.startswith("ERROR:"))
    assert f"writing {tmp_path}/.tmp-step_1 failed on rank 0: " in line
    assert "CheckpointException" not in line
    assert not (tmp_path / "step_1").exists() and not (tmp_path / "latest").exists()  # nothing half-written published
