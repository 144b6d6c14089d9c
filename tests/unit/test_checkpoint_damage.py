"""A damaged checkpoint on resume (parallel/checkpoint.py `resolve_checkpoint` / `problem`, one process, real DCP): a
file of the newest step_<N> truncated, deleted or unreadable, or a `latest` tag naming a missing directory, is passed
over for the newest loadable checkpoint, each one named with the file and the reason; nothing loadable gives None
with every reason. Before: the damaged checkpoint was chosen and its load raised DCP's 'CheckpointException
ranks:dict_keys([0])' (or a UnicodeDecodeError / torch's zip error) from every resume, which could never succeed."""

from __future__ import annotations

import json
import shutil
import zlib

import pytest
import torch

from molt_hydra.parallel.checkpoint import DamagedCheckpoint, load_checkpoint, resolve_checkpoint, save_checkpoint


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


def test_a_latest_tag_left_behind_by_a_crash_after_the_rename_resumes_the_newer_complete_step(saved, tmp_path):
    """A save renames .tmp-step_<N> to step_<N>, then rewrites `latest`: killed between the two, the tag still names
    step_1 while step_2 is complete. The resume takes the newest complete step (before: step_1, step 2's training
    lost and trained again, its data order repeated)."""
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    (root / "latest").write_text("step_1")
    skipped = []
    assert resolve_checkpoint(root, skipped, checksums=True) == root / "step_2" and skipped == []
    fresh, fresh_opt = _trained(1)
    assert load_checkpoint(root, fresh, fresh_opt) == {"at": 2}


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


def _overwrite_data(path):
    """Bytes changed in place, the file's length kept, inside its first tensor's data (a DCP shard: its middle; a
    torch.save file: the data record of its first tensor), so that it still loads: what the size and load checks
    cannot see. Before the CRC32s were recorded, such a shard resumed as garbage weights, an RNG file as other RNG
    streams, without a word."""
    import zipfile

    data, start = bytearray(path.read_bytes()), len(path.read_bytes()) // 2
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            info = next(i for i in z.infolist() if "/data/" in i.filename)
            start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 4  # (stored, not compressed)
    data[start:start + 8] = bytes(b ^ 0xFF for b in data[start:start + 8])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["rng_rank0.pt", "dcp/.metadata"])
def test_a_small_file_changed_at_its_full_length_is_passed_over_by_the_checksum_check(saved, tmp_path, name):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    _overwrite_data(root / "step_2" / name)
    if name == "rng_rank0.pt":
        assert resolve_checkpoint(root) == root / "step_2"  # the cheap check (every rank's) cannot see it
    skipped = []
    assert resolve_checkpoint(root, skipped, checksums=True) == root / "step_1"
    assert len(skipped) == 1 and skipped[0].startswith(f"{root / 'step_2'}: {name}: "), skipped


def _flip_header(path):
    """The first bytes changed (a DCP shard: its first item's zip header): torch.load cannot read the item."""
    data = bytearray(path.read_bytes())
    data[:8] = bytes(b ^ 0xFF for b in data[:8])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("change", [_overwrite_data, _flip_header], ids=["data", "header"])
def test_a_shard_changed_at_its_full_length_fails_its_load_naming_the_file(saved, tmp_path, change):
    """A shard's CRC32 is checked as the load reads it (parallel/crc_reader.py), not by the resume check, which would
    read it a second time: the load raises DamagedCheckpoint naming the file, both CRC32s and the fix (the run then
    resumes the step before: runtime/entrypoint.py _load_verified), also where the change left an item torch.load
    cannot read."""
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    shard = root / "step_2" / "dcp" / "__0_0.distcp"
    change(shard)
    saved_crc = json.loads((root / "step_2" / "crc32.json").read_text())["dcp/__0_0.distcp"]
    assert resolve_checkpoint(root, checksums=True) == root / "step_2"  # (the shards are not read there)
    with pytest.raises(DamagedCheckpoint):  # a warm start: the optimizer's bytes, not loaded, are summed too
        load_checkpoint(root, *_trained(1), step="step_2", model_only=True)
    with pytest.raises(DamagedCheckpoint) as err:
        load_checkpoint(root, *_trained(1), step="step_2")
    assert err.value.args[1] == (f"{root / 'step_2'}: dcp/__0_0.distcp: CRC32 {zlib.crc32(shard.read_bytes()):08x}, "
                                 f"saved as {saved_crc:08x} (its bytes changed since the save)")
    assert str(err.value).endswith(f"Fix: move {root / 'step_2'} out of the checkpoint directory to resume from the "
                                   "one before it")
    fresh, fresh_opt = _trained(1)
    with pytest.raises(DamagedCheckpoint):
        load_checkpoint(root, fresh, fresh_opt, step="step_2")
    assert load_checkpoint(root, fresh, fresh_opt, step="step_1") == {"at": 1}  # the next load replaces it all
    clean, clean_opt = _trained(1)
    load_checkpoint(root, clean, clean_opt, step="step_1")
    assert torch.equal(fresh.weight, saved[1]) and torch.equal(fresh.weight, clean.weight)
    for mine, theirs in zip(fresh_opt.state.values(), clean_opt.state.values()):
        assert all(torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(theirs[k])) for k in theirs)


