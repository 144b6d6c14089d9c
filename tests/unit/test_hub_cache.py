"""A hub id as model.path (models/hub_cache.py, models/build.py resolve_path): its snapshot in this host's HF cache,
weights included, is what every role loads; a cache holding a tokenizer alone serves a tokenizer only; with
downloads off and no weights cached, the run stops naming the fix. Before: every hub id was passed on as is and the
trainer's config loader refused it ("does not exist"), so a recipe on Qwen/Qwen3-4B could not train. The cache here
is one built in the test, in the layout huggingface_hub reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from molt_hydra.models.build import load_config, resolve_path


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def cache(hub: Path, repo: str, files: list[Path]) -> Path:
    snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    for f in files:
        shutil.copy(f, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("c0ffee")
    return snapshot


def test_a_cached_hub_model_resolves_to_its_snapshot_and_loads(hub):
    tiny = Path(resolve_path("tiny://qwen3_tiny"))
    snapshot = cache(hub, "org/model", sorted(p for p in tiny.iterdir() if p.is_file()))
    assert resolve_path("org/model") == str(snapshot)
    assert load_config(resolve_path("org/model")).model_type == "qwen3"


def test_a_tokenizer_alone_in_the_cache_serves_a_tokenizer_not_a_model(hub):
    tiny = Path(resolve_path("tiny://qwen3_tiny"))
    snapshot = cache(hub, "org/model", [tiny / "config.json", *tiny.glob("tokenizer*")])
    assert resolve_path("org/model", weights=False) == str(snapshot)
    with pytest.raises(FileNotFoundError, match=r"'org/model' is a hub id whose weights this host's HF cache .* "
                                                r"does not hold, and HF_HUB_OFFLINE=1 forbids downloading them: "
                                                r"download it first \(hf download org/model\)"):
        resolve_path("org/model")
    assert resolve_path("org/not-cached", weights=False) == "org/not-cached"  # transformers fetches a tokenizer


def test_a_hub_model_with_no_weights_here_stops_the_run_before_ray_naming_its_key(hub, capsys):
    from types import SimpleNamespace

    from molt_hydra.runtime import entrypoint
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    model = SimpleNamespace(path="org/absent", ref_path=None, critic_path=None)
    with pytest.raises(SystemExit) as exited:
        entrypoint._build_models(SimpleNamespace(model=model))
    assert exited.value.code == EXIT_FAILED
    assert capsys.readouterr().err.startswith("\nRun failed: model.path=org/absent: 'org/absent' is a hub id whose "
                                              "weights this host's HF cache")
