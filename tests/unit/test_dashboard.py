"""The dashboard catalog expanded against logged keys, its W&B workspace, the sinks hook and molt-report's pages.

`check_dashboard_matches_run` is the check a real run must pass (tests/integration/test_dashboard_run.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from molt_hydra.logging import dashboard
from molt_hydra.logging.sinks import MetricSinks
from molt_hydra.runtime import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wandb_offline import summary  # noqa: E402

# What each section must show when the run logs it (names from docs/metrics.md).
ESSENTIAL = {
    "Reward and score": {"train/reward", "train/score"},
    "Drift: sampler vs trainer": {"train/vllm_kl", "train/drift/k3_kl", "train/drift/is_ratio_min",
                                  "train/drift/is_ratio_mean", "train/drift/is_ratio_max",
                                  "train/drift/staleness_mean", "train/drift/staleness_max"},
    "MoE routing": {"train/routing/agreement", "train/routing/agreement_worst_layer"},
    "Rollouts": {"train/response_length"},
    "Throughput": {"train/perf/train_tokens_per_sec", "train/perf/rollout_tokens_per_sec"},
    "Time split": {"train/timing/share/policy_train", "train/timing/generation"},
    "Losses": {"train/policy_loss"},
    "Grad norm": {"train/actor_grad_norm"},
    "KL to reference": {"train/kl"},
}


def panel_keys(spec: dict) -> set[str]:
    return {k for s in spec["sections"] for p in s["panels"] for k in p["keys"]}


def check_dashboard_matches_run(run_dir: Path, expected_sections: set[str]) -> dict:
    """The run's dashboard.json (written when its sinks closed) names only keys of its metrics.jsonl, has exactly
    `expected_sections`, each with its essential metrics; returns the spec."""
    logged = dashboard.logged_keys(run_dir / "metrics.jsonl")
    spec = json.loads((run_dir / dashboard.SPEC_FILE).read_text())
    assert panel_keys(spec) <= logged, sorted(panel_keys(spec) - logged)
    assert {s["name"] for s in spec["sections"]} == expected_sections
    for section in spec["sections"]:
        shown = {k for p in section["panels"] for k in p["keys"]}
        assert ESSENTIAL[section["name"]] <= shown, (section["name"], sorted(ESSENTIAL[section["name"]] - shown))
    return spec


def _keys(*names: str) -> set[str]:
    return {f"train/{n}" for n in names}


def test_sections_keep_matching_keys_and_drop_the_rest():
    keys = _keys("reward", "vllm_kl", "drift/is_ratio_min", "drift/is_ratio_max", "timing/generation",
                 "timing/share/generation", "policy_loss", "kl_coef", "digit_fraction") | {"eval/eval_toy_pass1"}
    got = {s["name"]: {p["title"]: (p["x"], p["keys"]) for p in s["panels"]} for s in dashboard.sections(keys)}
    assert got == {
        "Reward and score": {"reward": ("train/global_step", ["train/reward"]),
                             "eval pass@k": ("eval/global_step", ["eval/eval_toy_pass1"])},
        "Drift: sampler vs trainer": {"vllm_kl (k1) and k3 KL": ("train/global_step", ["train/vllm_kl"]),
                                      "IS ratio": ("train/global_step",
                                                   ["train/drift/is_ratio_max", "train/drift/is_ratio_min"])},
        # `*` stays within one path segment: timing/* is not timing/share/*
        "Time split": {"share of the step": ("train/global_step", ["train/timing/share/generation"]),
                       "seconds": ("train/global_step", ["train/timing/generation"])},
        "Losses": {"policy loss": ("train/global_step", ["train/policy_loss"])},
        # no MoE key, no train/kl: those sections are absent (kl_coef alone does not open "KL to reference")
    }


def test_moe_and_kl_sections_appear_when_their_metrics_are_logged():
    keys = _keys("routing/agreement", "routing/agreement_worst_layer", "routing/aux_loss", "kl", "kl_coef")
    got = {s["name"]: [p["title"] for p in s["panels"]] for s in dashboard.sections(keys)}
    assert got == {"MoE routing": ["routing agreement", "aux loss"],
                   "KL to reference": ["KL to reference", "KL coefficient"]}


def test_moe_section_shows_every_routing_metric_the_trainer_logs():
    """docs/metrics.md: the MoE section shows `train/routing/*`. Every key RoutingStats emits (a VLM's image / text
    split and the load-balancing loss included, as a router with probabilities over an image batch gives them) is in
    one of its panels. Before: `routing/replayed` (R3's own check: 1.0 when the trainer used the engine's experts) and
    the image / text split were on no panel, in W&B or molt-report."""
    import torch

    from molt_hydra.models.moe_routing import RoutingStats

    stats = RoutingStats(num_layers=2, num_experts=4)
    own, engine = torch.tensor([[0, 1], [2, 3], [0, 2]]), torch.tensor([[0, 1], [2, 1], [0, 2]])
    for layer in range(2):
        stats.add(layer, torch.full((3, 4), 0.25), own, engine, engine, image=torch.tensor([1, 0, 0]))
    emitted = {f"train/{k}" for k in stats.metrics()}
    assert {"train/routing/replayed", "train/routing/agreement_image", "train/routing/replayed_text"} <= emitted
    (section,) = dashboard.sections(emitted)
    assert section["name"] == "MoE routing"
    assert {k for p in section["panels"] for k in p["keys"]} == emitted


def test_eval_pass_panel_shows_a_data_source_whose_name_holds_a_slash():
    """An eval row's `datasource` names its metrics (`eval_<ds>_pass<n>`); an HF-style name (openai/gsm8k) puts a '/'
    into them. The keys come from the generator's own evaluate (the runner a stand-in scoring each rollout 1 or 0).
    Before: the pass@k panel's `*` stopped at the '/', so those metrics were on no panel."""
    import asyncio
    from types import SimpleNamespace

    from molt_hydra.rollout.generation import Sampling
    from molt_hydra.rollout.generator import SamplesGenerator

    class Runner:  # stand-in for the agent runner: rollout i of a group scores i % 2
        async def run_group(self, row, n, sampling):
            return [(SimpleNamespace(reward=float(i % 2), rollout_id=f"{row['prompt']}-{i}", action_ranges=[(0, 1)],
                                     truncated=False), None) for i in range(n)]

    rows = [{"prompt": "p", "datasource": "openai/gsm8k"}, {"prompt": "q", "datasource": "toy"}]
    gen = SamplesGenerator(rows, runner=Runner(), batch_size=2, n_samples_per_prompt=2, sampling=Sampling(max_tokens=1),
                           seed=0)
    m = asyncio.run(gen.evaluate(rows, 2, Sampling(max_tokens=1)))
    assert m["eval_openai/gsm8k_pass2"] == 1.0 and m["eval_openai/gsm8k_pass1"] == 0.5
    shown = {k for s in dashboard.sections({f"eval/{k}" for k in m}) for p in s["panels"] if p["title"] == "eval pass@k"
             for k in p["keys"]}
    assert shown == {f"eval/eval_{ds}_pass{n}" for ds in ("openai/gsm8k", "toy") for n in (1, 2)}


