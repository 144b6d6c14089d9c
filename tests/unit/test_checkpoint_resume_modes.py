"""A resume keeps `model.master_weights` (parallel/checkpoint.py load_checkpoint, one process, real DCP): the
optimizer state of fp32 FSDP params and of optimizer-held masters differ in kind, so a checkpoint saved in one mode is
refused in the other before anything loads, naming the key, both values and the fix. The mode is the one the
checkpoint recorded, or, in a checkpoint older than the record, the one its model tensors' dtypes tell (fp32: fsdp;
compute dtype: optimizer). A warm start (weights only) is not checked."""

from __future__ import annotations

import zipfile

import pytest
import torch

from molt_hydra.parallel.checkpoint import load_checkpoint, save_checkpoint, saved_master_weights


def _trained(seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8, dtype=dtype)).sum().backward()
    opt.step()
    return model, opt


def test_a_checkpoint_of_the_other_mode_is_refused_before_loading(tmp_path):
    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt, client_state={"master_weights": "fsdp"})
    fresh, fresh_opt = _trained(1)
    before = fresh.weight.detach().clone()
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path, fresh, fresh_opt, master_weights="optimizer")
    message = str(err.value)
    assert message.startswith("model.master_weights: ") and "saved with model.master_weights=fsdp" in message
    assert "this run has optimizer" in message and "Fix: set model.master_weights=fsdp" in message
    assert torch.equal(fresh.weight, before)  # refused before anything loaded


@pytest.mark.parametrize("dtype,want", [(torch.float32, "fsdp"), (torch.bfloat16, "optimizer")], ids=["fp32", "bf16"])
def test_an_unrecorded_mode_is_told_by_the_model_tensors_dtype(tmp_path, dtype, want):
    model, opt = _trained(0, dtype)
    path = save_checkpoint(tmp_path, 1, model, opt)  # no mode in its client state, as before the record
    assert saved_master_weights(path) == want
    other = "optimizer" if want == "fsdp" else "fsdp"
    with pytest.raises(ValueError, match=f"saved with model.master_weights={want}, this run has {other}"):
        load_checkpoint(tmp_path, *_trained(1, dtype), master_weights=other)
    fresh, fresh_opt = _trained(1, dtype)
    assert load_checkpoint(tmp_path, fresh, fresh_opt, master_weights=want) == {}
    assert torch.equal(fresh.weight, model.weight)


def test_a_warm_start_loads_the_weights_whatever_the_mode(tmp_path):
    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt, client_state={"master_weights": "fsdp"})
    fresh, fresh_opt = _trained(1)
    assert load_checkpoint(tmp_path, fresh, fresh_opt, model_only=True, master_weights="optimizer") == {}
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("warm", [False, True], ids=["resume", "warm_start"])
def test_the_run_refuses_a_resume_across_modes_before_anything_starts(tmp_path, capsys, warm):
    """runtime/entrypoint.py `_check_resume`, which runs before Ray: the run's last line names the checkpoint, both
    modes and the fix; a warm start (weights only) goes on."""
    from types import SimpleNamespace

    from molt_hydra.runtime.entrypoint import EXIT_FAILED, _check_resume

    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt, client_state={"master_weights": "fsdp"})
    value = SimpleNamespace
    cfg = value(job=value(value="rl"), model=value(master_weights=value(value="optimizer")), checkpoint=value(
        dir=str(tmp_path), resume=value(value="auto"), load_model_only=warm, save_steps=0), eval=value(data_path=None))
    if warm:
        _check_resume(cfg)
        return
    with pytest.raises(SystemExit) as stop:
        _check_resume(cfg)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == EXIT_FAILED and last.startswith("Run failed: model.master_weights: ")
    assert "saved with model.master_weights=fsdp, this run has optimizer" in last and "Fix: set model." in last


