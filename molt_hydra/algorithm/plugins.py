"""User plugins: import the modules named in `algorithm.plugins` so their `@register_advantage_estimator` /
`@register_policy_loss` decorators run before the estimator and loss are looked up by name."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Iterable


def load_plugins(modules: Iterable[str]) -> list[ModuleType]:
    """Import each dotted module name (idempotent: Python caches imports, so decorators run once)."""
    # Built-ins register first, so a plugin reusing a built-in name fails loudly instead of silently replacing it.
    importlib.import_module("molt_hydra.algorithm.advantage")
    importlib.import_module("molt_hydra.algorithm.loss")
    loaded = []
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except Exception as e:  # noqa: BLE001 -- whatever a plugin raises on import (a SyntaxError, a duplicate
            # registration's ValueError) is its failure to load, reported as one (was: a traceback out of validation)
            raise ImportError(f"algorithm.plugins: cannot import {name!r}: {type(e).__name__}: {e}") from e
    return loaded
