"""Failures carry the real error (real Ray actors and tasks). A role whose start raises is named, with its exception,
in the run's failure message: a trainer rank by its role and rank, any other role's actor by its class (before, both
read "driver: the process died" and the exception was only in failure.txt, e.g. model.freeze_moe_router on a dense
model). The chat server's 5xx carries the engine's own message, also when vLLM raises an empty EngineGenerateError
whose cause holds it (images to a text-only model gave `500 "EngineGenerateError: "`)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from types import SimpleNamespace

import pytest
import ray

from molt_hydra.agents.wire.server import failure_text
from molt_hydra.parallel.group import RankStartFailed, TrainerGroup
from molt_hydra.parallel.trainer_spec import TrainerSpec
from molt_hydra.runtime.entrypoint import _report_failure
from molt_hydra.runtime.watchdog import describe

WHY = "Qwen3ForCausalLM has no MoE router this trainer supports"
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import a test module


class BrokenWorker:
    """A trainer rank whose model build raises, as TrainerWorker does for a knob the model cannot take."""

    def __init__(self, spec):
        raise NotImplementedError(WHY)


class AgentRunnerActor:
    """Named as the real agent-runner actor class, so the failure is told by Ray's `ray::Class.method()` line."""

    def __init__(self):
        raise ValueError("agent.runner needs a GPU")

    def ping(self):
        return True


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def report(tmp_path, error) -> list[str]:
    cfg = SimpleNamespace(output_dir=str(tmp_path), job=SimpleNamespace(value="rl"),
                          checkpoint=SimpleNamespace(dir=str(tmp_path / "checkpoints")))
    return asyncio.run(_report_failure(cfg, None, error))


def test_a_trainer_rank_whose_start_raises_is_named_with_its_error(local_ray, tmp_path):
    with pytest.raises(RankStartFailed) as e:
        TrainerGroup(1, TrainerSpec("tiny://qwen3_tiny"), num_cpus_per_rank=1, startup_timeout_s=120,
                     worker_cls=BrokenWorker)
    assert e.value.role == "actor rank 0"
    assert describe(e.value.error) == f"its start failed: NotImplementedError: {WHY}"
    lines = report(tmp_path, e.value)
    assert lines == [f"Run failed: actor rank 0: its start failed: NotImplementedError: {WHY}.",
                     "Last checkpoint: none (the run starts from step 0 again)",
                     f"Details (traceback): {tmp_path / 'failure.txt'}"]
    assert f"NotImplementedError: {WHY}" in (tmp_path / "failure.txt").read_text()


def test_another_roles_actor_whose_start_raises_is_named_by_its_class(local_ray, tmp_path):
    actor = ray.remote(AgentRunnerActor).remote()
    with pytest.raises(ray.exceptions.RayActorError) as e:
        ray.get(actor.ping.remote())
    (first, *_) = report(tmp_path, e.value)
    assert first == "Run failed: agent runner: its start failed: ValueError: agent.runner needs a GPU."


TEXT_ONLY = "Multi-modal processor not available for text-only models"  # what vLLM 0.32 says, as its cause


def engine_generate_error():
    from vllm.v1.engine.exceptions import EngineGenerateError

    try:
        raise ValueError(TEXT_ONLY)
    except ValueError as e:
        raise EngineGenerateError() from e


def test_a_5xx_carries_the_engines_message_in_process_and_across_ray(local_ray):
    with pytest.raises(Exception) as here:
        engine_generate_error()
    assert failure_text(here.value) == f"ValueError: {TEXT_ONLY}"
    with pytest.raises(Exception) as remote:
        ray.get(ray.remote(engine_generate_error).remote())
    assert type(remote.value).__name__.startswith("RayTaskError")
    assert f"ValueError: {TEXT_ONLY}" in failure_text(remote.value)


def test_an_eval_jobs_failure_offers_no_checkpoint_to_resume(tmp_path):
    """job=eval trains nothing. Before: its failure ended 'Last checkpoint: none (the run starts from step 0 again)'."""
    from molt_hydra.rollout.generator import RunFailed

    cfg = SimpleNamespace(output_dir=str(tmp_path), job=SimpleNamespace(value="eval"),
                          checkpoint=SimpleNamespace(dir=str(tmp_path / "checkpoints")))
    lines = asyncio.run(_report_failure(cfg, None, RunFailed("agent runner", "every eval rollout failed")))
    assert lines == ["Run failed: agent runner: every eval rollout failed.",
                     f"Details (traceback): {tmp_path / 'failure.txt'}"]


