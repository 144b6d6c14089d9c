"""Run a function on N local trainer ranks (torch.multiprocessing), for tests, benchmarks and single-host SFT.

`fn(rank, world_size, master_port, *args)` runs in each spawned process; a rank that raises or a run that passes
`timeout_s` terminates them all and raises here, so a broken collective never hangs the caller; so does the
caller's interruption.
"""

from __future__ import annotations

import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, closed (tests' and benchmarks' one-rank workers); ranks that meet rendezvous on held_store's."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_STORES: list = []  # the TCPStore servers this process opened as rank 0 (held_store), for its life


def held_store() -> int:
    """A TCPStore server on a port the OS picks (0), held for this process's life: its port, which rank 0 hands to the
    other members of its group. torch's tcp:// rendezvous store is multi-tenant, as is weight_sync's BroadcastGroup's:
    rank 0's own join reuses this server. Before, a port was probed free and closed, and rank 0 bound it seconds
    later: a process that took it meanwhile (a parallel test, another run on the node) failed the start (EADDRINUSE),
    or had its own store joined by the other members."""
    import torch.distributed as dist

    # (the server listens on every interface; the host is where this process's own client connects)
    _STORES.append(dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False))
    return _STORES[-1].port


def store_port(rank: int, shared) -> int:
    """The port of the ranks' TCPStore: rank 0 opens it (held_store) and sets `shared.value` to its port, which the
    other ranks wait for. `shared`: run_ranks' shared memory, or a Ray trainer group's key in Ray's GCS
    (parallel/group.py)."""
    if rank == 0:
        shared.value = held_store()
    pause = 0.05
    while not (port := shared.value):  # (rank 0 failing before it: run_ranks, or the trainer group, ends every rank)
        time.sleep(pause)
        pause = min(2 * pause, 1.0)  # a Ray group's read is a GCS call: not 20 a second per rank for a model build
    return port


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
    fn(rank, world_size, store_port(rank, shared_port), *args)
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
    port = mp.get_context("spawn").Value("i", 0, lock=False)  # set by rank 0 (store_port)
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
