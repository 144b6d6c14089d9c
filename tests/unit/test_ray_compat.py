"""compat/ray.py: once turned off, a Ray call made while no Ray runs raises instead of starting a Ray instance (a
trainer group's start, in a thread, did so after an interrupted run's ray.shutdown: tests/integration/test_faults.py)
and back as it was once the run is over; Ray's GCS and raylet that the run started are read there
(runtime/ray_head.py)."""

from __future__ import annotations

import pytest
import ray
from ray._private import auto_init_hook

from molt_hydra.compat import ray as compat


def test_no_ray_call_starts_ray_once_auto_init_is_off(monkeypatch):
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", True)  # (restored after the test)
    assert not ray.is_initialized()
    compat.no_auto_init()
    with pytest.raises(Exception, match="Ray has not been started yet"):
        ray.put(1)
    assert not ray.is_initialized()


def test_other_rays_are_refused(monkeypatch):
    import molt_hydra.compat

    monkeypatch.setattr(molt_hydra.compat, "installed", lambda *dists: ("ray", "2.61.0"))
    with pytest.raises(molt_hydra.compat.VersionError, match=r"turning off Ray's auto-init \(molt_hydra/compat/"
                       r"ray.py\) is written for ray 2\.60\.x; ray 2\.61\.0 is installed"):
        compat.no_auto_init()


def test_rays_node_still_keeps_its_processes_where_they_are_read():
    from ray._private import node, ray_constants, worker

    assert hasattr(worker, "_global_node") and callable(node.Node.dead_processes)
    assert (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET) == compat.HEAD


def test_a_dead_gcs_or_raylet_is_a_failure_naming_it_and_the_signal(monkeypatch):
    """Ray's node, standing in (a real one is the slow test's: tests/integration/test_faults.py): its processes are
    real ones, a killed `sleep` for the raylet and one for the log monitor, which the run goes on without."""
    import signal
    import subprocess
    from types import SimpleNamespace

    from ray._private import worker

    from molt_hydra.runtime.ray_head import dead_head

    killed = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    for p in killed:
        p.send_signal(signal.SIGKILL)
        p.wait()
    dead = [("log_monitor", killed[0])]
    monkeypatch.setattr(worker, "_global_node", SimpleNamespace(dead_processes=lambda: dead))
    assert dead_head() is None
    dead.append(("raylet", killed[1]))
    failed = dead_head()
    assert (failed.role, failed.cause) == ("Ray's raylet", "the process died (killed by SIGKILL); no role can go on "
                                                            "without it")
    monkeypatch.setattr(worker, "_global_node", None)  # (a Ray this process joined, or none)
    assert dead_head() is None


