"""Run model-written Python in a sandboxed subprocess: wall-clock limit, address-space limit, no network.

Network isolation has two layers: the child enters a fresh network namespace (`unshare(CLONE_NEWNET)`: no
interfaces but a down loopback, so nothing connects anywhere, including from grandchildren), when the process may
(root / CAP_SYS_ADMIN); and an audit hook in the child interpreter refuses every `socket.*` event, which holds
without privileges. The limits are arguments (Molt's PYTHON_EXECUTOR_* environment knobs become agent kwargs).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import resource
import signal
import sys
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000

# Runs in the child before the user code; audit hooks cannot be removed once added.
_BOOTSTRAP = """
import sys
def _no_network(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in this sandbox")
if {block}:
    sys.addaudithook(_no_network)
del _no_network
_code = sys.stdin.read()
sys.stdin = open("/dev/null")
exec(compile(_code, "<code>", "exec"), {{"__name__": "__main__"}})
"""


@dataclass
class ExecutionResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed for the time limit
    timed_out: bool
    output_truncated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def as_observation(self) -> str:
        """The text an agent feeds back to the model."""
        if self.timed_out:
            return (self.stdout + "\nTimeoutError: execution exceeded the time limit").strip()
        text = self.stdout if self.ok else (self.stdout + self.stderr)
        return text.strip()


@functools.cache
def network_namespace_available() -> bool:
    """Whether children can get their own network namespace here."""
    if sys.platform != "linux":
        return False
    # Probed once in a throwaway child: unshare needs CAP_SYS_ADMIN, and a failure must not surprise the sandbox.
    pid = os.fork()
    if pid == 0:
        ok = ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) == 0
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0



async def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 16384,
    allow_network: bool = False,
) -> ExecutionResult:
    """Run `code` with `python -I` in a new process group; kill the whole group at `timeout_s`."""
    memory = memory_mb * 2**20
    isolate_net = not allow_network and network_namespace_available()

    def limit_child() -> None:  # runs in the forked child before exec
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if isolate_net:
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-c",
        _BOOTSTRAP.format(block=not allow_network),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=limit_child,
        start_new_session=True,
    )
    proc.stdin.write(code.encode())
    proc.stdin.close()
    truncated = False

    async def read_capped(stream: asyncio.StreamReader) -> bytes:
        nonlocal truncated
        kept = bytearray()
        while chunk := await stream.read(65536):  # keep draining so the child never blocks on a full pipe
            room = max_output_bytes - len(kept)
            truncated |= len(chunk) > room
            kept += chunk[:room]
        return bytes(kept)

    readers = asyncio.gather(read_capped(proc.stdout), read_capped(proc.stderr), proc.wait())
    timed_out = False
    try:
        out, err, _ = await asyncio.wait_for(asyncio.shield(readers), timeout_s)
    except TimeoutError:
        timed_out = True
        _kill_group(proc.pid)
        out, err, _ = await readers
    except BaseException:  # cancelled by the agent's own timeout: never leave the child running
        _kill_group(proc.pid)
        raise
    return ExecutionResult(
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        output_truncated=truncated,
    )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
