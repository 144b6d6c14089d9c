"""checkpoint.max_disk_gb (parallel/retention.py through parallel/checkpoint.py save_checkpoint, one process, real
DCP): the oldest resumable checkpoints are pruned until the rest fits; the newest is never pruned; when it alone is
over the budget the save is kept and the error says so, with the key and the fix."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.parallel.checkpoint import resolve_checkpoint, save_checkpoint
from molt_hydra.parallel.retention import dir_bytes


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256)  # 65792 fp32 values: ~263 kB a checkpoint


def _steps(root):
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))


def test_budget_prunes_oldest_and_keeps_the_newest(tmp_path):
    model = _model()
    save_checkpoint(tmp_path, 1, model, keep=0)
    one = dir_bytes(tmp_path / "step_1")
    budget_gb = 2.5 * one / 1e9  # two checkpoints fit, three do not
    for step in (2, 3, 4):
        save_checkpoint(tmp_path, step, model, keep=0, max_disk_gb=budget_gb)
    assert _steps(tmp_path) == [3, 4]
    assert resolve_checkpoint(tmp_path).name == "step_4"


def test_without_budget_every_checkpoint_stays(tmp_path):
    model = _model()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, keep=0)
    assert _steps(tmp_path) == [1, 2, 3]


def test_newest_over_budget_is_kept_and_named(tmp_path):
    model = _model()
    save_checkpoint(tmp_path, 1, model, keep=0)
    with pytest.raises(RuntimeError) as err:
        save_checkpoint(tmp_path, 2, model, keep=0, max_disk_gb=1e-6)
    size = f"{dir_bytes(tmp_path / 'step_2') / 1e9:.3g}"
    assert str(err.value).startswith(f"checkpoint.max_disk_gb=1e-06: the newest checkpoint {tmp_path / 'step_2'} "
                                     f"alone takes {size} GB")
    assert f"Fix: raise checkpoint.max_disk_gb above {size}" in str(err.value)
    assert _steps(tmp_path) == [2]  # the older one pruned, the new one complete and resumable
    assert resolve_checkpoint(tmp_path).name == "step_2"


def test_a_checkpoint_that_cannot_be_pruned_is_named(tmp_path, caplog):
    """checkpoint.max_num=1 and step_1 immutable (chattr +i: its files cannot be removed, as in a directory another
    user owns). Before: the removal's error was ignored, the checkpoints outgrew max_num / max_disk_gb without a
    word; now a warning (the terminal's, through role_warnings.py) names the directory and the cause."""
    import subprocess

    model = _model()
    save_checkpoint(tmp_path, 1, model, keep=1)
    if subprocess.run(["chattr", "+i", str(tmp_path / "step_1")], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root on a filesystem that supports it)")
    try:
        with caplog.at_level("WARNING", logger="molt_hydra"):
            save_checkpoint(tmp_path, 2, model, keep=1)
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "step_1")])
    assert _steps(tmp_path) == [1, 2]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("molt_hydra")] == [
        f"checkpoint retention: {tmp_path / 'step_1'} could not be removed (Operation not permitted): it stays on "
        "disk, beyond checkpoint.max_num / checkpoint.max_disk_gb; remove it by hand"]


@pytest.mark.parametrize("keep, budget", [(1, None), (0, 1.5)], ids=["max_num=1", "max_disk_gb"])
def test_the_critics_copy_of_the_actors_newest_step_outlives_a_failed_actor_save(tmp_path, keep, budget):
    """A run with a critic saves each step for the critic first, then for the actor (runtime/controller.py save); the
    actor's step-2 save fails (a full disk: the bigger save; a kill). Before: the critic's step-2 save had pruned its
    step_1 (checkpoint.max_num=1, or a budget of one checkpoint), so the actor's newest, step_1, had no critic: the
    resume check refused it ('ckpt_critic/step_1: missing'), and no step was left to resume. The critic's save keeps
    the actor's newest (`hold`), the step after is pruned as before."""
    model, actor, critic = _model(), tmp_path / "ckpt", tmp_path / "ckpt_critic"
    one = dir_bytes(save_checkpoint(tmp_path / "probe", 1, model, keep=0))
    budget_gb = budget and budget * one / 1e9  # one checkpoint fits, two do not
    save_checkpoint(critic, 1, model, keep=keep, max_disk_gb=budget_gb)
    save_checkpoint(actor, 1, model, keep=keep, max_disk_gb=budget_gb)
    save_checkpoint(critic, 2, model, keep=keep, max_disk_gb=budget_gb, hold=1)  # the actor's newest: step 1
    assert _steps(critic) == [1, 2] and resolve_checkpoint(actor).name == "step_1"  # (its step-2 save failed)
    save_checkpoint(critic, 2, model, keep=keep, max_disk_gb=budget_gb, hold=1)  # the resume's step 2, again
    save_checkpoint(actor, 2, model, keep=keep, max_disk_gb=budget_gb)
    save_checkpoint(critic, 3, model, keep=keep, max_disk_gb=budget_gb, hold=2)
    assert _steps(critic) == [2, 3] and _steps(actor) == [2]
