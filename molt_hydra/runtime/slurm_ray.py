"""Ray inside a Slurm allocation: the node this process runs on starts the Ray head, every other node of the
allocation joins through its own `srun` step, and the driver (this process) connects once all nodes and their
resources are up. Everything started here ends with the `with` block — and with the job, since Slurm kills the steps.

    with ray_cluster(cfg.cluster, log_dir=Path(cfg.output_dir) / "ray") as address:
        ...  # inside an allocation: ray.init(address=...) done, all nodes up; outside one: address is None

The allocation is discovered from Slurm's own environment (SLURM_JOB_ID, SLURM_JOB_NODELIST) — the same under a
submitit job (whose single task runs on the first node: conf/hydra/launcher/molt_slurm.yaml), a plain `sbatch`
(launchers/molt.sbatch) and an interactive `salloc`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from molt_hydra.config.schema import ClusterConfig
from molt_hydra.runtime.preemption import ignoring_the_notice

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
RAY = str(Path(sys.executable).with_name("ray"))  # the venv's, also when its bin/ is not on PATH


class RayClusterError(RuntimeError):
    """The Ray cluster over the allocation did not form (a node missing, resources short, a step died)."""


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]
    "Slurm node names of the job, in Slurm's order."
    this_node: str


def allocation() -> Allocation | None:
    """The Slurm job this process runs in, or None outside one."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ["SLURM_NODELIST"]
    nodes = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                           text=True).stdout.split()
    this = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return Allocation(job_id=job_id, nodes=tuple(nodes), this_node=this)


def node_ip(node: str) -> str:
    """The address Slurm itself uses for a node (its NodeAddr), as an IPv4 address. Not `hostname -i`: fake nodes
    on one host (launchers/local_slurm.sh) differ only in NodeAddr (127.0.1.N; Ray rewrites 127.0.0.1)."""
    out = subprocess.run(["scontrol", "show", "node", node, "-o"], check=True, capture_output=True, text=True).stdout
    return socket.gethostbyname(next((f.split("=", 1)[1] for f in out.split() if f.startswith("NodeAddr=")), node))


def _temp_dir(job_id: str, node: str) -> str:
    # Per job and node: two jobs on one node, or two fake nodes on one host, must not share Ray's session dir.
    return f"/tmp/ray-{job_id}-{node}"


def _popen(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    # Own process group, so that stopping it can reach every process it started.
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _held_port(stack: ExitStack, host: str) -> int:
    """A free port on `host`, held (bound, SO_REUSEPORT) until `stack` closes: a process binding it meanwhile is
    refused, as is bind(0) handing it out, while Ray's gRPC server, which binds with SO_REUSEPORT too (same user),
    takes it. Before, the port was probed and closed, and a process that took it before Ray bound it ended the head."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind((host, 0))
    stack.callback(held.close)
    return held.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (srun forwards it to its step; `ray start --block` stops its Ray processes), SIGKILL after a grace."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):  # its group has ended already
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    with suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def wait_for_nodes(alloc: Allocation, want_cpus: float, want_gpus: float, steps: dict[str, tuple]) -> dict:
    """Block until Ray sees every node of the allocation alive with at least the wanted resources; fail with the
    missing nodes and the logs of their steps on timeout, or at once when a step has exited."""
    import ray

    ips = {node_ip(n): n for n in alloc.nodes}
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        res = ray.cluster_resources()
        if set(ips) <= alive and res.get("CPU", 0) >= want_cpus and res.get("GPU", 0) >= want_gpus:
            return res
        dead = {node: (proc, log) for node, (proc, log) in steps.items() if proc.poll() is not None}
        if dead or time.monotonic() > deadline:
            missing = sorted(ips[ip] for ip in set(ips) - alive)
            why = (f"the Ray step on {', '.join(dead)} exited" if dead else f"not up after {START_TIMEOUT_S:.0f} s")
            logs = "\n".join(f"--- {log} (node {node}):\n{_tail(log)}" for node, (_, log) in (dead or steps).items())
            raise RayClusterError(
                f"Ray over Slurm job {alloc.job_id}: {why}. Nodes missing: {missing or 'none'}; resources "
                f"CPU {res.get('CPU', 0)}/{want_cpus}, GPU {res.get('GPU', 0)}/{want_gpus}. Fix: check the node "
                f"logs below and that cluster.nodes/cpus_per_node/devices_per_node match the allocation.\n{logs}")
        time.sleep(0.5)


def _check_allocation(alloc: Allocation | None, cluster: ClusterConfig) -> None:
    """Refuse a multi-node cluster with no allocation and no Ray address, and an allocation of another size."""
    if alloc is None and cluster.nodes > 1 and not cluster.ray_address:
        raise RayClusterError(
            f"cluster.nodes={cluster.nodes} but this process runs in no Slurm allocation (SLURM_JOB_ID unset) and "
            f"cluster.ray_address is unset, so only this machine would be used. Fix: submit it (`molt-run -m ... "
            f"cluster=slurm`, or `sbatch launchers/molt.sbatch`), set cluster.ray_address to a running Ray "
            f"cluster, or set cluster.nodes=1.")
    if alloc is not None and not cluster.ray_address and len(alloc.nodes) != cluster.nodes:
        raise RayClusterError(
            f"Slurm job {alloc.job_id} has {len(alloc.nodes)} node(s) ({','.join(alloc.nodes)}) but cluster.nodes="
            f"{cluster.nodes}. Fix: set cluster.nodes={len(alloc.nodes)} or allocate {cluster.nodes} node(s).")


def _start_nodes(stack: ExitStack, alloc: Allocation, log_dir: Path, cpus: int) -> tuple[str, dict[str, tuple]]:
    """The Ray head on this node, then one `ray start` step per other node; each stopped when `stack` closes.
    Returns the head's address and {node: (process, log)}."""
    # Ray >= 2.5x turns token auth on for a `ray start --head` unless told otherwise, while this driver fixed its
    # auth mode when it imported ray (disabled unless RAY_AUTH_MODE was set): head and workers follow the driver.
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "RAY_USAGE_STATS_ENABLED": "0"}
    head_ip, temp_dir = node_ip(alloc.this_node), _temp_dir(alloc.job_id, alloc.this_node)
    # Not Ray's fixed defaults (6379, 10001, 52365): other jobs may share this node. Ray picks free ports itself for
    # the GCS (--port=0: the head writes its address into its temp dir) and the dashboard agents (0); it refuses 0 for
    # its client server, whose port is held here until Ray binds it (_held_port). Before, each port was probed free,
    # closed, and bound by Ray seconds later (a worker's dashboard agent's probed on the head's node, not its own).
    with suppress(FileNotFoundError):  # a requeued job's (the same job id), from its earlier attempt
        os.remove(Path(temp_dir) / "ray_current_cluster")
    common = ["--num-cpus", str(cpus), "--disable-usage-stats", "--block", "--dashboard-agent-listen-port=0"]
    head_log = log_dir / f"head-{alloc.this_node}.log"
    head = _popen([*ignoring_the_notice(RAY), "start", "--head", f"--node-ip-address={head_ip}", "--port=0",
                   f"--ray-client-server-port={_held_port(stack, head_ip)}", "--include-dashboard=false",
                   f"--temp-dir={temp_dir}", *common], head_log, env)
    stack.callback(_stop, head)
    steps = {alloc.this_node: (head, head_log)}
    address = _wait_head(head_ip, temp_dir, head, head_log)
    for node in (n for n in alloc.nodes if n != alloc.this_node):
        log = log_dir / f"worker-{node}.log"
        # One srun step per other node (the job's own step runs only on this one). --overlap: the step may share
        # the node with other steps of the job.
        proc = _popen(["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap",
                       f"--cpus-per-task={os.environ.get('SLURM_CPUS_PER_TASK', '1')}", "--kill-on-bad-exit=1",
                       *ignoring_the_notice(RAY), "start", f"--address={address}", f"--node-ip-address={node_ip(node)}",
                       f"--temp-dir={_temp_dir(alloc.job_id, node)}", *common], log, env)
        stack.callback(_stop, proc)
        steps[node] = (proc, log)
    return address, steps


