import asyncio
import socket
import time

import pytest

from molt_hydra.agents.python_executor import network_namespace_available, run_python


def run(coro):
    return asyncio.run(coro)


def test_output_and_errors():
    r = run(run_python("print(6*7)"))
    assert (r.stdout, r.exit_code, r.ok, r.as_observation()) == ("42\n", 0, True, "42")
    r = run(run_python("raise KeyError('k')"))
    assert r.exit_code == 1 and "KeyError: 'k'" in r.as_observation()


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    start = time.monotonic()
    r = run(run_python("while True:\n    pass", timeout_s=1.0))
    assert r.timed_out and r.exit_code is None and not r.ok
    assert time.monotonic() - start < 5
    assert "TimeoutError" in r.as_observation()


def test_allocating_4gb_fails_under_the_memory_limit():
    r = run(run_python("x = bytearray(4 * 2**30)\nprint('allocated')", memory_mb=512))
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_a_socket_is_refused_and_nothing_connects():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    r = run(run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"))
    assert r.exit_code == 1 and "PermissionError: network access is disabled" in r.stderr
    with pytest.raises(BlockingIOError):
        server.accept()  # no connection ever arrived
    server.close()


@pytest.mark.skipif(not network_namespace_available(), reason="needs CAP_SYS_ADMIN for a network namespace")
def test_a_grandchild_process_has_no_network_either():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = ("import subprocess, sys\n"
            f"c = 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)'\n"
            "p = subprocess.run([sys.executable, '-c', c], capture_output=True, text=True)\n"
            "print(p.returncode, p.stderr.strip().splitlines()[-1])")
    r = run(run_python(code))
    assert r.stdout.startswith("1 OSError: [Errno 101] Network is unreachable"), r
    server.close()


def test_network_can_be_allowed():
    r = run(run_python("import socket\nsocket.socket().close()\nprint('ok')", allow_network=True))
    assert r.stdout == "ok\n"


def test_output_is_capped():
    r = run(run_python("print('x' * 100000)", max_output_bytes=100))
    assert r.stdout == "x" * 100 and r.output_truncated and r.exit_code == 0
