"""job=sft's rank loop (parallel/sft.py) on Slurm's notice and on a damaged checkpoint, as the RL run's
(test_preemption.py, test_resume_faults.py): one rank in this process (as under torchrun: real FSDP2 over gloo, the
tiny model, real checkpoint files). The notice through `molt-run` (signal, save, exit 130, resume) is the slow test at
the end; the notice's handler alone: tests/unit/test_preemption_notice.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from molt_hydra.config.schema import EXIT_INTERRUPTED
from molt_hydra.parallel.checkpoint import resolve_checkpoint
from molt_hydra.parallel.launch import free_port
from molt_hydra.parallel.sft import STOP, STOPPED, run_sft

pytestmark = pytest.mark.timeout(300)
MOLT_RUN = str(Path(sys.executable).with_name("molt-run"))


def rows(n: int) -> list[dict]:
    rng = random.Random(0)
    return [{"input": [{"role": "user", "content": f"What is {a}+{b}?"}], "output": f"It is {a + b}."}
            for a, b in ((rng.randint(0, 20), rng.randint(0, 20)) for _ in range(n))]


# 6 rows in batches of 2: 3 steps, one micro-batch each
SMALL = dict(input_key="input", output_key="output", batch_size=2, lr=3e-3, num_ranks=1, lr_warmup_ratio=0.0,
             max_tokens_per_micro_batch=1024, max_len=64, timeout_s=120, param_dtype="fp32", export_hf=False)
EVALS = dict(eval_data=rows(2), eval_steps=1)  # an eval at every step's end


@pytest.fixture
def one_rank(monkeypatch):
    """run_sft runs its one rank in this process (as torchrun's ranks do); a process group a failure left is ended."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield lambda: monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if dist.is_initialized():
        dist.destroy_process_group()


def sft(one_rank, out: Path, **kw) -> list[dict]:
    one_rank()
    return run_sft("tiny://qwen3_tiny", rows(6), str(out), ckpt_path=str(out / "ckpt"), **{**SMALL, **kw})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Three steps without a stop, an eval and a checkpoint after each."""
    out = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RANK", "0")
        mp.setenv("WORLD_SIZE", "1")
        mp.setenv("MASTER_PORT", str(free_port()))
        history = run_sft("tiny://qwen3_tiny", rows(6), str(out), ckpt_path=str(out / "ckpt"), save_steps=1,
                          **SMALL, **EVALS)
    assert [r["global_step"] for r in history] == [1, 2, 3]
    return out / "ckpt", [r["sft_loss"] for r in history], [r["eval sft_loss"] for r in history]


def test_the_ranks_save_the_step_under_way_on_the_notice_and_the_resume_goes_on_exactly(straight, one_rank,
                                                                                           tmp_path):
    """`stop` set (the driver's handler of the notice sets it while step 1 trains): step 1 ends, is saved although
    save_steps=-1 saves only at the end, and the ranks return without the final export, leaving STOPPED. Before,
    job=sft had no stop: the notice killed it (or submitit requeued it at once) and the requeued run began at step 0.
    The eval due at step 1 waits for the resume (the grace after the notice is short: the save first), which runs it
    first, as the RL loop does; before, it ran ahead of the save."""
    stop = multiprocessing.get_context("spawn").Value("i", STOP, lock=False)
    first = sft(one_rank, tmp_path, save_steps=-1, stop=stop, export_hf=True, **EVALS)
    assert [r["global_step"] for r in first] == [1] and stop.value == STOPPED
    assert "eval sft_loss" not in first[0]  # skipped: the save came first
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_1"]
    assert not (tmp_path / "hf").exists()  # not the end of training: no export
    rest = sft(one_rank, tmp_path, save_steps=-1, resume=True, stop=multiprocessing.Value("i", 0, lock=False),
               **EVALS)
    assert [r["global_step"] for r in rest] == [1, 2, 3]  # step 1's skipped eval, then steps 2 and 3
    assert "sft_loss" not in rest[0] and _steps(tmp_path) == [1, 1, 2, 3]  # (its record in sft_metrics.jsonl too)
    assert [r["eval sft_loss"] for r in rest] == pytest.approx(straight[2], rel=1e-5)
    assert [r["sft_loss"] for r in first + rest[1:]] == pytest.approx(straight[1], rel=1e-5)


def _change_a_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # its length kept: only the CRC32 the load checks can tell
    shard.write_bytes(bytes(data))


def test_a_damaged_shard_of_the_newest_checkpoint_is_passed_over_for_the_one_before(straight, one_rank, tmp_path,
                                                                                     capfd):
    """The run's resume check chose step_3 (it reads the small files only); the load finds its shard changed. Before:
    'Run failed: sft trainer rank 0: DamagedCheckpoint: reading .../step_3 failed', though step_2 was there."""
    shutil.copytree(straight[0], tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "step_3"
    _change_a_byte(newest / "dcp" / "__0_0.distcp")
    history = sft(one_rank, tmp_path, resume=True, resume_step="step_3")
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("Checkpoint passed over")]
    assert len(lines) == 1 and lines[0].startswith(f"Checkpoint passed over: {newest}: dcp/__0_0.distcp: CRC32 ")
    assert lines[0].endswith(f"(its bytes changed since the save); resuming from {tmp_path / 'ckpt' / 'step_2'} "
                             "instead"), lines
    assert [r["global_step"] for r in history] == [3]
    assert history[0]["sft_loss"] == pytest.approx(straight[1][2], rel=1e-5)  # step 3 again, from step 2's state
    assert resolve_checkpoint(tmp_path / "ckpt", checksums=True) == newest  # saved again in its place


def test_a_resume_drops_the_rows_the_interrupted_attempt_logged_past_its_checkpoint(straight, one_rank, tmp_path,
                                                                                     capfd):
    """The interrupted attempt logged steps 1-3 (and was killed writing the next row); its last checkpoint is step_2.
    The resume logs step 3 again: its row replaces the attempt's, and the torn row goes, each with a line, as an RL
    run's metrics.jsonl (logging/sinks.py). Before: sft_metrics.jsonl only appended: step 3 twice, after the torn
    row glued to it."""
    shutil.copytree(straight[0], tmp_path / "ckpt", ignore=shutil.ignore_patterns("step_3", "latest"))
    logged = (straight[0].parent / "sft_metrics.jsonl").read_text().splitlines()
    path = tmp_path / "sft_metrics.jsonl"
    path.write_text("".join(line + "\n" for line in logged) + logged[-1][:20])
    history = sft(one_rank, tmp_path, resume=True, **EVALS)
    assert [r["global_step"] for r in history] == [3]
    assert path.read_text().splitlines() == [*logged[:2], json.dumps(history[0])]
    out, err = capfd.readouterr()
    assert f"{path}: 1 row(s) past step 2 dropped (the interrupted run's; logged again)" in out
    assert f"{path}: 1 unreadable row(s) dropped on resume (a write the stop cut short)" in err


def test_a_run_from_step_0_moves_an_earlier_runs_metrics_aside(straight, one_rank, tmp_path, capfd):
    """A run with no checkpoint to go on from (a new checkpoint.dir) in an output_dir an earlier run logged to starts
    at step 0: the earlier sft_metrics.jsonl is moved aside whole, named after its last write, with a line, as an RL
    run's metrics.jsonl. So is it for a start from a checkpoint's weights only (load_model_only: step 0 again).
    Before: the new rows went on after the earlier run's (steps 1, 2, 3 twice)."""
    import calendar

    logged = (straight[0].parent / "sft_metrics.jsonl").read_text()
    path = tmp_path / "sft_metrics.jsonl"
    path.write_text(logged)
    last_write = calendar.timegm((2026, 12, 6, 12, 0, 0))
    os.utime(path, (last_write, last_write))
    first = sft(one_rank, tmp_path, resume=True)
    aside = tmp_path / "sft_metrics.earlier-20261206T120000Z.jsonl"
    assert aside.read_text() == logged
    assert [json.loads(line) for line in path.read_text().splitlines()] == first
    assert [r["global_step"] for r in first] == [1, 2, 3]
    assert (f"{tmp_path}: an earlier run's metrics moved aside to {aside.name}; this run starts at step 0\n"
            in capfd.readouterr().out)
    os.utime(path, (last_write, last_write))  # its last write that second too: the next name is taken
    again = sft(one_rank, tmp_path, resume=True, load_model_only=True)  # step_3's weights, from step 0
    second = tmp_path / "sft_metrics.earlier-20261206T120000Z-2.jsonl"
    assert [json.loads(line) for line in second.read_text().splitlines()] == first
    assert [json.loads(line) for line in path.read_text().splitlines()] == again
    assert aside.read_text() == logged


def test_a_resume_past_the_runs_last_step_is_refused_naming_the_epochs(straight, one_rank, tmp_path):
    """The checkpoint is at step 3 of 3 (one epoch of 3 steps); this run's train.epochs=0.5 makes 2 steps. Before:
    nothing was trained and step 3's weights were exported as the half-epoch run's, exit 0, without a word (job=rl
    refuses a train.max_steps below its checkpoint's step). Nothing is written: no row, no export."""
    shutil.copytree(straight[0], tmp_path / "ckpt")
    with pytest.raises(ValueError) as e:
        sft(one_rank, tmp_path, resume=True, max_epochs=0.5, export_hf=True)
    from molt_hydra.config.schema import WEIGHTS_ALONE

    assert str(e.value) == ("train.epochs=0.5 makes 2 steps of 3 per epoch, but the checkpoint resumed is at step 3 "
                            f"already. Fix: set train.epochs to 1 or more, or {WEIGHTS_ALONE}")
    assert _steps(tmp_path) == [] and not (tmp_path / "hf").exists()
    assert [r["global_step"] for r in sft(one_rank, tmp_path, resume=True, max_epochs=1)] == []  # at its end: none
    from molt_hydra.parallel.checkpoint import saved_client_state

    # each save records the run's last step: a resume at it starts no rank (runtime/entrypoint.py _nothing_left)
    assert [saved_client_state(straight[0] / f"step_{n}")["total_steps"] for n in (1, 2, 3)] == [3, 3, 3]


def _steps(out: Path) -> list[int]:
    path = out / "sft_metrics.jsonl"
    return [json.loads(line)["global_step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # ~1.5 min: two molt-run jobs
def test_molt_run_sft_saves_the_step_under_way_on_the_notice_and_resumes_from_it(tmp_path):
    """The notice sent, as Slurm sends it, to every process of the job (the driver and its 2 ranks): the ranks live
    on, end the step under way, save it; the run exits 130 naming that step; a resume goes on from it. Before: every
    process died of the signal (exit -12), nothing saved (under submitit: requeued at once, from step 0)."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [r["input"][0], {"role": "assistant", "content": r["output"]}]})
                            + "\n" for r in rows(400)))
    out = tmp_path / "run"
    args = [MOLT_RUN, "job=sft", f"data.train_path={data}", "data.input_key=messages", "train.batch_size=4",
            "train.micro_batch_size=2", f"hydra.run.dir={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    err = _stopped_on_notice(args, out, env)
    saved = _steps(out)[-1]
    assert 2 <= saved < 100, saved
    assert err.rstrip().splitlines()[-1] == (f"Run stopped on SIGUSR2 (a time limit or a preemption): checkpoint "
                                             f"saved at step {saved}; resume with checkpoint.resume=auto "
                                             f"hydra.run.dir={out}."), err[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{saved}"]
    assert not list(out.rglob("model.safetensors"))  # not the end of training: no export

    resumed = subprocess.run([*args, "checkpoint.resume=auto"], capture_output=True, text=True, env=env, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out) == list(range(1, 101))  # from the saved step on to the end (100 steps), exported there
    assert list(out.rglob("model.safetensors"))


def _stopped_on_notice(args: list[str], out: Path, env: dict) -> str:
    """`molt-run args`, sent Slurm's notice once it trained 2 steps; returns its stderr, once it exited 130."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while len(_steps(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None and len(_steps(out)) >= 2, "the run ended or did not train in 240 s"
    os.killpg(proc.pid, signal.SIGUSR2)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    return err


@pytest.mark.slow  # ~1.5 min: two molt-run jobs
def test_a_warm_start_requeued_on_the_notice_resumes_its_own_step_whole(straight, tmp_path):
    """An SFT warm start (checkpoint.load_model_only=true from a copy as step_0 of its own checkpoint.dir, as the fix
    of a warm start among another run's steps says) stopped by Slurm's notice, then requeued: the same command again
    resumes the step it saved, whole, and trains on to the end. Before: SFT's checkpoints held no run record, so the
    requeued job was refused as a warm start among another run's steps (exit 4) and a preempted SFT job never
    finished."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [r["input"][0], {"role": "assistant", "content": r["output"]}]})
                            + "\n" for r in rows(400)))
    out, own = tmp_path / "run", tmp_path / "own"
    shutil.copytree(straight[0] / "step_3", own / "step_0")  # another run's weights (tiny://qwen3_tiny, as here)
    args = [MOLT_RUN, "job=sft", f"data.train_path={data}", "data.input_key=messages", "train.batch_size=4",
            "train.micro_batch_size=2", f"hydra.run.dir={out}", f"checkpoint.dir={own}",
            "checkpoint.load_model_only=true", "checkpoint.resume=auto"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    _stopped_on_notice(args, out, env)
    saved = _steps(out)[-1]
    assert sorted(p.name for p in own.glob("step_*")) == ["step_0", f"step_{saved}"]

    requeued = subprocess.run(args, capture_output=True, text=True, env=env, timeout=400)  # the same command
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert (f"checkpoint.load_model_only=true: {own / f'step_{saved}'} was saved by this warm start itself (started "
            f"from its weights in checkpoint.dir={own}): resuming it whole, as a restart") in requeued.stderr
    assert _steps(out) == list(range(1, 101))  # from the saved step on to the end (100 steps), not from 0 again
    assert list(out.rglob("model.safetensors"))
