"""The python-tool sandbox, probed the way model-written code would try to escape it.

The escape tests run the default sandbox (bubblewrap; `make install` installs it as root) and need it to work here;
the fallback (`sandbox="rlimits"`) keeps what it promises: scrubbed environment, scratch cwd, rlimits, no network.
"""

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import molt_hydra
from molt_hydra.agents import python_executor
from molt_hydra.agents.python_executor import SandboxLimits, network_namespace_available, run_python

BWRAP_PROBLEM = python_executor._bwrap_problem()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"bubblewrap sandbox unusable: {BWRAP_PROBLEM}")


def run(coro):
    return asyncio.run(coro)


def _processes_of(uid: int) -> list[int]:
    """`uid`'s processes once those killed at the call's end had 20 s to go: their exit and reaping follow the call's
    return, slower on a loaded box (was: a fixed 0.5 s); what survived the call sleeps 60 s, or forks on."""
    deadline = time.monotonic() + 20
    while True:
        found = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                uid_line = next(ln for ln in status.read_text().splitlines() if ln.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if int(uid_line.split()[1]) == uid:
                found.append(int(status.parent.name))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ normal tool code still runs
def test_output_and_errors():
    r = run(run_python("print(6*7)"))
    assert (r.stdout, r.exit_code, r.ok, r.as_observation()) == ("42\n", 0, True, "42")
    r = run(run_python("raise KeyError('k')"))
    assert r.exit_code == 1 and "KeyError: 'k'" in r.as_observation()


@pytest.mark.parametrize("sandbox", ["auto", "rlimits"])
def test_stderr_holds_the_codes_own_output_only(sandbox):
    """Before: every call's stderr began with the sandbox bootstrap's own `<string>:3: SyntaxWarning: "is not" with a
    literal`, so every failed call's observation showed the model a warning about code it never wrote."""
    r = run(run_python("import sys\nsys.exit('boom')", sandbox=sandbox))
    assert (r.stderr, r.exit_code, r.as_observation()) == ("boom\n", 1, "boom")


def test_code_holding_a_lone_surrogate_fails_in_the_sandbox_as_python_would():
    """A tool call's JSON may decode to a lone surrogate ("\\ud800"). Before: run_python raised UnicodeEncodeError
    itself, so the agent's whole rollout failed; now the code reaches Python, whose compile refuses it, and the
    model sees that error."""
    r = run(run_python("s = '\ud800'"))
    assert r.exit_code == 1 and r.stderr.strip().endswith(
        "UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' in position 5: surrogates not allowed")


@pytest.mark.parametrize("code", [5, None, b"print(1)", ["print(1)"]])
def test_code_that_is_no_string_is_the_calls_error_and_starts_no_process(code, monkeypatch):
    """A tool call's arguments may be {"code": 5}. Before: run_python started the sandbox, then raised AttributeError
    ('int' object has no attribute 'encode') out of the agent, failing its rollout; the started process waited on its
    stdin for the rest of the run, one more for each such call. Now the model sees the error, as it sees Python's."""
    async def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", no_process)
    r = run(run_python(code))
    assert (r.stdout, r.exit_code, r.ok, r.timed_out) == ("", 1, False, False)
    assert r.as_observation() == f"TypeError: the code is {type(code).__name__} {code!r}, not a string of Python source"


def test_math_and_numpy_run_and_output_is_captured():
    pytest.importorskip("numpy")
    code = "import math, numpy as np\nprint(math.comb(10, 3))\nprint(int(np.arange(1, 101).sum()))"
    r = run(run_python(code))
    assert r.stdout == f"{120}\n{5050}\n" and r.ok, r


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    r = run(run_python("while True:\n    pass", timeout_s=1.0))
    assert r.timed_out and r.exit_code is None and not r.ok  # (timed_out: the call's own 1 s limit fired)
    assert "TimeoutError" in r.as_observation()


@pytest.mark.timeout(40)  # before: the call returned when the escaped process did, 60 s on
def test_a_process_that_left_the_group_holding_the_pipes_cannot_hold_the_call_past_its_limit():
    """In the rlimits fallback a process may leave the call's process group (setsid) and outlive it with stdout open.
    Before: the call read until that process ended, ignoring timeout_s; now it returns timed out, with what was read,
    once the killed group's output has had KILL_GRACE_S. (Under bwrap, killing the sandbox ends every process.)"""
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    print(os.getpid(), flush=True)\n"
            "    time.sleep(60)\nelse:\n    time.sleep(0.5)\n    print('parent', flush=True)")

    async def call_then_end_the_escaped_process():
        start = time.monotonic()
        r = await run_python(code, timeout_s=1, sandbox="rlimits")
        took = time.monotonic() - start
        os.kill(int(r.stdout.split()[0]), 9)
        await asyncio.sleep(0.5)  # its pipes close on this loop (no transport left open when it ends)
        return r, took

    r, took = run(call_then_end_the_escaped_process())
    escaped, parent = r.stdout.split()
    assert r.timed_out and r.exit_code is None and parent == "parent"
    assert 1 <= took < 1 + python_executor.KILL_GRACE_S + 3, took


