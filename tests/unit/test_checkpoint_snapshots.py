"""checkpoint.save_hf's HF snapshots (<checkpoint.dir>/hf/step_<N>, exported after each resumable save: parallel/
retention.py, through parallel/checkpoint.py save_checkpoint and export_hf, one process, real DCP and a real HF export
of the tiny Qwen3). Before, retention knew only the resumable checkpoints: every snapshot stayed on disk for good, out
of checkpoint.max_num and checkpoint.max_disk_gb; and an export killed midway left its .tmp- directory (`best`'s, a
snapshot's) until the same name was exported again, a snapshot's never."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.models.build import resolve_path
from molt_hydra.parallel.checkpoint import export_hf, save_checkpoint
from molt_hydra.parallel.retention import dir_bytes


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(resolve_path("tiny://qwen3_tiny"), torch_dtype=torch.float32)


def _save(root, step, model, **kw):
    """As the RL loop saves with checkpoint.save_hf: the resumable checkpoint, then its step's snapshot."""
    save_checkpoint(root, step, model, keep=kw.pop("keep", 0), **kw)
    export_hf(root / "hf" / f"step_{step}", model, dtype=torch.float32)


def _names(path):
    return sorted(p.name for p in path.iterdir())


def test_snapshots_go_with_their_checkpoints_under_max_num(tmp_path, model):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, keep=2)
    assert _names(tmp_path) == ["hf", "latest", "step_3", "step_4"]
    assert _names(tmp_path / "hf") == ["step_3", "step_4"]  # (before: step_1 to step_4)


def test_keeping_every_checkpoint_keeps_every_snapshot(tmp_path, model):
    """checkpoint.max_num <= 0 and no max_disk_gb: nothing is pruned, a snapshot whose checkpoint the user moved
    away (archived) included. Before: every snapshot older than the oldest checkpoint left was removed."""
    for step in (1, 2):
        _save(tmp_path, step, model)
    (tmp_path / "step_1").rename(tmp_path.parent / f"{tmp_path.name}_archived_step_1")
    _save(tmp_path, 3, model)
    assert _names(tmp_path / "hf") == ["step_1", "step_2", "step_3"]


def test_snapshots_count_in_the_disk_budget(tmp_path, model):
    _save(tmp_path, 1, model)
    one, snapshot = dir_bytes(tmp_path / "step_1"), dir_bytes(tmp_path / "hf" / "step_1")
    assert snapshot > 0
    budget = (3 * one + snapshot / 2) / 1e9  # three checkpoints alone fit; with two snapshots beside, not
    _save(tmp_path, 2, model, max_disk_gb=budget)
    _save(tmp_path, 3, model, max_disk_gb=budget)  # (step_3's snapshot is written after the save: not yet counted)
    assert _names(tmp_path) == ["hf", "latest", "step_2", "step_3"]  # (before: step_1 kept, its snapshot too)
    assert _names(tmp_path / "hf") == ["step_2", "step_3"]


def test_what_killed_exports_left_is_removed_by_the_next_save(tmp_path, model):
    """The directories a kill during an export leaves (as tests/unit/test_checkpoint_crash.py's kills leave them):
    `best`'s and a snapshot's half-written copy, and a snapshot whose replacement was killed between its two
    renames (put back)."""
    _save(tmp_path, 1, model)
    (tmp_path / ".tmp-best").mkdir()
    (tmp_path / ".tmp-best" / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "hf" / ".tmp-step_2").mkdir()
    (tmp_path / "hf" / "step_1").rename(tmp_path / "hf" / ".old-step_1")
    save_checkpoint(tmp_path, 2, model)
    assert _names(tmp_path) == ["hf", "latest", "step_1", "step_2"]
    assert _names(tmp_path / "hf") == ["step_1"]
    assert (tmp_path / "hf" / "step_1" / "config.json").is_file()


def test_an_export_dir_that_is_a_link_is_exported_into_its_target(tmp_path, model):
    """checkpoint.export_dir as a link to another disk: each export replaces the target's contents and the link stays.
    Before: the first put a directory in the link's place (on the link's disk), the second failed ('Cannot call rmtree
    on a symbolic link')."""
    (tmp_path / "big").mkdir()
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "hf_final"
    link.symlink_to(tmp_path / "big" / "final", target_is_directory=True)
    for _ in range(2):
        export_hf(link, model, dtype=torch.float32)
    assert link.is_symlink()
    assert (tmp_path / "big" / "final" / "config.json").is_file()
    assert _names(tmp_path / "out") == ["hf_final"]
