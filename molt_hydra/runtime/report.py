"""`molt-report <sweep or run dir>`: one table row per sweep point (its overrides, status, steps, final and best value
of each metric), a PNG of one metric per point over steps, and the dashboard's sections (the same panels as the W&B
dashboard, `molt_hydra/logging/dashboard.py`) as one PNG per section on one HTML page, `DIR/report/index.html`.
`--wandb` also saves the dashboard to W&B (or writes `DIR/dashboard.json` while not logged in).

    molt-report multirun/sweep_estimators_is/2026-11-29_19-36-30
    molt-report SWEEP --metric train/reward --metric train/vllm_kl:absmin --png reward.png
    molt-report outputs/default/2026-11-29_19-36-30 --wandb

A run directory (one with `metrics.jsonl` or `run_record.json`) is a sweep of one point. A point is a subdirectory
with `.hydra/overrides.yaml` (Hydra writes it when the point starts) and/or a submitit submission under
`SWEEP/.submitit/` (so points still pending in Slurm are listed too). Metrics come from each point's `metrics.jsonl`
(one JSON object per step, with a `step` key); a final value is the last step's as logged (nan too). Status:
submitit's result file when there is one (completed / failed: <error>), else Slurm's state from `sacct` (pending,
running, requeued, cancelled, ...), else the run's directory: running (a run holds its lock), completed (the run
recorded its end in run_record.json), failed: <cause> (its failure.txt; a stalled role's too), interrupted at step N
(Ctrl-C / SIGTERM, as run_record.json records), else the metrics (completed when the last step reached
train.max_steps, else stopped at step N: killed, or its driver crashed).
"""

from __future__ import annotations

import argparse
import difflib
import json
import pickle
import re
import shutil
import subprocess
import sys
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from molt_hydra.logging.dashboard import BEST_BY, final_and_best, read_metrics, series  # noqa: F401 (re-exported)
from molt_hydra.runtime.run_lock import in_use
from molt_hydra.runtime.run_record import ENDED, INTERRUPTED

DEFAULT_METRICS = ("train/reward", "train/vllm_kl:absmin")


@dataclass
class Point:
    num: int
    overrides: list[str] = field(default_factory=list)
    dir: Path | None = None
    job_id: str | None = None
    result: tuple | None = None
    "submitit's (outcome, value) once the job ended."
    max_steps: int | None = None
    rows: list[dict] = field(default_factory=list)
    status: str = ""


def _add_submissions(sweep: Path, points: dict[int, Point]) -> None:
    """Each job of submitit's folder onto its point (added when Hydra has not started it): its Slurm/local job id and
    its result."""
    for sub in sorted(sweep.glob(".submitit/*/*_submitted.pkl")):
        job_id = sub.name.removesuffix("_submitted.pkl")
        try:  # DelayedSubmission(launcher, overrides, dir_key, job_num, ...)
            args = pickle.loads(sub.read_bytes()).args
        except Exception:  # noqa: BLE001 - an unreadable submission is just not listed
            continue
        res = sub.with_name(f"{job_id}_0_result.pkl")
        try:
            result = pickle.loads(res.read_bytes()) if res.is_file() else None
        except Exception as e:  # noqa: BLE001
            result = ("error", f"unreadable result: {e}")
        point = points.setdefault(int(args[2]), Point(num=int(args[2]), overrides=list(args[0])))
        point.job_id, point.result = job_id, result


def _sacct_states(job_ids: list[str]) -> dict[str, str]:
    if not job_ids or shutil.which("sacct") is None:
        return {}
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                         capture_output=True, text=True, timeout=30)
    rows = (line.partition("|")[::2] for line in out.stdout.splitlines())  # (job, state)
    # the state's first word, lower case: "CANCELLED by 0" -> cancelled
    return {job: state.split()[0].lower() if state else "" for job, state in rows if job in job_ids}


def _status_from_result(result: tuple) -> str:
    outcome, value = result
    if outcome == "success":
        status = getattr(value, "status", None)
        if status is not None and status.name == "FAILED":
            exc = getattr(value, "_return_value", None)
            return f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
        return "completed"
    lines = [ln for ln in str(value).strip().splitlines() if ln.strip()]
    return f"failed: {lines[-1].strip() if lines else outcome}"


