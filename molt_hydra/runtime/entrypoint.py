"""Run a validated config: write the run record, then start the job it names."""

from __future__ import annotations

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.plan import Plan
from molt_hydra.runtime.run_record import write_run_record


def run(cfg: RunConfig, plan: Plan) -> None:
    write_run_record(cfg, cfg.output_dir)
    print("The RL loop is not wired yet (issue 7): the plan above is what it will place.")