def _run_dir(root: Path, name: str, overrides: list[str], rows: list[dict], group: str = "sw_1") -> Path:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": int(name.split("_")[0])}}}))
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": 2}}))
    (d / "resolved_config.yaml").write_text(yaml.safe_dump(
        {"train": {"max_steps": 2}, "logger": {"wandb": {"project": "proj", "entity": None, "group": group}}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", **r}) + "\n" for r in rows))
    return d


def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    base = ["+recipe=tiny_cpu"]
    _run_dir(sweep, "0_a", base + ["algorithm.estimator=grpo", "seed=1"],
             [{"step": 1, "train/reward": 0.1, "train/vllm_kl": 0.01}, {"step": 2, "train/reward": 0.3}])
    _run_dir(sweep, "1_b", base + ["algorithm.estimator=rloo", "seed=2"],
             [{"step": 1, "train/reward": 0.2, "train/routing/agreement": 0.9}])
    return sweep


def test_sweep_spec_groups_by_the_swept_keys_and_tables_final_and_best(tmp_path):
    sweep = _sweep(tmp_path)
    points = report.load_points(sweep)
    spec = report.dashboard_spec(sweep, points)
    assert spec["groupby"] == ["algorithm.estimator", "seed"]  # +recipe is shared and not a config key
    assert spec["filter"] == {"Group": "sw_1"} and spec["project"] == "proj"
    assert spec["columns"] == ["config:algorithm.estimator", "config:seed",
                               "summary:train/reward", "summary:best/train/reward",
                               "summary:train/vllm_kl", "summary:best/train/vllm_kl"]
    # the union of the points' keys: point 1's MoE metric opens the MoE section
    assert [s["name"] for s in spec["sections"]] == ["Reward and score", "Drift: sampler vs trainer", "MoE routing"]

    view = dashboard.workspace(spec, entity="team")._to_model()  # the W&B view, built without network
    run_set = view.spec.section.run_sets[0]
    assert [k.name for k in run_set.grouping] == ["algorithm.value.estimator", "seed.value"]  # W&B's config paths
    assert run_set.filters["filters"][0]["key"]["name"] == "group" and run_set.filters["filters"][0]["value"] == "sw_1"
    panels = [p.model_dump(exclude_none=True)["config"] for s in view.spec.section.panel_bank_config.sections
              for p in s.panels]
    assert [p["metrics"] for p in panels] == [p["keys"] for s in spec["sections"] for p in s["panels"]]
    assert {p["x_axis"] for p in panels} == {"train/global_step"}


def test_molt_report_draws_the_sections_and_writes_the_spec_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))  # no `wandb login` either
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    sweep = _sweep(tmp_path)
    assert report.main([str(sweep), "--wandb"]) == 0
    out = capsys.readouterr().out
    spec = json.loads((sweep / dashboard.SPEC_FILE).read_text())
    assert spec == report.dashboard_spec(sweep, report.load_points(sweep))
    assert f"molt-report --wandb {sweep}` publishes it" in out
    page = (sweep / "report" / "index.html").read_text()
    pngs = sorted(p.name for p in (sweep / "report").glob("*.png"))
    assert pngs == ["drift_sampler_vs_trainer.png", "moe_routing.png", "reward_and_score.png"]
    assert all(f"<img src='{name}'>" in page for name in pngs) and "algorithm.estimator=grpo" in page
    assert all((sweep / "report" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in pngs)


def test_molt_report_takes_a_run_directory(tmp_path, capsys):
    run = _run_dir(tmp_path, "0_run", [], [{"step": 1, "train/reward": 0.5}, {"step": 2, "train/reward": 0.25}])
    # as wandb lays it out when the run restarted within a second: the directory's name ends in "-1", not the id
    (run / "wandb" / "offline-run-20260101_000000-abc123-1").mkdir(parents=True)
    (run / "wandb" / "offline-run-20260101_000000-abc123-1" / "run-abc123.wandb").write_bytes(b"")
    (run / "wandb" / "latest-run").symlink_to("offline-run-20260101_000000-abc123-1")
    assert report.main([str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:7] == ["0", "-", "completed", "2", "0.25", "0.5", "1"]
    spec = report.dashboard_spec(run, report.load_points(run))
    assert spec["filter"] == {"ID": "abc123"} and spec["groupby"] == []


def _summary_when_written(wandb_file: Path) -> dict:
    # wandb-core writes the file from its own process; the summary record can land a moment after finish() returns
    deadline = time.monotonic() + 30
    while not (s := summary(wandb_file)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return s


@pytest.mark.parametrize("dashboard_on", [True, False])
def test_sinks_write_the_dashboard_and_best_values_at_close(tmp_path, monkeypatch, dashboard_on):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sinks = MetricSinks(tmp_path, run_name="r", config={}, wandb_mode="offline", dashboard=dashboard_on)
    for step, (reward, kl) in enumerate([(0.2, 0.03), (0.6, 0.01), (0.4, 0.02)], start=1):
        sinks.log({"reward": reward, "vllm_kl": kl, "policy_loss": -reward}, step)
    run_id = sinks.wandb_id
    sinks.close()
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    if not dashboard_on:
        assert not (tmp_path / dashboard.SPEC_FILE).exists()
        assert "best/train/reward" not in _summary_when_written(wandb_file)
        return
    spec = json.loads((tmp_path / dashboard.SPEC_FILE).read_text())
    assert spec["filter"] == {"ID": run_id}
    assert panel_keys(spec) == {"train/reward", "train/vllm_kl", "train/policy_loss"}
    s = _summary_when_written(wandb_file)
    assert s["best/train/reward"] == 0.6 and s["best/train/vllm_kl"] == 0.01  # max reward, min drift
