"""The real Slurm cluster the `slurm` tests submit to: launchers/local_slurm.sh (slurmctld + slurmd n1, n2 on
loopback + munge + slurmdbd), installed and started once per test session, stopped after it — unless it was already
up when the session began (then it is left as found)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import submitit
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launchers" / "local_slurm.sh"


def _up() -> bool:
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    was_up = _up()
    subprocess.run(["bash", str(SCRIPT), "start"], check=True, timeout=600)
    yield ["n1", "n2"]
    if not was_up:
        subprocess.run(["bash", str(SCRIPT), "stop"], check=True, timeout=120)


def submitit_executor(folder: Path, overrides: list[str]) -> submitit.AutoExecutor:
    """submitit set up exactly as the molt_slurm launcher preset resolves for the config `overrides` (e.g.
    cluster=slurm cluster.nodes=2), with its job folders under `folder`."""
    from molt_hydra.config.store import CONF_DIR, register

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"hydra.sweep.dir={folder}"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert params.pop("_target_").endswith("SlurmLauncher")
    ex = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                               slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = {"nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "mem_gb", "timeout_min", "name",
            "stderr_to_stdout"}
    ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    return ex


def sacct(job: str, timeout_s: float = 60.0, until=None) -> dict[str, list[dict[str, str]]]:
    """JobID -> its records [{JobName, State, NNodes, NodeList}], oldest first (-D: a requeued job has one per run;
    array tasks included), polled until `until(rows)` holds: records arrive a second or two after the job ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-D", "-o", "JobID,JobName,State,NNodes,NodeList", "-j", job],
                             capture_output=True, text=True, timeout=30).stdout
        rows = {}
        for line in out.splitlines():
            jid, name, state, nnodes, nodelist = line.split("|")
            rows.setdefault(jid, []).append({"JobName": name, "State": state, "NNodes": nnodes, "NodeList": nodelist})
        if until is None or until(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(1)
