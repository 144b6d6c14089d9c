"""runtime/slurm_ray.py outside a Slurm allocation: cluster.nodes > 1 is refused (only this machine would be used),
one node starts nothing."""

from __future__ import annotations

import pytest

from molt_hydra.config.schema import ClusterConfig
from molt_hydra.runtime.slurm_ray import RayClusterError, ray_cluster


@pytest.fixture(autouse=True)
def no_allocation(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(var, raising=False)


def test_several_nodes_outside_an_allocation_are_refused(tmp_path):
    with pytest.raises(RayClusterError) as e:
        with ray_cluster(ClusterConfig(nodes=2), tmp_path):
            pytest.fail("the body must not run")
    msg = str(e.value)
    assert "cluster.nodes=2" in msg and "no Slurm allocation" in msg and "Fix:" in msg and "cluster=slurm" in msg


def test_one_node_or_a_given_ray_address_starts_nothing(tmp_path):
    with ray_cluster(ClusterConfig(nodes=1), tmp_path) as address:
        assert address is None
    with ray_cluster(ClusterConfig(nodes=2, ray_address="10.0.0.1:6379"), tmp_path) as address:
        assert address == "10.0.0.1:6379"
    assert not any(tmp_path.iterdir())  # no Ray logs: nothing was started
