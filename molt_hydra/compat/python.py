"""CPython: what this project reaches into, and the releases it is checked against.

Written for CPython 3.10 - 3.13 (tested: 3.11, every CI run), whose `multiprocessing.forkserver` keeps its one
server in the module-level `_forkserver` (`_forkserver_pid`, `_forkserver_alive_fd`); other releases are refused
when a forkserver is asked for. Reached into here:

- the forkserver (`start_forkserver`, `ForkedWithLaunchEnv`): a fresh single-threaded interpreter that imports a
  module list while its parent works, then forks children from that clean state (as safe as spawn inside a threaded
  Ray actor). Its children run with the environment of their launch, as spawned ones would; they die with the server
  (PR_SET_PDEATHSIG), the server with its parent (its alive pipe). Used for vLLM's engine core (compat/vllm.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys
from pathlib import Path

from molt_hydra.compat import written_for
# imported where used: setproctitle (optional)

FORKSERVER_PYTHONS = {"Python": ("3.10", "3.11", "3.12", "3.13")}  # whose forkserver state is read below
PR_SET_PDEATHSIG = 1
_started: dict[str, str] | None = None  # the variables the running server was started with, when started here


@contextlib.contextmanager
def scoped_env(values: dict[str, str]):
    """`values` set in os.environ inside the block; each variable's previous value (or absence) restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _server():
    version = ".".join(map(str, sys.version_info[:3]))
    written_for("the engine core's forkserver", "python", FORKSERVER_PYTHONS, ("Python", version))
    return multiprocessing.forkserver._forkserver


def start_forkserver(preload: list[str], env: dict[str, str]) -> None:
    """Start this process's forkserver (once) with `env` on top of the current environment; it imports `preload` at
    once, in parallel with the caller. A second call finds the first one's server."""
    global _started
    if _server()._forkserver_pid is not None:
        return
    multiprocessing.forkserver.set_forkserver_preload(preload)
    with scoped_env(env):  # the server's exec environment is this process's own at the time
        multiprocessing.forkserver.ensure_running()
    _started = dict(env)


def forkserver_unusable() -> str:
    """Why the server cannot fork a child launched now ("" when it can): none started here, it died, or a variable it
    was started with has another value in this process now."""
    pid = _server()._forkserver_pid
    if _started is None or pid is None:
        return "no forkserver started by this module"
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
            raise FileNotFoundError
    except FileNotFoundError:
        return f"the forkserver (pid {pid}) died"
    differ = [f"{k}={os.environ.get(k)!r}, the server's {v!r}" for k, v in _started.items() if os.environ.get(k) != v]
    return "a variable set for the child differs from the forkserver's: " + "; ".join(differ) if differ else ""


class LaunchEnvProcess(multiprocessing.context.ForkServerProcess):
    """A process forked by the server that runs with the environment at its launch, as a spawned one would."""

    def start(self) -> None:
        self._launch_env = dict(os.environ)
        super().start()

    def run(self) -> None:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:  # dies with the server
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        # this process holds the server's alive pipe (for forkserver children of its own): the server would outlive
        # its parent while this child lives, and the child the server; it starts no forkserver children
        server = _server()
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None
        with contextlib.suppress(ImportError):  # vLLM names the core with it, when it is installed; its setup
            import setproctitle  # finds the title's memory through the environment's, which the update below moves

            setproctitle.getproctitle()
        for key in os.environ.keys() - self._launch_env.keys():
            del os.environ[key]
        os.environ.update({k: v for k, v in self._launch_env.items() if os.environ.get(k) != v})
        super().run()


class ForkedWithLaunchEnv(multiprocessing.context.ForkServerContext):
    Process = LaunchEnvProcess