def load_points(sweep: Path) -> list[Point]:
    """The sweep's points with their metrics and status; a run directory is one point."""
    if any((sweep / name).is_file() for name in RUN_FILES):  # a single run (one that failed at start: no metrics)
        points = {0: Point(num=0, dir=sweep, max_steps=_max_steps(_resolved_config(sweep)))}
    else:
        points = {}
        for over in sorted(sweep.glob("*/.hydra/overrides.yaml")):
            pdir = over.parent.parent
            hydra_cfg = yaml.safe_load((pdir / ".hydra" / "hydra.yaml").read_text()) or {}
            num = hydra_cfg.get("hydra", {}).get("job", {}).get("num", pdir.name.split("_", 1)[0])
            # '???': a run's directory among others (outputs/<name>/), numbered in order (was: a ValueError traceback)
            num = int(num) if str(num).isdigit() else max(points, default=-1) + 1
            points[num] = Point(num=num, overrides=list(yaml.safe_load(over.read_text()) or []), dir=pdir,
                                max_steps=_max_steps(yaml.safe_load((pdir / ".hydra" / "config.yaml").read_text())))
        _add_submissions(sweep, points)
    states = _sacct_states([p.job_id for p in points.values() if p.job_id and p.result is None])
    for p in points.values():
        p.rows = read_metrics(p.dir / "metrics.jsonl") if p.dir else []
        if p.result is not None:
            p.status = _status_from_result(p.result)
        elif p.job_id in states:
            p.status = states[p.job_id]
        else:
            p.status = _status_from_dir(p)
    return [points[n] for n in sorted(points)]


RUN_FILES = ("metrics.jsonl", "run_record.json")  # what a run writes into its directory (run_record.json first)


def _status_from_dir(p: Point) -> str:
    """A point's status from its directory: running while a run holds its lock; completed where the run recorded its
    end (its data may end it before train.max_steps); failed with the cause failure.txt starts with, where this
    attempt wrote it (each start rewrites run_record.json: a resume's failure.txt is newer), a stall's too;
    interrupted where the user stopped it (run_record.json); else from the metrics. Before, a run in progress, a
    crashed one, an interrupted or stalled one and one whose data ran out were each "stopped at step N"."""
    last = int(p.rows[-1]["step"]) if p.rows else None
    if p.dir is None:
        return "no metrics"
    if in_use("output_dir", p.dir):
        return "running" if last is None else f"running (step {last})"
    record, failure = p.dir / "run_record.json", p.dir / "failure.txt"
    with suppress(OSError, ValueError):
        if ENDED in json.loads(record.read_text()):
            return "completed"
    if failure.is_file() and (not record.is_file() or failure.stat().st_mtime >= record.stat().st_mtime):
        cause = next(iter(failure.read_text(errors="replace").splitlines()), "").strip()
        cause = cause.removeprefix("Run failed: ").removeprefix("Run stopped: ").rstrip(".")  # (a stall's: stopped)
        return f"failed: {cause or 'see ' + str(failure)}"
    with suppress(OSError, ValueError):  # Ctrl-C / SIGTERM (exit 130): the user's stop, not a crash
        if json.loads(record.read_text()).get(INTERRUPTED):
            return "interrupted" if last is None else f"interrupted at step {last}"
    if last is None:
        return "no metrics"
    return "completed" if p.max_steps is not None and last >= p.max_steps else f"stopped at step {last}"


def _max_steps(cfg: dict | None) -> int | None:
    return ((cfg or {}).get("train") or {}).get("max_steps")


def varying_overrides(points: list[Point]) -> dict[int, list[str]]:
    """Each point's overrides that are not shared by every point (the sweep axes); all of them for one point."""
    if len(points) <= 1:
        return {p.num: p.overrides for p in points}
    common = set.intersection(*(set(p.overrides) for p in points))
    return {p.num: [o for o in p.overrides if o not in common] for p in points}


def _parse_metric(spec: str) -> tuple[str, str]:
    key, _, mode = spec.rpartition(":")
    if key and mode not in BEST_BY:  # a mistyped mode, or a key holding a colon (an eval data source's, gsm8k:main)
        raise ValueError(f"--metric {spec}: {mode!r} is not one of {', '.join(BEST_BY)} (how the best value is chosen)."
                         f" Fix: one of them; a key holding a colon takes its mode after it: --metric {spec}:max")
    return (key, mode) if key else (spec, "max")


