"""Clipped value loss for the critic (Molt §2.9), derived by hand."""

import pytest
import torch

from molt_hydra.algorithm.value_loss import value_loss

OLD = torch.tensor([[0.8, 0.5, 1.0, 0.0]])
RETURNS = torch.tensor([[1.5, 0.0, 1.2, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)


def values():
    return torch.tensor([[1.1, 0.5, 2.0, 9.0]], requires_grad=True)


def test_clipped_value_loss_takes_the_larger_of_both_errors():
    v = values()
    loss, metrics = value_loss(v, OLD, RETURNS, MASK, value_clip=0.2)
    t0 = 0.5 * max((1.1 - 1.5) ** 2, (0.8 + 0.2 - 1.5) ** 2)  # V moved 0.3: clipped to 1.0, larger error wins
    t1 = 0.5 * max((0.5 - 0.0) ** 2, (0.5 + 0.0 - 0.0) ** 2)
    t2 = 0.5 * max((2.0 - 1.2) ** 2, (1.0 + 0.2 - 1.2) ** 2)  # clipped error is 0: unclipped wins
    assert loss.item() == pytest.approx((t0 + t1 + t2) / 3)
    assert metrics["value_loss"].item() == pytest.approx((t0 + t1 + t2) / 3)
    assert metrics["value_clip_frac"].item() == pytest.approx(2 / 3)  # |dV| = 0.3 and 1.0 exceed 0.2
    loss.backward()
    # t0: the clipped branch is active and saturated -> 0; t1: (V - R) / 3; t2: (V - R) / 3; padding 0
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.5 / 3, 0.8 / 3, 0.0])


def test_no_clip_is_half_squared_error():
    loss, metrics = value_loss(values(), OLD, RETURNS, MASK, value_clip=None)
    assert loss.item() == pytest.approx(0.5 * ((1.1 - 1.5) ** 2 + 0.5 ** 2 + 0.8 ** 2) / 3)
    assert "value_clip_frac" not in metrics


def test_global_token_count_and_dp_scale():
    loss, _ = value_loss(values(), OLD, RETURNS, MASK, value_clip=None, num_tokens=6, dp_size=2)
    assert loss.item() == pytest.approx(0.5 * ((1.1 - 1.5) ** 2 + 0.5 ** 2 + 0.8 ** 2) / 6 * 2)


@pytest.mark.parametrize("clip", [0.2, None])
def test_non_finite_inputs_off_the_mask_touch_neither_loss_nor_gradient(clip):
    """Padding whose values, old values or returns are NaN / inf: the loss stayed finite (masked out), but the
    backward through the square gave the masked value 0 * NaN, a NaN gradient into the value head."""
    nan, inf = float("nan"), float("inf")
    v = torch.tensor([[1.1, 0.5, 2.0, nan]], requires_grad=True)
    loss, _ = value_loss(v, torch.tensor([[0.8, 0.5, 1.0, inf]]), torch.tensor([[1.5, 0.0, 1.2, nan]]), MASK,
                         value_clip=clip)
    reference, _ = value_loss(values(), OLD, RETURNS, MASK, value_clip=clip)
    assert loss.item() == pytest.approx(reference.item())
    loss.backward()
    grads = [0.0, 0.5 / 3, 0.8 / 3] if clip else [(1.1 - 1.5) / 3, 0.5 / 3, 0.8 / 3]
    assert v.grad[0].tolist() == pytest.approx([*grads, 0.0])
