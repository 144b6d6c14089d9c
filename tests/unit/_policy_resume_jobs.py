"""Two-rank job for tests/unit/test_policy_resume_return.py, in a module of its own: each spawned rank imports it."""

import json
from pathlib import Path


def policy_saves_and_resumes(rank: int, world: int, port: int, path: str) -> None:
    """The actor's rank class as runtime/roles.py builds it (the tiny Qwen3, gloo): a save of the loop's state, then
    the resume's load of that step; writes what the load returned (what Ray sends the driver) to `<path>/rank<r>`."""
    from molt_hydra.models.build import resolve_path
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    from molt_hydra.runtime.roles import PolicyWorkerMixin

    policy = type("PolicyWorker", (PolicyWorkerMixin, TrainerWorker), {})
    worker = policy(TrainerSpec(rank=rank, world_size=world, master_port=port, total_steps=10, timeout_s=120,
                                model_path=resolve_path("tiny://qwen3_tiny")))
    root = str(Path(path, "ckpt"))
    worker.save_checkpoint(root, {"loop": {"queued": list(range(1000))}}, tag=1)
    Path(path, f"rank{rank}").write_text(json.dumps(worker.load_checkpoint(root, step="step_1")))
    worker.shutdown()