def test_allocating_4gb_fails_under_the_memory_limit():
    r = run(run_python("x = bytearray(4 * 2**30)\nprint('allocated')", memory_mb=512))
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_output_is_capped():
    r = run(run_python("print('x' * 100000)", max_output_bytes=100))
    assert r.stdout == "x" * 100 and r.output_truncated and r.exit_code == 0


def test_a_cut_output_says_so_in_the_observation():
    """Before: the observation was the first max_output_bytes of stdout and nothing else, so the model read a cut
    output as all the code printed."""
    r = run(run_python("print('x' * 1000)", max_output_bytes=100))
    assert r.as_observation() == "x" * 100 + "\n[output truncated: stdout and stderr are each cut at 100 bytes]"
    assert run(run_python("print('x' * 100)", max_output_bytes=101)).as_observation() == "x" * 100  # (not cut)


@pytest.mark.parametrize("sandbox", ["auto", "rlimits"])
def test_a_process_killed_or_failing_without_a_word_says_how_it_ended(sandbox):
    """Before: a call killed by a signal (or exiting non-zero with nothing on stderr) was observed as its stdout
    alone, "before", as if it had succeeded. The exit code is -9 in the fallback (as Popen reports it) and 128 + 9
    under bwrap (as bwrap reports it): the signal is named in both."""
    r = run(run_python("import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)",
                       sandbox=sandbox))
    assert r.exit_code in (-9, 128 + 9) and not r.ok
    assert r.as_observation() == f"before\n\nProcess killed by signal SIGKILL (exit code {r.exit_code})"
    r = run(run_python("import sys\nprint('hi')\nsys.exit(3)", sandbox=sandbox))
    assert r.as_observation() == "hi\n\nProcess exited with code 3"


def test_a_timed_out_call_names_its_limit():
    r = run(run_python("import time\nprint('start', flush=True)\ntime.sleep(30)", timeout_s=1.5))
    assert r.as_observation() == "start\n\nTimeoutError: execution exceeded the time limit of 1.5 s"


@pytest.mark.parametrize("sandbox", ["auto", "rlimits"])
def test_a_traceback_shows_the_codes_own_frames_only(sandbox):
    """Before: every traceback began with the sandbox bootstrap's frame, `File "<string>", line 14, in <module>`, a
    line of code the model never wrote, in every failed call's observation."""
    r = run(run_python("def f():\n    return 1 / 0\nf()", sandbox=sandbox))
    assert r.exit_code == 1 and r.stderr == ('Traceback (most recent call last):\n'
                                             '  File "<code>", line 3, in <module>\n'
                                             '  File "<code>", line 2, in f\nZeroDivisionError: division by zero\n')


