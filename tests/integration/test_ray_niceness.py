"""The Ray cluster a run starts (runtime/roles.py `init_ray`) runs every role at the launcher's niceness: Ray's default
worker niceness (+15) made the engines and the vLLM processes they spawn lose the CPU to Ray's own daemons and to any
other process at the launcher's niceness (bench/rollout_overhead.py)."""

import os
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class Probe:
    def niceness(self) -> dict:
        import multiprocessing

        child = multiprocessing.get_context("spawn").Process(target=os.getpid)  # what vLLM's engine core inherits
        child.start()
        inherited = os.getpriority(os.PRIO_PROCESS, child.pid)
        child.join()
        return {"main": os.getpriority(os.PRIO_PROCESS, os.getpid()), "child": inherited}


def test_roles_and_their_children_run_at_the_launchers_niceness():
    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from molt_hydra.runtime.roles import init_ray

    assert not ray.is_initialized()
    init_ray(OmegaConf.to_object(compose_config([])))
    try:
        got = ray.get(Probe.remote().niceness.remote(), timeout=120)
    finally:
        ray.shutdown()
    launcher = os.getpriority(os.PRIO_PROCESS, 0)
    assert got == {"main": launcher, "child": launcher}  # Ray's default would give min(launcher + 15, 19)
