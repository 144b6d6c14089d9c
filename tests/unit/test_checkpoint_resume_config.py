"""A resume under a config changed since the checkpoint's save (runtime/entrypoint.py `_refuse_changed_config`, which
runs before Ray): a key that changes what the run learns from the saved step on is refused, naming the key, both
values and the fix; a longer train.max_steps, logging, parallelism go on, named in one line (with what a longer run
does to a decaying LR schedule). Before, every one of them went on without a word: a changed train.optimizer.lr was
not even applied (the optimizer's param groups and the scheduler's base_lrs, both in the checkpoint, brought the saved
LR back)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from molt_hydra.models.tiny import resolve_model_path
from molt_hydra.parallel.checkpoint import save_checkpoint
from molt_hydra.runtime.entrypoint import EXIT_FAILED, WARM_START, _check_resume
from molt_hydra.runtime.resume_lora import NEW_RUN
from molt_hydra.runtime.run_record import write_run_record
from molt_hydra.runtime.validate import validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

SAVED = ["train.max_steps=4", "train.num_episodes=2", "model.master_weights=fsdp", "train.optimizer.scheduler=cosine"]


def _cfg(tmp_path, *overrides):
    return validate(OmegaConf.to_object(compose_config(
        [*SAVED, f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides], output_dir=str(tmp_path / "out"))))


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.fixture
def saved(tmp_path):
    """A run's step-3 checkpoint (in its second episode), its client state as the RL controller saves it (the run
    record with the config)."""
    model, opt = _trained()
    record = write_run_record(_cfg(tmp_path), tmp_path / "out")
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "loop": {"generator": {"epoch": 1}}, "run_record": record})
    return tmp_path / "ckpt" / "step_3"


@pytest.mark.parametrize("change,named", [
    ("train.optimizer.lr=1e-05", "train.optimizer.lr=1e-05 (saved with 0.002)"),
    ("train.optimizer.warmup_ratio=0.5", "train.optimizer.warmup_ratio=0.5 (saved with 0.0)"),
    ("rollout.batch_size=32", "rollout.batch_size=32 (saved with 8)"),
    ("rollout.n_samples_per_prompt=16", "rollout.n_samples_per_prompt=16 (saved with 8)"),
    ("seed=1", "seed=1 (saved with 42)"),
    ("algorithm.estimator=rloo", "algorithm.estimator=rloo (saved with grpo)"),
    ("model.path=tiny://qwen3_moe_tiny", "model.path=tiny://qwen3_moe_tiny (saved with tiny://qwen3_tiny)"),
    ("model.tokenizer_path=tiny://qwen3_moe_tiny", "model.tokenizer_path=tiny://qwen3_moe_tiny (saved with None)"),
    ("agent.reasoning_parser=qwen3", "agent.reasoning_parser=qwen3 (saved with None)"),
    # the engine's dtype: the behaviour policy's log-probs, so each IS ratio and which tokens the band masks
    ("rollout.dtype=bfloat16", "rollout.dtype=bfloat16 (saved with float32)"),
    ("train.max_steps=2", "train.max_steps=2, but it is at step 3 already (set it to 3 or more)"),
    ("train.num_episodes=1", "train.num_episodes=1, but it is in episode 2 already: no prompt is left (set it "
                             "above 1)"),
], ids=lambda v: str(v).split("=")[0])
def test_a_key_that_changes_the_math_is_refused_before_anything_starts(saved, tmp_path, capsys, change, named):
    cfg = _cfg(tmp_path, "checkpoint.resume=auto", change)
    with pytest.raises(SystemExit) as stop:
        _check_resume(cfg)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == EXIT_FAILED
    assert last.startswith(f"Run failed: {saved} cannot be resumed as saved: ") and named in last, last
    assert last.endswith(f"Fix: set them back (see its run_record.json), or {WARM_START}")


@pytest.mark.parametrize("change,named", [
    # the trainer's forward routes each token to the experts its rollout used, not to its own router's choice
    ("rollout.routing_replay=true", "rollout.routing_replay=True (saved with False)"),
    # the router's top-k on bfloat16 logits: near-ties go to other experts, so other trainer log-probs and gradients
    ("model.gate_precision=bfloat16", "model.gate_precision=bfloat16 (saved with float32)"),
], ids=lambda v: str(v).split("=")[0])
def test_a_routing_change_since_a_moe_runs_save_is_refused(tmp_path, capsys, change, named):
    """Before, each went on named as one more changed key."""
    moe = "model.path=tiny://qwen3_moe_tiny"
    model, opt = _trained()
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "loop": {"generator": {"epoch": 0}},
        "run_record": write_run_record(_cfg(tmp_path, moe), tmp_path / "out")})
    with pytest.raises(SystemExit):
        _check_resume(_cfg(tmp_path, moe, "checkpoint.resume=auto", change))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f": {named}. Fix: set them back" in last, last


def test_an_rl_resume_of_an_sft_runs_checkpoint_is_refused_before_anything_starts(tmp_path, capsys):
    """In the SFT run's output_dir, where checkpoint.resume=never's refusal offers checkpoint.resume=auto. Before:
    every role started, loaded it, then the run failed with 'KeyError: 'loop''."""
    model, opt = _trained()
    path = save_checkpoint(tmp_path / "ckpt", 4, model, opt, client_state={
        "global_step": 4, "master_weights": "fsdp", "consumed_samples": 64, "eval_skipped": False})
    with pytest.raises(SystemExit) as stop:
        _check_resume(_cfg(tmp_path, "checkpoint.resume=auto"))
    assert stop.value.code == EXIT_FAILED
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Run failed: checkpoint.resume=auto: {path} is a job=sft run's checkpoint; job=rl resumes only its own. Fix: "
        f"{WARM_START}, or point checkpoint.dir at a job=rl run's checkpoints")
    assert _check_resume(_cfg(tmp_path, "checkpoint.resume=auto", "checkpoint.load_model_only=true",
                              "checkpoint.save_steps=0"))[0] == path


def test_an_sft_resume_of_an_rl_runs_checkpoint_is_refused(saved, capsys):
    """Before: job=sft went on at the RL run's optimizer step count, with its LR schedule and optimizer state."""
    from types import SimpleNamespace as value

    cfg = value(job=value(value="sft"), model=value(master_weights=value(value="fsdp")), train=value(batch_size=8),
                checkpoint=value(dir=str(saved.parent), resume=value(value="must"), load_model_only=False))
    with pytest.raises(SystemExit):
        _check_resume(cfg)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"Run failed: checkpoint.resume=must: {saved} is a job=rl run's checkpoint; job=sft resumes only its own.")


