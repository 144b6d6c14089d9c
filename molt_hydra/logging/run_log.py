"""What one training step leaves behind: its metric row in every sink, the progress line, the sample table and the
optional trajectory dump (<output_dir>/trajectories/step{N}.jsonl). Takes the logger group, never the root config."""

from __future__ import annotations

import json
from pathlib import Path

from molt_hydra.config.schema import LoggerConfig

# a trajectory's fields in its dump row, after the decoded prompt, response and reward
TRAJECTORY_FIELDS = ("token_ids", "logprobs", "versions", "action_ranges", "group_id", "rollout_id")


class RunLog:
    def __init__(self, cfg: LoggerConfig, output_dir: str | Path, tokenizer, sinks, progress):
        """`sinks`: logging/sinks.py MetricSinks; `progress`: logging/progress.py Progress."""
        self.cfg, self.dir, self.tokenizer = cfg, Path(output_dir), tokenizer
        self.sinks, self.progress = sinks, progress

    def step(self, step: int, metrics: dict, batch) -> None:
        log = self.cfg
        if step % log.every_steps == 0:
            self.sinks.log(metrics, step)
        self.progress.step(step, metrics)
        rows = [t for g in batch.groups for t in g.trajectories]
        if log.sample_table_every and step % log.sample_table_every == 0 and rows:
            self.sinks.log_samples([self._sample_row(t) for t in rows[:8]], step)
        if log.dump_trajectories or log.debug_rollout:
            out = self.dir / "trajectories"
            out.mkdir(exist_ok=True)
            with open(out / f"step{step}.jsonl", "w") as f:
                for t in rows:
                    row = dict(zip(("prompt", "response", "reward"), self._sample_row(t)))
                    f.write(json.dumps({**row, **{name: getattr(t, name) for name in TRAJECTORY_FIELDS}}) + "\n")

    def eval(self, step: int, metrics: dict) -> None:
        self.sinks.log(metrics, step, prefix="eval")
        self.progress.eval(step, metrics)

    def _sample_row(self, t) -> tuple[str, str, float]:
        first = t.action_ranges[0][0] if t.action_ranges else len(t.token_ids)
        return (self.tokenizer.decode(t.token_ids[:first]), self.tokenizer.decode(t.generated_ids), float(t.reward))

    def close(self) -> None:
        self.sinks.close()
