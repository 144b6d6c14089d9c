"""The tree's own invariants, held in CI: pyflakes' checks (an undefined name is a NameError waiting for the one path
that reaches it), lines of at most 120 characters (ruff's E501, line-length in pyproject.toml) and the shape rules of
the house (scripts/code_stats.py: no function over 60 lines, no import cycle, no upward import across layers, no patch
of another library or reach into its privates outside compat/)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKED = ["molt_hydra", "tests", "scripts", "bench", "launchers", "recipes"]


RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"  # the test extra's, beside this python


def test_pyflakes_finds_nothing():
    out = subprocess.run([RUFF, "check", "--no-cache", "--output-format", "concise", *CHECKED], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_lint_catches_an_undefined_name(tmp_path):
    # the check above is only worth its green if it fails on what it is for
    (tmp_path / "bad.py").write_text("def f():\n    return saves\n")
    out = subprocess.run([RUFF, "check", "--no-cache", "--output-format", "concise", str(tmp_path / "bad.py")],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1 and "F821" in out.stdout and "saves" in out.stdout


def test_shape_rules_hold():
    out = subprocess.run([sys.executable, "scripts/code_stats.py", "--long"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    counts = {k: int(v) for k, v in re.findall(r"(functions > 60 lines|import cycles|upward imports|patches outside "
                                              r"compat|private reaches outside compat) (\d+)", out)}
    assert counts == {"functions > 60 lines": 0, "import cycles": 0, "upward imports": 0,
                      "patches outside compat": 0, "private reaches outside compat": 0}, out
