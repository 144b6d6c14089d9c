"""checkpoint.export_dir: the final export replaces the directory whole (parallel/checkpoint.py `_replace_dir`), so one
that is or holds a directory of the run, or holds files that are no export, is refused before anything starts.
Before: accepted; at the run's end the export took output_dir's metrics and checkpoint.dir's checkpoints with it (or a
user's other files), without a word. The last test shows the replacement itself with a real export of the tiny Qwen3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _config_helpers import compose_config
from molt_hydra.cli import validated
from molt_hydra.config.schema import ConfigError

KEY = "checkpoint.export_dir"


def _export_lines(tmp_path, *overrides) -> list[str]:
    """The config's error lines on checkpoint.export_dir, with output_dir at `tmp_path`."""
    try:
        validated(compose_config(list(overrides), output_dir=str(tmp_path)), list(overrides))
    except ConfigError as e:
        return [line.removeprefix("- ") for line in str(e).splitlines() if line.startswith(f"- {KEY}: ")]
    return []


@pytest.mark.parametrize("export,held", [
    ("{out}", "output_dir"), ("{out}/checkpoints", "checkpoint.dir"), ("{out}/..", "output_dir"),
    ("{out}/dumps", "train.rollout_dump_dir")])
def test_an_export_dir_that_is_or_holds_a_run_directory_is_refused(tmp_path, export, held):
    lines = _export_lines(tmp_path, f"{KEY}={export.format(out=tmp_path)}", f"train.rollout_dump_dir={tmp_path}/dumps")
    assert len(lines) == 1, lines
    assert f"is or holds {held} (" in lines[0] and "the final export replaces it whole" in lines[0]
    assert lines[0].endswith("Fix: set checkpoint.export_dir to a new directory of its own (default "
                             "<output_dir>/hf_final)")


def test_an_export_dir_that_is_the_runs_own_model_directory_is_refused(tmp_path):
    """model.path's directory holds config.json, so it read as an earlier export: the run's end replaced its base model
    (with LoRA, by an adapter alone). A hub id or a tiny:// model is no directory here, and stays out of it."""
    from molt_hydra.models.build import resolve_path

    base = tmp_path / "base"
    base.mkdir()
    for f in Path(resolve_path("tiny://qwen3_tiny")).iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    lines = _export_lines(tmp_path, f"model.path={base}", f"{KEY}={base}")
    assert len(lines) == 1 and f"is or holds model.path ('{base}')" in lines[0], lines
    assert _export_lines(tmp_path, "model.path=tiny://qwen3_tiny", f"{KEY}={tmp_path}/hf") == []


def test_an_export_dir_holding_other_files_is_refused_and_an_earlier_export_or_an_empty_one_is_not(tmp_path):
    other = tmp_path / "models"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    lines = _export_lines(tmp_path, f"{KEY}={other}")
    assert len(lines) == 1 and "holds files that are no HF export (['notes.txt'])" in lines[0], lines
    assert lines[0].endswith("or move its files out")
    (tmp_path / "empty").mkdir()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "adapter_config.json").write_text("{}")  # a LoRA run's export, replaced by its resume's
    for ok in (tmp_path / "empty", earlier, tmp_path / "hf_final"):
        assert _export_lines(tmp_path, f"{KEY}={ok}") == []


def test_the_default_export_dir_and_an_export_into_an_existing_directory_replace_it_whole(tmp_path):
    """Why the rules: the export leaves nothing of what the directory held."""
    from transformers import AutoModelForCausalLM

    from molt_hydra.models.build import resolve_path
    from molt_hydra.parallel.checkpoint import export_hf

    assert _export_lines(tmp_path) == []
    model = AutoModelForCausalLM.from_pretrained(resolve_path("tiny://qwen3_tiny"), dtype=torch.float32)
    (tmp_path / "step_3").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    export_hf(tmp_path, model, dtype=torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
