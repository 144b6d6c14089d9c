"""Run model-written Python in a sandbox: bubblewrap where it is installed, rlimits + netns + audit hook otherwise.

bubblewrap (`bwrap`, Debian's `bubblewrap`; `make install` brings it) gives each call fresh pid, network, ipc, uts
and mount namespaces: the file system is only /usr, the Python install and its venv (all read-only), a fresh
/proc and a minimal /dev, plus a size-capped tmpfs at /tmp that is the working directory, the only writable place,
and is gone when the call ends (mounted before the read-only binds, so a Python or venv living under /tmp stays
visible, read-only, inside it). /etc holds only ld.so.cache and localtime; no project or run directory, no
home. Started as root, the code then runs
as an unprivileged uid of its own (`setpriv`, no capabilities, no groups), so RLIMIT_NPROC counts only this call's
processes; started as a user, bwrap maps that user into a user namespace. Killing bwrap kills the whole pid
namespace (`--die-with-parent`), grandchildren included.

The fallback (no working bwrap) is the earlier mechanism: a fresh network namespace when the process may create one
(root / CAP_SYS_ADMIN), an audit hook refusing every `socket.*` event (holds without privileges), rlimits, a
scratch working directory removed after the call and a scrubbed environment; it does not hide or protect the file
system and keeps the caller's uid. `sandbox_in_use()` says which one runs, with the reason; the run record
names it.

In both, the environment is only what the interpreter needs (no WANDB_API_KEY or other secrets of the trainer), and
rlimits cap address space, processes, open files and file size; the wall-clock limit kills the process group.
The limits are arguments (Molt's PYTHON_EXECUTOR_* environment knobs become agent kwargs, see `SandboxLimits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
SCRATCH = "/tmp"  # where the scratch tmpfs is mounted inside bwrap (and the working directory)
KILL_GRACE_S = 5.0  # after the wall-clock limit, the killed group's last output is read this long at most

# Runs in the child before the user code; audit hooks cannot be removed once added.
_BOOTSTRAP = """
import resource, sys
_nproc = {nproc}  # (a literal `32 is not None` would print a SyntaxWarning into every call's stderr)
if _nproc is not None:  # set here, inside the namespaces: see _process_limit
    resource.setrlimit(resource.RLIMIT_NPROC, (_nproc, _nproc))
def _no_network(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in this sandbox")
if {block}:
    sys.addaudithook(_no_network)
del _no_network
_code = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")  # the code as the agent's str holds it
sys.stdin = open("/dev/null")
try:
    exec(compile(_code, "<code>", "exec"), {{"__name__": "__main__"}})
except (SystemExit, KeyboardInterrupt):
    raise
except BaseException as _e:  # the traceback of the code's own frames: not this bootstrap's line, which it never wrote
    _e.__traceback__ = _e.__traceback__.tb_next  # (the hook prints the exception's own traceback)
    sys.excepthook(type(_e), _e, _e.__traceback__)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits; the python-tool agents take them as kwargs `exec_<name>` (e.g. `exec_max_processes`)."""

    timeout_s: float = 10.0
    "Wall-clock limit (Molt: PYTHON_EXECUTOR_TIMEOUT, 10 s)."
    memory_mb: int = 1024
    "Address-space limit per process (Molt: PYTHON_EXECUTOR_MEM_BYTES, 1 GiB)."
    max_output_bytes: int = 16384
    "stdout and stderr are each cut here (Molt: PYTHON_EXECUTOR_OUTPUT_CHARS, 2048 chars)."
    max_processes: int = 32
    "Processes and threads of the call (RLIMIT_NPROC): a fork bomb stops here."
    max_open_files: int = 256
    "Open file descriptors per process (RLIMIT_NOFILE)."
    max_file_mb: int = 64
    "Largest file (RLIMIT_FSIZE); under bwrap also the size of the whole scratch tmpfs."

    BOUNDS = {"timeout_s": (0.1, 3600), "memory_mb": (64, 1 << 20), "max_output_bytes": (1, 1 << 26),
              "max_processes": (4, 4096), "max_open_files": (16, 1 << 16), "max_file_mb": (1, 1 << 20)}

    @classmethod
    def from_agent_kwargs(cls, exec_kwargs: dict) -> "SandboxLimits":
        """From an agent's `exec_<name>=value` kwargs; an unknown name is refused with the known ones."""
        names = [f.removeprefix("exec_") for f in exec_kwargs]
        unknown = [k for k, n in zip(exec_kwargs, names) if not k.startswith("exec_") or n not in cls.BOUNDS]
        if unknown:
            raise ValueError(f"agent.runner.{unknown[0]}: not a python-tool kwarg. Fix: use max_turns or one of "
                             f"{', '.join('exec_' + n for n in cls.BOUNDS)}.")
        return cls(**dict(zip(names, exec_kwargs.values())))

    def __post_init__(self):
        for name, (low, high) in self.BOUNDS.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high):
                raise ValueError(f"agent.runner.exec_{name}: must be a number in [{low}, {high}], got {value!r}. "
                                 f"Fix: set agent.runner.exec_{name}={getattr(SandboxLimits, name)} (the default) "
                                 f"or a value in range.")


