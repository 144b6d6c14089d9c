"""The HF export's tokenizer where model.tokenizer_path (or model.path) is a hub id (parallel/checkpoint.py
`_save_tokenizer`): the run's tokenizer loads it from the HF cache, and the export carries that one, in the adapter's
directory and the merged model's as in a full export. Before: only a local directory's tokenizer was exported; a hub
id's was left out without a word. The hub cache here is one built in the test (the layout huggingface_hub reads)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from molt_hydra.models import lora
from molt_hydra.models.build import resolve_path
from molt_hydra.parallel.checkpoint import export_hf

PROBE = "<molt_probe>"  # a token the tiny tokenizer has not: tells the cached tokenizer from model.path's


@pytest.fixture
def hub_tokenizer(tmp_path, monkeypatch) -> tuple[str, int]:
    """A hub id whose tokenizer (the tiny one with PROBE added) sits in an HF cache of its own; (id, PROBE's id)."""
    import huggingface_hub.constants
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_path("tiny://qwen3_tiny"))
    tokenizer.add_tokens([PROBE])
    repo = tmp_path / "hub" / "models--org--tok"
    tokenizer.save_pretrained(repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return "org/tok", tokenizer.get_vocab()[PROBE]


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_path("tiny://qwen3_tiny"), dtype=torch.float32)


def _probe_id(d: Path) -> int | None:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d).get_vocab().get(PROBE)


def test_a_hub_ids_tokenizer_is_exported_from_the_hf_cache(tmp_path, hub_tokenizer):
    hub_id, probe = hub_tokenizer
    export_hf(tmp_path / "full", _model(), tokenizer_path=hub_id, dtype=torch.float32)
    assert _probe_id(tmp_path / "full") == probe
    spec = dict(rank=4, alpha=8.0, dropout=0.0, init="default", target_modules=list(lora.ATTENTION))
    export_hf(tmp_path / "lora", lora.add_adapter(_model(), spec), tokenizer_path=hub_id,
              base_path=resolve_path("tiny://qwen3_tiny"), dtype=torch.float32, adapter=spec, merged=True)
    for d in (tmp_path / "lora", tmp_path / "lora" / "merged"):
        assert _probe_id(d) == probe, d


def test_a_hub_id_not_in_the_cache_is_exported_without_a_tokenizer_saying_so(tmp_path, hub_tokenizer, caplog):
    shutil.rmtree(tmp_path / "hub")
    with caplog.at_level(logging.WARNING, logger="molt_hydra.parallel.checkpoint"):
        export_hf(tmp_path / "full", _model(), tokenizer_path=hub_tokenizer[0], dtype=torch.float32)
    assert not list((tmp_path / "full").glob("tokenizer*"))
    assert "HF export: its tokenizer org/tok is neither a directory nor in this host's HF cache" in caplog.text


def test_a_cached_hub_ids_config_is_read_where_validation_and_the_resume_check_need_it(tmp_path, monkeypatch):
    """models/hub_cache.py: a hub id's snapshot in this host's HF cache serves model_fields (the family's LoRA
    targets, the plan's shapes) as a local directory does; a name not downloaded here stays unknown."""
    import json

    import huggingface_hub.constants

    from molt_hydra.models.rules import model_fields
    from molt_hydra.runtime.resume_lora import adapter_change

    snapshot = tmp_path / "hub" / "models--org--model" / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    shutil.copy(Path(resolve_path("tiny://qwen3_tiny")) / "config.json", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("c0ffee")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_fields("org/model") == json.loads((snapshot / "config.json").read_text())
    assert model_fields("org/never-downloaded") is None

    def tree(targets):
        return {"model": {"path": "org/model", "lora": {"rank": 8, "alpha": None, "target_modules": targets}}}

    family = lora.resolve_targets("qwen3", None)  # what null resolves to for this model's family
    assert adapter_change(tree(list(reversed(family))), tree(None)) is None  # the default spelled out: no change
    assert adapter_change(tree(family[:1]), tree(None)) is not None
