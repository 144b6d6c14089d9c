"""runtime/watchdog.py `stopped`: a stall names the role whose process a signal stopped (SIGSTOP), a role's child
too (a vLLM engine core under its engine actor). Before: a stopped trainer rank was told as 'actor stalled: train_step
did not finish within 30 s', no rank and no cause named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as value

import asyncio

import pytest

from molt_hydra.runtime import watchdog
from molt_hydra.runtime.entrypoint import _stalled
from molt_hydra.runtime.watchdog import EXIT_STALLED, RoleStalled, descendants, stopped


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class PollClock:
    """watchdog's clock, `step` s on at each read: its polls look `step` apart however late a loaded box runs them (on
    the real clock, polls 0.05 s apart whose pgrep calls took > 0.1 s looked like a stopped driver's, and the count
    started again); `reads` counts the polls (one read before the first)."""

    def __init__(self, step: float):
        self.step, self.reads = step, 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.reads * self.step


def test_a_stall_names_the_roles_whose_process_is_stopped(tmp_path):
    rank = subprocess.Popen(["sleep", "60"])
    engine = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"])
    runner = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not descendants(engine.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (core,) = descendants(engine.pid)
        for pid in (rank.pid, core):
            os.kill(pid, signal.SIGSTOP)
        while {_state(rank.pid), _state(core)} != {"T"}:
            time.sleep(0.01)
        pids = {"rollout engine 0": engine.pid, "actor rank 0": rank.pid, "agent runner 0": runner.pid}
        assert stopped(pids) == [("rollout engine 0", core), ("actor rank 0", rank.pid)]
        last_words: list[str] = []
        code = _stalled(value(output_dir=str(tmp_path)), pids,
                        "actor stalled: train_step did not finish within 30 s", [], last_words)
        assert code == EXIT_STALLED
        assert last_words[0] == "Run stopped: actor stalled: train_step did not finish within 30 s; stopped by a " \
            f"signal (SIGSTOP; SIGCONT resumes it): rollout engine 0 (pid {core}), actor rank 0 (pid {rank.pid}).", \
            last_words
        os.kill(rank.pid, signal.SIGCONT)
        while _state(rank.pid) == "T":
            time.sleep(0.01)
        assert stopped(pids) == [("rollout engine 0", core)]
    finally:
        for pid in descendants(engine.pid):
            os.kill(pid, signal.SIGKILL)
        for p in (rank, engine, runner):
            p.kill()


def test_a_role_that_stays_stopped_ends_the_run_without_waiting_for_a_deadline(monkeypatch):
    """`watch_stopped` (the loop runs it beside its steps): a role seen stopped in STOPPED_POLLS polls in a row is a
    stall named after it (before: told only when its call's deadline passed, 1800 s for a trainer rank); one resumed
    before that, or polls far apart (the driver itself was stopped), start the count again."""
    monkeypatch.setattr(watchdog, "STOPPED_POLLS", 4)
    monkeypatch.setattr(watchdog, "STOPPED_POLL_S", 0.05)
    rank, runner = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    pids = {"actor rank 0": rank.pid, "agent runner 0": runner.pid}
    try:
        os.kill(rank.pid, signal.SIGSTOP)
        while _state(rank.pid) != "T":  # (stopped once it runs again: later on a loaded box)
            time.sleep(0.01)
        monkeypatch.setattr(watchdog, "time", clock := PollClock(0.05))
        with pytest.raises(RoleStalled) as stall:
            asyncio.run(asyncio.wait_for(watchdog.watch_stopped(pids), 60))
        assert stall.value.role == "actor rank 0"
        assert str(stall.value) == f"actor rank 0 stalled: its process has made no progress for {4 * 0.05:g} s"
        assert clock.reads == 1 + 4  # at the 4th poll, not before

        # stopped for 2 polls of 4, resumed for one, stopped for 2 again: never 4 in a row. The signals go after the
        # polls they follow (was: 2.5 polls' time apart, which a late poll on a loaded box could miss)
        after_poll, polls, real = {2: signal.SIGCONT, 3: signal.SIGSTOP, 5: signal.SIGCONT}, [], watchdog.stopped

        def stopped_then_signalled(role_pids, alone=None):
            polls.append(real(role_pids, alone))
            if len(polls) in after_poll:
                os.kill(rank.pid, after_poll[len(polls)])
            return polls[-1]

        async def resumed_in_time():
            watcher = asyncio.ensure_future(watchdog.watch_stopped(pids))
            while len(polls) < 8 and not watcher.done():
                await asyncio.sleep(0.01)
            assert not watcher.done()
            watcher.cancel()

        os.kill(rank.pid, signal.SIGSTOP)
        monkeypatch.setattr(watchdog, "stopped", stopped_then_signalled)
        asyncio.run(resumed_in_time())
        monkeypatch.setattr(watchdog, "stopped", real)

        async def driver_stopped_too():  # polls 1 s apart (> 3 x the interval): each one starts the count again
            # (watchdog's own clock: asyncio's keeps the real one)
            monkeypatch.setattr(watchdog, "time", PollClock(1.0))
            await asyncio.wait_for(watchdog.watch_stopped(pids), 12 * 0.05)

        os.kill(rank.pid, signal.SIGSTOP)
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(driver_stopped_too())
    finally:
        for p in (rank, runner):
            p.kill()


def test_a_stopped_gcs_or_raylet_ends_the_run_naming_it_not_its_childrens_roles(monkeypatch):
    """Ray's GCS and raylet are watched as roles `alone` (runtime/ray_head.pids), their children not theirs: a raylet's
    children are the roles' workers and Ray's agents. Before: a stopped GCS went unseen while the run went on (no new
    actor, no engine restart), and showed only when the teardown's ray.shutdown waited on it."""
    monkeypatch.setattr(watchdog, "STOPPED_POLLS", 3)
    monkeypatch.setattr(watchdog, "STOPPED_POLL_S", 0.05)
    gcs = subprocess.Popen(["sleep", "60"])
    raylet = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"])
    try:
        deadline = time.monotonic() + 10
        while not descendants(raylet.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker,) = descendants(raylet.pid)
        for pid in (worker, gcs.pid):
            os.kill(pid, signal.SIGSTOP)
        while {_state(worker), _state(gcs.pid)} != {"T"}:
            time.sleep(0.01)
        head = {"Ray's raylet": raylet.pid, "Ray's gcs_server": gcs.pid}
        assert stopped({}, head) == [("Ray's gcs_server", gcs.pid)]
        monkeypatch.setattr(watchdog, "time", PollClock(0.05))
        with pytest.raises(RoleStalled) as stall:
            asyncio.run(asyncio.wait_for(watchdog.watch_stopped({}, head), 60))
        assert str(stall.value) == f"Ray's gcs_server stalled: its process has made no progress for {3 * 0.05:g} s"
    finally:
        for pid in descendants(raylet.pid):
            os.kill(pid, signal.SIGKILL)
        for p in (gcs, raylet):
            p.kill()


def test_a_stall_on_a_full_disk_is_still_told_without_its_stacks(monkeypatch, tmp_path):
    """The stacks' file cannot be written (the output_dir's filesystem full: /dev/full stands in as that file, its
    writes fail with ENOSPC). Before: the OSError escaped the stall's report, the run ended in a traceback and the
    stall was never named; now its lines say why there are no stacks."""
    monkeypatch.setattr(watchdog.time, "strftime", lambda fmt: "now")
    (tmp_path / "stacks-now.txt").symlink_to("/dev/full")
    lines = watchdog.stall_report(tmp_path, {}, "actor stalled: train_step did not finish within 30 s", [])
    assert lines == ["Run stopped: actor stalled: train_step did not finish within 30 s.",
                     "Stacks of every role: not written (OSError: [Errno 28] No space left on device)"], lines