@dataclass
class ExecutionResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed for the time limit
    timed_out: bool
    output_truncated: bool
    sandbox: str = ""
    "`bwrap` or `rlimits`: which mechanism ran the call."
    limits: SandboxLimits | None = None
    "The limits it ran under (named in `as_observation`)."

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def as_observation(self) -> str:
        """The text an agent feeds back to the model: stdout, then why the call failed, and that its output was cut
        (was: a cut output, and a process killed by a signal or exiting non-zero without a word on stderr, read as
        the whole output of a call that succeeded)."""
        limits = self.limits or SandboxLimits()
        tail = (f"\nTimeoutError: execution exceeded the time limit of {limits.timeout_s:g} s" if self.timed_out
                else "" if self.ok else self.stderr if self.stderr.strip() else f"\n{self._ended()}")
        cut = (f"\n[output truncated: stdout and stderr are each cut at {limits.max_output_bytes} bytes]"
               if self.output_truncated else "")
        return (self.stdout + tail).strip() + cut

    def _ended(self) -> str:
        """How a process that failed without a word on stderr ended: its exit code, or the signal that killed it
        (negative under the rlimits fallback, as Popen reports it; 128 + the signal under bwrap, as it reports it)."""
        code = self.exit_code
        number = -code if code < 0 else code - 128 if self.sandbox == "bwrap" and code > 128 else None
        try:
            return f"Process killed by signal {signal.Signals(number).name} (exit code {code})"
        except ValueError:  # no signal of that number (or none: a plain exit code)
            return f"Process exited with code {code}"


@functools.cache
def network_namespace_available() -> bool:
    """Whether children can get their own network namespace here (the fallback's network isolation): probed once
    with the children's own syscall in a throwaway interpreter (it needs CAP_SYS_ADMIN; a failure must not surprise
    the sandbox, and a fork of this threaded process could deadlock). Off Linux the probe fails: False."""
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare({CLONE_NEWNET}) != 0)"
    return subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True).returncode == 0


def _read_only_roots() -> list[str]:
    """What the interpreter needs: /usr (merged-/usr Debian: /bin, /lib are links into it), Python, its venv."""
    roots = {"/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix),
             os.path.dirname(os.path.realpath(sys.executable))}
    roots = sorted(r for r in roots if r != "/")
    return [r for r in roots if not any(r != o and r.startswith(o + "/") for o in roots)]


