"""A damaged checkpoint on resume (parallel/checkpoint.py `resolve_checkpoint` / `problem`, one process, real DCP): a
file of the newest step_<N> truncated, deleted or unreadable, or a `latest` tag naming a missing directory, is passed
over for the newest loadable checkpoint, each one named with the file and the reason; nothing loadable gives None
with every reason. Before: the damaged checkpoint was chosen and its load raised DCP's 'CheckpointException
ranks:dict_keys([0])' (or a UnicodeDecodeError / torch's zip error) from every resume, which could never succeed."""

from __future__ import annotations

import shutil

import pytest
import torch

from molt_hydra.parallel.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return model, opt


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {  # what is done to step_2, and the file the reason names
    "shard_truncated": (lambda s: _truncate(s / "dcp" / "__0_0.distcp"), "dcp/__0_0.distcp: "),
    "shard_deleted": (lambda s: (s / "dcp" / "__0_0.distcp").unlink(), "dcp/__0_0.distcp: No such file"),
    "metadata_truncated": (lambda s: _truncate(s / "dcp" / ".metadata"), "dcp/.metadata: "),
    "extra_state_truncated": (lambda s: _truncate(s / "extra_state.pt"), "extra_state.pt: "),
    "extra_state_deleted": (lambda s: (s / "extra_state.pt").unlink(), "extra_state.pt: No such file"),
    "rng_truncated": (lambda s: _truncate(s / "rng_rank0.pt"), "rng_rank0.pt: "),
    "rng_deleted": (lambda s: (s / "rng_rank0.pt").unlink(), "rng_rank0.pt: No such file"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "root"
    model, opt = _trained(0)
    save_checkpoint(root, 1, model, opt, client_state={"at": 1})
    first = model.weight.detach().clone()
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    save_checkpoint(root, 2, model, opt, client_state={"at": 2})
    return root, first


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(saved, tmp_path, case):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    damage, named = DAMAGE[case]
    damage(root / "step_2")
    skipped = []
    assert resolve_checkpoint(root, skipped) == root / "step_1"
    assert len(skipped) == 1 and skipped[0].startswith(f"{root / 'step_2'}: {named}"), skipped
    fresh, fresh_opt = _trained(1)
    assert load_checkpoint(root, fresh, fresh_opt) == {"at": 1}  # the ranks resolve the same checkpoint
    assert torch.equal(fresh.weight, saved[1])


@pytest.mark.parametrize("latest", [b"step_9", b"\xff\xfe", b"", b"../elsewhere"], ids=["missing", "garbage", "empty",
                                                                                        "not_a_tag"])
def test_a_latest_tag_naming_no_loadable_checkpoint_leaves_the_newest_step(saved, tmp_path, latest):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    (root / "latest").write_bytes(latest)
    skipped = []
    assert resolve_checkpoint(root, skipped) == root / "step_2"
    assert skipped == ([f"{root / 'step_9'}: missing"] if latest == b"step_9" else [])


def test_nothing_loadable_is_none_with_every_reason(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    for step in (1, 2):
        (root / f"step_{step}" / "extra_state.pt").unlink()
    skipped = []
    assert resolve_checkpoint(root, skipped) is None
    assert [s.split(": ")[0] for s in skipped] == [str(root / "step_2"), str(root / "step_1")]
    assert load_checkpoint(root, *_trained(1)) is None


def test_a_half_written_save_is_not_a_candidate(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    shutil.copytree(root / "step_2", root / ".tmp-step_3")
    (root / ".tmp-step_3" / "extra_state.pt").unlink()
    skipped = []
    assert resolve_checkpoint(root, skipped) == root / "step_2" and skipped == []
