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
