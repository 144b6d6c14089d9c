"""parallel/launch.py run_ranks: the ranks' TCPStore port is chosen by rank 0 itself (port 0, held from then on), so no
other process can take it between its choice and its use. Before, the parent probed a free port, closed it, and rank
0 bound it later: a process that took it meanwhile (stood for here by a listener bound right after the probe) failed
the ranks' start with EADDRINUSE, or had its own store joined by ranks 1.. And ranks past run_ranks' timeout are
named."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rendezvous_job import rank_1_hangs, summed_ranks  # noqa: E402
from molt_hydra.parallel import launch  # noqa: E402


def test_the_ranks_rendezvous_on_a_port_no_other_process_took(tmp_path, monkeypatch):
    others = []  # another process's listeners, each on a port the moment a probe found it free

    def taken_after_probe(host: str = "127.0.0.1") -> int:
        port = probe(host)
        other = socket.socket()
        other.bind(("", port))
        other.listen()
        others.append((other, port))
        return port

    probe = launch.free_port
    monkeypatch.setattr(launch, "free_port", taken_after_probe)
    try:
        launch.run_ranks(summed_ranks, 2, str(tmp_path), timeout_s=60)
    finally:
        for other, _ in others:
            other.close()
    (port0, sum0), (port1, sum1) = (Path(tmp_path, f"rank{r}").read_text().split() for r in (0, 1))
    assert sum0 == sum1 == "3"  # 1 + 2: both ranks in one group
    assert port0 == port1 and int(port0) not in {port for _, port in others}


def test_ranks_past_their_timeout_are_named(tmp_path):
    """Before: '2 ranks of rank_1_hangs did not finish within 6s', whichever rank hung."""
    with pytest.raises(TimeoutError) as late:
        launch.run_ranks(rank_1_hangs, 2, str(tmp_path), timeout_s=6)
    assert str(late.value) == "2 ranks of rank_1_hangs did not finish within 6s; still running: rank 1"
