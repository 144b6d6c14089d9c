"""The batch's samples over a trainer group's ranks: one slice per data-parallel group, the same slice for the tp x cp
ranks inside it, which split each sample's work. Before, each rank took a slice of its own, so tensor-parallel peers
ran their collectives over different samples, and the controller stacked every rank's log-probs as if the slices
were disjoint (tp x the batch)."""
from __future__ import annotations

import pytest
import torch

from molt_hydra.parallel.group import TrainerGroup
from molt_hydra.parallel.trainer_spec import TrainerSpec


def _group(world: int, tp: int, cp: int) -> TrainerGroup:
    """The group's own bookkeeping without Ray (its ranks are not what is tested): __init__'s sizes, from its spec."""
    group = TrainerGroup.__new__(TrainerGroup)
    spec = TrainerSpec(model_path="tiny://qwen3_tiny", tp_size=tp, cp_size=cp, dp_size=world // (tp * cp))
    group.num_ranks, group.replicas, group.dp_size = world, spec.tp_size * spec.cp_size, world // (tp * cp)
    return group


@pytest.mark.parametrize("world,tp,cp", [(4, 1, 1), (4, 2, 1), (8, 2, 2), (8, 1, 4)])
def test_each_data_parallel_group_takes_one_slice_on_all_its_ranks(world, tp, cp):
    dp = world // (tp * cp)
    samples = list(range(6 * dp))
    shards = _group(world, tp, cp).shard(samples)
    # the mesh's layout (torch's init_device_mesh, as AutoModel's dp x cp x tp): rank r sits at dp index r // (cp*tp)
    layout = torch.arange(world).reshape(dp, cp, tp)
    for d in range(dp):
        wanted = samples[d * 6:(d + 1) * 6]
        assert [shards[r] for r in layout[d].flatten().tolist()] == [wanted] * (cp * tp)


def test_per_shard_keeps_one_ranks_results_per_data_parallel_group():
    group = _group(8, 2, 2)
    results = [f"rank {r}" for r in range(8)]
    assert group.per_shard(results) == ["rank 0", "rank 4"]  # dp index 0 and 1 (r // 4)
    assert [x for rank in group.per_shard(group.shard(list("ab"))) for x in rank] == ["a", "b"]


def test_an_uneven_split_names_the_data_parallel_size():
    with pytest.raises(ValueError, match="5 samples do not split evenly over 2 data-parallel ranks"):
        _group(4, 2, 1).shard(list(range(5)))