def test_a_longer_run_and_other_logging_go_on_named_in_one_line(saved, tmp_path, capsys):
    cfg = _cfg(tmp_path, "checkpoint.resume=must", "train.max_steps=8", "logger.tensorboard=true",
               "train.timeouts.step_s=60")
    assert _check_resume(cfg)[0] == saved
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Resuming {saved} with keys changed since its save: logger.tensorboard False -> True, train.max_steps 4 -> 8,"
        " train.timeouts.step_s 3600.0 -> 60.0; the LR schedule (cosine) now spans the new length, so the LR from "
        "step 3 on differs from the saved run's")
    # the saved config: nothing to say; a warm start (its weights alone, from step 0): whatever changed
    for same in (_cfg(tmp_path, "checkpoint.resume=auto"),
                 _cfg(tmp_path, "checkpoint.resume=auto", "checkpoint.load_model_only=true", "seed=1",
                      "checkpoint.save_steps=0")):
        assert _check_resume(same)[0] == saved
        assert "changed" not in capsys.readouterr().err


def test_keys_molt_hydra_added_or_removed_since_the_save_go_on_named(tmp_path, capsys):
    """A checkpoint saved by an earlier molt_hydra, resumed by one whose schema has a key more (here algorithm.gamma)
    and one less. Before: refused as 'algorithm.gamma=1.0 (saved with None)', whose fix, setting it back, no value
    can follow: no checkpoint of an earlier version could be resumed once a key of the math was added."""
    model, opt = _trained()
    record = write_run_record(_cfg(tmp_path), tmp_path / "out")
    del record["config"]["algorithm"]["gamma"]
    record["config"]["train"]["retired_knob"] = 3
    path = save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "loop": {"generator": {"epoch": 1}}, "run_record": record})
    assert _check_resume(_cfg(tmp_path, "checkpoint.resume=auto"))[0] == path
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Resuming {path} with keys changed since its save: algorithm.gamma (no such key) -> 1.0, "
        "train.retired_knob 3 -> (no such key)")


def test_resume_auto_with_no_checkpoint_says_it_starts_from_step_0(tmp_path, capsys):
    """The usual way to miss one: a new invocation's output_dir is a new timestamped directory (hydra.run.dir), and
    the default checkpoint.dir is under it."""
    assert _check_resume(_cfg(tmp_path, "checkpoint.resume=auto"))[0] is None
    assert capsys.readouterr().err.strip().splitlines() == [
        f"checkpoint.resume=auto: no checkpoint under checkpoint.dir={tmp_path / 'ckpt'}, so the run starts from step 0"
        " (to go on from a run, set checkpoint.dir, or output_dir, to its)"]


