"""Loss aggregation modes and the global token-mean contract across micro-batches and DP ranks (Molt §2.7)."""

import pytest
import torch

from molt_hydra.algorithm.aggregation import aggregate_loss, masked_mean

NAN, INF = float("nan"), float("inf")
# row 0: three tokens 1, 2, 3; row 1: two tokens 4, 5; row 2: no action token. Off-mask values are poison.
LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 5.0, INF, 7.0], [NAN, 8.0, 9.0, 10.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),
    ("seq-mean-token-sum", ((1 + 2 + 3) + (4 + 5)) / 2),                # G = rows with a token
    ("seq-mean-token-sum-norm", ((1 + 2 + 3) + (4 + 5)) / 2 / 4),       # / L, the mask width
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2),
])
def test_local_modes(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-6)


def test_explicit_scale_factor_and_empty_mask():
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=3.0).item() == pytest.approx(
        15 / 2 / 3)
    empty = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate_loss(LOSS, empty, mode).item() == 0.0


def test_masked_mean_ignores_poison_off_the_mask():
    assert masked_mean(LOSS, MASK).item() == pytest.approx(3.0)
    assert masked_mean(LOSS, MASK, dim=-1).tolist() == [[2.0], [4.5], [0.0]]


def test_dp_without_global_counts_and_unknown_mode_are_rejected():
    with pytest.raises(ValueError, match="needs num_tokens"):
        aggregate_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="needs global_batch_size"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="algorithm.loss_agg='mean'"):
        aggregate_loss(LOSS, MASK, "mean")


# 2 DP ranks x 2 micro-batches each, of different widths and token counts
WINDOW = {
    0: [(torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[1, 1, 0]])),
        (torch.tensor([[3.0, 4.0, 5.0, 6.0], [7.0, 0.0, 0.0, 0.0]]), torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]))],
    1: [(torch.tensor([[8.0]]), torch.tensor([[1]])),
        (torch.tensor([[9.0, 10.0], [11.0, 12.0]]), torch.tensor([[1, 1], [0, 1]]))],
}
TOKENS = {0: [1, 2, 3, 4, 5, 6, 7], 1: [8, 9, 10, 12]}  # the action-token values, by rank
SEQS = [[1, 2], [3, 4, 5, 6], [7], [8], [9, 10], [12]]


def fsdp_window_loss(mode, **window):
    """Gradient accumulation sums micro-batch losses on each rank; FSDP then averages the ranks."""
    per_rank = [sum(aggregate_loss(loss, mask.bool(), mode, dp_size=2, **window) for loss, mask in mbs)
                for mbs in WINDOW.values()]
    return sum(per_rank) / 2


def test_global_token_mean_over_micro_batches_and_dp_ranks():
    all_tokens = TOKENS[0] + TOKENS[1]
    n = len(all_tokens)  # what the trainer all-reduces before the window: 11
    loss = fsdp_window_loss("token-mean", num_tokens=n)
    assert loss.item() == pytest.approx(sum(all_tokens) / n)
    # per-micro-batch means (the naive alternative) would weigh a 1-token micro-batch like a 5-token one
    naive = sum(aggregate_loss(l, m.bool(), "token-mean") for mbs in WINDOW.values() for l, m in mbs) / 4
    assert naive.item() != pytest.approx(sum(all_tokens) / n)


def test_global_sequence_mean_over_micro_batches_and_dp_ranks():
    loss = fsdp_window_loss("seq-mean-token-mean", global_batch_size=len(SEQS))
    assert loss.item() == pytest.approx(sum(sum(s) / len(s) for s in SEQS) / len(SEQS), rel=1e-6)
    loss = fsdp_window_loss("seq-mean-token-sum", global_batch_size=len(SEQS))
    assert loss.item() == pytest.approx(sum(sum(s) for s in SEQS) / len(SEQS))


def test_gradient_of_the_window_is_one_over_n_per_token():
    leaves = [[(loss.clone().requires_grad_(), mask.bool()) for loss, mask in mbs] for mbs in WINDOW.values()]
    total = sum(aggregate_loss(l, m, "token-mean", num_tokens=11, dp_size=2) for mbs in leaves for l, m in mbs) / 2
    total.backward()
    for mbs in leaves:
        for loss, mask in mbs:
            assert torch.allclose(loss.grad, mask.float() / 11)
