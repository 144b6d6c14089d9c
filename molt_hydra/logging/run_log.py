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
        self.unlogged: tuple[int, dict] | None = None  # the last step, when logger.every_steps kept it from W&B / TB

    def step(self, step: int, metrics: dict, batch) -> None:
        """metrics.jsonl gets every step (docs/metrics.md); W&B and TensorBoard every logger.every_steps-th and the
        last (`flush`). Before, every_steps thinned metrics.jsonl too, which molt-report, the W&B summary's best
        values and the run's closing summary read."""
        log = self.cfg
        remote = step % log.every_steps == 0
        self.unlogged = None if remote else (step, metrics)  # (first: a failed W&B write of this step flushes none)
        self.sinks.log(metrics, step, remote=remote)
        self.progress.step(step, metrics)
        rows = [t for g in batch.groups for t in g.trajectories]
        if log.sample_table_every and step % log.sample_table_every == 0 and rows:
            self.sinks.log_samples([self._sample_row(t) for t in rows[:8]], step)
        if log.dump_trajectories:
            out = self.dir / "trajectories"
            out.mkdir(exist_ok=True)
            with open(out / f"step{step}.jsonl", "w") as f:
                for t in rows:
                    row = dict(zip(("prompt", "response", "reward"), self._sample_row(t)))
                    f.write(json.dumps({**row, **{name: getattr(t, name) for name in TRAJECTORY_FIELDS}}) + "\n")

    def samples(self, step: int, exps: list, returns, mask, group_stds) -> None:
        """logger.debug_rollout (Molt's MOLT_DEBUG_ROLLOUT): one console line per trained sample: its reward, its
        return (mean over its action tokens), its group's reward std and its decoded response (every turn's)."""
        for e, ret, m, std in zip(exps, returns, mask.bool(), group_stds.tolist()):
            mean_return = ret[m].mean().item() if m.any() else float("nan")
            text = self.tokenizer.decode(e.token_ids[e.action_mask].tolist())
            print(f"debug_rollout step {step} sample {e.rollout_id} group {e.group_id}: reward {e.reward:.4f} return "
                  f"{mean_return:.4f} group_reward_std {std:.4f} | {text!r}", flush=True)

    def eval(self, step: int, metrics: dict) -> None:
        self.sinks.log(metrics, step, prefix="eval")
        self.progress.eval(step, metrics)

    def _sample_row(self, t) -> tuple[str, str, float]:
        first = t.action_ranges[0][0] if t.action_ranges else len(t.token_ids)
        return (self.tokenizer.decode(t.token_ids[:first]), self.tokenizer.decode(t.generated_ids), float(t.reward))

    def flush(self) -> None:
        """The last step into W&B and TensorBoard if logger.every_steps kept it out: the RL loop calls it when its
        steps end (the data, train.max_steps, Slurm's notice), `close` when a failure ends the run. Before, a run whose
        last step was no multiple of every_steps never logged it: molt-report called the completed run "stopped at
        step N", and W&B's summary (final values) ended there."""
        if self.unlogged is not None:
            self.sinks.log(self.unlogged[1], self.unlogged[0], jsonl=False)
            self.unlogged = None

    def close(self) -> None:
        try:
            self.flush()
        finally:  # (a sink that failed the step's row fails its flush again: W&B is still finished)
            self.sinks.close()
