"""Dashboards as code: the sections every run and every sweep opens on, as a W&B workspace (`wandb-workspaces`) and
as the spec `molt-report` draws offline.

One catalog (`SECTIONS`) names the panels by metric pattern (`*` matches within one path segment, `**` across). A spec
is the catalog expanded against the keys a run really logged (its `metrics.jsonl`): a panel keeps the keys it matches
and is left out when it matches none; a section with a `when` pattern (MoE routing, KL to reference) appears only when
the run logs such a key. A sweep's spec is the same sections over the union of its points' keys, plus a runset filtered
to the sweep's W&B group, grouped by the swept config keys, with a runs table of final and best values.

The spec is written as `dashboard.json` into the run / sweep directory; `publish` turns it into a
`wandb_workspaces.workspaces.Workspace` and saves it when W&B is reachable (else it says how to publish later).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
# imported where used: wandb and wandb_workspaces (heavy, optional)

SPEC_FILE = "dashboard.json"
TRAIN_X, EVAL_X = "train/global_step", "eval/global_step"
# (metric, best-by) columns of the runs table; MetricSinks writes `best/<metric>` into the W&B summary at the end.
# vllm_kl is the signed k1 estimate: its least drift is the value nearest 0 (absmin), not the most negative one.
TABLE_METRICS = (("train/reward", "max"), ("train/vllm_kl", "absmin"))
BEST_BY = {"max": lambda v: -v, "min": lambda v: v, "absmin": abs}

# (section, `when` pattern or None, [(panel title, [metric patterns])])
SECTIONS: list[tuple[str, str | None, list[tuple[str, list[str]]]]] = [
    ("Reward and score", None, [
        ("reward", ["train/reward", "train/rollout/reward_mean"]),
        ("score", ["train/score"]),
        ("rollout pass@1", ["train/rollout/pass1"]),
        ("eval pass@k", ["eval/eval_**_pass*"]),  # (a data source's name may hold a '/': openai/gsm8k)
    ]),
    ("Drift: sampler vs trainer", None, [
        ("vllm_kl (k1) and k3 KL", ["train/vllm_kl", "train/drift/k3_kl"]),
        ("|rollout logp - train logp|", ["train/drift/abs_logp_diff_*"]),
        ("IS ratio", ["train/drift/is_ratio_*"]),
        ("masked by IS correction", ["train/drift/is_filtered_*", "train/is_filter_ratio"]),
        ("staleness (policy versions)", ["train/drift/staleness_*"]),
    ]),
    ("MoE routing", "train/routing/*", [
        # (a VLM's image / text split too); `replayed`: the experts the trainer used are the engine's (R3: 1.0)
        ("routing agreement", ["train/routing/agreement*"]),
        ("experts used = engine's (replayed)", ["train/routing/replayed*"]),
        ("image tokens (share)", ["train/routing/image_tokens"]),
        ("aux loss", ["train/routing/aux_loss"]),
        ("expert load entropy", ["train/routing/expert_load_entropy"]),
    ]),
    ("Rollouts", None, [
        ("response length (tokens)", ["train/response_length", "train/rollout/response_length_mean"]),
        ("truncated", ["train/rollout/truncated_rate", "train/truncated"]),
        ("dropped samples", ["train/rollout/dropped/total"]),
    ]),
    ("Throughput", None, [
        ("tokens / s", ["train/perf/*tokens_per_sec"]),
        ("step time (s)", ["train/perf/*step_time_s", "train/timing/step_total"]),
        ("MFU", ["train/perf/*mfu"]),
        ("device memory (GB)", ["train/perf/*gpu_mem_*"]),
    ]),
    ("Time split", None, [
        ("share of the step", ["train/timing/share/*"]),
        ("seconds", ["train/timing/*"]),
    ]),
    ("Losses", None, [
        ("policy loss", ["train/policy_loss"]),
        ("value loss", ["train/value_loss"]),
        ("entropy", ["train/entropy_loss"]),
        ("clip fractions", ["train/policy_clip_ratio", "train/value_clip_frac"]),
        ("KL old vs new policy", ["train/policy_kl"]),
    ]),
    ("Grad norm", None, [
        ("grad norm", ["train/actor_grad_norm", "train/critic_grad_norm"]),
        ("learning rate", ["train/actor_lr", "train/critic_lr"]),
    ]),
    ("KL to reference", "train/kl", [
        ("KL to reference", ["train/kl", "train/logprobs_diff"]),
        ("KL coefficient", ["train/kl_coef"]),
    ]),
]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _matcher(patterns: list[str]) -> re.Pattern:
    """`*` matches within one path segment, `**` across them."""
    return re.compile("|".join(re.escape(p).replace(r"\*\*", ".*").replace(r"\*", "[^/]*") for p in patterns) + r"\Z")


def logged_keys(metrics_jsonl: Path) -> set[str]:
    """Every metric key of a metrics.jsonl (the `step` / `kind` bookkeeping left out); a torn last line is skipped."""
    return {k for row in read_metrics(metrics_jsonl) for k in row if k not in ("step", "kind")}


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl; a torn last line (the run is still writing) is skipped."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric; for a step logged twice (a resumed run re-ran it) the later value wins."""
    by_step: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if is_number(value) and math.isfinite(value):
            by_step[int(row["step"])] = float(value)
    return sorted(by_step.items())


