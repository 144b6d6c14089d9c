"""A model or tokenizer location as a local directory: itself, or a hub id's snapshot in this host's HF cache, where
transformers loads it from. `local_dir` downloads nothing (validation, the plan, the export's tokenizer: a hub id
never fetched on this host has none); `snapshot` downloads a run's model there first when it is not cached."""

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


def snapshot(hub_id: str, weights: bool = True) -> str:
    """A hub id's local snapshot: the cached one, else downloaded into the HF cache now (what transformers and vLLM
    would each do, done once, so every role reads the same files: the weight sync's coverage check reads the
    engine's). `weights`: the snapshot must hold them (a cache holding only a tokenizer or a config, AutoTokenizer's,
    is completed); without, a tokenizer's id not cached is returned as it is, for transformers to fetch. With downloads
    off (HF_HUB_OFFLINE=1) and no weights cached, FileNotFoundError naming the fix."""
    local = local_dir(hub_id)
    if local is not None and (not weights or any(local.glob("*.safetensors")) or any(local.glob("*.bin"))):
        return str(local)
    if not weights:
        return hub_id
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{hub_id!r} is a hub id whose weights this host's HF cache ({constants.HF_HUB_CACHE}) "
                                f"does not hold, and HF_HUB_OFFLINE=1 forbids downloading them: download it first "
                                f"(hf download {hub_id}), or give a local model directory")
    return snapshot_download(hub_id)
