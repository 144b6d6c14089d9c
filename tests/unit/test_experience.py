"""Token-first Experience and right-padded collation."""

import pytest
import torch

from molt_hydra.algorithm.experience import Experience, collate


def test_experience_from_lists_and_defaults():
    e = Experience([11, 12, 13], [0, 1, 1], [0.0, -0.5, -0.25], 1.0, group_id="p0", rollout_id="r0")
    assert e.token_ids.dtype == torch.long and e.action_mask.dtype == torch.bool
    assert e.rollout_log_probs.dtype == torch.float32
    assert e.policy_versions.tolist() == [-1, -1, -1]  # unknown versions
    assert e.score == 1.0  # defaults to the reward


def test_experience_rejects_misaligned_fields_and_an_action_at_token_0():
    with pytest.raises(ValueError, match="token-aligned"):
        Experience([1, 2, 3], [0, 1], [0.0, -0.5, -0.1], 0.0, 0, 0)
    with pytest.raises(ValueError, match="token-aligned"):
        Experience([1, 2], [0, 1], [0.0, -0.5], 0.0, 0, 0, policy_versions=[0, 1, 2])
    with pytest.raises(ValueError, match="token 0 has no context"):
        Experience([1, 2], [1, 1], [0.0, -0.5], 0.0, 0, 0)


def test_collate_right_pads_every_field():
    a = Experience([1, 2, 3, 4], [0, 1, 0, 1], [0.0, -0.5, 0.0, -0.25], 1.0, "g", "r0",
                   policy_versions=[-1, 2, -1, 3], score=0.5, info={"turns": 2})
    b = Experience([5, 6], [0, 1], [0.0, -1.0], -1.0, "g", "r1", policy_versions=[-1, 3])
    batch = collate([a, b], pad_token_id=99)
    assert batch.token_ids.tolist() == [[1, 2, 3, 4], [5, 6, 99, 99]]
    assert batch.action_mask.tolist() == [[False, True, False, True], [False, True, False, False]]
    assert batch.rollout_log_probs.tolist() == [[0.0, -0.5, 0.0, -0.25], [0.0, -1.0, 0.0, 0.0]]
    assert batch.policy_versions.tolist() == [[-1, 2, -1, 3], [-1, 3, -1, -1]]
    assert batch.rewards.tolist() == [1.0, -1.0]
    assert batch.group_ids == ["g", "g"] and batch.rollout_ids == ["r0", "r1"]
    with pytest.raises(ValueError, match="at least one"):
        collate([])


def test_numpy_pickled_samples_round_trip_as_writable_tensors():
    """A trainer call's samples cross Ray as numpy buffers and come back as the same tensors (dtype, values), each
    writable and owning its memory; bfloat16 (numpy has none) keeps torch's pickling."""
    import pickle

    from molt_hydra.algorithm.experience import NumpyPickled

    rows = [{"input_ids": torch.arange(5), "action_mask": torch.tensor([False, True, True, False, True]),
             "advantages": torch.randn(5), "routed_experts": torch.ones(5, 2, 2, dtype=torch.int16),
             "pixel_values": torch.randn(2, 3).bfloat16()} for _ in range(3)]
    wire = pickle.dumps(NumpyPickled(rows), protocol=5, buffer_callback=(buffers := []).append)
    assert len(buffers) == 3 * 4  # every tensor but the bfloat16 one went out of band
    back = pickle.loads(wire, buffers=[memoryview(b).toreadonly() for b in buffers])  # as Ray hands them over
    assert type(back) is list
    for got, want in zip(back, rows):
        assert got.keys() == want.keys()
        for k in want:
            assert type(got[k]) is torch.Tensor and got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
            got[k].zero_()  # writable
    views = torch.randn(4, 6)
    logprobs = pickle.loads(pickle.dumps(NumpyPickled([views[1, :3], views[2, 1:]]), protocol=5))
    assert torch.equal(logprobs[0], views[1, :3]) and torch.equal(logprobs[1], views[2, 1:])