def final_and_best(rows: list[dict], key: str, mode: str) -> tuple[float | None, float | None, int | None]:
    """Value at the last step that logged `key`, NaN / inf as logged (was: the last finite one, so a run whose metric
    turned NaN at its end read as healthy), best finite value (BEST_BY[mode]: max, min, or absmin, nearest 0,
    signed), and the step of the best (first one on ties)."""
    logged = {int(row["step"]): float(row[key]) for row in rows if is_number(row.get(key))}  # a step's later row wins
    if not logged:
        return None, None, None
    s = series(rows, key)
    if not s:
        return logged[max(logged)], None, None
    best_step, best = min(s, key=lambda point: BEST_BY[mode](point[1]))  # the first of equal values
    return logged[max(logged)], best, best_step


def sections(keys: set[str]) -> list[dict]:
    """The catalog expanded against `keys`: [{name, panels: [{title, x, keys}]}], empty panels and sections out."""
    out = []
    for name, when, panels in SECTIONS:
        if when is not None and not any(map(_matcher([when]).match, keys)):
            continue
        matched = [(title, sorted(filter(_matcher(patterns).match, keys))) for title, patterns in panels]
        kept = [{"title": title, "x": EVAL_X if found[0].startswith("eval/") else TRAIN_X, "keys": found}
                for title, found in matched if found]
        if kept:
            out.append({"name": name, "panels": kept})
    return out


def run_spec(run_dir: Path, *, run_id: str | None, name: str, project: str, entity: str | None) -> dict:
    """The dashboard of one run: its sections, filtered to that W&B run."""
    return {"name": f"molt_hydra run {name}", "project": project, "entity": entity,
            "filter": {"ID": run_id} if run_id else {"Name": name}, "groupby": [], "columns": [],
            "sections": sections(logged_keys(Path(run_dir) / "metrics.jsonl"))}


def sweep_spec(point_dirs: list[Path], swept_keys: list[str], *, group: str, project: str,
               entity: str | None) -> dict:
    """The dashboard of a sweep: the same sections over all points, one line per point grouped by the swept keys,
    and a runs table (swept keys, final and best of TABLE_METRICS)."""
    keys = set().union(*(logged_keys(Path(d) / "metrics.jsonl") for d in point_dirs)) if point_dirs else set()
    columns = [f"config:{k}" for k in swept_keys] + [f"summary:{best}{key}" for key, _ in TABLE_METRICS
                                                      for best in ("", "best/")]
    return {"name": f"molt_hydra sweep {group}", "project": project, "entity": entity, "filter": {"Group": group},
            "groupby": swept_keys, "columns": columns, "sections": sections(keys)}


def workspace(spec: dict, entity: str):
    """The spec as a wandb-workspaces Workspace (nothing is sent until `.save()`)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    (field, value), = spec["filter"].items()
    return ws.Workspace(
        entity=entity, project=spec["project"], name=spec["name"],
        sections=[ws.Section(name=s["name"], is_open=True, panels=[
            wr.LinePlot(title=p["title"], x=p["x"], y=p["keys"]) for p in s["panels"]]) for s in spec["sections"]],
        runset_settings=ws.RunsetSettings(filters=expr.And(expr.Metric(field) == value),
                                          groupby=[expr.Config(k) for k in spec["groupby"]],
                                          pinned_columns=list(spec["columns"])),
    )


def publish(spec: dict, directory: Path, online: bool = True) -> str:
    """Write the spec into `directory`; save it to W&B when `online` and logged in. Returns what happened."""
    import wandb

    path = Path(directory) / SPEC_FILE
    path.write_text(json.dumps(spec, indent=2) + "\n")
    try:  # an API client needs a key (WANDB_API_KEY or `wandb login`)
        api = wandb.Api(timeout=20) if online else None
    except wandb.errors.UsageError:  # no API key: the offline path
        api = None
    if api is None:
        return (f"dashboard spec written to {path} (W&B offline or not logged in: after `wandb login` and "
                f"`wandb sync`, `molt-report --wandb {directory}` publishes it)")
    saved = workspace(spec, spec["entity"] or api.default_entity).save()
    return f"dashboard saved to W&B: {saved.url} (spec: {path})"