@contextmanager
def ray_cluster(cluster: ClusterConfig, log_dir: str | Path) -> Iterator[str | None]:
    """Form Ray over the current Slurm allocation and connect this process to it; yields the head's address.
    Outside an allocation (or with cluster.ray_address set) yields cluster.ray_address and starts nothing; outside
    one with cluster.nodes > 1 and no ray_address it refuses (the other nodes would be silently missing). Each Ray node
    advertises cluster.cpus_per_node logical CPUs."""
    alloc = allocation()
    _check_allocation(alloc, cluster)
    if alloc is None or cluster.ray_address:
        yield cluster.ray_address
        return
    import ray  # deferred: the launcher imports this module before it knows whether Ray starts here

    cpus = cluster.cpus_per_node
    gpus = cluster.devices_per_node if cluster.device.value == "cuda" else 0
    t0 = time.monotonic()
    with ExitStack() as stack:
        address, steps = _start_nodes(stack, alloc, Path(log_dir), cpus)
        ray.init(address=address, include_dashboard=False)
        stack.callback(ray.shutdown)
        res = wait_for_nodes(alloc, cpus * len(alloc.nodes), gpus * len(alloc.nodes), steps)
        print(f"ray: {len(alloc.nodes)} node(s) up in {time.monotonic() - t0:.1f}s over Slurm job {alloc.job_id} "
              f"({','.join(alloc.nodes)}), head {address}, CPU {res.get('CPU', 0):g} GPU {res.get('GPU', 0):g}",
              flush=True)
        yield address
    # a clean end drops this node's Ray session dir (raylet/GCS logs) once Ray has stopped; after a failure it stays
    shutil.rmtree(_temp_dir(alloc.job_id, alloc.this_node), ignore_errors=True)


def _wait_head(head_ip: str, temp_dir: str, head: subprocess.Popen, log: Path) -> str:
    """The head's address once its GCS listens (its port: Ray's choice, in the address file the head writes)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with suppress(OSError, ValueError, IndexError):  # no file yet, or the GCS not listening yet
            port = int(Path(temp_dir, "ray_current_cluster").read_text().strip().rsplit(":", 1)[1])
            socket.create_connection((head_ip, port), timeout=1).close()
            return f"{head_ip}:{port}"
        if head.poll() is not None or time.monotonic() > deadline:
            raise RayClusterError(f"Ray head on {head_ip} did not come up "
                                  f"({'exited' if head.poll() is not None else 'timeout'}); {log}:\n{_tail(log)}")
        time.sleep(0.2)