def _bwrap_argv(limits: SandboxLimits, allow_network: bool, uid: int | None) -> list[str]:
    argv = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session"]
    argv += ["--unshare-user", "--uid", "65534", "--gid", "65534"] if uid is None else []  # not root: a userns
    argv += [] if allow_network else ["--unshare-net"]
    # The scratch tmpfs first: the read-only binds below land on top of it, so an interpreter or venv that lives
    # under /tmp (a checkout there) stays visible instead of being hidden by the fresh /tmp.
    argv += ["--perms", "1777", "--size", str(limits.max_file_mb * 2**20), "--tmpfs", SCRATCH]
    made = {"/", SCRATCH}
    for root in _read_only_roots():
        # bwrap makes missing parents 0700: the dropped uid could not pass them
        for parent in map(str, reversed(Path(root).parents)):
            if parent not in made:
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        argv += ["--ro-bind", root, root]
        made.add(root)
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host) and host not in made:
            argv += ["--ro-bind", host, host]
    argv += ["--perms", "0755", "--dir", "/etc"]
    for path in ["/etc/ld.so.cache", "/etc/localtime"] + ["/etc/resolv.conf", "/etc/hosts", "/etc/ssl"] * allow_network:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--chdir", SCRATCH]
    if uid is not None:  # root: leave for a uid of this call's own, without capabilities or groups
        argv += ["--", "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all"]
    return argv + ["--"]


@functools.cache
def _bwrap_problem() -> str | None:
    """None when bwrap can build the sandbox here, else why not (probed once with the real arguments)."""
    if sys.platform != "linux":
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap; `make install` does it as root)"
    uid = 2**30 if os.geteuid() == 0 else None
    if uid is not None and shutil.which("setpriv") is None:
        return "setpriv (util-linux) is missing, needed to drop root inside bwrap"
    argv = _bwrap_argv(SandboxLimits(), False, uid) + [sys.executable, "-I", "-c", "import os; print(os.getuid())"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=_child_env(SCRATCH))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap failed to start: {e}"
    if out.returncode != 0:
        # Typically "No permissions to create new namespace" (unprivileged user namespaces disabled by
        # kernel.unprivileged_userns_clone / AppArmor, or a container without CAP_SYS_ADMIN).
        return f"bwrap cannot create its namespaces here: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


@functools.cache
def sandbox_in_use() -> str:
    """One line naming the sandbox model-written code gets on this host, and what it lacks."""
    problem = _bwrap_problem()
    if problem is None:
        version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
        who = "an unprivileged uid per call" if os.geteuid() == 0 else "the caller's uid in a user namespace"
        return (f"bwrap ({version}): pid/net/mount/ipc/uts namespaces, read-only /usr + python, tmpfs scratch, "
                f"{who}, empty environment, rlimits")
    net = "network namespace + audit hook" if network_namespace_available() else "audit hook only (no netns)"
    nproc = "no process limit (root)" if os.geteuid() == 0 else "process limit on the caller's uid"
    return (f"rlimits fallback ({problem}): {net}, scratch cwd, empty environment, {nproc}; NO file-system "
            f"isolation, runs as uid {os.geteuid()}")


def _child_env(scratch: str) -> dict[str, str]:
    # Nothing of the trainer's environment: only what the interpreter needs. One BLAS thread: threads count
    # against max_processes, and a BLAS pool as wide as the node would not fit.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


