"""A call that rank 0 alone acts in fails there, while the other trainer ranks take part in its collectives: each is
told at once, and the ranks' collectives stay in step (2 ranks, gloo).

* A weight push (weight_sync/sender.py push_from_rank), failing as it does when an engine's vLLM core dies mid-sync:
  the other ranks gather every bucket (FSDP collectives) while rank 0 pushes. Before, rank 0 stopped gathering at the
  failed bucket, and the other ranks waited on it in the next gather until the collective timeout
  (train.timeouts.collective_s, 1800 s), the driver until the engine-call deadline (900 s): the run stalled instead of
  replacing the engine (runtime/calls.py push_weights). Now rank 0 takes part in every gather, then raises.
"""

import sys
from pathlib import Path

from molt_hydra.parallel import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rank_0_failure_jobs import export_fails_on_rank_0, push_fails_on_rank_0  # noqa: E402


def test_a_push_failing_on_rank_0_leaves_the_other_ranks_collectives_in_step(tmp_path):
    launch.run_ranks(push_fails_on_rank_0, 2, str(tmp_path), timeout_s=120)
    assert (tmp_path / "rank0").read_text() == "RuntimeError: EngineDeadError: the engine core died"
    assert (tmp_path / "rank1").read_text() == "returned {}"


def test_an_export_failing_on_rank_0_fails_on_every_rank_at_once(tmp_path):
    """parallel/checkpoint.py export_hf (the final, best and per-checkpoint HF exports): rank 0 writes, the others
    waited in a barrier. Before, rank 0's write error (a full disk...) left them there until the collective timeout
    (train.timeouts.collective_s, 30 min), and the run's end with them. Now every rank raises it, naming rank 0."""
    launch.run_ranks(export_fails_on_rank_0, 2, str(tmp_path), timeout_s=120)
    tmp = tmp_path / "in_the_way" / ".tmp-hf"
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == (
            f"RuntimeError: writing {tmp} failed on rank 0: NotADirectoryError: [Errno 20] Not a directory: '{tmp}'")
