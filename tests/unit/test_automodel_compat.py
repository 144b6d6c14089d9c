"""compat/automodel.py: each reach into NeMo AutoModel refuses releases it was not written for, and (where AutoModel
is installed: the GPU device) AutoModel still has the signatures and behaviour the reaches rely on."""

from __future__ import annotations

import importlib.util
from importlib import metadata

import pytest
import torch

from molt_hydra.compat import automodel as compat
from molt_hydra.models.automodel import permute_tokens_all_local

needs_automodel = pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                                     reason="needs nemo_automodel (the GPU device's install)")


def test_releases_outside_the_written_for_ones_are_refused_naming_both(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda dist: "0.8.1")
    with pytest.raises(RuntimeError, match=r"the sync-free token permutation \(molt_hydra/compat/automodel.py\) is "
                                           r"written for nemo-automodel 0\.7\.x; nemo-automodel 0\.8\.1 is installed"):
        compat.install_sync_free_permute(8, permute_tokens_all_local)

    def missing(dist):
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(RuntimeError, match="nemo-automodel is not installed"):
        compat.has_own_model_class(None)


@needs_automodel
def test_the_patched_permutation_matches_automodels_with_every_expert_local():
    import inspect

    from nemo_automodel.components.moe import experts

    compat.install_sync_free_permute(4, permute_tokens_all_local)
    original = experts._permute_tokens_for_grouped_mm._molt_original
    assert list(inspect.signature(original).parameters) == ["indices", "weights", "token_mask", "n_local_experts",
                                                            "experts_start_idx", "return_slot_ids"]
    indices = torch.tensor([[0, 2], [3, 1], [2, 0]])
    weights, mask = torch.rand(3, 2), torch.ones(3, dtype=torch.bool)
    ours = experts._permute_tokens_for_grouped_mm(indices, weights, mask, 4, 0)
    theirs = original(indices, weights, mask, 4, 0)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.float(), b.float())


@needs_automodel
def test_automodel_has_its_own_class_for_qwen3_moe():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"])
    assert compat.has_own_model_class(config)