async def run_python(code: str, *, allow_network: bool = False, sandbox: str = "auto", **limits) -> ExecutionResult:
    """Run `code` with `python -I` in the sandbox (`auto`: bwrap if it works here, else `rlimits`) under
    `SandboxLimits(**limits)` (`timeout_s=`, `memory_mb=`, ...); kill the whole group at `timeout_s`."""
    limits = SandboxLimits(**limits)
    if sandbox not in ("auto", "bwrap", "rlimits"):
        raise ValueError(f"sandbox: must be auto, bwrap or rlimits, got {sandbox!r}")
    if not isinstance(code, str):  # a tool call's arguments {"code": 5}: the model sees the error, as Python's own
        # (was: an AttributeError out of the agent, after the sandbox had started: its process waited on stdin for
        # the rest of the run, one more for every such call)
        return ExecutionResult("", f"TypeError: the code is {type(code).__name__} {code!r:.60}, not a string of "
                               "Python source\n", 1, False, False)
    if sandbox == "auto":
        sandbox = "bwrap" if _bwrap_problem() is None else "rlimits"
    elif sandbox == "bwrap" and _bwrap_problem() is not None:
        raise RuntimeError(f"sandbox=bwrap: {_bwrap_problem()}")
    isolate_net = sandbox == "rlimits" and not allow_network and network_namespace_available()
    scratch = SCRATCH if sandbox == "bwrap" else tempfile.mkdtemp(prefix="molt-python-")
    # A uid of this call's own (root only): RLIMIT_NPROC counts per uid, so concurrent calls do not share it. Drawn
    # from the OS, not Python's `random`, which agent code (and the runner, per rollout) seeds (was: two calls after
    # one seed ran as one uid, and one's processes counted against the other's limit).
    uid = 2**30 + secrets.randbelow(2**30) if sandbox == "bwrap" and os.geteuid() == 0 else None
    prefix = _bwrap_argv(limits, allow_network, uid) if sandbox == "bwrap" else []

    def limit_child() -> None:  # runs in the forked child before exec; rlimits are inherited through bwrap
        for kind, value in ((resource.RLIMIT_AS, limits.memory_mb * 2**20), (resource.RLIMIT_CORE, 0),
                            (resource.RLIMIT_NOFILE, limits.max_open_files),
                            (resource.RLIMIT_FSIZE, limits.max_file_mb * 2**20)):
            resource.setrlimit(kind, (value, value))
        if isolate_net:
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)

    bootstrap = _BOOTSTRAP.format(block=not allow_network, nproc=_process_limit(sandbox, limits.max_processes))
    pipe = asyncio.subprocess.PIPE
    try:
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-I", "-c", bootstrap, stdin=pipe, stdout=pipe, stderr=pipe,
            preexec_fn=limit_child, start_new_session=True, cwd=None if sandbox == "bwrap" else scratch,
            env=_child_env(scratch))
        return await _communicate(proc, code, limits, sandbox)
    finally:
        if sandbox == "rlimits":
            shutil.rmtree(scratch, ignore_errors=True)


def _process_limit(sandbox: str, max_processes: int) -> int | None:
    """RLIMIT_NPROC for the child. It counts every task of the uid, and the kernel also checks a user namespace's
    count against the limit its creator had, so it is set by the child inside bwrap's namespaces (set before, a
    user's other processes would already exceed it and bwrap could not even start). In the fallback the uid is the
    caller's: its tasks so far plus `max_processes`; root ignores the limit there."""
    if sandbox == "bwrap":
        return max_processes
    if os.geteuid() == 0:
        return None
    tasks = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # the process ended meanwhile
            continue
        if int(fields["Uid"].split()[0]) == os.getuid():
            tasks += int(fields["Threads"])
    return tasks + max_processes


async def _communicate(proc, code: str, limits: SandboxLimits, sandbox: str) -> ExecutionResult:
    proc.stdin.write(code.encode("utf-8", "surrogatepass"))  # a lone surrogate (a tool call's JSON "\ud800") too
    proc.stdin.close()
    truncated, out, err = False, bytearray(), bytearray()

    async def read_capped(stream: asyncio.StreamReader, kept: bytearray) -> None:
        nonlocal truncated
        while chunk := await stream.read(65536):  # keep draining so the child never blocks on a full pipe
            room = limits.max_output_bytes - len(kept)
            truncated |= len(chunk) > room
            kept += chunk[:room]

    readers = asyncio.gather(read_capped(proc.stdout, out), read_capped(proc.stderr, err), proc.wait())
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(readers), limits.timeout_s)
    except TimeoutError:
        timed_out = True
        _kill_group(proc.pid)
        # the group's end closes the pipes, unless a process that left it holds them (setsid; only the rlimits
        # fallback lets one outlive the call): then what was read so far (was: the call waited for that process)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(readers, KILL_GRACE_S)
    except BaseException:  # cancelled by the agent's own timeout: never leave the child running
        _kill_group(proc.pid)
        raise
    return ExecutionResult(out.decode(errors="replace"), err.decode(errors="replace"),
                           None if timed_out else proc.returncode, timed_out, truncated, sandbox, limits)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
