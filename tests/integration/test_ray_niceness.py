"""The Ray cluster a run starts (runtime/roles.py `init_ray`) runs every role at the launcher's niceness: Ray's default
worker niceness (+15) made the engines and the vLLM processes they spawn lose the CPU to Ray's own daemons and to any
other process at the launcher's niceness (bench/rollout_overhead.py). And every role and what it spawns ignores
Slurm's notice (SIGUSR2, sent to every process of the job step): only the driver acts on it (runtime/preemption.py);
before, it ended every Ray process while the driver was saving."""

import os
import signal
import time
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class Probe:
    def niceness(self) -> dict:
        import multiprocessing

        def ignores_usr2(pid: int) -> bool:  # from the kernel's own record (SigIgn: a mask, bit signum - 1)
            (mask,) = [ln.split()[1] for ln in open(f"/proc/{pid}/status") if ln.startswith("SigIgn:")]
            return bool(int(mask, 16) >> (signal.SIGUSR2 - 1) & 1)

        # what vLLM's engine core inherits (it sleeps, so its status can be read)
        child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(3,))
        child.start()
        inherited, ignores = os.getpriority(os.PRIO_PROCESS, child.pid), ignores_usr2(child.pid)
        child.join()
        return {"main": os.getpriority(os.PRIO_PROCESS, os.getpid()), "child": inherited,
                "ignore usr2": [ignores_usr2(os.getpid()), ignores]}


def test_roles_and_their_children_run_at_the_launchers_niceness_and_ignore_slurms_notice():
    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from molt_hydra.runtime.roles import init_ray

    def drivers(signum, frame):
        pass

    assert not ray.is_initialized()
    before = signal.signal(signal.SIGUSR2, drivers)
    try:
        init_ray(OmegaConf.to_object(compose_config([])))
        assert signal.getsignal(signal.SIGUSR2) is drivers  # the driver's own is back
        got = ray.get(Probe.remote().niceness.remote(), timeout=120)
    finally:
        ray.shutdown()
        signal.signal(signal.SIGUSR2, before)
    launcher = os.getpriority(os.PRIO_PROCESS, 0)
    # Ray's default would give min(launcher + 15, 19); USR2's default action ends the process
    assert got == {"main": launcher, "child": launcher, "ignore usr2": [True, True]}
