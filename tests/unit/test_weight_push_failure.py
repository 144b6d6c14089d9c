"""A weight push that fails on the trainer's rank 0 (weight_sync/sender.py push_from_rank), as it does when an
engine's vLLM core dies mid-sync: the other ranks gather every bucket (FSDP collectives) while rank 0 pushes. Before,
rank 0 stopped gathering at the failed bucket, and the other ranks waited on it in the next gather until the
collective timeout (train.timeouts.collective_s, 1800 s), the driver until the engine-call deadline (900 s): the run
stalled instead of replacing the engine (runtime/calls.py push_weights). Now rank 0 takes part in every gather, then
raises."""

import sys
from pathlib import Path

from molt_hydra.parallel import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _weight_push_job import push_fails_on_rank_0  # noqa: E402


def test_a_push_failing_on_rank_0_leaves_the_other_ranks_collectives_in_step(tmp_path):
    launch.run_ranks(push_fails_on_rank_0, 2, str(tmp_path), timeout_s=120)
    assert (tmp_path / "rank0").read_text() == "RuntimeError: EngineDeadError: the engine core died"
    assert (tmp_path / "rank1").read_text() == "returned {}"
