"""`build_once` (models/tiny.py): the ranks of a run resolve the same `tiny://` path at once on a cold cache.
Before: every process built its own copy and replaced the published one, pulling it from under a rank that was
already reading it (`Unrecognized model ... Should have a model_type key`, the first CI run on a fresh machine)."""

import multiprocessing as mp
import time
from pathlib import Path

from molt_hydra.models.tiny import build_once

PROCESSES = 4


def _write_model(staging: Path, log: Path) -> None:
    with open(log, "a") as f:
        f.write("built\n")
    (staging / "m").mkdir()
    time.sleep(0.5)  # the others arrive while this build is under way
    (staging / "m" / "config.json").write_text('{"model_type": "qwen3"}')


def _resolve(root: str, start, seen) -> None:
    start.wait()
    build_once(Path(root), ("m",), lambda staging: _write_model(staging, Path(root) / "builds.log"))
    seen.put((Path(root) / "m" / "config.json").read_text())


def test_concurrent_resolvers_build_once_and_all_read_the_published_model(tmp_path):
    ctx = mp.get_context("spawn")
    start, seen = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_resolve, args=(str(tmp_path), start, seen)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    read = [seen.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert (tmp_path / "builds.log").read_text() == "built\n"  # one build, not one per process
    assert read == ['{"model_type": "qwen3"}'] * PROCESSES
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".build-")] == []  # no staging left behind


def test_a_model_a_killed_build_left_half_written_is_rebuilt(tmp_path):
    (tmp_path / "m").mkdir()  # no config.json: a build killed before it published (or an older, unlocked one)
    (tmp_path / "m" / "stale.bin").write_text("x")
    build_once(tmp_path, ("m",), lambda staging: _write_model(staging, tmp_path / "builds.log"))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json"]
