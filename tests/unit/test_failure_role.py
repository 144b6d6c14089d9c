"""A role's actor that dies while the run starts (a kill -9 of the rollout engine before it is ready) is named in the
run's failure (runtime/entrypoint.py `_actor_role`): Ray's ActorDiedError names its class only on a `class_name:`
line. Before: 'Run failed: driver: the process died (...)'."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as value

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
