"""A process killed while a save replaces a directory (parallel/checkpoint.py `_replace_dir`: a step saved again in
its place, as after a resume that passed a damaged one over; `best`; the HF export): at each point of the swap, the
resume finds the step whole (the old copy or the new one), and the next save leaves nothing behind. Before, the old
directory was removed first: killed before the rename, the step was gone, its new copy in a .tmp- directory that no
resume considers (the run resumed the step before, or, with no other, from step 0). The kill is real (os._exit in a
child process, at the file operation named)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace as value

import pytest
import torch

from molt_hydra.parallel.checkpoint import load_checkpoint, save_checkpoint

CHILD = r"""
import os, shutil, sys, torch
from molt_hydra.parallel import checkpoint

root, kill_at = sys.argv[1], int(sys.argv[2])
ops, real_replace, real_rmtree = [], os.replace, shutil.rmtree

def dies_at(op, real):
    def call(path, *args, **kwargs):
        if "step_2" in str(path):  # the swap's operations on step_2 (its rename in, what is removed)
            ops.append(op)
            if len(ops) == kill_at:
                os._exit(9)  # killed just before this operation
        return real(path, *args, **kwargs)
    return call

torch.manual_seed(2)
checkpoint.os.replace = dies_at("replace", real_replace)
checkpoint.shutil.rmtree = dies_at("rmtree", real_rmtree)
checkpoint.save_checkpoint(root, 2, torch.nn.Linear(4, 4), client_state={"master_weights": "fsdp", "at": "second"})
print("swap:", " ".join(ops))
"""


def _model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4)


@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_a_kill_at_any_point_of_replacing_a_step_leaves_it_resumable(tmp_path, kill_at, capsys):
    from molt_hydra.runtime.entrypoint import _check_resume

    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, _model(0), client_state={"master_weights": "fsdp", "at": "first"})
    save_checkpoint(root, 2, _model(1), client_state={"master_weights": "fsdp", "at": "first"})
    child = subprocess.run([sys.executable, "-c", CHILD, str(root), str(kill_at)], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 9, child.stdout + child.stderr[-2000:]  # killed at the swap's operation `kill_at`
    cfg = value(job=value(value="rl"), model=value(master_weights=value(value="fsdp")), checkpoint=value(
        dir=str(root), resume=value(value="auto"), load_model_only=False))
    found, state = _check_resume(cfg)
    assert found == root / "step_2"
    # killed before the new copy was renamed in: the old one (killed after: the new one)
    at, seed = ("first", 1) if kill_at < 3 else ("second", 2)
    assert state["at"] == at
    fresh = _model(5)
    assert load_checkpoint(root, fresh, step="step_2")["at"] == at
    assert torch.equal(fresh.weight, _model(seed).weight)
    named = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Checkpoint")]
    assert named == ([f"Checkpoint passed over: {root / '.tmp-step_2'}: a save that never finished (the next save "
                      "removes it)"] if kill_at < 3 else []), named  # (step_2 itself is not passed over)
    save_checkpoint(root, 3, _model(3))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2", "step_3"]


def test_the_swap_renames_the_old_copy_aside_before_the_new_one_goes_in(tmp_path):
    """The operations the test above kills before, in order: the old step renamed aside, the new one renamed in,
    the old one removed."""
    root = tmp_path / "ckpt"
    save_checkpoint(root, 2, _model(1))
    child = subprocess.run([sys.executable, "-c", CHILD, str(root), "0"], capture_output=True, text=True, timeout=120)
    assert child.stdout.strip().splitlines()[-1] == "swap: replace replace rmtree", child.stderr[-2000:]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]


def test_best_left_aside_by_a_kill_is_put_back_by_the_resume_check(tmp_path):
    """checkpoint.dir/best (the best policy's HF export, replaced at each better eval) killed between the two renames:
    the resume check puts it back before anything starts (before: removed first, the kill lost it)."""
    from molt_hydra.runtime.entrypoint import _check_resume

    root = tmp_path / "ckpt"
    save_checkpoint(root, 2, _model(1), client_state={"master_weights": "fsdp"})
    (root / ".old-best").mkdir()
    (root / ".old-best" / "best.json").write_text('{"step": 1}')
    (root / ".tmp-best").mkdir()  # the new export, complete or not
    cfg = value(job=value(value="rl"), model=value(master_weights=value(value="fsdp")), checkpoint=value(
        dir=str(root), resume=value(value="auto"), load_model_only=False))
    assert _check_resume(cfg)[0] == root / "step_2"
    assert (root / "best" / "best.json").read_text() == '{"step": 1}' and not (root / ".old-best").exists()


HOLDER = r"""
import sys
from molt_hydra.runtime.run_lock import run_lock
with run_lock({"checkpoint.dir": sys.argv[1]}):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
"""


def test_a_leftover_of_a_directory_another_run_writes_is_left_to_that_run(tmp_path):
    """A run that only reads a checkpoint.dir (checkpoint.save_steps=0: it takes no lock there) while another run,
    holding that directory's lock, is between the two renames of replacing `best`: the reader's resume check leaves
    the old copy aside, and the writer's rename in goes through. Before: the check put the old copy back under the
    writer, whose rename then failed (OSError: Directory not empty), ending that run. Once the writer is gone, its
    leftover is put back as before, and a run holding the lock itself (it writes there) puts it back too."""
    from molt_hydra.runtime.entrypoint import _check_resume
    from molt_hydra.runtime.run_lock import run_lock

    root = tmp_path / "ckpt"
    save_checkpoint(root, 2, _model(1), client_state={"master_weights": "fsdp"})
    (root / ".old-best").mkdir()  # the writer's swap, between its two renames
    (root / ".tmp-best").mkdir()
    cfg = value(job=value(value="rl"), model=value(master_weights=value(value="fsdp")), checkpoint=value(
        dir=str(root), resume=value(value="auto"), load_model_only=False))
    writer = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "held"
        assert _check_resume(cfg)[0] == root / "step_2"
        assert sorted(p.name for p in root.iterdir() if "best" in p.name) == [".old-best", ".tmp-best"]
    finally:
        writer.communicate("", timeout=60)
    (root / ".tmp-best").rename(root / "best")  # the writer's rename in: its own `best` is not in the way
    (root / ".old-best").rmdir()  # (and its removal of the old one)
    (root / "best").rename(root / ".old-best")  # a writer that died between the renames, its lock gone with it
    _check_resume(cfg)
    assert (root / "best").is_dir() and not (root / ".old-best").exists()
    (root / "best").rename(root / ".old-best")
    with run_lock({"checkpoint.dir": str(root)}):  # this run's own lock (a run writing there)
        _check_resume(cfg)
    assert (root / "best").is_dir() and not (root / ".old-best").exists()


def test_a_leftover_the_resume_check_cannot_put_back_is_left_as_it_is(tmp_path, monkeypatch):
    """A checkpoint.dir this run only reads (mounted read-only, a warm start's source) holding a crash's leftover:
    the resume check goes on without it (was: a PermissionError traceback before anything started)."""
    from molt_hydra.parallel import checkpoint
    from molt_hydra.runtime.entrypoint import _check_resume

    root = tmp_path / "ckpt"
    save_checkpoint(root, 2, _model(1), client_state={"master_weights": "fsdp"})
    (root / ".old-best").mkdir()

    def read_only(path):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(checkpoint, "recover", read_only)
    cfg = value(job=value(value="rl"), model=value(master_weights=value(value="fsdp")), checkpoint=value(
        dir=str(root), resume=value(value="auto"), load_model_only=False))
    assert _check_resume(cfg)[0] == root / "step_2" and (root / ".old-best").is_dir()


PRUNE = r"""
import os, sys, torch
from molt_hydra.parallel import retention

real_rmtree = retention.shutil.rmtree

def killed_midway(path, *args, **kwargs):  # step_1's small files gone, its shards not yet
    if "step_1" not in str(path):
        return real_rmtree(path, *args, **kwargs)
    for name in ("extra_state.pt", "crc32.json"):
        os.unlink(os.path.join(path, name))
    os._exit(9)

retention.shutil.rmtree = killed_midway
from molt_hydra.parallel.checkpoint import save_checkpoint
save_checkpoint(sys.argv[1], 2, torch.nn.Linear(64, 64), keep=1)
"""


def test_a_kill_while_retention_removes_a_step_leaves_nothing_the_next_save_keeps(tmp_path):
    """checkpoint.max_num=1: saving step_2 prunes step_1, and the process is killed while step_1's files are
    removed. Before: step_1 stayed with its shards and without extra_state.pt, no longer a checkpoint, so retention
    never counted or removed it again (a checkpoint's size on disk for good, beyond max_num / max_disk_gb). Now the
    next save removes what is left of it."""
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, torch.nn.Linear(64, 64), keep=1)
    child = subprocess.run([sys.executable, "-c", PRUNE, str(root)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 9, child.stderr[-2000:]
    save_checkpoint(root, 3, torch.nn.Linear(64, 64), keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3"]


def test_a_file_in_the_steps_place_fails_the_save_naming_it(tmp_path):
    """Only a directory is renamed aside (tests/integration/test_resume_faults.py puts a file where the critic's step
    goes to fail its save): the save fails naming the file, which stays as it was."""
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, _model(0))
    (root / "step_2").write_text("in the way")
    with pytest.raises(RuntimeError) as err:
        save_checkpoint(root, 2, _model(1))
    assert str(err.value) == (f"writing {root / '.tmp-step_2'} failed on rank 0: NotADirectoryError: [Errno 20] Not a "
                              f"directory: '{root / '.tmp-step_2'}' -> '{root / 'step_2'}'")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]
    assert (root / "step_2").read_text() == "in the way"