def test_a_ray_it_was_not_written_for_is_reported_in_one_message(monkeypatch, tmp_path):
    """init_ray's check refuses it; the failure's report must not reach into Ray again (a second VersionError, raised
    while the first was reported: a traceback)."""
    import asyncio
    from types import SimpleNamespace as value

    import molt_hydra.compat
    from molt_hydra.runtime.entrypoint import _report_failure

    monkeypatch.setattr(molt_hydra.compat, "installed", lambda *dists: ("ray", "2.61.0"))
    with pytest.raises(molt_hydra.compat.VersionError) as refused:
        compat.no_auto_init()
    cfg = value(output_dir=str(tmp_path), job=value(value="rl"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    lines = asyncio.run(_report_failure(cfg, None, refused.value))
    assert lines[0] == f"Run failed: driver: VersionError: {refused.value}.", lines


@pytest.mark.parametrize("ends", ["done", "failed", "interrupted"])
def test_after_a_run_in_this_process_rays_auto_init_is_as_it_was(monkeypatch, tmp_path, ends):
    """runtime/entrypoint.py `run` in this process (a notebook's call, cli.main in a test): the run turns auto-init off
    (init_ray, stood in for by a `_main` that does only that); once it ends, however it ends, a Ray call here starts
    Ray as Ray's default does. Before, auto-init stayed off: a later `ray.put(1)` raised 'Ray has not been started'."""
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    import molt_hydra.models.build
    from molt_hydra.config.schema import EXIT_INTERRUPTED
    from molt_hydra.runtime import entrypoint
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    async def run_main(*args):
        compat.no_auto_init()
        assert auto_init_hook.enable_auto_connect is False
        if ends == "interrupted":
            raise KeyboardInterrupt  # (a Ctrl-C where the event loop does not take it)
        return 0 if ends == "done" else EXIT_FAILED

    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", True)  # Ray's default (restored after the test)
    monkeypatch.setattr(entrypoint, "_main", run_main)
    monkeypatch.setattr(molt_hydra.models.build, "resolve_path", lambda path, weights=True: path)
    cfg = OmegaConf.to_object(compose_config([f"checkpoint.dir={tmp_path / 'ckpt'}"], output_dir=str(tmp_path)))
    if ends == "done":
        entrypoint.run(cfg)
    else:
        with pytest.raises(SystemExit) as e:
            entrypoint.run(cfg)
        assert e.value.code == (EXIT_FAILED if ends == "failed" else EXIT_INTERRUPTED)
    assert auto_init_hook.enable_auto_connect is True


def test_a_role_that_died_with_its_raylet_ending_behind_it_is_reported_as_the_raylet(monkeypatch, tmp_path):
    """A kill of Ray's dashboard agent ends its raylet gracefully (it fate-shares with the agent), its workers first:
    a trainer rank's death reached the driver while the raylet still lived, and the run was reported as 'actor rank
    0: train_step failed: ... Owner's node has crashed'. The report now waits (ray_head.EXIT_S) for the raylet's end.
    Ray's node stands in, its raylet a real process that ends 0.5 s after the failure (the slow test's is real:
    tests/integration/test_faults.py)."""
    import asyncio
    import subprocess
    from types import SimpleNamespace as value

    from ray._private import worker

    from molt_hydra.runtime.entrypoint import _report_failure
    from molt_hydra.runtime.watchdog import RunFailed

    cfg = value(output_dir=str(tmp_path), job=value(value="rl"), checkpoint=value(dir=str(tmp_path / "ckpt")))

    async def report(cause: BaseException) -> list[str]:
        raylet = subprocess.Popen(["sleep", "0.5"])
        monkeypatch.setattr(worker, "_global_node", value(dead_processes=lambda: [("raylet", raylet)]
                                                          if raylet.poll() is not None else [],
                                                          live_processes=lambda: []))  # (none stopped)
        try:
            raise RunFailed("actor rank 0", "train_step failed: the process died") from cause
        except RunFailed as error:
            return await _report_failure(cfg, None, error)

    died = ray.exceptions.RayActorError(error_msg="Worker exit detail: Owner's node has crashed.")
    lines = asyncio.run(report(died))
    assert lines[0] == "Run failed: Ray's raylet: the process died (exit status 0, as Ray ends it when its dashboard " \
                       "or runtime-env agent dies); no role can go on without it (first seen as actor rank 0: " \
                       "train_step failed: the process died).", lines
    # a role's own error, or its process's death alone, is reported at once, as it is: the raylet is not waited for
    for cause in (ValueError("bad batch"), ray.exceptions.RayActorError(error_msg="Worker exit type: SYSTEM_ERROR")):
        lines = asyncio.run(report(cause))
        assert lines[0] == "Run failed: actor rank 0: train_step failed: the process died.", lines


def test_a_role_that_died_with_its_raylet_stopped_is_reported_as_the_raylet(monkeypatch, tmp_path):
    """SIGSTOP of the raylet: Ray's health check may take its node for dead, every actor with it. Before: the run
    was reported as 'actor rank 0: train_step failed: ... Owner's node has crashed', the stopped raylet not named.
    Ray's node stands in, its raylet a real stopped process (the real run: tests/integration/test_faults.py)."""
    import asyncio
    import signal
    import subprocess
    from types import SimpleNamespace as value

    from ray._private import worker

    from molt_hydra.runtime import entrypoint
    from molt_hydra.runtime.watchdog import RunFailed

    cfg = value(output_dir=str(tmp_path), job=value(value="rl"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    monkeypatch.setattr(entrypoint, "EXIT_S", 0.2)
    raylet, gcs = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(worker, "_global_node", value(dead_processes=lambda: [],
                                                      live_processes=lambda: [("gcs_server", gcs), ("raylet", raylet),
                                                                              ("log_monitor", raylet)]))

    async def report(cause: BaseException) -> list[str]:
        try:
            raise RunFailed("actor rank 0", "train_step failed: the process died") from cause
        except RunFailed as error:
            return await entrypoint._report_failure(cfg, None, error)

    died = ray.exceptions.RayActorError(error_msg="Worker exit detail: Owner's node has crashed.")
    try:
        raylet.send_signal(signal.SIGSTOP)
        while open(f"/proc/{raylet.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            pass
        lines = asyncio.run(report(died))
        assert lines[0] == f"Run failed: Ray's raylet: its process (pid {raylet.pid}) is stopped by a signal " \
                           "(SIGSTOP; SIGCONT resumes it); no role can go on without it (first seen as actor rank 0: " \
                           "train_step failed: the process died).", lines
        # a role's own error is its own, whatever the raylet's state
        assert asyncio.run(report(ValueError("bad batch")))[0] == "Run failed: actor rank 0: train_step failed: the " \
                                                                  "process died."
    finally:
        for p in (raylet, gcs):
            p.kill()
            p.wait()