def _name_unlogged(points: list[Point], metrics: list[tuple[str, str]]) -> None:
    """A metric no point logged (mistyped, or the points have not logged yet) is named, with the nearest logged, else
    those holding its last part (`pass1`: eval/eval_toy_pass1), else the logged ones (was: "the nearest logged: none",
    what to ask for untold)."""
    logged = sorted({k for p in points for row in p.rows for k in row if k not in ("step", "kind")})
    for key in dict.fromkeys(key for key, _ in metrics):
        if key in logged:
            continue
        near = difflib.get_close_matches(key, logged, n=3) or [k for k in logged if key.rsplit("/", 1)[-1] in k][:8]
        some = f"{', '.join(logged[:12])}{', ...' if len(logged) > 12 else ''}"
        told = (f"the nearest logged: {', '.join(near)}" if near else
                f"none is near it; the {len(logged)} logged: {some}" if logged else "no point logged any metric yet")
        print(f"molt-report: no point logged {key} (its columns are empty); {told}", file=sys.stderr)


def table(points: list[Point], metrics: list[tuple[str, str]]) -> tuple[list[str], list[list[str]]]:
    labels = varying_overrides(points)
    header = ["#", "overrides", "status", "steps"] + [
        name for key, mode in metrics for name in (f"final {key}", f"best {key} ({mode})", "@step")]
    rows = []
    for p in points:
        row = [str(p.num), " ".join(labels[p.num]) or "-", p.status, str(p.rows[-1]["step"]) if p.rows else "-"]
        for key, mode in metrics:
            final, best, at = final_and_best(p.rows, key, mode)
            row += ["-" if v is None else f"{v:.4g}" for v in (final, best)] + ["-" if at is None else str(at)]
        rows.append(row)
    return header, rows


def render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _panel(ax, points: list[Point], keys: list[str], title: str) -> None:
    """One line per point and key over steps."""
    labels = varying_overrides(points)
    for p in points:
        for key in keys:
            s = series(p.rows, key)
            name = key.split("/", 1)[-1]
            if s:
                ax.plot([x for x, _ in s], [y for _, y in s], marker=".",
                        label=f"{p.num}: {' '.join(labels[p.num])} {name}" if len(points) > 1 else name)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot(points: list[Point], key: str, path: Path) -> Path:
    return _figure(points, [{"keys": [key], "title": ""}], f"{key} per point", path, dpi=100)