class Rank:
    """A trainer rank's call: the survivor's fails as gloo fails a collective whose peer died."""

    def step(self, fail: bool) -> int:
        if fail:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8861")
        return 1


def test_a_rank_that_died_is_named_over_the_peer_its_death_failed(local_ray):
    """Before: rank 1 killed mid-save ended the run as 'checkpoint writer (actor rank 0): save_checkpoint failed:
    RuntimeError: ... Connection closed by peer', naming the survivor (and a disk problem) rather than the dead rank."""
    from molt_hydra.runtime.calls import _every
    from molt_hydra.runtime.watchdog import RunFailed

    survivor, dead = ray.remote(Rank).remote(), ray.remote(Rank).remote()
    assert ray.get(dead.step.remote(False)) == 1
    ray.kill(dead)
    with pytest.raises(ray.exceptions.RayActorError):  # ray.kill is asynchronous: a call right after may still run
        for _ in range(300):
            ray.get(dead.step.remote(False))
            time.sleep(0.1)
    with pytest.raises(RunFailed) as e:
        asyncio.run(_every([survivor.step.remote(True), dead.step.remote(False)], 60, "actor", "train_step"))
    assert e.value.role == "actor 1"
    assert e.value.cause.startswith("train_step failed: the process died ("), e.value.cause


def test_a_group_lost_on_the_drivers_side_has_its_error_in_the_summary(tmp_path):
    """A group whose runner reply failed (rollout/generator.py `_group`) never reaches the runners' example errors.
    Before: the summary listed 'agent_exception 4' and no example error at all."""
    from molt_hydra.rollout.generator import RunFailed

    cause = "RuntimeError: AgentRunnerActor.run_group returned a list that cannot be sent to its caller"
    lines = report(tmp_path, RunFailed("agent runner", "every rollout failed", drops={"agent_exception": 4},
                                       examples={"agent_exception": cause, "agent_timeout": "not dropped here"}))
    assert lines[:3] == ["Run failed: agent runner: every rollout failed.",
                         "  dropped samples by reason: agent_exception 4",
                         f"  example error (agent_exception): {cause}"]


def test_agent_codes_print_and_logging_are_linked_in_output_dir_and_named(local_ray, tmp_path):
    """Before: what an Env / ChatAgent / reward function printed or logged went only to Ray's session files under
    /tmp/ray (log_to_driver=False), named nowhere: a researcher debugging a reward with print() saw nothing."""
    from molt_hydra.rollout.generator import RunFailed
    from molt_hydra.runtime import agent_runner

    class Runner(agent_runner.AgentRunnerActor):  # the real actor's output_files; a stand-in for its constructor
        def __init__(self):  # (a tokenizer and engines: not needed to say where the process's output goes)
            pass

        def agent_code(self, i):
            print(f"reward of rollout {i}: 0.5")  # as a user's reward function would
            logging.getLogger("my_env").warning("env %d: bad answer", i)
            try:  # as agents/base.py logs a failed rollout (before: its traceback went nowhere, the run's warnings
                raise ValueError(f"grader {i} is down")  # handler shadowing Python's last-resort one)
            except ValueError:
                logging.getLogger("molt_hydra.agents.base").exception("rollout r%d: agent raised", i)

    from molt_hydra.runtime.role_warnings import ENV

    # as a run's processes start: told where the run's warnings go (runtime/role_warnings.py)
    env = {"env_vars": {ENV: str(tmp_path / "role_warnings.jsonl")}}
    runners = [ray.remote(Runner).options(num_cpus=0, runtime_env=env).remote() for _ in range(2)]
    ray.get([r.agent_code.remote(i) for i, r in enumerate(runners)])
    line = asyncio.run(agent_runner.link_output(runners, str(tmp_path)))
    assert line == f"agent code's print / logging output: {tmp_path}/agent_runner_*.{{out,err}}"
    for i in range(2):
        assert f"reward of rollout {i}: 0.5\n" in (tmp_path / f"agent_runner_{i}.out").read_text()
        err = (tmp_path / f"agent_runner_{i}.err").read_text()
        assert f"env {i}: bad answer\n" in err
        assert f"ERROR molt_hydra.agents.base: rollout r{i}: agent raised\nTraceback" in err
        assert f"ValueError: grader {i} is down\n" in err
    lines = report(tmp_path, RunFailed("agent runner", "every rollout failed", drops={"agent_exception": 4}))
    assert lines[2] == (f"  agent code's output (print, logging, each failure's traceback): "
                        f"{tmp_path}/agent_runner_*.{{out,err}}"), lines
