"""Every LR scheduler validation accepts builds and steps in the trainer's loop (one `step()` per optimizer step, no
metric); the floor schedulers decay to lr x min_lr_ratio; warmup ramps linearly over ceil(total x ratio) steps."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import SchedulerType

from molt_hydra.config.validate import FLOOR_SCHEDULERS, UNBUILDABLE_SCHEDULERS
from molt_hydra.parallel.optim import build_scheduler

TOTAL, RATIO, LR = 10, 0.3, 2.0


def lrs(name: str, min_lr_ratio: float = 0.1) -> list[float]:
    """The learning rate each of TOTAL optimizer steps used."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=LR)
    scheduler = build_scheduler(opt, name=name, total_steps=TOTAL, warmup_ratio=RATIO, min_lr_ratio=min_lr_ratio)
    used = []
    for _ in range(TOTAL):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    used.append(opt.param_groups[0]["lr"])
    return used


@pytest.mark.parametrize("name", sorted(s.value for s in SchedulerType if s.value not in UNBUILDABLE_SCHEDULERS))
def test_every_accepted_scheduler_steps_without_a_metric(name):
    used = lrs(name)
    assert len(used) == TOTAL + 1 and all(0 <= lr <= LR for lr in used)


@pytest.mark.parametrize("name", sorted(UNBUILDABLE_SCHEDULERS))
def test_the_refused_schedulers_cannot_run_in_the_loop(name):
    """The table is true: each refused name fails at build or at its first metric-less step."""
    with pytest.raises((TypeError, ValueError)):
        lrs(name)


@pytest.mark.parametrize("name", FLOOR_SCHEDULERS)
def test_floor_schedulers_decay_to_the_floor(name):
    """After warmup the cosine falls to lr x min_lr_ratio and never below (the warmup variant reaches it one step
    earlier)."""
    assert min(lrs(name, min_lr_ratio=0.25)[math.ceil(TOTAL * RATIO):]) == pytest.approx(LR * 0.25)


def test_warmup_ramps_over_ceil_total_times_ratio_steps():
    warmup = math.ceil(TOTAL * RATIO)
    used = lrs("constant_with_warmup")
    assert used[:warmup + 1] == pytest.approx([LR * step / warmup for step in range(warmup + 1)])
    assert used[warmup:] == pytest.approx([LR] * (TOTAL + 1 - warmup))