def test_a_role_resumes_the_step_it_is_told_and_a_missing_one_is_named(tmp_path):
    """Every role resumes the actor's step (runtime/entrypoint.py passes `step`): here the newest is step_2, yet
    step_1 is loaded when asked for; a step this role never saved is an error naming its path and the fix."""
    first, opt = _trained(0)
    save_checkpoint(tmp_path, 1, first, opt, client_state={"at": 1})
    second, opt2 = _trained(1)
    save_checkpoint(tmp_path, 2, second, opt2, client_state={"at": 2})
    fresh, fresh_opt = _trained(2)
    assert load_checkpoint(tmp_path, fresh, fresh_opt, step="step_1") == {"at": 1}
    assert torch.equal(fresh.weight, first.weight)
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path, fresh, fresh_opt, step="step_3")
    assert str(err.value).startswith(f"{tmp_path / 'step_3'}: missing; every role resumes step_3") and "Fix: " in \
        str(err.value)


@pytest.mark.parametrize("batch_size,warm,refused", [(4, False, True), (8, False, False), (4, True, False)],
                         ids=["other_size", "same_size", "warm_start"])
def test_an_sft_resume_under_another_batch_size_is_refused(tmp_path, capsys, batch_size, warm, refused):
    """job=sft resumes at sample global_step x train.batch_size: a checkpoint of 3 steps of 8 samples resumed with
    batch size 4 went on at sample 12 of the epoch's order, repeating 12 samples without a word. Now the run stops
    before anything starts naming both sizes; the same size, or a warm start (weights only, step 0), goes on."""
    from types import SimpleNamespace

    from molt_hydra.runtime.entrypoint import EXIT_FAILED, _check_resume

    model, opt = _trained(0)
    save_checkpoint(tmp_path, 3, model, opt, client_state={"master_weights": "fsdp", "global_step": 3,
                                                           "consumed_samples": 3 * 8})
    value = SimpleNamespace
    cfg = value(job=value(value="sft"), model=value(master_weights=value(value="fsdp")), train=value(
        batch_size=batch_size), checkpoint=value(dir=str(tmp_path), resume=value(value="auto"), load_model_only=warm,
                                                  save_steps=0))
    if not refused:
        assert _check_resume(cfg)[0].name == "step_3"
        return
    with pytest.raises(SystemExit) as stop:
        _check_resume(cfg)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == EXIT_FAILED and last.startswith("Run failed: train.batch_size: ")
    assert "after 3 steps of 8 samples (24 consumed); train.batch_size=4 would resume at sample 12" in last
    assert "Fix: set train.batch_size=8, or start from its weights alone: copy it as step_0 of a new checkpoint.dir " \
           "and set checkpoint.load_model_only=true" in last


def test_the_resume_hint_names_the_checkpoint_the_resume_would_take(tmp_path):
    """A failed run's last lines name the checkpoint to resume from. Before: the newest one whose files were there,
    even when one had changed since its save (its CRC32 no longer matching), which the resume then passed over."""
    from types import SimpleNamespace

    from molt_hydra.runtime.entrypoint import _resume_hint

    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt)
    newest = save_checkpoint(tmp_path, 2, model, opt)
    rng = newest / "rng_rank0.pt"
    with zipfile.ZipFile(rng) as archive:  # a byte of the saved RNG state itself: the file still loads
        at = archive.getinfo("archive/data/0").header_offset + 200
    data = bytearray(rng.read_bytes())
    data[at] ^= 0xFF
    rng.write_bytes(bytes(data))
    value = SimpleNamespace
    cfg = value(job=value(value="rl"), checkpoint=value(dir=str(tmp_path)), output_dir="outputs/default/now")
    # the run's directory too: the command run again without it takes a new timestamped one, with no checkpoint
    assert _resume_hint(cfg) == [f"Last checkpoint: {tmp_path / 'step_1'}; resume with checkpoint.resume=auto "
                                 "hydra.run.dir=outputs/default/now"]