def _figure(points: list[Point], panels: list[dict], title: str, path: Path, dpi: int = 80) -> Path:
    """One PNG of `panels` ({"keys", "title"} each, three a row at most) under `title`; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _panel(ax, points, panel["keys"], panel["title"])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _resolved_config(run_dir: Path) -> dict:
    """The run's resolved config (run_record.py writes it), or Hydra's copy of the composed one."""
    for path in (run_dir / "resolved_config.yaml", run_dir / ".hydra" / "config.yaml"):
        if path.is_file():
            return yaml.safe_load(path.read_text()) or {}
    return {}


def swept_keys(points: list[Point]) -> list[str]:
    """The config keys a sweep varies (its overrides that differ between points), in order of first appearance."""
    keys = (over.partition("=")[0].lstrip("+~") for labels in varying_overrides(points).values() for over in labels
            if "=" in over)
    return list(dict.fromkeys(key for key in keys if not key.startswith("hydra.") and key != "recipe"))


def dashboard_spec(target: Path, points: list[Point]) -> dict:
    """The W&B dashboard spec of a run directory or a sweep directory."""
    from molt_hydra.compat.wandb import last_run_id
    from molt_hydra.logging import dashboard

    dirs = [p.dir for p in points if p.dir is not None]
    wandb_cfg = (_resolved_config(dirs[0]) if dirs else {}).get("logger", {}).get("wandb", {})
    project, entity = wandb_cfg.get("project", "molt_hydra"), wandb_cfg.get("entity")
    if (target / "metrics.jsonl").is_file():
        return dashboard.run_spec(target, run_id=last_run_id(target), project=project, entity=entity,
                                  name=wandb_cfg.get("run_name") or target.name)
    return dashboard.sweep_spec(dirs, swept_keys(points), group=wandb_cfg.get("group") or target.name,
                                project=project, entity=entity)


def plot_sections(points: list[Point], spec: dict, out_dir: Path, metrics: list[tuple[str, str]]) -> Path:
    """One PNG per dashboard section (a panel per subplot, one line per point and metric) and an HTML page of them
    with the table; returns the page."""
    import html

    out_dir.mkdir(parents=True, exist_ok=True)
    images = []
    for section in spec["sections"]:
        png = out_dir / (re.sub(r"[^a-z0-9]+", "_", section["name"].lower()).strip("_") + ".png")
        images.append((section["name"], _figure(points, section["panels"], section["name"], png).name))
    body = "".join(f"<h2>{html.escape(name)}</h2><img src='{src}'>\n" for name, src in images)
    page = out_dir / "index.html"
    page.write_text(f"<html><head><meta charset='utf-8'><title>{html.escape(spec['name'])}</title></head><body>"
                    f"<h1>{html.escape(spec['name'])}</h1><pre>{html.escape(render(*table(points, metrics)))}</pre>"
                    f"\n{body}</body></html>\n")
    return page


WHERE = "Fix: give a run's directory (outputs/<name>/<time>) or a sweep's (multirun/<name>/<time>)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molt-report", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path, help="a multirun directory (multirun/<name>/<time>) or a run directory")
    ap.add_argument("--metric", action="append", metavar="KEY[:max|min|absmin]",
                    help=f"metric columns, best by max (default), min or absmin (nearest 0, e.g. the signed "
                         f"train/vllm_kl); the first one is plotted "
                         f"(default: {' '.join(DEFAULT_METRICS)})")
    ap.add_argument("--png", type=Path, help="plot path (default: SWEEP/report_<metric>.png)")
    ap.add_argument("--wandb", action="store_true",
                    help="save the W&B dashboard of the run / sweep (or write DIR/dashboard.json when not logged in)")
    args = ap.parse_args(argv)
    try:
        metrics = [_parse_metric(m) for m in (args.metric or DEFAULT_METRICS)]
    except ValueError as e:
        print(f"molt-report: {e}", file=sys.stderr)
        return 2
    if not args.sweep_dir.is_dir():
        print(f"molt-report: {args.sweep_dir} is not a directory. {WHERE}", file=sys.stderr)
        return 2
    if args.png is not None:  # told before the table (was: matplotlib's traceback after it)
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = sorted(FigureCanvasBase.get_supported_filetypes())
        why = (f"{args.png.parent} is no directory" if not args.png.parent.is_dir() else None if
               args.png.suffix.lstrip(".").lower() in kinds else f"no image format ends it ({', '.join(kinds)})")
        if why:
            print(f"molt-report: --png {args.png}: {why}. Fix: a .png path in an existing directory", file=sys.stderr)
            return 2
    points = load_points(args.sweep_dir)
    if not points:
        print(f"molt-report: no sweep points under {args.sweep_dir} "
              f"(no metrics.jsonl, run_record.json, */.hydra/overrides.yaml or .submitit/). {WHERE}", file=sys.stderr)
        return 2
    _name_unlogged(points, metrics)
    print(render(*table(points, metrics)))
    key = metrics[0][0]
    png = args.png or args.sweep_dir / f"report_{key.replace('/', '_')}.png"
    spec = dashboard_spec(args.sweep_dir, points)
    try:
        print(f"\nplot of {key}: {plot(points, key, png)}")
        print(f"dashboard sections: {plot_sections(points, spec, args.sweep_dir / 'report', metrics)}")
    except OSError as e:  # (was: a traceback after the table)
        print(f"molt-report: cannot write {e.filename}: {e.strerror}. Fix: make {args.sweep_dir} writable (the plots "
              "go to its report/ and report_<metric>.png), or copy it where you can write", file=sys.stderr)
        return 1
    if args.wandb:
        from molt_hydra.logging import dashboard

        try:
            print(dashboard.publish(spec, args.sweep_dir))
        except Exception as e:  # noqa: BLE001 - network / permission: say it, the spec is on disk
            print(f"molt-report: dashboard not saved to W&B: {e!r} (spec: {args.sweep_dir / dashboard.SPEC_FILE})",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
