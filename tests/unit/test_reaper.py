"""runtime/reaper.py: the processes a run's ray.init started end with the driver, also when it is killed (real
processes: a `sleep` in its own session stands for Ray's DashboardAgent, which outlived a kill -9 of the driver by
60 s, also one during ray.init). The Ray run itself: tests/integration/test_faults.py (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from molt_hydra.runtime import reaper

REPO = Path(__file__).resolve().parents[2]
DRIVER = """
import subprocess, time
from molt_hydra.runtime import reaper
reaper.watch()
# started after the watcher, never named to it (ray.init's raylet starts the agents); outlives its parent unless
# something ends it
agent = subprocess.Popen(["sleep", "300"], start_new_session=True)


def waits() -> int:  # the watcher's waits in select: one a poll (was: a fixed 3 polls' time, too short on a loaded box)
    status = open(f"/proc/{reaper._watcher.pid}/status").read()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


begun = waits()
while waits() < begun + 3:  # a whole listing begun after the agent started
    time.sleep(reaper.POLL_S)
print(agent.pid, flush=True)
time.sleep(300)
"""


def _gone(pid: int, within: float) -> bool:
    until = time.monotonic() + within
    while time.monotonic() < until:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True  # dead, not yet reaped by its new parent
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_driver_takes_the_watched_processes_with_it():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    agent = int(driver.stdout.readline())
    try:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert _gone(agent, reaper.GRACE_S + 5)  # (the grace: what ends on its own, a Ray worker, does)
    finally:
        if not _gone(agent, 0):
            os.kill(agent, signal.SIGKILL)


def test_stop_ends_the_watcher_and_leaves_the_rest_to_the_teardown():
    reaper.watch()
    agent = subprocess.Popen(["sleep", "300"], start_new_session=True)
    watcher = reaper._watcher
    reaper.settled()
    reaper.stop()
    try:
        assert watcher.poll() == 0 and agent.poll() is None
    finally:
        agent.kill()
        agent.wait()


KEPT = """
import asyncio, os, signal, subprocess, time
from molt_hydra.runtime import reaper
reaper.KEEP_S = 0.05
reaper.watch()
agent = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
reaper.settled()
first = reaper._watcher
os.kill(first.pid, signal.SIGKILL)

async def run():  # (the RL loop runs `keep` beside its steps)
    keeping = asyncio.ensure_future(reaper.keep())
    while reaper._watcher is first:
        await asyncio.sleep(0.05)
    print(agent.pid, first.pid, reaper._watcher.pid, flush=True)
    await asyncio.sleep(300)

asyncio.run(run())
"""


def test_a_killed_watcher_is_started_again_and_still_ends_the_processes_with_a_killed_driver():
    """Before: a kill -9 of the watcher went unseen, and a kill -9 of the driver after it left Ray's agents behind."""
    driver = subprocess.Popen([sys.executable, "-c", KEPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    agent = None
    try:
        agent, first, second = map(int, driver.stdout.readline().split())
        assert driver.stderr.readline() == f"The run's reaper (pid {first}), which ends Ray's processes if the " \
            f"driver is killed, died (killed by SIGKILL): started again (pid {second}).\n"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert _gone(agent, reaper.GRACE_S + 5)
    finally:
        driver.kill()
        if agent is not None and not _gone(agent, 0):
            os.kill(agent, signal.SIGKILL)


def test_the_watcher_ignores_slurms_notice_and_a_hangup():
    """Slurm signals every process of a job step with the notice (submitit's --signal=USR2@N, without B:). Before: the
    watcher died at each notice (the run restarted it, saying so), a kill -9 of the driver meanwhile left Ray's
    agents."""
    reaper.watch()
    try:
        line = next(ln for ln in open(f"/proc/{reaper._watcher.pid}/status") if ln.startswith("SigIgn:"))
        mask = int(line.split()[1], 16)
        assert mask >> (signal.SIGUSR2 - 1) & 1 and mask >> (signal.SIGHUP - 1) & 1, hex(mask)
        os.kill(reaper._watcher.pid, signal.SIGUSR2)
        time.sleep(0.2)
        assert reaper._watcher.poll() is None  # it lives on
    finally:
        reaper.stop()