def test_a_checkpoint_without_its_config_is_resumed_saying_so(tmp_path, capsys):
    model, opt = _trained()
    path = save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={"master_weights": "fsdp", "rl_step": 3})
    assert _check_resume(_cfg(tmp_path, "checkpoint.resume=auto", "seed=1"))[0] == path
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Resuming {path}, saved before checkpoints recorded their config: keys changed since are not checked")



@pytest.fixture
def finished(tmp_path):
    """A finished run's last checkpoint, step 4 of train.max_steps=4 (its loop state as the RL controller saves it)."""
    model, opt = _trained()
    record = write_run_record(_cfg(tmp_path), tmp_path / "out")
    return save_checkpoint(tmp_path / "ckpt", 4, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 4, "loop": {"generator": {"epoch": 1}}, "run_record": record})


def _started_nothing(monkeypatch):
    """entrypoint.run's starts past the resume check (the model's build, Ray) as a recorded failure."""
    from molt_hydra.models import build
    from molt_hydra.runtime import entrypoint

    started = []
    monkeypatch.setattr(build, "resolve_path", lambda path, weights=True: started.append(path) or path)
    monkeypatch.setattr(entrypoint, "ray_cluster", lambda *a: pytest.fail("Ray was started"))
    return started, entrypoint


def test_a_resume_with_no_step_left_says_so_and_starts_nothing(finished, tmp_path, capsys, monkeypatch):
    """Before: every role started, nothing was trained, step 4 was saved and exported again. Where the run ended
    between its last save and its export (Slurm's notice at its last step, the export killed: none, or an earlier
    shorter run's), the resume still goes on, to export it."""
    started, entrypoint = _started_nothing(monkeypatch)
    export = tmp_path / "out" / "hf_final"
    for _ in ("missing", "older"):
        with pytest.raises(pytest.fail.Exception, match="Ray was started"):
            entrypoint.run(_cfg(tmp_path, "checkpoint.resume=auto"))
        assert started.pop() == "tiny://qwen3_tiny"
        export.mkdir(exist_ok=True)
        os.utime(export, (0, 0))
    os.utime(export)  # its export, written after its last save
    entrypoint.run(_cfg(tmp_path, "checkpoint.resume=auto"))
    assert started == []
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"Nothing left to run: {finished} is at step 4, train.max_steps=4, exported to {export}; nothing was "
        "trained, saved or exported. To train further, raise train.max_steps.")
    entrypoint.run(_cfg(tmp_path, "checkpoint.resume=auto", "checkpoint.export_final=false"))
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"Nothing left to run: {finished} is at step 4, train.max_steps=4; nothing was trained, saved or exported. "
        "To train further, raise train.max_steps.")


def _prompt_file(path: Path, labels: list[str]) -> Path:
    path.write_text("".join(f'{{"prompt": "what is {i} + 1?", "label": "{label}"}}\n'
                            for i, label in enumerate(labels)))
    return path


@pytest.mark.parametrize("changed", [True, False])
def test_a_prompt_file_changed_since_the_save_is_refused_before_ray(changed, tmp_path, capsys, monkeypatch):
    """The same data.train_path, its contents changed since the save (one label fixed): the loop's place in the
    prompts cannot be resumed. Refused, naming both and the fix, before Ray or any role starts (before: once every
    role had started, minutes on GPU, SamplesGenerator.load_state_dict's ValueError). Unchanged, the rows loaded for
    the check are the roles' (no second load)."""
    from molt_hydra.rollout.generator import prompts_fingerprint, refuse_other_prompts
    from molt_hydra.runtime import entrypoint
    from molt_hydra.runtime.roles import _load_rows

    labels = [str(i + 1) for i in range(8)]
    cfg = _cfg(tmp_path, f"data.train_path={_prompt_file(tmp_path / 'prompts.jsonl', labels)}")
    saved = prompts_fingerprint(_load_rows(cfg, scoring=False)[0])
    model, opt = _trained()
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "loop": {"generator": {"epoch": 0, "prompts": saved}},
        "run_record": write_run_record(cfg, tmp_path / "out")})
    if changed:
        _prompt_file(tmp_path / "prompts.jsonl", ["9", *labels[1:]])
    started = []

    async def main(cfg, record, resume_from, shown, notice, rows=None):
        started.append(rows)
        return 0

    from contextlib import nullcontext

    monkeypatch.setattr(entrypoint, "_build_models", lambda cfg: None)  # (the tokenizer _load_rows reads: built)
    monkeypatch.setattr(entrypoint, "ray_cluster", lambda *a: nullcontext())
    monkeypatch.setattr(entrypoint, "_main", main)
    cfg.checkpoint.resume = type(cfg.checkpoint.resume)("auto")
    if not changed:
        entrypoint.run(cfg)
        assert [rows[0] for rows in started] == [_load_rows(cfg, scoring=False)[0]]
        return
    with pytest.raises(SystemExit) as e:
        entrypoint.run(cfg)
    now = prompts_fingerprint(_load_rows(cfg, scoring=False)[0])
    assert (e.value.code, started, now != saved) == (EXIT_FAILED, [], True)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"Run failed: data.train_path={tmp_path / 'prompts.jsonl'}: {tmp_path / 'ckpt' / 'step_3'} was trained on "
        f"other prompts ({saved}) than this run's ({now}); its place in them cannot be resumed. Fix: resume with the "
        "data it was trained on, or start on this data from its weights alone: copy it as step_0 of a new "
        "checkpoint.dir and set checkpoint.load_model_only=true")
    # the generator's own refusal (a role's load) is the same text, from one place
    with pytest.raises(ValueError) as refused:
        refuse_other_prompts(saved, now, str(tmp_path / "ckpt" / "step_3"))
    assert last == f"Run failed: data.train_path={tmp_path / 'prompts.jsonl'}: {refused.value}"


