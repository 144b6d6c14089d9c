"""runtime/writable.py `check_outputs`, which runs before Ray: the metric sinks' directories under output_dir (W&B's
wandb/, TensorBoard's tensorboard/) that cannot hold files stop the run naming the directory, why and the fix. Before,
wandb.init met them once every engine had started: `Run failed: driver (I/O): NotADirectoryError ...` minutes in. A
plain file in the directory's place stands for any unwritable one (root ignores permission bits)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace as value

import pytest

from molt_hydra.runtime.watchdog import EXIT_FAILED
from molt_hydra.runtime.writable import check_outputs


def _cfg(out, job="rl", wandb="offline", tensorboard=False, save_steps=-1, eval_data=None, checkpoints=None,
         export_dir=None):
    return value(output_dir=str(out), job=value(value=job), logger=value(
        wandb=value(mode=value(value=wandb)), tensorboard=tensorboard), checkpoint=value(
        dir=str(checkpoints or out / "checkpoints"), export_final=export_dir is not None, export_dir=export_dir,
        save_steps=save_steps, best_metric_key=""),
        train=value(rollout_dump_dir=None), eval=value(data_path=eval_data))


@pytest.mark.parametrize("name, key, off, kw", [
    ("wandb", "logger.wandb.mode", "disabled", {}),
    ("tensorboard", "logger.tensorboard", "false", {"wandb": "disabled", "tensorboard": True}),
])
def test_an_unwritable_sink_directory_stops_the_run_before_anything_starts(tmp_path, capsys, name, key, off, kw):
    (tmp_path / name).write_text("")
    with pytest.raises(SystemExit) as stop:
        check_outputs(_cfg(tmp_path, **kw))
    assert stop.value.code == EXIT_FAILED
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"- output_dir/{name}={tmp_path / name}: not writable: Not a directory ({tmp_path / name}). Fix: make it a "
        f"writable directory, point output_dir elsewhere, or set {key}={off}.")



def test_an_output_dir_whose_name_the_disk_cannot_hold_stops_the_run_before_anything_starts(tmp_path, capsys):
    """Before: its nearest existing parent was probed (writable), and Hydra's mkdir failed later (OSError traceback)."""
    limit = __import__("os").pathconf(tmp_path, "PC_NAME_MAX")
    # below a directory still to be made, or right below one that exists (Path.exists raised there: ENAMETOOLONG)
    for out in (tmp_path / "runs" / ("x" * (limit + 1)) / "run", tmp_path / ("x" * (limit + 1))):
        with pytest.raises(SystemExit) as e:
            check_outputs(_cfg(out, wandb="disabled"))
        assert e.value.code == EXIT_FAILED
        err = capsys.readouterr().err
        assert f"- output_dir={out}: not writable: the name 'xxxx" in err
        assert f"is {limit + 1} bytes, over this disk's {limit}. Fix: point output_dir at a writable directory." in err
    check_outputs(_cfg(tmp_path / "runs" / ("x" * limit) / "run", wandb="disabled"))  # at the limit: fine


def test_a_checkpoint_dir_the_run_only_reads_may_be_read_only(tmp_path, capsys):
    """checkpoint.save_steps=0 resuming (a warm start) from a checkpoint.dir it cannot write (a file stands for it:
    root ignores permission bits): the run writes nothing there, so it goes on. Before: 'Run not started: output
    directory not writable. - checkpoint.dir=...: not writable'. Where it saves, or exports `best` there (an RL
    run's eval), the directory is checked as before."""
    checkpoints = tmp_path / "read_only"
    checkpoints.write_text("")
    check_outputs(_cfg(tmp_path, wandb="disabled", save_steps=0, checkpoints=checkpoints))
    for kw in ({"save_steps": -1}, {"save_steps": 0, "eval_data": "builtin://gsm8k_mini"}):
        with pytest.raises(SystemExit):
            check_outputs(_cfg(tmp_path, wandb="disabled", checkpoints=checkpoints, **kw))
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
            f"- checkpoint.dir={checkpoints}: not writable: Not a directory")


def test_an_export_dir_in_a_directory_the_run_cannot_write_stops_the_run_before_anything_starts(tmp_path, capsys):
    """The export replaces checkpoint.export_dir whole, through copies beside it, and its run lock is beside it too:
    the directory holding it must take new files, even where export_dir itself does. Before: check_outputs passed,
    then the run lock's open raised a PermissionError traceback (and, before the lock, the final export failed after
    training)."""
    shared = tmp_path / "shared"
    (shared / "mine").mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(shared)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root on a filesystem that supports it)")
    try:
        with pytest.raises(SystemExit) as stop:
            check_outputs(_cfg(tmp_path / "out", wandb="disabled", export_dir=str(shared / "mine")))
    finally:
        subprocess.run(["chattr", "-i", str(shared)])
    assert stop.value.code == EXIT_FAILED
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"- the directory holding checkpoint.export_dir={shared}: not writable: Operation not permitted ({shared}). "
        "Fix: point checkpoint.export_dir into a writable directory.")


def test_an_output_dir_on_a_full_disk_stops_the_run_before_anything_starts(tmp_path, capsys):
    """A full disk still makes directories (tmpfs, ext4 with inodes left): the probe writes a byte too. Before: it
    passed, and a resume onto the full output_dir started every role before failing on the first metrics write."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (disk / "out").mkdir()
        with open(disk / "fill", "wb", buffering=0) as f:  # until the disk is full
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 4096)
        with pytest.raises(SystemExit) as stop:
            check_outputs(_cfg(disk / "out", wandb="disabled"))
    finally:
        subprocess.run(["umount", "-l", str(disk)])
    assert stop.value.code == EXIT_FAILED
    assert f"- output_dir={disk / 'out'}: not writable: No space left on device" in capsys.readouterr().err