def test_limits_out_of_bounds_are_refused_with_the_key():
    with pytest.raises(ValueError, match=r"agent\.runner\.exec_max_processes: must be a number in \[4, 4096\]"):
        SandboxLimits(max_processes=0)
    with pytest.raises(ValueError, match=r"exec_max_file_mb"):
        run(run_python("print(1)", max_file_mb=-1))


# ---------------------------------------------------------------------------------------------------------- escapes
@needs_bwrap
def test_the_default_sandbox_is_bubblewrap_and_says_so():
    assert run(run_python("print(1)")).sandbox == "bwrap"
    assert python_executor.sandbox_in_use().startswith("bwrap (bubblewrap ")


@pytest.mark.parametrize("sandbox", ["auto", "rlimits"])
def test_a_secret_in_the_parents_environment_is_not_visible(monkeypatch, sandbox):
    monkeypatch.setenv("WANDB_API_KEY", "s3cret-key")
    r = run(run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('WANDB_API_KEY'))",
                       sandbox=sandbox))
    assert r.ok and "s3cret-key" not in r.stdout and r.stdout.splitlines()[-1] == "None", r


@needs_bwrap
def test_a_secret_cannot_be_read_from_another_process():
    # A trainer-side process started with the key in its environment: /proc/<pid>/environ would show it.
    holder = subprocess.Popen(["sleep", "60"], env={"WANDB_API_KEY": "s3cret-key", "PATH": os.environ["PATH"]})
    try:
        code = ("import os\nfor pid in [" + str(holder.pid) + ", " + str(os.getpid()) + "]:\n"
                "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
                "    except OSError as e:\n        print(type(e).__name__)")
        r = run(run_python(code))
    finally:
        holder.kill()
        holder.wait()
    assert r.ok and "s3cret-key" not in r.stdout, r
    assert r.stdout.split() == ["FileNotFoundError", "FileNotFoundError"]  # host processes are not even visible


@needs_bwrap
def test_nothing_outside_scratch_can_be_written(tmp_path):
    run_dir = tmp_path / "outputs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    project = Path(molt_hydra.__file__).resolve().parents[1]
    targets = [run_dir / "metrics.jsonl", run_dir / "new_file", project / "pwned.txt", Path(sys.prefix) / "pwned.txt",
               Path("/usr/pwned.txt"), Path("/pwned.txt")]
    code = ("import os\nfor t in " + repr([str(t) for t in targets]) + ":\n"
            "    try:\n        open(t, 'a').write('x')\n        print('WROTE', t)\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
            "open('inside_scratch.txt', 'w').write('ok')\nprint(open('inside_scratch.txt').read())")
    r = run(run_python(code))
    assert r.ok and "WROTE" not in r.stdout and r.stdout.splitlines()[-1] == "ok", r
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not any(t.exists() for t in targets[1:])