def test_the_checks_before_ray_read_the_client_state_once(tmp_path, monkeypatch):
    """extra_state.pt holds the loop's queued batches (here 4 MB of them). Before: the resume checks before Ray
    (master weights, job, changed config, nothing left, the prompts) each torch.loaded it again, 6 loads in all; now
    the integrity check loads it (resolve_checkpoint) and the client state is read once, for every check."""
    from contextlib import nullcontext

    from molt_hydra.parallel import checkpoint
    from molt_hydra.rollout.generator import prompts_fingerprint
    from molt_hydra.runtime import entrypoint
    from molt_hydra.runtime.roles import _load_rows

    cfg = _cfg(tmp_path, f"data.train_path={_prompt_file(tmp_path / 'prompts.jsonl', ['1'] * 8)}")
    model, opt = _trained()
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "run_record": write_run_record(cfg, tmp_path / "out"),
        "loop": {"generator": {"epoch": 0, "prompts": prompts_fingerprint(_load_rows(cfg, scoring=False)[0])},
                 "queued": [torch.zeros(1 << 20)]}})
    loads, real_load = [], torch.load

    def counted(f, *args, **kwargs):
        loads.append(str(f))
        return real_load(f, *args, **kwargs)

    started = []

    async def main(cfg, record, resume_from, shown, notice, rows=None):
        started.append((resume_from, rows is not None))
        return 0

    monkeypatch.setattr(checkpoint.torch, "load", counted)
    monkeypatch.setattr(entrypoint, "_build_models", lambda cfg: None)  # (the tokenizer _load_rows reads: built)
    monkeypatch.setattr(entrypoint, "ray_cluster", lambda *a: nullcontext())
    monkeypatch.setattr(entrypoint, "_main", main)
    cfg.checkpoint.resume = type(cfg.checkpoint.resume)("auto")
    entrypoint.run(cfg)
    assert started == [(tmp_path / "ckpt" / "step_3", True)]  # every check ran, and passed
    assert loads.count(str(tmp_path / "ckpt" / "step_3" / "extra_state.pt")) == 2, loads


def test_a_warm_start_that_would_save_among_the_runs_steps_it_starts_from_is_refused(saved, tmp_path, capsys):
    """A warm start (checkpoint.load_model_only) counts its steps from 0 again and saves into checkpoint.dir, the
    run's it starts from. Before: it went on; its step_1 replaced that run's, and with that run's newest 3 steps
    there (checkpoint.max_num=3, what retention leaves) retention removed it as soon as it was saved (the driver then
    failed writing its run_record.json into it), and a resume took that run's newest step. Now it is refused before
    anything starts, naming the fix; a copy of the checkpoint as step_0 of a directory of its own goes on, and its
    steps are then this run's."""
    warm = ("checkpoint.resume=auto", "checkpoint.load_model_only=true")
    with pytest.raises(SystemExit) as stop:
        _check_resume(_cfg(tmp_path, *warm))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == EXIT_FAILED
    assert last.startswith(f"Run failed: checkpoint.load_model_only=true: this run starts from {saved}'s weights at "
                           f"step 0, and would save its checkpoints into checkpoint.dir={saved.parent}, among that "
                           "run's (step_3 the newest): "), last
    assert last.endswith(f"Fix: copy it as step_0 of a directory of its own (cp -r {saved} NEW/step_0) and set "
                         "checkpoint.dir=NEW, or save none with checkpoint.save_steps=0; to go on with that run "
                         "itself, checkpoint.load_model_only=false")
    # saving no step but exporting eval's `best` there (it replaced that run's): refused too, the fix saying so
    with pytest.raises(SystemExit):
        _check_resume(_cfg(tmp_path, *warm, "checkpoint.save_steps=0", "eval.data_path=builtin://toy_eval",
                                  "eval.every_steps=1"))
    assert capsys.readouterr().err.strip().endswith(
        "or save none with checkpoint.save_steps=0 checkpoint.best_metric_key=none; to go on with that run itself, "
        "checkpoint.load_model_only=false")
    assert _check_resume(_cfg(tmp_path, *warm, "checkpoint.save_steps=0")) == (saved, None)  # writes nothing there
    import shutil

    own = tmp_path / "own"
    shutil.copytree(saved, own / "step_0")
    cfg = _cfg(tmp_path, *warm, f"checkpoint.dir={own}")
    assert _check_resume(cfg) == (own / "step_0", None)
    model, opt = _trained()
    for step in (1, 2, 3):  # this run's saves (max_num=3): the copy goes first, its own stay
        save_checkpoint(own, step, model, opt, client_state={"rl_step": step}, keep=3)
    assert sorted(p.name for p in own.glob("step_*")) == ["step_1", "step_2", "step_3"]


