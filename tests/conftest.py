"""Shared fixtures. Nothing here loads from a hub: the tiny models are built locally once per session."""

from __future__ import annotations

import os
import sys

import pytest

# Tests never reach a model hub, and W&B never leaves the machine.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# logger.wandb.mode=auto goes online where W&B finds credentials (logging/sinks.py): a developer's own (`wandb login`'s
# ~/.netrc, WANDB_API_KEY) must not send a test's run there; tests that need credentials set their own
os.environ["NETRC"] = os.devnull
os.environ.pop("WANDB_API_KEY", None)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from molt_hydra.models.tiny import resolve_model_path

    return resolve_model_path("tiny://qwen3_tiny")


@pytest.fixture(scope="session")
def tiny_moe_model() -> str:
    from molt_hydra.models.tiny import resolve_model_path

    return resolve_model_path("tiny://qwen3_moe_tiny")


@pytest.fixture(scope="module", autouse=True)
def ray_ends_with_its_module():
    """A module's in-process Ray cluster ends with the module even where the fixture that started it failed after
    `ray.init` (an engine that would not start): otherwise every later module's `ray.init` fails ("called ray.init
    twice") and the run-level tests find a stranger's cluster."""
    yield
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
