"""The actor's resume load (runtime/roles.py PolicyWorker.load_checkpoint, called on every rank through Ray by
runtime/entrypoint.py _load_verified, which reads rank 0's answer): the client state, with the loop's queued batches,
comes back from rank 0 alone. Before, every rank sent its copy through Ray (2 ranks, gloo, the tiny Qwen3)."""

import json
import sys
from pathlib import Path

from molt_hydra.parallel import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _policy_resume_jobs import policy_saves_and_resumes  # noqa: E402


def test_the_resumed_client_state_comes_back_from_rank_0_alone(tmp_path):
    launch.run_ranks(policy_saves_and_resumes, 2, str(tmp_path), timeout_s=300)
    state = json.loads((tmp_path / "rank0").read_text())
    assert state["loop"] == {"queued": list(range(1000))} and state["global_step"] == 0
    assert json.loads((tmp_path / "rank1").read_text()) is None