def test_a_warm_start_restarted_over_its_own_steps_resumes_them_whole(saved, tmp_path, capsys):
    """The same command again (Slurm's requeue) after the warm start saved steps of its own: its newest step is
    resumed whole (loop, optimizer, data position), said in one line. Before: refused as another run's steps (and
    before that, trained again from step 0 over them). Told by the step's record of its run's config; a step another
    run saved there stays refused (the test above)."""
    import shutil

    own, warm = tmp_path / "own", ("checkpoint.resume=auto", "checkpoint.load_model_only=true")
    shutil.copytree(saved, own / "step_0")
    cfg = _cfg(tmp_path, *warm, f"checkpoint.dir={own}")
    model, opt = _trained()
    save_checkpoint(own, 2, model, opt, client_state={  # as the warm start's controller saves it
        "master_weights": "fsdp", "rl_step": 2, "loop": {"generator": {"epoch": 0}},
        "run_record": write_run_record(cfg, tmp_path / "warm_out")})
    capsys.readouterr()
    again = _cfg(tmp_path, *warm, f"checkpoint.dir={own}")
    found, state = _check_resume(again)
    assert (found, state["rl_step"], again.checkpoint.load_model_only) == (own / "step_2", 2, False)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"checkpoint.load_model_only=true: {own / 'step_2'} was saved by this warm start itself (started from its "
        f"weights in checkpoint.dir={own}): resuming it whole, as a restart")


def _sft_cfg(tmp_path, *overrides):
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}\n' * 8)
    return validate(OmegaConf.to_object(compose_config(
        ["job=sft", f"data.train_path={chats}", "data.input_key=messages", "train.batch_size=8",
         "train.micro_batch_size=4", "train.optimizer.scheduler=cosine",
         f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides], output_dir=str(tmp_path / "out"))))


@pytest.fixture
def sft_saved(tmp_path):
    """A job=sft run's step-3 checkpoint, its client state as parallel/sft.py saves it (the run record with the
    config; the trainer adds global_step)."""
    model, opt = _trained()
    record = write_run_record(_sft_cfg(tmp_path), tmp_path / "out")
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "global_step": 3, "consumed_samples": 3 * 8, "total_steps": 3, "run_record": record})
    return tmp_path / "ckpt" / "step_3"


def test_an_sft_resume_under_a_changed_seed_or_lr_is_refused_and_a_longer_one_named(sft_saved, tmp_path, capsys):
    """job=sft: a changed seed reshuffled the epoch's samples past the saved position (some skipped, some seen twice),
    a changed LR was not applied (the checkpoint's optimizer and scheduler brought the saved one back), each without a
    word. Refused as in job=rl; more epochs (its length) go on, named, with what they do to a decaying schedule."""
    with pytest.raises(SystemExit) as stop:
        _check_resume(_sft_cfg(tmp_path, "checkpoint.resume=auto", "seed=1", "train.optimizer.lr=1e-05"))
    assert stop.value.code == EXIT_FAILED
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Run failed: {sft_saved} cannot be resumed as saved: seed=1 (saved with 42); train.optimizer.lr=1e-05 (saved "
        f"with 0.002). Fix: set them back (see its run_record.json), or {WARM_START}")
    assert _check_resume(_sft_cfg(tmp_path, "checkpoint.resume=auto", "train.epochs=2"))[0] == sft_saved
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Resuming {sft_saved} with keys changed since its save: train.epochs 1 -> 2; the LR schedule (cosine) now "
        "spans the new length, so the LR from step 3 on differs from the saved run's")


