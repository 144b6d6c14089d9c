"""parallelism.offload=optimizer (Molt's `--fsdp.offload optimizer`; parallel/optim.py MasterWeightAdamW with
on_host): fp32 masters and AdamW moments are host copies apart from the params, the step runs torch's fused AdamW
on them and writes them back into the params. On this CPU machine host and device are one memory, so what is shown
here is the mechanism and its math: separate masters, params equal to them after every step, and the same training
as the in-place optimizer (FSDP2 over 2 gloo ranks, and 1 rank). The GPU test (tests/gpu/test_trainer_gpu.py) shows
the placement: params on the GPU, state on the host, less GPU memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _master_weight_jobs as jobs  # noqa: E402

from molt_hydra.parallel.launch import run_ranks  # noqa: E402


@pytest.mark.parametrize("world_size", [1, 2], ids=["1rank", "2ranks_fsdp"])
def test_the_offloaded_optimizer_trains_as_the_in_place_one(world_size, tmp_path):
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload_{offload}.pt"
        run_ranks(jobs.offload_steps, world_size, out, offload, timeout_s=240)
        runs[offload] = torch.load(out, weights_only=False)
    off = runs[True]
    assert off["optimizer"] == "MasterWeightAdamW" and runs[False]["optimizer"] == "AdamW"
    assert off["state_devices"] == {"cpu"}
    assert not any(off["master_is_param"].values())  # host copies, never the params' own storage
    assert all(off["master_equals_param"].values())  # fp32 params: each step writes its masters back exactly
    # the same AdamW update (torch's fused kernel vs its foreach one: equal up to float rounding)
    for name, p in runs[False]["params"].items():
        torch.testing.assert_close(off["params"][name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_a_resumed_run_with_the_optimizer_on_the_host_continues_bit_exactly(tmp_path):
    """Save after one step and load into fresh ranks (2 ranks, FSDP2): the masters and moments come back into host
    memory and the next step equals the uninterrupted run's."""
    run_ranks(jobs.resume_run, 2, str(tmp_path), tmp_path / "straight.pt", False, True, timeout_s=240)
    run_ranks(jobs.resume_run, 2, str(tmp_path), tmp_path / "resumed.pt", True, True, timeout_s=240)
    straight, resumed = (torch.load(tmp_path / f, weights_only=False) for f in ("straight.pt", "resumed.pt"))
    assert straight["devices"] == resumed["devices"] == {"cpu"}
    for key in ("params", "master", "exp_avg", "exp_avg_sq"):
        for name, t in straight["state"][key].items():
            assert torch.equal(resumed["state"][key][name], t), (key, name)
