"""A resume keeps `model.master_weights` (parallel/checkpoint.py load_checkpoint `expect`, one process, real DCP): the
optimizer state of fp32 FSDP params and of optimizer-held masters differ in kind, so a checkpoint saved in one mode is
refused in the other before anything loads, naming the key, both values and the fix; a matching mode (or a
checkpoint that recorded none) loads, and a warm start (weights only) is not checked."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.parallel.checkpoint import load_checkpoint, save_checkpoint

EXPECT_OPTIMIZER = {"master_weights": ("optimizer", "model.master_weights")}


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_a_checkpoint_of_the_other_mode_is_refused_before_loading(tmp_path):
    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt, client_state={"master_weights": "fsdp"})
    fresh, fresh_opt = _trained(1)
    before = fresh.weight.detach().clone()
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path, fresh, fresh_opt, expect=EXPECT_OPTIMIZER)
    message = str(err.value)
    assert message.startswith("model.master_weights: ") and "model.master_weights=fsdp" in message
    assert "this run has optimizer" in message and message.endswith("Fix: set model.master_weights=fsdp")
    assert torch.equal(fresh.weight, before)  # refused before anything loaded


@pytest.mark.parametrize("saved", [{"master_weights": "optimizer"}, {}], ids=["same_mode", "not_recorded"])
def test_a_matching_or_unrecorded_mode_loads(tmp_path, saved):
    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt, client_state=saved)
    fresh, fresh_opt = _trained(1)
    assert load_checkpoint(tmp_path, fresh, fresh_opt, expect=EXPECT_OPTIMIZER) == saved
    assert torch.equal(fresh.weight, model.weight)


def test_a_warm_start_loads_the_weights_whatever_the_mode(tmp_path):
    model, opt = _trained(0)
    save_checkpoint(tmp_path, 1, model, opt, client_state={"master_weights": "fsdp"})
    fresh, fresh_opt = _trained(1)
    assert load_checkpoint(tmp_path, fresh, fresh_opt, model_only=True, expect=EXPECT_OPTIMIZER) == {}
    assert torch.equal(fresh.weight, model.weight)