def test_an_sft_resume_goes_on_over_keys_the_job_never_reads(tmp_path, capsys):
    """job=sft keeps a recipe's rollout.* / algorithm.* / train.max_steps as they are (read by nothing), and its
    command line may not set them: a change of one since the save was refused with 'set them back', which no command
    could do. Now it is named, as any key that changes nothing the run learns."""
    model, opt = _trained()
    saved = ["rollout.temperature=0.7", "algorithm.estimator=rloo", "train.max_steps=1"]
    record = write_run_record(_sft_cfg(tmp_path, *saved), tmp_path / "out")
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "global_step": 3, "consumed_samples": 3 * 8, "total_steps": 3, "run_record": record})
    found, _ = _check_resume(_sft_cfg(tmp_path, "checkpoint.resume=auto"))
    assert found == tmp_path / "ckpt" / "step_3"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"Resuming {found} with keys changed since its save: ") \
        and "rollout.temperature 0.7 -> 1.0" in last, last


def test_an_sft_resume_with_no_step_left_says_so_and_starts_nothing(sft_saved, tmp_path, capsys, monkeypatch):
    """job=sft at the last step of its train.epochs (recorded at the save), exported after it: one line, no rank
    started. Before: the ranks started, trained nothing, evaluated the last step again (a second row of it in
    sft_metrics.jsonl on each such resume) and exported the same weights again. An export missing or older than the
    save, or more train.epochs, still start the ranks."""
    from molt_hydra.runtime import sft_job

    started, entrypoint = _started_nothing(monkeypatch)
    monkeypatch.setattr(sft_job, "run_sft_job", lambda *a: started.append("ranks") or [])
    export = tmp_path / "out" / "hf"
    for _ in ("missing", "older"):
        entrypoint.run(_sft_cfg(tmp_path, "checkpoint.resume=auto"))
        assert started.pop() == "ranks"
        export.mkdir(exist_ok=True)
        os.utime(export, (0, 0))
    os.utime(export)  # its export, written after its last save
    entrypoint.run(_sft_cfg(tmp_path, "checkpoint.resume=auto", "train.epochs=2"))
    assert started.pop() == "ranks"
    entrypoint.run(_sft_cfg(tmp_path, "checkpoint.resume=auto"))
    assert started == []
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"Nothing left to run: {sft_saved} is at step 3, the last of train.epochs=1, exported to {export}; nothing "
        "was trained, saved or exported. To train further, raise train.epochs.")


def _sft_saved(tmp_path, data, *overrides):
    """A job=sft run's step-3 checkpoint of 64-sample steps over `data`, its client state as parallel/sft.py saves it
    (the run record with the config, the training data's identity)."""
    from molt_hydra.data.sft_dataset import data_identity

    sft = ["job=sft", f"data.train_path={data}", "data.input_key=messages", "model.master_weights=fsdp",
           f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides]
    model, opt = _trained()
    record = write_run_record(validate(OmegaConf.to_object(compose_config(sft, output_dir=str(tmp_path / "out")))),
                              tmp_path / "out")
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "global_step": 3, "consumed_samples": 3 * 64, "train_data": data_identity(data),
        "run_record": record})
    return lambda *more: validate(OmegaConf.to_object(compose_config(
        [*sft, "checkpoint.resume=auto", *more], output_dir=str(tmp_path / "out"))))


@pytest.mark.parametrize("change,named", [
    ("seed=1", "seed=1 (saved with 42)"),
    ("data.max_samples=100", "data.max_samples=100 (saved with 100000000)"),
    ("data.max_len=64", "data.max_len=64 (saved with 256)"),
    ("rewritten", None),  # (named below, from the file's bytes)
], ids=lambda v: str(v).split("=")[0])
def test_an_sft_resume_over_other_samples_or_another_order_is_refused(tmp_path, capsys, change, named):
    """job=sft resumes at sample global_step x train.batch_size of a permutation of its samples seeded by `seed`.
    Before: another seed, other data.* settings, or the data file written again at the same path (here: each reply's
    text changed, the size the same) went on in another order or over other samples, repeating and skipping samples
    without a word."""
    import hashlib

    data = tmp_path / "chats.jsonl"

    def write(reply: str) -> str:
        data.write_text("".join(f'{{"messages": [{{"role": "user", "content": "hi {i:02}"}}, {{"role": "assistant", '
                                f'"content": "{reply} {i:02}"}}]}}\n' for i in range(64)))
        return f"{data.stat().st_size} bytes, sha256 {hashlib.sha256(data.read_bytes()).hexdigest()[:16]}"

    saved = write("hello")
    resumed = _sft_saved(tmp_path, data)
    assert _check_resume(resumed())[0].name == "step_3"  # the same data and settings: resumed
    if change == "rewritten":
        named = f"data.train_path={data} holds other data ({write('howdy')}) than at the save ({saved})"
    with pytest.raises(SystemExit) as stop:
        _check_resume(resumed(*([] if change == "rewritten" else [change])))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == EXIT_FAILED
    assert last.startswith(f"Run failed: {tmp_path / 'ckpt' / 'step_3'} cannot be resumed as saved: ") and named in \
        last, last
    assert last.endswith(f"Fix: put the saved data back at that path, or {WARM_START}" if change == "rewritten" else
                         f"Fix: set them back (see its run_record.json), or {WARM_START}")


