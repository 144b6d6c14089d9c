"""Helpers shared by the tests/config suite: in-process compose (fast) and the real `molt-run` CLI (a subprocess).

Compose in-process wherever the CLI is not what is under test; the CLI costs ~2 s per call, so the tests that need
it start their calls together through `run_cli_many`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from molt_hydra.config.store import CONF_DIR, RECIPES_DIR, register

REPO = Path(__file__).resolve().parents[2]
MOLT_RUN = Path(sys.executable).with_name("molt-run")
PLAN_HEADER = "== Plan =="


def compose_config(overrides: list[str], *, output_dir: str | None = "/nonexistent/molt_hydra_test",
                   hydra_config: bool = False) -> DictConfig:
    """Compose conf/ (+ recipe) + overrides exactly as `molt-run` does, in this process.

    `output_dir` defaults to `${hydra:runtime.output_dir}`, which only resolves inside a Hydra run; tests pin it.
    """
    global _initialized
    if not (_initialized and GlobalHydra.instance().is_initialized()):
        register()
        GlobalHydra.instance().clear()
        # Left initialized (no `with`): initializing costs as much as a compose, and every test here composes.
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
        _initialized = True
    extra = [f"output_dir={output_dir}"] if output_dir is not None else []
    return compose("config", overrides=[*overrides, *extra], return_hydra_config=hydra_config)


_initialized = False


@dataclass
class Recipe:
    name: str
    path: Path
    argv: list[str]  # the first-line command after `molt-run`, e.g. ['-m', '+recipe=x', 'cluster=local_gpus']

    @property
    def multirun(self) -> bool:
        return "-m" in self.argv or "--multirun" in self.argv

    @property
    def overrides(self) -> list[str]:
        return [a for a in self.argv if not a.startswith("-")]


def recipes() -> list[Recipe]:
    out = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("#"), f"{path}: the first line must be `# <command that runs it>`, got {first!r}"
        argv = shlex.split(first.lstrip("#"))
        assert argv and argv[0] == "molt-run", f"{path}: first-line command must start with molt-run, got {first!r}"
        out.append(Recipe(path.stem, path, argv[1:]))
    return out


@dataclass
class CliResult:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self) -> str:
        return (f"molt-run {shlex.join(self.args)} -> exit {self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}"
                f"\n--- stderr ---\n{self.stderr[-4000:]}")


def run_cli(args: list[str], timeout: float = 120) -> CliResult:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # the user's default: no stack traces
    p = subprocess.run([str(MOLT_RUN), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return CliResult(args, p.returncode, p.stdout, p.stderr)


def run_cli_many(calls: list[list[str]]) -> list[CliResult]:
    """Run several CLI calls at once (each is mostly Python start-up and imports)."""
    with ThreadPoolExecutor(max_workers=max(2, min(len(calls), os.cpu_count() or 2))) as pool:
        return list(pool.map(run_cli, calls))
