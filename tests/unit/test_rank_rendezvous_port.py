"""parallel/launch.py run_ranks, a Ray trainer group (parallel/group.py) and the weight broadcast's group
(weight_sync/sender.py): the members' TCPStore port is chosen by rank 0 itself (port 0, held from then on), so no
other process can take it between its choice and its use. Before, the parent probed a free port, closed it, and rank
0 bound it later: a process that took it meanwhile (stood for here by a listener bound right after the probe) failed
the ranks' start with EADDRINUSE, or had its own store joined by ranks 1.. And ranks past run_ranks' timeout are
named."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rendezvous_job import rank_1_hangs, summed_ranks  # noqa: E402
from molt_hydra.parallel import launch  # noqa: E402


@pytest.fixture
def others(monkeypatch):
    """Another process's listeners, each on a port the moment a probe (launch.free_port) found it free."""
    others, probe = [], launch.free_port

    def taken_after_probe(host: str = "127.0.0.1") -> int:
        port = probe(host)
        other = socket.socket()
        other.bind(("", port))
        other.listen()
        others.append((other, port))
        return port

    monkeypatch.setattr(launch, "free_port", taken_after_probe)
    yield others
    for other, _ in others:
        other.close()


def test_the_ranks_rendezvous_on_a_port_no_other_process_took(tmp_path, others):
    launch.run_ranks(summed_ranks, 2, str(tmp_path), timeout_s=60)
    (port0, sum0), (port1, sum1) = (Path(tmp_path, f"rank{r}").read_text().split() for r in (0, 1))
    assert sum0 == sum1 == "3"  # 1 + 2: both ranks in one group
    assert port0 == port1 and int(port0) not in {port for _, port in others}


def test_ranks_past_their_timeout_are_named(tmp_path):
    """Before: '2 ranks of rank_1_hangs did not finish within 6s', whichever rank hung."""
    with pytest.raises(TimeoutError) as late:
        launch.run_ranks(rank_1_hangs, 2, str(tmp_path), timeout_s=6)
    assert str(late.value) == "2 ranks of rank_1_hangs did not finish within 6s; still running: rank 1"


def test_the_weight_broadcast_group_opens_on_a_port_no_other_process_took(others):
    """The trainer's rank 0 and an engine's worker form the NCCL weight-broadcast group (gloo here: CPU stand-ins);
    rank 0's store is on a port no other process took. Before: 'The server socket has failed to listen ...
    (errno: 98 - Address already in use)' when the probed port was taken."""
    from test_weight_sync_transports import FakeEngine, FakeWorker, StandInTrainerRank

    from molt_hydra.weight_sync.sender import open_broadcast

    rank0, worker = StandInTrainerRank(), FakeWorker()
    asyncio.run(open_broadcast(rank0, [FakeEngine(worker, [])], workers_per_engine=1, timeout_s=30))
    sender, receiver = rank0.weight_broadcast_group, worker._weight_comm
    assert sender.group.size() == receiver.group.size() == 2
    assert sender.store.port == receiver.store.port not in {port for _, port in others}


def _world_size(_worker) -> int:
    return dist.get_world_size()


@pytest.mark.slow
def test_a_trainer_groups_ranks_rendezvous_on_a_port_no_other_process_took(others):
    """Two real trainer ranks as Ray actors (parallel/group.py) join one process group at rank 0's store, on a port
    no other process took. Before: rank 0's start failed ('actor rank 0: ... EADDRINUSE') when the port the driver
    probed (rank 0 on its node) was taken before rank 0 bound it."""
    import ray

    from molt_hydra.parallel.group import TrainerGroup
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (Ray's workers cannot import this module)
        g = TrainerGroup(2, TrainerSpec("tiny://qwen3_tiny", timeout_s=120), num_cpus_per_rank=1,
                         startup_timeout_s=300)
        assert ray.get([w.__ray_call__.remote(_world_size) for w in g.workers], timeout=60) == [2, 2]
        host, port = g.rendezvous.rsplit(":", 1)
        assert host == ray.util.get_node_ip_address() and int(port) not in {p for _, p in others}
        g.shutdown()
    finally:
        ray.shutdown()
