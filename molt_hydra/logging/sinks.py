"""Where metrics go: a jsonl file always, W&B (offline unless W&B finds credentials) and TensorBoard when configured.

Train metrics are logged as `train/<name>` against `train/global_step`, eval as `eval/<name>` (Molt's names). The W&B
run id goes into every checkpoint so a resumed run continues the same W&B run (a run that starts over in the same
directory continues the last W&B run there); sweeps set the W&B group.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
from pathlib import Path

from molt_hydra.logging import dashboard
# imported where used: wandb, TensorBoard (heavy, optional)

# the run's per-step dumps under output_dir: logger.dump_trajectories (logging/run_log.py), logger.dump_logprobs
DUMPS = ("trajectories", "logprobs")


def aside_stamp(paths: list[Path]) -> str | None:
    """A start from step 0: the name an earlier attempt's files go aside under, `earlier-<UTC time of the first one's
    last write>` (-2, -3 .. where an earlier start over took it); None: none of `paths` holds anything."""
    for path in paths:
        if path.exists() and path.stat().st_size:
            stamp = first = time.strftime("earlier-%Y%m%dT%H%M%SZ", time.gmtime(path.stat().st_mtime))
            n = 1
            while any(path.parent.glob(f"*.{stamp}*")):  # (a file or a dump directory of that name)
                n += 1
                stamp = f"{first}-{n}"
            return stamp
    return None


def rewind_jsonl(path: Path, step: int, *, key: str = "step", aside: str | None = None) -> Path | None:
    """A jsonl of per-step rows (their step under `key`), on a resume from `step`: the rows past it are dropped (the
    interrupted run logged them; this run logs those steps again), and so are torn ones, each with a line; at step 0
    (`aside`: aside_stamp's name) the file, the earlier attempt's, is moved aside whole instead. Returns where it was
    moved (None: it stayed). MetricSinks.rewind (RL) and job=sft use it."""
    if not path.exists():
        return None
    rows, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append((line, int(json.loads(line)[key])))
        except (ValueError, KeyError, TypeError):  # cut short: killed mid-write (node failure, disk full)
            torn += bool(line.strip())
    if step == 0 and aside and (rows or torn):
        return path.rename(path.with_name(f"{path.stem}.{aside}{path.suffix}"))
    if torn:
        print(f"{path}: {torn} unreadable row(s) dropped on resume (a write the stop cut short)", file=sys.stderr,
              flush=True)
    kept = path.with_name(path.name + ".rewound")  # replaced whole: a kill mid-write leaves the old file, not half
    kept.write_text("".join(line + "\n" for line, s in rows if s <= step))
    os.replace(kept, path)
    if past := sum(s > step for _, s in rows):
        print(f"{path}: {past} row(s) past step {step} dropped (the interrupted run's; logged again)", flush=True)
    return None


class MetricSinks:
    def __init__(self, output_dir: str | Path, *, run_name: str, config: dict, wandb_mode: str = "auto",
                 project: str = "molt_hydra", entity: str | None = None, group: str | None = None,
                 tensorboard: bool = False, resume_wandb_id: str | None = None, dashboard: bool = False):
        self.dir = Path(output_dir)
        self.dashboard = dashboard
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self.wandb_run = None
        # after a resume, by kind (train, eval): steps <= this were logged to W&B by the interrupted run (see rewind)
        self.replayed_to: dict[str, int] = {}
        self.resumes_wandb = False  # the W&B run goes on from an earlier one (rows logged again are marked)
        self.nonfinite: set[str] = set()  # metrics whose last value was NaN / inf (named once per such streak)
        if wandb_mode == "auto":  # online where W&B finds credentials (WANDB_API_KEY, `wandb login`), as wandb.init
            from molt_hydra.compat.wandb import api_key

            wandb_mode = "online" if api_key()[0] else "offline"
        self.wandb_mode = wandb_mode
        if wandb_mode != "disabled":
            import wandb

            from molt_hydra.compat.wandb import last_run_id, settings

            # no checkpoint to name it (a Slurm point requeued before its first one): the last W&B run here goes on
            resume_wandb_id = resume_wandb_id or last_run_id(self.dir)
            self.resumes_wandb = resume_wandb_id is not None
            self.wandb_run = wandb.init(project=project, entity=entity, group=group, name=run_name, config=config,
                                        mode=wandb_mode, dir=str(self.dir), id=resume_wandb_id,
                                        resume="allow" if resume_wandb_id else None, settings=settings())
            for prefix in ("train", "eval"):
                self.wandb_run.define_metric(f"{prefix}/global_step")
                self.wandb_run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/global_step")
        self.tb = self._tensorboard(run_name) if tensorboard else None

    def _tensorboard(self, run_name: str, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.dir / "tensorboard" / run_name), purge_step=purge_step)

    def rewind(self, step: int) -> None:
        """On resume from step `step` (0: a start from scratch, e.g. a Slurm requeue before the first checkpoint):
        drop the jsonl rows past it (the interrupted run logged them; this run logs those steps again), so every step
        keeps a single row; TensorBoard is told the same (a restart marker at step + 1: its readers drop the earlier
        points from there on). W&B history cannot be rewritten: in the W&B run resumed, the rows of those steps
        logged again carry `<prefix>/replayed_after_resume` = 1, so charts can filter them.
        At step 0 no earlier row is this run's to drop: the earlier attempt's files (metrics.jsonl, samples.jsonl, its
        TensorBoard events and DUMPS) are moved aside whole, named, with a notice. Before: they were dropped (dumps
        overwritten), so a new run in an output_dir an earlier run had logged to (a new checkpoint.dir: no checkpoint
        found) erased its metrics."""
        self.jsonl.close()
        paths = [self.dir / "metrics.jsonl", self.dir / "samples.jsonl"]
        stamp = aside_stamp(paths) if step == 0 else None
        moved = []
        if self.resumes_wandb:  # by kind: an eval a Slurm notice's save skipped is logged first at the resumed step
            for row in dashboard.read_metrics(paths[0]):
                kind = row.get("kind", "train")
                self.replayed_to[kind] = max(self.replayed_to.get(kind, 0), int(row["step"]))
        for path in paths:
            moved += [aside] if (aside := rewind_jsonl(path, step, aside=stamp)) else []
        for name in DUMPS if moved else ():  # (a run from step 0 would overwrite some of them: a mix of two runs)
            if (self.dir / name).is_dir():
                moved.append((self.dir / name).rename(self.dir / f"{name}.{stamp}"))
        if self.tb is not None:
            self.tb.close()
            run = Path(self.tb.log_dir)  # this writer's own events file is one; an earlier attempt's are the others
            if moved and len(list(run.glob("events.out.tfevents.*"))) > 1:
                moved.append(run.rename(run.with_name(f"{run.name}.{stamp}")))
            self.tb = self._tensorboard(run.name, purge_step=step + 1)
        if moved:
            print(f"{self.dir}: an earlier attempt's metrics, with no checkpoint to go on from, moved aside to "
                  f"{', '.join(p.name for p in moved)}; this run starts at step 0"
                  + (" and goes on in the last W&B run here (steps logged again marked replayed_after_resume)"
                     if self.resumes_wandb else ""), flush=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, metrics: dict[str, float], step: int, prefix: str = "train", *, jsonl: bool = True,
            remote: bool = True) -> None:
        """One step's row into metrics.jsonl (`jsonl`) and into W&B and TensorBoard (`remote`): logger.every_steps
        thins the latter two only (logging/run_log.py)."""
        self._check_in_place()
        # Non-finite values are kept (NaN in the jsonl, as W&B shows them): a metric that goes NaN must be seen, so
        # the console names it where it turns non-finite (W&B's charts leave the point out without a word).
        clean = {f"{prefix}/{k}": float(v) for k, v in metrics.items() if dashboard.is_number(v)}
        for k, v in clean.items():
            if not math.isfinite(v) and k not in self.nonfinite:
                print(f"step {step}: non-finite metric {k} = {v} (logged as is)", file=sys.stderr, flush=True)
            (self.nonfinite.discard if math.isfinite(v) else self.nonfinite.add)(k)
        if jsonl:
            self.jsonl.write(json.dumps({"step": step, "kind": prefix, **clean}) + "\n")
        if not remote:
            return
        if self.wandb_run is not None:
            replayed = {f"{prefix}/replayed_after_resume": 1.0} if step <= self.replayed_to.get(prefix, -1) else {}
            self.wandb_run.log({**clean, **replayed, f"{prefix}/global_step": step})
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)

    def _check_in_place(self) -> None:
        """Every sink still writes where it started: metrics.jsonl is the file at its path, an offline W&B run's
        file (its only copy) and TensorBoard's directory are there. Before: with output_dir (or a sink's directory)
        removed or moved mid-run, the rows went on to the removed files without a word until the run's end."""
        path = self.dir / "metrics.jsonl"
        try:
            gone = [] if os.stat(path).st_ino == os.fstat(self.jsonl.fileno()).st_ino else [path]
        except FileNotFoundError:
            gone = [path]
        if self.wandb_run is not None and self.wandb_mode == "offline":
            gone += [p for p in [Path(self.wandb_run.settings.sync_file)] if not p.is_file()]
        if self.tb is not None:
            gone += [p for p in [Path(self.tb.get_logdir())] if not p.is_dir()]
        if gone:
            raise FileNotFoundError(errno.ENOENT, "removed or replaced while the run wrote it (output_dir, or the "
                                    "sink's directory, deleted or moved?): the metrics from here on would be lost. "
                                    "Fix: leave output_dir in place while the run goes on", str(gone[0]))

    def log_samples(self, rows: list[tuple[str, str, float]], step: int) -> None:
        """A table of (prompt, response, reward) sample trajectories."""
        with open(self.dir / "samples.jsonl", "a") as f:
            for prompt, response, reward in rows:
                f.write(json.dumps({"step": step, "prompt": prompt, "response": response, "reward": reward}) + "\n")
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=["global_step", "prompt", "response", "reward"],
                                data=[[step, p, r, w] for p, r, w in rows])
            self.wandb_run.log({"train/generated_samples": table, "train/global_step": step})
        if self.tb is not None:
            self.tb.add_text("train/generated_samples", "\n\n".join(f"**{w:.3f}** {p} → {r}" for p, r, w in rows), step)

    def close(self) -> None:
        """Flush and close every sink. W&B's service process goes too (a later run in this process starts its own):
        the run ends every process it started, and a service killed under a live wandb breaks the next wandb.init."""
        self.jsonl.close()
        if self.wandb_run is not None:
            import wandb

            if self.dashboard:
                self._publish_dashboard()
            self.wandb_run.finish()
            wandb.teardown()
            self.wandb_run = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def _publish_dashboard(self) -> None:
        """logger.wandb_dashboard: best values into the summary (the sweep's runs table), then the run's dashboard:
        saved to W&B when online, else written as dashboard.json for `molt-report --wandb` after `wandb sync`."""
        rows = dashboard.read_metrics(self.dir / "metrics.jsonl")
        for key, mode in dashboard.TABLE_METRICS:
            best = dashboard.final_and_best(rows, key, mode)[1]
            if best is not None:
                self.wandb_run.summary[f"best/{key}"] = best
        run = self.wandb_run
        spec = dashboard.run_spec(self.dir, run_id=run.id, name=run.name, project=run.project,
                                  entity=run.entity or None)
        try:
            print(dashboard.publish(spec, self.dir, online=self.wandb_mode == "online"), flush=True)
        except Exception as e:  # noqa: BLE001 - a failed upload must not lose the run's end; the spec is on disk
            print(f"dashboard not saved to W&B ({e!r}); spec: {self.dir / dashboard.SPEC_FILE}, "
                  f"retry with `molt-report --wandb {self.dir}`", flush=True)
