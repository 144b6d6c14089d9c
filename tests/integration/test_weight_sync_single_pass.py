"""The single-pass CUDA IPC weight sync shares a trainer rank's own parameter tensors (weight_sync/shared_params.py,
`SharedParams`); what it relies on, checked on a real FSDP2 trainer over gloo (spawned ranks): with one rank,
`local_full_weights` returns views of the very storages the optimizer updates in place (so views taken once serve
every later sync), and their addresses stay put across optimizer steps (the cached handles stay valid) but not across
a forward alone (FSDP's unsharded parameters: the per-sync check sees it); with two ranks it refuses (a gather is
needed: the bucketed path)."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.parallel.launch import run_ranks

import _weight_sync_jobs as jobs

pytestmark = pytest.mark.timeout(300)


def test_one_fsdp_rank_shares_its_optimizer_updated_storages_and_two_ranks_do_not(tmp_path):
    run_ranks(jobs.single_pass_tensors, 1, tmp_path / "r1.pt", timeout_s=180)
    one = torch.load(tmp_path / "r1.pt", weights_only=False)
    assert one["shared"] and one["in_optimizer_storages"]
    assert one["names"] == [n for n in one["state_names"] if n != "lm_head.weight"]  # tiny qwen3 ties its head
    assert one["changed"] == one["names"]  # views taken before the steps hold the stepped weights ...
    assert one["equal_full_state"]  # ... exactly the model's full state
    assert one["key_after_step"] and one["key_after_forward"]

    run_ranks(jobs.single_pass_tensors, 2, tmp_path / "r2.pt", timeout_s=180)
    assert torch.load(tmp_path / "r2.pt", weights_only=False) == {"shared": False}
