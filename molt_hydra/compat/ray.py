"""Ray: what this project reaches into.

`ray._private.auto_init_hook.enable_auto_connect` (ray 2.60): a Ray call made while no Ray runs starts a new local
instance (read once, from RAY_ENABLE_AUTO_CONNECT, when ray is imported). A trainer group starts in a thread
(runtime/roles.py) that a Ctrl-C during the run's start does not stop: after the teardown's ray.shutdown its next
call started a second Ray, whose agents outlived the run and whose start delayed its exit ~20 s. Turned off at the
teardown, such a call raises instead (the thread ends; its error goes nowhere: its awaiter was cancelled). Once
the run is over (`auto_init_restored`) it is back as it was: before, it stayed off in the process, and a notebook's
later `ray.put` / `@ray.remote` call raised "Ray has not been started yet" instead of starting Ray as by default.
"""

from __future__ import annotations

from contextlib import contextmanager

from molt_hydra.compat import written_for

SUPPORTED = {"ray": ("2.60",)}
_found: list[bool] = []  # the setting the first no_auto_init since `auto_init_restored`'s block began turned off


def no_auto_init() -> None:
    """From now on (until `auto_init_restored`'s block ends), no Ray call in this process starts a Ray instance; only
    an explicit ray.init does."""
    written_for("turning off Ray's auto-init", "ray", SUPPORTED)
    from ray._private import auto_init_hook

    if not _found:
        _found.append(auto_init_hook.enable_auto_connect)
    auto_init_hook.enable_auto_connect = False


@contextmanager
def auto_init_restored():
    """Ray's auto-init as it was before the block, once the block ends (also on a failure), where no_auto_init turned
    it off inside. The block holds the run's asyncio.run, which waits for the run's threads: none calls Ray after it."""
    _found.clear()
    try:
        yield
    finally:
        if _found:  # (no_auto_init ran: its version check passed)
            from ray._private import auto_init_hook

            auto_init_hook.enable_auto_connect = _found.pop()


HEAD = ("gcs_server", "raylet")  # what every role needs; a run goes on without Ray's others (its log monitor ...)


def dead_head_processes() -> dict[str, int]:
    """Ray's GCS and raylet that this process's ray.init started and that have ended, each with its exit status
    (negative: the signal that ended it); {} also where this process joined a Ray it did not start."""
    written_for("reading Ray's own processes", "ray", SUPPORTED)
    from ray._private import worker

    node = worker._global_node
    return {} if node is None else {kind: p.poll() for kind, p in node.dead_processes() if kind in HEAD}


def live_head_processes() -> dict[str, int]:
    """The pid of Ray's GCS and raylet that this process's ray.init started and that still run; {} as above."""
    written_for("reading Ray's own processes", "ray", SUPPORTED)
    from ray._private import worker

    node = worker._global_node
    return {} if node is None else {kind: p.pid for kind, p in node.live_processes() if kind in HEAD}


def actor_pid(actor) -> int | None:
    """The pid of `actor`'s process as Ray's GCS records it once the process is leased, also while the actor's
    constructor still runs (a call to the actor waits for its constructor); None before."""
    written_for("reading an actor's pid from Ray's GCS", "ray", SUPPORTED)
    from ray._private import state

    return state.actors(actor._actor_id.hex()).get("Pid") or None


def gcs_get(key: str) -> bytes | None:
    """`key`'s value in Ray's GCS key-value store (any process of the cluster reads it), None if not set."""
    written_for("Ray's GCS key-value store", "ray", SUPPORTED)
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key)


def gcs_put(key: str, value: str) -> None:
    written_for("Ray's GCS key-value store", "ray", SUPPORTED)
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value)


@contextmanager
def started_ignoring(signals: tuple):
    """The processes ray.init starts in the block (through `ray._private.services.ConsolePopen`: its GCS, raylet and
    agents; the raylet's workers inherit it) start with `signals` ignored, while this process keeps its handlers.
    Before, the driver itself ignored them for the whole ray.init (an ignored signal stays ignored across fork and
    exec): a SIGHUP or Slurm's notice that came then was lost, and the run went on as if none had."""
    written_for("starting Ray's processes with signals ignored", "ray", SUPPORTED)
    from ray._private import services

    popen = services.ConsolePopen

    class Ignoring(popen):
        def __init__(self, *args, preexec_fn=None, **kwargs):
            def preexec():  # (in the child, between fork and exec)
                import signal

                for sig in signals:
                    signal.signal(sig, signal.SIG_IGN)
                if preexec_fn is not None:
                    preexec_fn()

            super().__init__(*args, preexec_fn=preexec, **kwargs)

    services.ConsolePopen = Ignoring
    try:
        yield
    finally:
        services.ConsolePopen = popen
