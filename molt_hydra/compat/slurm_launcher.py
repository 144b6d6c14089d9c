"""Sweeps on Slurm (hydra-submitit-launcher 1.2.x, checked by compat/hydra.py): the `launch` of
hydra-submitit-launcher's SlurmLauncher (compat/hydra.py puts it in place of the plugin's own: Hydra instantiates
launchers only from its hydra_plugins package), with what a sweep owes its user when
Slurm says no or a point fails. Its own `launch` let sbatch's refusal out as a submitit traceback, and waited on the
points in order, ending at the first failed one with its traceback: the points after it unreported (still running).
Here a refused submission is a config error naming the cluster.* keys and what the partitions have (exit 2), and every
point is waited for; the failed ones are then listed (number, overrides, Slurm job, state, the end of its log) and the
sweep ends as failed (exit 4). conf/hydra/launcher/molt_slurm.yaml selects it. The plugin's LocalLauncher
(hydra/launcher=submitit_local: each point a local process) takes it too: its own launch ended at the first failed
point with submitit's UncompletedJobError traceback (exit 1), the points after it unreported."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf

from molt_hydra.config.schema import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_INTERRUPTED

POLL_S = 5.0
# polls in a row that a point, unfinished to submitit, is absent from squeue before it counts as gone: an array task
# cancelled while pending (held, or behind array_parallelism) leaves squeue at once and never reaches sacct, so
# submitit's state for it stays UNKNOWN, and molt-run -m waited for ever
GONE_POLLS = 3
# squeue reasons of a pending job that Slurm does not clear by itself (a site without EnforcePartLimits=ALL accepts
# such a request at submission, then keeps it pending for ever)
NEVER_STARTS = {"PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount",
                "InvalidQOS", "QOSMaxWallDurationPerJobLimit", "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit",
                "QOSMaxGRESPerJob", "AccountNotAllowed", "QOSNotAllowed"}
# the cluster.* keys the launcher preset maps onto sbatch (molt_slurm.yaml, molt_slurm_gpu.yaml)
REQUEST_KEYS = ("nodes", "cpus_per_node", "devices_per_node", "partition", "account", "qos", "constraint", "time_min")


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
    """SlurmLauncher.launch: submit every point as one job array, wait for all, report the failed ones."""
    from submitit.core.utils import FailedJobError

    executor, slurm = _executor(launcher), launcher._EXECUTOR == "slurm"
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in launcher.config.hydra.sweep:
        sweep_dir.chmod(int(str(launcher.config.hydra.sweep.mode), 8))
    submitit_launcher.log.info(f"Submitit '{launcher._EXECUTOR}' sweep output dir : {sweep_dir}")
    points = [list(o) for o in job_overrides]
    params = [(o, "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}", Singleton.get_state())
              for i, o in enumerate(points)]
    try:
        jobs = executor.map_array(launcher, *zip(*params))
    except FailedJobError as e:  # sbatch refused the array: nothing was submitted
        print(f"Config error(s):\n{_refusal(launcher, str(e).strip())}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)
    for i, (point, job) in enumerate(zip(points, jobs)):
        submitit_launcher.log.info(f"\t#{initial_job_idx + i} : {' '.join(filter_overrides(point))} "
                                   f"({'Slurm job' if slurm else 'process'} {job.job_id})")
    try:
        results, failed = _wait(jobs, points, initial_job_idx, slurm)
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM here stops the waiting, not the points: say so, and how to reach them
        if not slurm:  # (local processes of molt-run's process group: a Ctrl-C reaches them, a SIGTERM does not)
            pids = " ".join(job.job_id for job in jobs)
            print(f"\nInterrupted: molt-run stopped waiting on the sweep's points, processes {pids} here (a Ctrl-C "
                  f"reaches them too; to stop any still running: `kill {pids}`); `molt-report {sweep_dir}` shows how "
                  "far each got.", file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)
        array = jobs[0].job_id.split("_")[0]
        print(f"\nInterrupted: molt-run stopped waiting; the sweep's {len(jobs)} point(s) keep running in Slurm (job "
              f"{array}: `squeue -j {array}`, cancel them with `scancel {array}`); `molt-report {sweep_dir}` shows "
              "how far each got.", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    if failed:
        others = "; the others completed" if len(failed) < len(points) else ""
        print("\n".join(failed) + f"\nRun failed: sweep {sweep_dir}: {len(failed)} of {len(points)} point(s) "
              f"failed (listed above){others}. Fix: see each point's log; " + ("a point resubmitted into the same "
              "directory resumes from its latest checkpoint." if slurm else "then run those points again."),
              file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    return results


def _wait(jobs: list, points: list[list[str]], first: int, slurm: bool) -> tuple[list[JobReturn], list[str]]:
    """Every point's result, also after a failed one; a failed, cancelled or timed-out point as its report line.
    A point pending for a reason Slurm will not clear by itself is named meanwhile (once per reason); one absent from
    squeue GONE_POLLS polls in a row, unfinished to submitit, has been dropped by Slurm and fails."""
    from submitit.core.utils import UncompletedJobError

    told: set[tuple[str, str]] = set()
    absent = dict.fromkeys((job.job_id for job in jobs), 0)
    while not all(job.done() or absent[job.job_id] >= GONE_POLLS for job in jobs):
        queued = _queued(jobs) if slurm else None
        for number, job in enumerate(jobs, start=first):
            if queued is not None:  # (squeue failed: slurmctld busy; look again next time)
                absent[job.job_id] = 0 if job.job_id in queued or job.done() else absent[job.job_id] + 1
            why = queued.get(job.job_id) if queued else None
            if why in NEVER_STARTS and (job.job_id, why) not in told:
                told.add((job.job_id, why))
                print(f"sweep point #{number}: Slurm job {job.job_id} is pending with reason {why}: as its "
                      f"partition's limits stand, Slurm will not start it. Fix: `scancel {job.job_id}` and ask for "
                      f"what the partition allows (`sinfo`; cluster.nodes, cpus_per_node, devices_per_node, time_min, "
                      f"account, qos, constraint); molt-run keeps waiting.", file=sys.stderr, flush=True)
        time.sleep(POLL_S)
    results, failed = [], []
    for i, (point, job) in enumerate(zip(points, jobs)):
        try:
            if not job.done(force_check=True):  # (submitit's own sacct look may be minutes old: one now)
                raise UncompletedJobError("Slurm dropped it without a result (no longer queued, no accounting "
                                          "record): an array task cancelled before it started")
            ret = job.results()[0]
            ret.return_value  # noqa: B018 - raises what the task raised (Hydra's run_job caught it)
            results.append(ret)
        except Exception as e:  # noqa: BLE001 - reported by the caller, with the others
            failed.append(_failure(first + i, point, job, e, "Slurm job" if slurm else "process"))
    return results, failed


def _executor(launcher):
    """The executor as the parent's launch sets it up (submitit_folder, max_num_timeout, the queue parameters)."""
    import submitit

    params, name = dict(launcher.params), launcher._EXECUTOR
    ex = submitit.AutoExecutor(cluster=name, folder=params.pop("submitit_folder"),
                               **{f"{name}_{k}": params.pop(k) for k in ("max_num_timeout",) if k in params})
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    ex.update_parameters(**{k if k in base else f"{name}_{k}": v for k, v in params.items()})
    return ex


