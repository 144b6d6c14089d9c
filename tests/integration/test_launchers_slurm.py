"""Sweeps on a real Slurm (launchers/local_slurm.sh: nodes n1, n2 on loopback) through real submitit, with real Ray
formed inside the allocation. The cluster is started by the session fixture and stopped after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
from omegaconf import OmegaConf

from molt_hydra.config.schema import ClusterConfig
from slurm_cluster import REPO, sacct, slurm_cluster, submitit_executor  # noqa: F401 - the fixture

pytestmark = pytest.mark.slurm
# the job functions below travel to the Slurm job by value: this test module is not importable there
cloudpickle.register_pickle_by_value(sys.modules[__name__])
MOLT_RUN = str(Path(sys.executable).with_name("molt-run"))
MOLT_REPORT = str(Path(sys.executable).with_name("molt-report"))


def _molt(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([MOLT_RUN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _array_id(sweep: Path) -> str:
    ids = {p.name.split("_")[0] for p in (sweep / ".submitit").iterdir() if "_" in p.name and p.is_dir()}
    assert len(ids) == 1, ids
    return ids.pop()


def _point_dirs(sweep: Path) -> list[Path]:
    return sorted(p.parent.parent for p in sweep.glob("*/.hydra/overrides.yaml"))


def test_sweep_points_run_as_slurm_jobs(slurm_cluster, tmp_path):
    """Two points -> one Slurm array job of two tasks (dry_run: composing, validating and planning inside the job)."""
    sweep = tmp_path / "sweep"
    r = _molt(["-m", "+recipe=tiny_cpu", "cluster=slurm", "algorithm.estimator=grpo,rloo", "dry_run=true",
               f"hydra.sweep.dir={sweep}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    array = _array_id(sweep)
    rows = sacct(array, until=lambda rows: len(rows) == 2 and all(r[-1]["State"] == "COMPLETED" for r in rows.values()))
    assert {jid: recs[-1]["State"] for jid, recs in rows.items()} == {f"{array}_0": "COMPLETED",
                                                                       f"{array}_1": "COMPLETED"}
    assert {recs[-1]["JobName"] for recs in rows.values()} == {"tiny_cpu"}
    # the job's sbatch lines come from cluster.* through conf/hydra/launcher/molt_slurm.yaml
    script = (sweep / ".submitit" / array / f"{array}_submission.sh").read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --cpus-per-task=2", "#SBATCH --time=60", "#SBATCH --signal=USR2@120"):
        assert line in script
    assert "srun --unbuffered" in script and "--nodes=1 --ntasks=1" in script
    dirs = _point_dirs(sweep)
    assert [d.name.split("_")[0] for d in dirs] == ["0", "1"]
    for d, est in zip(dirs, ("grpo", "rloo")):
        cfg = OmegaConf.load(d / ".hydra" / "config.yaml")
        launcher = OmegaConf.load(d / ".hydra" / "hydra.yaml").hydra.launcher._target_
        assert cfg.algorithm.estimator == est and launcher.endswith("SlurmLauncher") and cfg.checkpoint.resume == "auto"
    rep = subprocess.run([MOLT_REPORT, str(sweep)], capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    lines = rep.stdout.splitlines()
    assert lines[2].split()[:3] == ["0", "algorithm.estimator=grpo", "completed"]
    assert lines[3].split()[:3] == ["1", "algorithm.estimator=rloo", "completed"]
    assert (sweep / "report_train_reward.png").read_bytes()[:4] == b"\x89PNG"


def test_request_slurm_refuses_is_a_config_error(slurm_cluster, tmp_path):
    """More CPUs than a node has: sbatch refuses at once (local_slurm.sh: EnforcePartLimits=ALL); the sweep says so
    as a config error with the keys asked for and the partitions there are. Before: submitit's traceback."""
    r = _molt(["-m", "+recipe=tiny_cpu", "cluster=slurm", "cluster.cpus_per_node=8", "dry_run=true",
               f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    error = r.stderr[r.stderr.index("Config error(s):"):]
    assert "Slurm refused the sweep's job" in error and "cluster.nodes=1, cluster.cpus_per_node=8" in error
    assert "Fix:" in error and "\ndebug* up 2 2 " in error  # the partition: 2 nodes of 2 CPUs


def test_a_bad_point_refuses_the_sweep_before_anything_is_submitted(slurm_cluster, tmp_path):
    """The middle point of three is a config error: the whole sweep is refused naming the point and the key, and
    nothing is submitted (no sweep directory, no Slurm job). Before: all three were submitted and the middle one
    failed in its job, checked only there."""
    sweep = tmp_path / "sweep"
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    r = _molt(["-m", "+recipe=tiny_cpu", "cluster=slurm", "dry_run=true", "algorithm.estimator=grpo,nosuch,rloo",
               f"hydra.sweep.dir={sweep}"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines()[:2] == ["Config error(s):", "sweep point #1 of 3 (+recipe=tiny_cpu cluster=slurm "
                                         f"dry_run=True algorithm.estimator=nosuch hydra.sweep.dir={sweep}):"]
    assert r.stderr.splitlines()[2].startswith("- algorithm.estimator: 'nosuch' is not a registered estimator")
    assert not sweep.exists() and "Traceback" not in r.stderr
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout == before


def test_a_refusal_caused_by_a_launcher_key_names_it(slurm_cluster, tmp_path):
    """More memory than a node has, asked for through hydra.launcher.mem_gb: the refusal names that key and its fix.
    Before: it listed the cluster.* keys only (cluster.nodes=1, cluster.cpus_per_node=2, cluster.time_min=60), none
    of which was the cause."""
    r = _molt(["-m", "+recipe=tiny_cpu", "cluster=slurm", "seed=1,2", "dry_run=true", "hydra.launcher.mem_gb=100000",
               f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    error = r.stderr[r.stderr.index("Config error(s):"):]
    assert "(sbatch: error: Batch job submission failed: Requested node configuration is not available); asked for " \
           "cluster.nodes=1, cluster.cpus_per_node=2, cluster.time_min=60, hydra.launcher.mem_gb=100000. Fix: " in error
    assert "; or change or drop hydra.launcher.mem_gb. Partitions:\n" in error and "Traceback" not in r.stderr


def test_failed_point_is_named_and_the_others_run(slurm_cluster, tmp_path):
    """The middle point of three is cancelled while pending (held here; behind array_parallelism alike): it leaves
    squeue at once and never reaches sacct. Every point is waited for; the dropped one is named with its overrides,
    job and why; the sweep ends with exit 4. Before: submitit's state for it stayed UNKNOWN, and molt-run -m waited
    for ever."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([MOLT_RUN, "-m", "+recipe=tiny_cpu", "cluster=slurm", "dry_run=true",
                             "algorithm.estimator=grpo,dr_grpo,rloo", "+hydra.launcher.additional_parameters.hold=true",
                             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not (sweep / ".submitit").is_dir() or not any(p.name.isdigit() for p in (sweep / ".submitit").iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        array = _array_id(sweep)
        subprocess.run(["scancel", f"{array}_1"], check=True)
        subprocess.run(["scontrol", "release", array], check=True)
    except BaseException:
        proc.kill()
        subprocess.run(["scancel", *(p.name for p in (sweep / ".submitit").glob("*") if p.name.isdigit())])
        raise
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 4, err[-3000:]
    assert "Traceback" not in err
    assert f"sweep point #1 (+recipe=tiny_cpu cluster=slurm dry_run=True algorithm.estimator=dr_grpo): Slurm job " \
           f"{array}_1 UNKNOWN; no log (it never started):\n" in err, err[-3000:]
    assert "    Slurm dropped it without a result (no longer queued, no accounting record): an array task cancelled " \
           "before it started" in err
    assert err.strip().splitlines()[-1].startswith(f"Run failed: sweep {sweep}: 1 of 3 point(s) failed")
    assert "sweep point #0" not in err and "sweep point #2" not in err
    rows = sacct(array, until=lambda rows: len(rows) == 3)
    assert {jid: recs[-1]["State"] for jid, recs in rows.items()} == {f"{array}_0": "COMPLETED",
                                                                       f"{array}_2": "COMPLETED"}


def test_interrupting_the_waiting_front_names_the_points_still_running(slurm_cluster, tmp_path):
    """SIGTERM (or Ctrl-C) to `molt-run -m` while it waits on its Slurm points: it says they keep running and how to
    reach them, exit 130; they do complete. Before: 'Interrupted before the run started.'"""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([MOLT_RUN, "-m", "+recipe=tiny_cpu", "cluster=slurm", "dry_run=true",
                             "algorithm.estimator=grpo,rloo", f"hydra.sweep.dir={sweep}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (sweep / ".submitit").is_dir() or not any(p.name[:1].isdigit() for p in (sweep / ".submitit").iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(1)  # past the submission, into the waiting
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    array = _array_id(sweep)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"Interrupted: molt-run stopped waiting; the sweep's 2 point(s) keep running in Slurm (job {array}: "
        f"`squeue -j {array}`, cancel them with `scancel {array}`); `molt-report {sweep}` shows how far each got.")
    done = lambda rows: len(rows) == 2 and all(r[-1]["State"] == "COMPLETED" for r in rows.values())  # noqa: E731
    assert done(sacct(array, timeout_s=120, until=done))


def test_point_pending_for_a_reason_slurm_never_clears_is_named(slurm_cluster, tmp_path):
    """A site without EnforcePartLimits=ALL accepts a request beyond the partition's limits, then keeps it pending for
    ever. Made here by lowering the partition's MaxTime under a held point, then releasing it: the waiting front names
    the point, the reason and the fix; once the limit is back the point runs. Before: silence, for ever."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([MOLT_RUN, "-m", "+recipe=tiny_cpu", "cluster=slurm", "dry_run=true",
                             "+hydra.launcher.additional_parameters.hold=true", f"hydra.sweep.dir={sweep}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (sweep / ".submitit").is_dir() or not any(p.name.isdigit() for p in (sweep / ".submitit").iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        (job,) = [p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]  # one point: a plain job
        subprocess.run(["scontrol", "update", "PartitionName=debug", "MaxTime=1"], check=True)
        subprocess.run(["scontrol", "release", job], check=True)
        time.sleep(15)  # three of the front's looks at squeue
    finally:
        subprocess.run(["scontrol", "update", "PartitionName=debug", "MaxTime=INFINITE"], check=True)
        if sys.exc_info()[0] is not None:  # failed before the release: no held job or waiting front left behind
            proc.kill()
            held = [p.name for p in (sweep / ".submitit").glob("*") if p.name.isdigit()]
            subprocess.run(["scancel", *held], check=False)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert err.count(f"sweep point #0: Slurm job {job} is pending with reason PartitionTimeLimit: as its partition's "
                     f"limits stand, Slurm will not start it. Fix: `scancel {job}`") == 1


def _ray_driver(job_log_dir: str) -> dict:
    """Runs inside the Slurm job: form Ray over the allocation, then report what it sees."""
    import os

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from molt_hydra.runtime.slurm_ray import ray_cluster

    cluster = ClusterConfig(nodes=2, cpus_per_node=2)
    with ray_cluster(cluster, job_log_dir) as address:
        # the driver starts only now: every node must already be there
        alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        cpus = ray.cluster_resources()["CPU"]

        @ray.remote(num_cpus=1)
        def where():
            return os.environ.get("SLURMD_NODENAME")

        nodes = ray.get([where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                         .remote() for n in ray.nodes() if n["Alive"]])
    return {"address": address, "alive": alive, "cpus": cpus, "task_nodes": sorted(nodes),
            "job": os.environ["SLURM_JOB_ID"]}


def _executor(tmp_path: Path, nodes: int) -> submitit.AutoExecutor:
    return submitit_executor(tmp_path, ["cluster=slurm", f"cluster.nodes={nodes}"])


def test_two_node_job_forms_one_ray_cluster(slurm_cluster, tmp_path):
    job = _executor(tmp_path, nodes=2).submit(_ray_driver, str(tmp_path / "ray"))
    out = job.result()
    assert out["alive"] == ["127.0.1.1", "127.0.1.2"]
    assert out["cpus"] == 4.0
    assert out["task_nodes"] == ["n1", "n2"]
    assert out["address"].startswith("127.0.1.1:")
    assert "ray: 2 node(s) up" in job.stdout() and "(n1,n2)" in job.stdout()
    recs = sacct(out["job"], until=lambda rows: rows.get(out["job"], [{}])[-1].get("State") == "COMPLETED")
    assert recs[out["job"]][-1]["NNodes"] == "2"
    # every Ray process ended with the job (head: this step's child; worker: the srun step on n2)
    time.sleep(2)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"/tmp/ray-{out['job']}-" not in ps
    assert not Path(f"/tmp/ray-{out['job']}-n1").exists()  # the head's session dir goes after a clean end
    subprocess.run(["rm", "-rf", f"/tmp/ray-{out['job']}-n2"])  # n2's is on "another node" (same /tmp here)


def _mismatch_driver() -> str:
    from molt_hydra.runtime.slurm_ray import RayClusterError, ray_cluster

    try:
        with ray_cluster(ClusterConfig(nodes=2), "/tmp"):
            return "formed"
    except RayClusterError as e:
        return str(e)


def test_allocation_smaller_than_cluster_nodes_fails_clearly(slurm_cluster, tmp_path):
    msg = _executor(tmp_path, nodes=1).submit(_mismatch_driver).result()
    assert "has 1 node(s)" in msg and "cluster.nodes=2" in msg and "Fix:" in msg


@pytest.mark.slow
def test_sweep_trains_and_reports(slurm_cluster, tmp_path):
    """Needs the RL loop: both points train to the last step as Slurm jobs, in one W&B group named after the sweep."""
    sweep = tmp_path / "multirun" / "tiny_cpu" / "sw"
    r = _molt(["-m", "+recipe=tiny_cpu", "cluster=slurm", "algorithm.estimator=grpo,rloo", "train.max_steps=3",
               f"hydra.sweep.dir={sweep}"], tmp_path, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    for d in _point_dirs(sweep):
        steps = [json.loads(ln)["step"] for ln in (d / "metrics.jsonl").read_text().splitlines()]
        assert steps[-1] == 3
        wandb_files = list(d.glob("wandb/*/run-*.wandb"))
        assert wandb_files and b"tiny_cpu_sw" in wandb_files[0].read_bytes()  # the group: <name>_<time> of the sweep
    rep = subprocess.run([MOLT_REPORT, str(sweep)], capture_output=True, text=True, timeout=120)
    lines = rep.stdout.splitlines()
    assert [ln.split()[:4] for ln in lines[2:4]] == [["0", "algorithm.estimator=grpo", "completed", "3"],
                                                    ["1", "algorithm.estimator=rloo", "completed", "3"]]
    assert (sweep / "report_train_reward.png").stat().st_size > 5000


def _interrupt_one_point(tmp_path: Path, max_steps: int, interrupt: list[str], *overrides: str):
    """A one-point tiny_cpu sweep on Slurm, sent `interrupt` + [its job id] once it logged 3 steps, run to its end.
    Returns (its metrics.jsonl, the job id, the rows logged before the interrupt)."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([MOLT_RUN, "-m", "+recipe=tiny_cpu", "cluster=slurm", "algorithm.estimator=grpo",
                             f"train.max_steps={max_steps}", *overrides, f"hydra.sweep.dir={sweep}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics, deadline = None, time.monotonic() + 900
        while metrics is None and time.monotonic() < deadline and proc.poll() is None:
            found = list(sweep.glob("*/metrics.jsonl"))
            metrics = found[0] if found and len(found[0].read_text().splitlines()) >= 3 else None
            time.sleep(0 if metrics else 1)  # (a step of tiny_cpu takes ~0.2 s: interrupt it at once)
        assert metrics is not None, "the point never logged 3 steps"
        # a one-point sweep is submitted as a plain job (<id>), several points as an array (<id>_<n>)
        (job,) = [p.name for p in (sweep / ".submitit").iterdir() if p.is_dir() and p.name[:1].isdigit()]
        subprocess.run([*interrupt, job], check=True)
        before = metrics.read_text().splitlines()
        out, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return metrics, job, before


@pytest.mark.slow
def test_requeued_point_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    """Needs the RL loop: `scontrol requeue` mid-run; the point comes back to the same directory and continues its
    step counter from the latest checkpoint (metrics.jsonl is appended, never restarted at step 1)."""
    max_steps = 12
    metrics, job, before = _interrupt_one_point(tmp_path, max_steps, ["scontrol", "requeue"],
                                                "checkpoint.save_steps=1")
    lines = metrics.read_text().splitlines()
    assert lines[: len(before)] == before  # same output dir, appended
    last_before = json.loads(before[-1])["step"]
    after = [json.loads(ln)["step"] for ln in lines[len(before):]]
    assert after, "nothing logged after the requeue"
    assert 2 <= after[0] <= last_before + 1, (after[0], last_before)  # continued, not restarted at 1
    assert after[-1] == max_steps
    # the accounting database records the final state a little after the job ends
    done = lambda rows: len(rows.get(job, [])) >= 2 and rows[job][-1]["State"] == "COMPLETED"  # noqa: E731
    states = [r["State"] for r in sacct(job, until=done)[job]]
    assert states[0] == "REQUEUED" and states[-1] == "COMPLETED", states


@pytest.mark.slow
def test_point_requeued_before_its_first_checkpoint_starts_over_with_one_row_per_step(slurm_cluster, tmp_path):
    """Needs the RL loop: the slurm preset's default saves only at the end, so a point requeued mid-run has no
    checkpoint and starts again at step 1 in the same directory: metrics.jsonl keeps one row per step (before: the
    first attempt's steps, then 1, 2, ... again); the first attempt's rows are moved aside (before: dropped)."""
    max_steps = 10
    metrics, job, before = _interrupt_one_point(tmp_path, max_steps, ["scontrol", "requeue"])
    first, sweep = len(before), tmp_path / "sweep"
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == list(range(1, max_steps + 1))
    log = (sweep / ".submitit" / job / f"{job}_0_log.out").read_text()
    (aside,) = metrics.parent.glob("metrics.earlier-*.jsonl")  # the first attempt's rows, kept aside, named
    kept = [json.loads(ln)["step"] for ln in aside.read_text().splitlines()]
    assert kept == list(range(1, len(kept) + 1)) and len(kept) >= first >= 3
    assert f"an earlier attempt's metrics, with no checkpoint to go on from, moved aside to {aside.name}" in log


@pytest.mark.slow
def test_a_notice_before_the_time_limit_saves_the_step_and_the_requeued_point_goes_on_from_it(slurm_cluster, tmp_path):
    """Needs the RL loop: SIGUSR2 (what sbatch --signal sends `hydra.launcher.signal_delay_s` before the time limit)
    to a point with the preset's `checkpoint.save_steps=-1`: the point saves the step under way, submitit requeues
    it, and it goes on from that step (before: requeued at once, from step 0 again)."""
    max_steps = 10
    # to the job's steps: the point's Python (and its Ray processes, which ignore it)
    metrics, job, _ = _interrupt_one_point(tmp_path, max_steps, ["scancel", "--signal=USR2"])
    sweep = tmp_path / "sweep"
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert steps == list(range(1, max_steps + 1))  # one row per step: resumed where it saved, nothing run twice
    log = (sweep / ".submitit" / job / f"{job}_0_log.err").read_text()
    (saved,) = [int(ln.split("checkpoint saved at step ")[1].split(";")[0]) for ln in log.splitlines()
                if "SIGUSR2: checkpoint saved at step" in ln]
    assert 3 <= saved < max_steps
    out_log = (sweep / ".submitit" / job / f"{job}_0_log.out").read_text()
    assert f"at step {saved} (policy version" in out_log  # the requeued attempt resumed from it
    done = lambda rows: len(rows.get(job, [])) >= 2 and rows[job][-1]["State"] == "COMPLETED"  # noqa: E731
    states = [r["State"] for r in sacct(job, until=done)[job]]
    assert states[0] == "REQUEUED" and states[-1] == "COMPLETED", states


@pytest.mark.slow
def test_plain_sbatch_passes_the_notice_on_then_requeues_and_the_job_resumes(slurm_cluster, tmp_path):
    """Needs the RL loop: launchers/molt.sbatch (no submitit) gets the time-limit notice (--signal=B:USR2: the batch
    shell only); it passes it on to molt-run, which saves its step and exits, then requeues the job, which resumes
    from that step (before: requeued at once, from the last periodic checkpoint)."""
    env = {**os.environ, "PATH": f"{Path(MOLT_RUN).parent}:{os.environ['PATH']}"}
    max_steps = 10
    job = subprocess.run(["sbatch", "--parsable", "-N", "1", "--cpus-per-task=2",
                          str(REPO / "launchers" / "molt.sbatch"), "+recipe=tiny_cpu", f"train.max_steps={max_steps}"],
                         cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout.strip()
    deadline, found = time.monotonic() + 900, []
    while time.monotonic() < deadline:
        found = list(tmp_path.glob(f"outputs/*/slurm-{job}/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 3:
            break
        time.sleep(1)
    assert found, (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True)
    done = lambda rows: len(rows.get(job, [])) >= 2 and rows[job][-1]["State"] in ("COMPLETED", "FAILED")  # noqa: E731
    states = [r["State"] for r in sacct(job, timeout_s=1200, until=done)[job]]
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert states[0] == "REQUEUED" and states[-1] == "COMPLETED", (states, log[-3000:])
    (saved,) = [int(ln.split("checkpoint saved at step ")[1].split(";")[0]) for ln in log.splitlines()
                if "Run stopped on SIGUSR2" in ln]
    assert f"at step {saved} (policy version" in log  # the requeued job resumed from it
    steps = [json.loads(ln)["step"] for ln in found[0].read_text().splitlines()]
    assert steps == list(range(1, max_steps + 1))
