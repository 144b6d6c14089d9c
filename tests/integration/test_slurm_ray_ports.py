"""runtime/slurm_ray.py: the Ray head over a Slurm allocation binds ports Ray picks itself (the GCS's with --port=0,
the dashboard agents' with 0), and its client server's (Ray refuses 0 there) is held from its choice until Ray binds
it. Before, every port was probed free, closed, and bound by Ray seconds later: one taken meanwhile (stood for here by
a listener bound on each port right after its probe) ended the run, 'Ray head ... did not come up (exited)'. A real
head on this machine, as the allocation's one node."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from molt_hydra.config.schema import ClusterConfig
from molt_hydra.runtime import slurm_ray
from molt_hydra.runtime.slurm_ray import Allocation, ray_cluster


@pytest.mark.slow
def test_the_heads_ports_cannot_be_taken_before_ray_binds_them(tmp_path, monkeypatch):
    import ray

    from molt_hydra.parallel.launch import free_port

    ip = ray.util.get_node_ip_address()
    monkeypatch.setattr(slurm_ray, "allocation", lambda: Allocation(f"ports{os.getpid()}", ("n1",), "n1"))
    monkeypatch.setattr(slurm_ray, "node_ip", lambda node: ip)
    others = []  # another process's listeners, each on a port the moment a probe found it free

    def taken_after_probe(host: str = "127.0.0.1") -> int:
        port = free_port(host)
        other = socket.socket()
        other.bind(("", port))
        other.listen()
        others.append(other)
        return port

    monkeypatch.setattr(slurm_ray, "free_port", taken_after_probe, raising=False)
    held, hold = [], slurm_ray._held_port  # the client server's port, as _held_port chose it
    monkeypatch.setattr(slurm_ray, "_held_port", lambda stack, host: held.append(hold(stack, host)) or held[-1])
    try:
        with ray_cluster(ClusterConfig(nodes=1, cpus_per_node=1), tmp_path) as address:
            assert address.startswith(f"{ip}:") and ray.cluster_resources()["CPU"] == 1
            with socket.socket() as other, pytest.raises(OSError) as refused:  # the client server's, held
                other.bind(("", held[0]))
            assert refused.value.errno == errno.EADDRINUSE
    finally:
        for other in others:
            other.close()