def test_a_warm_start_across_a_lora_adapter_is_refused_before_anything_starts(saved, tmp_path, capsys):
    """A warm start loads the checkpoint's weights by name, and a LoRA run's engines serve model.path's base and get
    only the adapter. Before: LoRA over a full fine-tuning checkpoint (the warm start a refused resume under
    model.lora.rank suggests), full weights over an adapter, or an adapter of another rank started every role, and
    each trainer rank failed on 'Missing key in checkpoint state_dict: ...base_layer.weight' (or a size mismatch),
    told to move the checkpoint aside as damaged. Now each is refused before anything starts, naming the fix; the
    same adapter goes on."""
    import shutil

    def warm_start(step: Path, *overrides) -> str:
        own = tmp_path / f"own{len(list(tmp_path.glob('own*')))}"
        shutil.copytree(step, own / "step_0")
        with pytest.raises(SystemExit) as stop:
            _check_resume(_cfg(tmp_path, "checkpoint.resume=auto", "checkpoint.load_model_only=true",
                               f"checkpoint.dir={own}", *overrides))
        assert stop.value.code == EXIT_FAILED
        return capsys.readouterr().err.strip().splitlines()[-1]

    last = warm_start(saved, "model.lora.rank=8")
    assert last.startswith(f"Run failed: checkpoint.load_model_only=true: {tmp_path}/own0/step_0 holds full weights "
                           "(saved with model.lora.rank=null), and a LoRA run's engines serve model.path's base"), last
    # (a new run: a warm start from the export would load this checkpoint's weights again, and be refused again)
    assert last.endswith("Fix: turn LoRA off (model.lora.rank=null), or set model.path to its HF export "
                         f"(checkpoint.export_dir, or checkpoint.save_hf's <checkpoint.dir>/hf/step_N) {NEW_RUN}")
    # a LoRA run's step (its record says so) under full weights, and under another rank
    model, opt = _trained()
    record = write_run_record(_cfg(tmp_path, "model.lora.rank=8"), tmp_path / "lora_out")
    save_checkpoint(tmp_path / "lora", 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "loop": {"generator": {"epoch": 1}}, "run_record": record})
    lora_step = tmp_path / "lora" / "step_3"
    assert "step_0 holds a LoRA adapter (saved with model.lora.rank=8), which does not load into the full weights " \
           "this run trains. Fix: set model.lora.rank, model.lora.target_modules and model.path as saved, or set " \
           "model.path to its merged export" in warm_start(lora_step)
    assert ("step_0 holds an adapter of rank 8 on the family default over model.path=tiny://qwen3_tiny; this run's is "
            "rank 16 on the family default over tiny://qwen3_tiny") in warm_start(lora_step, "model.lora.rank=16")
    own = tmp_path / "same"
    shutil.copytree(lora_step, own / "step_0")
    assert _check_resume(_cfg(tmp_path, "checkpoint.resume=auto", "checkpoint.load_model_only=true",
                              f"checkpoint.dir={own}", "model.lora.rank=8", "model.lora.alpha=32")) == \
        (own / "step_0", None)


@pytest.fixture
def lora_saved(tmp_path):
    """A LoRA run's step-3 checkpoint (rank 8; alpha and targets left to their defaults)."""
    model, opt = _trained()
    save_checkpoint(tmp_path / "ckpt", 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "loop": {"generator": {"epoch": 1}},
        "run_record": write_run_record(_cfg(tmp_path, "model.lora.rank=8"), tmp_path / "out")})
    return tmp_path / "ckpt" / "step_3"