def _bytes_read() -> int:
    return int(next(line for line in open("/proc/self/io") if line.startswith("rchar:")).split()[1])


def test_a_resume_reads_each_shard_once(tmp_path):
    """The resume check (runtime/entrypoint.py _check_resume) and the load together read a shard's bytes once. Before,
    the check read every byte for the CRC32s and the load read them again: a 60 GB checkpoint, 120 GB of reads."""
    from types import SimpleNamespace as value

    from molt_hydra.runtime.entrypoint import _check_resume

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 1, model, opt)
    shards = sum(p.stat().st_size for p in (tmp_path / "step_1" / "dcp").glob("*.distcp"))
    fresh = torch.nn.Linear(1024, 1024)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    cfg = value(job=value(value="rl"), model=value(master_weights=value(value="fsdp")), checkpoint=value(
        dir=str(tmp_path), resume=value(value="auto"), load_model_only=False))
    before = _bytes_read()
    found, _ = _check_resume(cfg)
    load_checkpoint(tmp_path, fresh, fresh_opt, step=found.name)
    read = _bytes_read() - before
    assert shards <= read < 1.25 * shards, (read, shards)  # (the small files: a few KB)
    assert torch.equal(fresh.weight, model.weight)


def test_a_missing_checksum_file_is_named(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    (root / "step_2" / "crc32.json").unlink()
    skipped = []
    assert resolve_checkpoint(root, skipped, checksums=True) == root / "step_1"
    assert skipped == [f"{root / 'step_2'}: crc32.json: No such file or directory"]


def test_the_run_resumes_the_checked_checkpoint_and_names_the_one_passed_over(saved, tmp_path, capsys):
    """runtime/entrypoint.py `_check_resume` checks the small files' CRC32s once, before anything starts, and returns
    the checkpoint every role then loads by name (their own check is the cheap one, the shards' CRC32s checked as they
    are read); a half-written save is named too."""
    from types import SimpleNamespace as value

    from molt_hydra.runtime.entrypoint import _check_resume

    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    _overwrite_data(root / "step_2" / "rng_rank0.pt")
    shutil.copytree(root / "step_1", root / ".tmp-step_3")  # a run stopped while it saved step 3
    cfg = value(job=value(value="rl"), model=value(master_weights=value(value="fsdp")), checkpoint=value(
        dir=str(root), resume=value(value="auto"), load_model_only=False))
    assert _check_resume(cfg)[0] == root / "step_1"
    partial, line, unchecked = capsys.readouterr().err.strip().splitlines()
    assert partial == f"Checkpoint passed over: {root / '.tmp-step_3'}: a save that never finished (the next save " \
                      "removes it)"
    assert line.startswith(f"Checkpoint passed over: {root / 'step_2'}: rng_rank0.pt: CRC32 ")
    assert line.endswith(f"resuming from {root / 'step_1'} instead")
    assert unchecked.startswith(f"Resuming {root / 'step_1'}, saved before checkpoints recorded their config")
    fresh, fresh_opt = _trained(1)
    assert load_checkpoint(root, fresh, fresh_opt, step="step_1") == {"at": 1}
    assert torch.equal(fresh.weight, saved[1])


def test_the_next_save_removes_every_half_written_one(saved, tmp_path):
    """A run killed mid-save leaves .tmp-step_<N>; the next save, whatever its step, removes them all (before:
    only a leftover of the same step was removed, the others stayed, each as large as a checkpoint)."""
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    for step in (3, 7):
        shutil.copytree(root / "step_2", root / f".tmp-step_{step}")
    save_checkpoint(root, 4, *_trained(2))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2", "step_4"]


def test_a_critic_checkpoint_changed_since_its_save_stops_the_run_before_anything_starts(saved, tmp_path, capsys):
    """A run with a critic (algorithm.estimator=gae) resumes the critic at the actor's step; its files are checked by
    the same resume check: a critic file changed at its full length stops the run naming the file and the fix (before:
    the critic's own check, the cheap one, loaded it)."""
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from molt_hydra.runtime.entrypoint import EXIT_FAILED, _check_resume
    from molt_hydra.runtime.validate import validate

    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    shutil.copytree(saved[0], tmp_path / "root_critic")
    _overwrite_data(tmp_path / "root_critic" / "step_2" / "rng_rank0.pt")
    overrides = ["algorithm.estimator=gae", "parallelism.colocate_models=true", "model.master_weights=fsdp",
                 f"checkpoint.dir={root}", "checkpoint.resume=auto"]
    cfg = validate(OmegaConf.to_object(compose_config(overrides, output_dir=str(tmp_path / "out"))))
    with pytest.raises(SystemExit) as stop:
        _check_resume(cfg)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == EXIT_FAILED
    assert last.startswith(f"Run failed: checkpoint.resume=auto: {tmp_path / 'root_critic' / 'step_2'}: "
                           "rng_rank0.pt: CRC32 ")
    assert "the critic resumes the actor's step_2. Fix: move step_2 (and any later step) out of checkpoint.dir=" in last


def test_resume_never_over_an_earlier_runs_checkpoints_stops_before_anything_starts(saved, tmp_path, capsys):
    """checkpoint.resume=never with checkpoint.dir holding step_1, step_2 of an earlier run. Before: the run started;
    with checkpoint.max_num=2 its own step_1 was pruned as soon as saved (the newest steps are kept: the earlier
    run's), and a later resume took the earlier run's step_2."""
    from types import SimpleNamespace as value

    from molt_hydra.runtime.entrypoint import EXIT_FAILED, _check_resume

    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    cfg = value(job=value(value="rl"), checkpoint=value(dir=str(root), resume=value(value="never"), save_steps=1))
    with pytest.raises(SystemExit) as stop:
        _check_resume(cfg)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == EXIT_FAILED
    assert last.startswith(f"Run failed: checkpoint.resume=never, but {root} holds an earlier run's checkpoints "
                           "(step_2 the newest)") and "Fix: checkpoint.resume=auto" in last, last
    for fine in (value(dir=str(root), resume=value(value="never"), save_steps=0),  # saves nothing there
                 value(dir=str(tmp_path / "empty"), resume=value(value="never"), save_steps=1)):
        assert _check_resume(value(job=value(value="rl"), checkpoint=fine))[0] is None


@pytest.mark.parametrize("left", ["latest_only", "damaged_step"])
def test_no_loadable_checkpoint_names_the_fix_for_what_is_there(saved, tmp_path, capsys, left):
    """checkpoint.resume=auto with nothing loadable: a damaged step is to be moved aside before resume=never (which
    refuses to save among an earlier run's steps); a `latest` tag alone (its steps removed by hand) has nothing to
    move, and resume=never starts over it. Before, both said 'after moving the damaged ones aside'."""
    from types import SimpleNamespace as value

    from molt_hydra.runtime.entrypoint import EXIT_FAILED, _check_resume

    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    for step in (1, 2):
        if left == "latest_only":
            shutil.rmtree(root / f"step_{step}")
        else:
            (root / f"step_{step}" / "extra_state.pt").unlink()
    cfg = value(job=value(value="rl"), checkpoint=value(dir=str(root), resume=value(value="auto"), save_steps=1))
    with pytest.raises(SystemExit) as stop:
        _check_resume(cfg)
    lines = capsys.readouterr().err.strip().splitlines()
    fix = "Fix: point checkpoint.dir at a run's checkpoints, or start from step 0 with checkpoint.resume=never"
    assert stop.value.code == EXIT_FAILED
    assert lines[-1] == (f"Run failed: checkpoint.resume=auto: no loadable checkpoint under checkpoint.dir={root}. "
                         + fix + (" after moving the damaged ones aside." if left == "damaged_step" else "."))
    if left == "latest_only":  # what that fix does: resume=never goes on (no earlier step to mix with)
        never = value(dir=str(root), resume=value(value="never"), save_steps=1)
        assert f"Checkpoint not loadable: {root / 'step_2'}: missing" in lines
        assert _check_resume(value(job=value(value="rl"), checkpoint=never))[0] is None


def test_a_role_resuming_its_step_reads_the_extra_state_once(tmp_path):
    """A trainer rank's load of the step it is told (runtime/entrypoint.py passes `step`) checks it, then loads it:
    extra_state.pt, which holds the loop's queued batches (here 8 MB), is read once. Before, twice per rank."""
    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt, client_state={"queued": torch.randn(2_000_000)})
    size = (tmp_path / "step_1" / "extra_state.pt").stat().st_size
    fresh, fresh_opt = _trained(1)
    before = _bytes_read()
    state = load_checkpoint(tmp_path, fresh, fresh_opt, step="step_1")
    read = _bytes_read() - before
    assert size <= read < 1.5 * size, (read, size)  # (the other files: a few KB)
    assert torch.equal(state["queued"], torch.load(tmp_path / "step_1" / "extra_state.pt")["client_state"]["queued"])
    assert torch.equal(fresh.weight, model.weight)