def _refusal(launcher, sbatch_error: str) -> str:
    if "Unable to contact slurm controller" in sbatch_error:  # (no request of the user's: told as one, the fix misled)
        said = next(line for line in sbatch_error.splitlines() if "Unable to contact slurm controller" in line)
        return (f"- hydra/launcher: sbatch could not reach Slurm's controller ({said.strip()}), so "
                "nothing was submitted. Fix: run molt-run -m where `scontrol ping` says UP (a login node of the "
                "cluster), or again once slurmctld is back")
    cluster = launcher.config.cluster
    keys = [k for k in REQUEST_KEYS if cluster.get(k) is not None
            and (k != "devices_per_node" or launcher.params.get("gpus_per_node"))]  # GPUs: the _gpu preset only
    # the command line's own hydra.launcher.* keys (mem_gb, partition, additional_parameters...) ask for resources too
    given = [o.lstrip("+") for o in launcher.config.hydra.overrides.hydra
             if o.lstrip("+").startswith("hydra.launcher.")]
    asked = ", ".join([*(f"cluster.{k}={cluster[k]}" for k in keys), *given])
    also = f"; or change or drop {', '.join(o.split('=', 1)[0] for o in given)}" if given else ""
    return (f"- cluster: Slurm refused the sweep's job ({sbatch_error.splitlines()[-1]}); asked for {asked}. "
            f"Fix: ask for what a partition has (cluster.nodes, cluster.cpus_per_node, cluster.devices_per_node "
            f"within its nodes; an existing cluster.partition/account/qos/constraint){also}. Partitions:\n{_sinfo()}")


def _queued(jobs: list) -> dict[str, str] | None:
    """{job id: its pending reason, or None} of the sweep's jobs squeue lists (any state; pending array tasks one by
    one), or None when squeue could not answer."""
    arrays = ",".join(dict.fromkeys(j.job_id.split("_")[0] for j in jobs))
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T|%r", "-j", arrays],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):  # slurmctld busy or restarting
        return None
    if out.returncode and "Invalid job id" not in out.stderr:  # (an id Slurm has purged: none of them is queued)
        return None
    rows = [line.split("|", 2) for line in out.stdout.splitlines() if line.count("|") == 2]
    return {job: why if state == "PENDING" else None for job, state, why in rows}


def _sinfo() -> str:
    try:
        out = subprocess.run(["sinfo", "-o", "%P %a %D %c %m %G %l %f"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(sinfo failed: {e})"


def _failure(number: int, point: list[str], job: Any, error: Exception, kind: str) -> str:
    """One failed point: its number and overrides, its job (`kind`) and state, the end of its log (or the error)."""
    try:
        log = job.stderr() or ""
    except Exception:  # noqa: BLE001 - no log file (the job never started)
        log = ""
    tail = [ln for ln in (log or str(error)).splitlines() if ln.strip()][-8:]
    if type(error).__module__.split(".")[0] != "submitit":  # the task's own exception: its log may not show it
        tail.append(repr(error)[:1000])
    where = f"log {job.paths.stderr}" if job.paths.stderr.exists() else "no log (it never started)"
    return (f"sweep point #{number} ({' '.join(filter_overrides(point))}): {kind} {job.job_id} {job.state}; "
            f"{where}:\n" + "\n".join(f"    {ln}" for ln in tail))