@needs_bwrap
def test_root_only_files_are_absent_and_the_code_is_not_root():
    code = ("import os\ntry:\n    print(open('/etc/shadow').read())\n"
            "except OSError as e:\n    print(type(e).__name__)\n"
            "print(os.getuid(), os.getgid(), os.getgroups())\n"
            "try:\n    os.setuid(0)\n    print('BECAME ROOT')\nexcept OSError as e:\n    print(type(e).__name__)\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    r = run(run_python(code))
    lines = r.stdout.splitlines()
    assert lines[0] == "FileNotFoundError", r
    uid, gid, groups = lines[1].split(" ", 2)
    assert int(uid) != 0 and int(gid) != 0 and groups == "[]"
    assert lines[2] == "PermissionError" and int(lines[3], 16) == 0  # no capability at all


@needs_bwrap
def test_process_count_is_capped_and_nothing_survives_the_call():
    # 40 sleepers wanted; the cap (processes + threads of this call's uid) stops them at max_processes - 1 children.
    code = ("import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
            "    n += 1\nprint(os.getuid(), n, flush=True)\ntime.sleep(60)")
    r = run(run_python(code, max_processes=8, timeout_s=3))
    uid, forked = map(int, r.stdout.split())
    # the parent itself is one of the 8, and so is bwrap's init (pid 1) when it runs as the same (non-root) uid
    assert r.timed_out and forked == 8 - 1 - (os.geteuid() != 0), r
    assert _processes_of(uid) == []


@needs_bwrap
def test_a_fork_bomb_is_contained_and_killed():
    code = ("import os\nprint(os.getuid(), flush=True)\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    r = run(run_python(code, max_processes=16, timeout_s=2))
    assert r.timed_out
    uid = int(r.stdout.split()[0])
    assert _processes_of(uid) == []


@pytest.mark.parametrize("sandbox", ["auto", "rlimits"])
def test_a_file_larger_than_the_limit_cannot_be_written(sandbox):
    code = ("try:\n    open('big', 'wb').write(b'x' * (3 * 2**20))\n    print('WROTE')\n"
            "except OSError as e:\n    print(e.strerror)")
    r = run(run_python(code, max_file_mb=1, sandbox=sandbox))
    assert r.stdout.strip() == "File too large", r


@needs_bwrap
def test_scratch_as_a_whole_is_capped():
    # Files under the per-file limit still fill at most max_file_mb in total (the scratch tmpfs is that big).
    code = ("import os\nfor i in range(4):\n    try:\n        open(f'f{i}', 'wb').write(b'x' * (4 * 2**20 // 10))\n"
            "    except OSError as e:\n        print(i, e.strerror)\n        break")
    r = run(run_python(code, max_file_mb=1))
    assert r.stdout.strip() == f"{2**20 // (4 * 2**20 // 10)} No space left on device", r  # 2 x 0.4 MiB fit in 1


@pytest.mark.parametrize("sandbox", ["auto", "rlimits"])
def test_the_scratch_directory_is_the_cwd_and_is_gone_after_the_call(sandbox):
    first = run(run_python("import os\nopen('marker', 'w').write('x')\nprint(os.getcwd())\nprint(os.listdir('.'))",
                           sandbox=sandbox))
    assert first.ok and first.stdout.splitlines()[1] == "['marker']", first
    second = run(run_python("import os\nprint(os.listdir('.'))", sandbox=sandbox))
    assert second.stdout == "[]\n", second
    if first.sandbox == "rlimits":  # a host directory: removed
        assert not Path(first.stdout.splitlines()[0]).exists()


def test_a_socket_is_refused_and_nothing_connects():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    r = run(run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
                       timeout_s=10))
    assert r.exit_code == 1 and "PermissionError: network access is disabled" in r.stderr
    with pytest.raises(BlockingIOError):
        server.accept()  # no connection ever arrived
    server.close()


@pytest.mark.parametrize("sandbox", ["auto", "rlimits"])
def test_a_grandchild_process_has_no_network_either(sandbox):
    if sandbox == "rlimits" and not network_namespace_available():
        pytest.skip("the fallback needs CAP_SYS_ADMIN for a network namespace")
    if sandbox == "auto" and BWRAP_PROBLEM is not None:
        pytest.skip(BWRAP_PROBLEM)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    code = ("import subprocess, sys\n"
            f"c = 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)'\n"
            "p = subprocess.run([sys.executable, '-c', c], capture_output=True, text=True)\n"
            "print(p.returncode, p.stderr.strip().splitlines()[-1])")
    r = run(run_python(code, sandbox=sandbox))
    # bwrap's namespace has its own loopback (refused), the fallback's none (unreachable): never the host's port.
    assert r.stdout.startswith(("1 ConnectionRefusedError", "1 OSError: [Errno 101] Network is unreachable")), r
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


def test_network_can_be_allowed():
    r = run(run_python("import socket\nsocket.socket().close()\nprint('ok')", allow_network=True))
    assert r.stdout == "ok\n"


def test_the_fallback_names_itself():
    assert run(run_python("print(1)", sandbox="rlimits")).sandbox == "rlimits"
    with pytest.raises(ValueError, match="sandbox: must be auto, bwrap or rlimits"):
        run(run_python("print(1)", sandbox="docker"))



def test_agent_kwargs_become_limits_and_unknown_ones_are_refused():
    limits = SandboxLimits.from_agent_kwargs({"exec_timeout_s": 3, "exec_max_processes": 16})
    assert (limits.timeout_s, limits.max_processes, limits.memory_mb) == (3, 16, SandboxLimits.memory_mb)
    with pytest.raises(ValueError, match=r"agent\.runner\.exec_timout_s: not a python-tool kwarg"):
        SandboxLimits.from_agent_kwargs({"exec_timout_s": 3})


def test_the_run_record_and_start_up_name_the_sandbox(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from molt_hydra.runtime import run_record

    monkeypatch.setattr(run_record, "config_as_dict", lambda cfg: {"name": cfg.name})
    cfg = SimpleNamespace(job=SimpleNamespace(value="rl"), name="probe")
    record = run_record.write_run_record(cfg, tmp_path)
    expected = "bwrap (bubblewrap " if BWRAP_PROBLEM is None else f"rlimits fallback ({BWRAP_PROBLEM})"
    assert record["python_tool_sandbox"].startswith(expected)
    assert f"python tool sandbox: {record['python_tool_sandbox']}" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/usr/bin/bwrap").exists() and not __import__("shutil").which("bwrap"),
                    reason="bubblewrap is not installed")
def test_bwrap_sandbox_works_with_the_venv_under_tmp(tmp_path_factory):
    """A checkout (and so its .venv) under /tmp: the scratch tmpfs at /tmp must not hide the interpreter (it did:
    "setpriv: failed to execute .../.venv/bin/python", and the tool fell back to rlimits). A venv is made under /tmp
    and the sandbox is run from its interpreter; bwrap must work there and run the code read-only beside the venv."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="molt-sbx-", dir="/tmp"))
    try:
        venv = base / "checkout" / ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        probe = (
            "import asyncio, importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('pe', {str(Path(python_executor.__file__))!r})\n"
            "pe = sys.modules['pe'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(pe)\n"
            "assert sys.prefix.startswith('/tmp/'), sys.prefix\n"
            "print('problem:', pe._bwrap_problem())\n"
            "code = 'import sys, os; print(sys.prefix, os.getcwd()); open(sys.prefix + \"/x\", \"w\")'\n"
            "r = asyncio.run(pe.run_python(code, sandbox='bwrap'))\n"
            "print('sandbox:', r.sandbox, 'exit:', r.exit_code)\n"
            "print(r.stdout.strip()); print(r.stderr.strip()[-200:])\n"
        )
        out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = out.stdout.splitlines()
        assert lines[0] == "problem: None", out.stdout
        assert lines[1] == "sandbox: bwrap exit: 1", out.stdout  # ran in bwrap; the write into the venv failed
        assert lines[2] == f"{venv} /tmp", out.stdout  # the venv's interpreter, with the scratch tmpfs as cwd
        assert "Read-only file system" in out.stdout, out.stdout
    finally:
        __import__("shutil").rmtree(base, ignore_errors=True)


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="a uid of each call's own is the sandbox's as root")
def test_concurrent_calls_after_the_same_random_seed_keep_process_limits_of_their_own():
    """Before: each call's uid came from Python's global `random`, which agent code seeds (`random.seed(0)`, or the
    runner seeding it per rollout, agents/base.py seed_agent_rngs): two calls made after the same seed ran as one uid,
    so RLIMIT_NPROC counted both calls' processes and one of them could start fewer than its max_processes allow."""
    import random

    code = ("import os, time\nn = 0\nfor _ in range(5):\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\n"
            "print(os.getuid(), n, flush=True)\ntime.sleep(60)")

    async def after_seed():
        random.seed(0)
        return await run_python(code, max_processes=4, timeout_s=4)

    async def both():
        return await asyncio.gather(after_seed(), after_seed())

    (uid_a, forked_a), (uid_b, forked_b) = (map(int, r.stdout.split()) for r in run(both()))
    assert uid_a != uid_b
    assert forked_a == forked_b == 4 - 1  # the parent is one of the 4
