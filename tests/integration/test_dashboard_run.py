"""A real short `molt-run` with `logger.wandb_dashboard=true` (W&B offline): the dashboard it writes at the end names
only metrics its metrics.jsonl has, with the sections the run should show, and `molt-report` draws them.

RUNS is the list of runs checked; an MoE run is one more entry (its overrides and its sections, MoE routing
included), checked by the same function (`check_dashboard_matches_run` in tests/unit/test_dashboard.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_dashboard import check_dashboard_matches_run  # noqa: E402
from test_rl_loop import molt_run  # noqa: E402

from molt_hydra.runtime import report  # noqa: E402

DENSE_SECTIONS = {"Reward and score", "Drift: sampler vs trainer", "Rollouts", "Throughput", "Time split", "Losses",
                  "Grad norm"}
# name -> (overrides, expected sections). The default run's (dense actor: no MoE section, no KL-to-reference term)
# is checked on the async run of tests/integration/test_rl_loop.py, which starts the same stack with W&B offline:
# one run fewer in the suite, the same assertions (`check_run_dashboard`).
RUNS = {
    # the MoE recipe (routing replay on): the MoE routing section too, from the metrics the trainer's routers log
    "moe": (["+recipe=tiny_moe_cpu"], DENSE_SECTIONS | {"MoE routing"}),
}


def check_run_dashboard(run_dir: Path, output: str, sections: set[str]) -> None:
    """A run made with logger.wandb_dashboard=true (W&B offline): its dashboard names only logged metrics, has
    `sections`, points at the run's W&B id, and molt-report draws one PNG per section."""
    spec = check_dashboard_matches_run(run_dir, sections)
    assert f"dashboard spec written to {run_dir / 'dashboard.json'}" in output
    assert spec["filter"]["ID"] in {d.name.rsplit("-", 1)[-1] for d in run_dir.glob("wandb/offline-run-*")}
    assert report.main([str(run_dir)]) == 0
    assert len(list((run_dir / "report").glob("*.png"))) == len(sections)


@pytest.mark.slow  # ~30 s: the spec's sections are unit-tested (tests/unit/test_dashboard.py), the dense run's in
@pytest.mark.parametrize("name", sorted(RUNS))  # test_rl_loop.py
def test_run_dashboard_names_only_logged_metrics(tmp_path, name):
    overrides, sections = RUNS[name]
    proc = molt_run(tmp_path, "train.max_steps=2", "logger.wandb.mode=offline", "logger.wandb_dashboard=true",
                    *overrides)
    check_run_dashboard(tmp_path, proc.stdout + proc.stderr, sections)
