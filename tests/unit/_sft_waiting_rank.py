"""A job=sft rank for tests/unit/test_sft_stopped_rank.py, in a module of its own: each spawned rank imports it
(the test module's imports cost a rank seconds)."""

import os
import time
from pathlib import Path


def waiting_rank(rank: int, world: int, port: int, path: str) -> None:
    Path(path, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(10)  # (a collective waiting on a stopped rank)