def _refusal(cfg, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        _check_resume(cfg)
    assert stop.value.code == EXIT_FAILED
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_resume_spelling_out_the_lora_defaults_is_the_same_run(lora_saved, tmp_path, capsys):
    """model.lora as the trainer takes it: alpha null is 2 x rank, target_modules null the family's default (in any
    order: PEFT matches them as a set). Before: a resume (or warm start) that spelled either out was refused as a
    changed model.lora; another target set is still refused, naming the targets the saved run trained."""
    from molt_hydra.models.lora import FAMILIES

    default = FAMILIES["qwen3"][0]
    spelled = ("model.lora.rank=8", "model.lora.alpha=16", f"model.lora.target_modules=[{','.join(default[::-1])}]")
    found, state = _check_resume(_cfg(tmp_path, "checkpoint.resume=auto", *spelled))
    assert found == lora_saved and state["rl_step"] == 3
    assert "Resuming" not in capsys.readouterr().err  # (no key named as changed)
    own = tmp_path / "own"
    shutil.copytree(lora_saved, own / "step_0")
    assert _check_resume(_cfg(tmp_path, "checkpoint.resume=auto", "checkpoint.load_model_only=true",
                              f"checkpoint.dir={own}", *spelled)) == (own / "step_0", None)
    last = _refusal(_cfg(tmp_path, "checkpoint.resume=auto", "model.lora.rank=8",
                         "model.lora.target_modules=[v_proj,q_proj]"), capsys)
    assert f"model.lora.target_modules=['q_proj', 'v_proj'] (saved with {sorted(default)})" in last, last


def test_a_resume_under_another_adapter_names_a_fix_that_starts(lora_saved, tmp_path, capsys):
    """A resume of a LoRA run under another rank (or of a full fine-tuning run under LoRA) is refused. Before: its fix
    was a warm start from the checkpoint's weights (checkpoint.load_model_only=true), which is refused for just that
    (an adapter loads only into one of its shape); now it names the new run from an export that starts."""
    last = _refusal(_cfg(tmp_path, "checkpoint.resume=auto", "model.lora.rank=16"), capsys)
    assert last.startswith(f"Run failed: {lora_saved} cannot be resumed as saved: model.lora.alpha=32.0 (saved with "
                           "16.0); model.lora.rank=16 (saved with 8). "), last  # (alpha null: 2 x rank)
    assert last.endswith("Fix: set them back (see its run_record.json), or set model.path to its merged export "
                         f"(<checkpoint.export_dir>/merged, checkpoint.export_merged=true) {NEW_RUN} to train a new "
                         "adapter on it"), last
    full = tmp_path / "full"  # a full fine-tuning run's step, resumed under LoRA
    model, opt = _trained()
    save_checkpoint(full, 3, model, opt, client_state={
        "master_weights": "fsdp", "rl_step": 3, "loop": {"generator": {"epoch": 1}},
        "run_record": write_run_record(_cfg(tmp_path), tmp_path / "full_out")})
    assert _refusal(_cfg(tmp_path, "checkpoint.resume=auto", f"checkpoint.dir={full}", "model.lora.rank=8"),
                    capsys).endswith(f"<checkpoint.dir>/hf/step_N) {NEW_RUN}")
    # the fix as named (the tiny model's directory standing for the export) starts, at step 0
    export = resolve_model_path("tiny://qwen3_tiny")
    assert _check_resume(_cfg(tmp_path, "checkpoint.resume=auto", f"checkpoint.dir={tmp_path / 'new'}",
                              "checkpoint.load_model_only=false", f"model.path={export}", "model.lora.rank=16")) == \
        (None, None)


def test_an_sft_resume_past_the_last_step_of_fewer_epochs_is_refused_before_any_rank_starts(tmp_path, capsys):
    """A job=sft run of train.epochs=2 over 3 steps an epoch (its last step, 6, as the save records it), saved at step
    5, resumed with train.epochs=1 (3 steps): refused naming the steps, before any rank starts. Before: named as a
    change the resume goes on with ("train.epochs 2 -> 1"), then every rank loaded the model and the checkpoint and
    refused it (parallel/sft.py `_resume`)."""
    model, opt = _trained()
    record = write_run_record(_sft_cfg(tmp_path, "train.epochs=2"), tmp_path / "out")
    per_epoch = 3  # as parallel/sft.py counts them: ceil(epochs x steps per epoch) is the run's last step
    save_checkpoint(tmp_path / "ckpt", 5, model, opt, client_state={
        "master_weights": "fsdp", "global_step": 5, "consumed_samples": 5 * 8, "total_steps": 2 * per_epoch,
        "run_record": record})
    with pytest.raises(SystemExit) as stop:
        _check_resume(_sft_cfg(tmp_path, "checkpoint.resume=auto", "train.epochs=1"))
    assert stop.value.code == EXIT_FAILED
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Run failed: {tmp_path / 'ckpt' / 'step_5'} cannot be resumed as saved: train.epochs=1 makes 3 steps of 3 "
        f"per epoch, but it is at step 5 already (set it to 2 or more). Fix: set them back (see its run_record.json), "
        f"or {WARM_START}")
    assert _check_resume(_sft_cfg(tmp_path, "checkpoint.resume=auto", "train.epochs=3"))[0].name == "step_5"
