"""A model or tokenizer location as a local directory: itself, or a hub id's snapshot in this host's HF cache, where
transformers loads it from. Nothing is downloaded: a hub id never fetched on this host has none."""

from __future__ import annotations

import os
from pathlib import Path

PROBED = ("config.json", "tokenizer_config.json", "tokenizer.json")  # a snapshot holds one of these


def local_dir(path: str) -> Path | None:
    """`path` (`~` expanded) when it is a directory; a hub id's cached snapshot; else None (a name not downloaded
    here, or no name at all)."""
    local = Path(os.path.expanduser(path))
    if local.is_dir():
        return local
    from huggingface_hub import try_to_load_from_cache

    for name in PROBED:
        try:
            found = try_to_load_from_cache(path, name)
        except ValueError:  # not a hub id (HFValidationError)
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None
