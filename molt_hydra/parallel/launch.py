"""Run a function on N local trainer ranks (torch.multiprocessing), for tests, benchmarks and single-host SFT.

`fn(rank, world_size, master_port, *args)` runs in each spawned process; a rank that raises or a run that passes
`timeout_s` terminates them all and raises here, so a broken collective never hangs the caller; so does the
caller's interruption.
"""

from __future__ import annotations

import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_address() -> tuple[str, int]:
    """This node's IP as Ray knows it, and a port free on every interface (a TCPStore listens on all of them)."""
    import ray

    return ray.util.get_node_ip_address(), free_port("")


_STORE = None  # rank 0's TCPStore server, for its process's life


def _store_port(rank: int, shared) -> int:
    """The port of the ranks' TCPStore. Rank 0 binds port 0 (the OS picks a free one) and holds it: torch's tcp://
    rendezvous store is multi-tenant, so rank 0's init_process_group reuses that server; the other ranks wait for the
    port rank 0 shares. Before, the parent probed a free port and closed it, and rank 0 bound it seconds later: a
    process that took it meanwhile (a parallel test, another run on the node) failed the start (EADDRINUSE), or its
    store was joined by ranks 1.. of this one."""
    global _STORE
    if rank == 0:
        import torch.distributed as dist

        _STORE = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        shared.value = _STORE.port
    while not shared.value:  # (rank 0 failing before it: run_ranks ends every rank)
        time.sleep(0.01)
    return shared.value


def _entry(rank, fn, world_size, shared_port, threads, args):
    import os
    import sys
    import threading

    import torch
    from tqdm import tqdm
    torch.set_num_threads(threads)
    # Progress bars (transformers' "Loading weights") lock this process's threads only. tqdm's default lock adds a
    # multiprocessing one, a named semaphore that os._exit below left behind: the resource tracker then printed
    # "There appear to be N leaked semaphore objects" after the run's last line (every job=sft).
    tqdm.set_lock(threading.RLock())
    fn(rank, world_size, _store_port(rank, shared_port), *args)
    # Done and its results written: leave without the interpreter's teardown, where a gloo rank's C++ threads were
    # seen destroyed still joinable ("terminate called without an active exception", SIGABRT) after a good run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout_s: float = 600.0, threads_per_rank: int = 1, ignore=()):
    """`ignore`: signals the ranks ignore for their life (Slurm's notice under job=sft: only the caller acts on it,
    and Slurm sends it to every process of the job step). An ignored signal stays ignored across exec: they are
    ignored here while the ranks start, the caller's handlers back after."""
    import signal
    import threading

    import torch.multiprocessing as mp

    main = threading.current_thread() is threading.main_thread()  # (only it may set handlers)
    kept = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignore} if main else {}
    port = mp.get_context("spawn").Value("i", 0, lock=False)  # set by rank 0 (_store_port)
    try:
        ctx = mp.start_processes(_entry, args=(fn, world_size, port, threads_per_rank, args),
                                 nprocs=world_size, join=False, start_method="spawn")
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:  # named: which ranks still run (before: none, whichever hung)
                late = [str(i) for i, p in enumerate(ctx.processes) if p.is_alive()]
                raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish within {timeout_s:.0f}s; "
                                   f"still running: rank {', '.join(late)}")
    except BaseException:  # also Ctrl-C / SIGTERM (a KeyboardInterrupt): the ranks end with their caller
        for p in ctx.processes:
            p.kill()
        raise
