"""Which resumable checkpoints stay on disk: the newest `keep` (checkpoint.max_num), then, under a disk budget
(checkpoint.max_disk_gb, Molt's --ckpt.max_mem), the oldest pruned until the rest fits; never the newest one. When the
newest alone is over the budget, `over_budget` says so (the save itself is complete and kept). A step's HF snapshot
(checkpoint.save_hf: <root>/hf/step_<N>, exported after its save) counts with it once there and goes with it, as does
(under max_num or max_disk_gb) any snapshot older than the oldest checkpoint kept (before: none was ever removed, the
disk grew with every save)."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)
SNAPSHOTS = "hf"  # <root>/hf/step_<N>: checkpoint.save_hf's exports (runtime/controller.py)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())  # (0 for a missing one)


def _step(path: Path) -> float:
    return int(m.group(1)) if (m := re.fullmatch(r"step_(\d+)", path.name)) else float("inf")


def prune(tags: list[Path], keep: int, max_disk_gb: float | None, hold: Path | None = None) -> None:
    """`tags`: the loadable checkpoint directories, oldest first (the last is the one just saved). Keeping all
    (keep <= 0, no budget) removes nothing: not even a snapshot whose checkpoint the user moved away. `hold`: one kept
    besides (the critic's copy of the actor's newest step: the actor's save of the step just saved comes after the
    critic's, and may fail; before, with checkpoint.max_num=1 or a tight budget, the critic's copy was gone then, and
    no step could be resumed)."""
    if keep <= 0 and max_disk_gb is None:
        return
    pruned = [t for t in (tags[:-keep] if keep > 0 else []) if t != hold]
    tags = [t for t in tags if t not in pruned]
    snapshots = tags[-1].parent / SNAPSHOTS
    sizes = [dir_bytes(t) + dir_bytes(snapshots / t.name) for t in tags] if max_disk_gb is not None else []
    while sizes and sum(sizes) > max_disk_gb * 1e9 and (
            first := next((i for i, t in enumerate(tags[:-1]) if t != hold), None)) is not None:
        pruned.append(tags.pop(first))
        sizes.pop(first)
    oldest = _step(tags[0])
    for old in [*pruned, *(s for s in snapshots.glob("step_*") if _step(s) < oldest)]:
        # renamed first: a kill as it is removed leaves a .pruned- directory, which the next save removes (before: a
        # step_<N> with part of its files, no longer a checkpoint, so never pruned again, its shards on disk for good)
        trash = old.with_name(f".pruned-{old.name}")
        try:
            os.replace(old, trash)
            shutil.rmtree(trash)
        except OSError as e:  # (was ignored: the checkpoints outgrew max_num / max_disk_gb without a word)
            logger.warning("checkpoint retention: %s could not be removed (%s): it stays on disk, beyond "
                           "checkpoint.max_num / checkpoint.max_disk_gb; remove it by hand",
                           trash if trash.exists() else old, e.strerror or e)


def over_budget(newest: Path, max_disk_gb: float | None) -> str | None:
    """The error when the newest checkpoint alone does not fit the budget, else None."""
    if max_disk_gb is None or (size := dir_bytes(newest)) <= max_disk_gb * 1e9:
        return None
    return (f"checkpoint.max_disk_gb={max_disk_gb}: the newest checkpoint {newest} alone takes {size / 1e9:.3g} GB, "
            f"over the budget (it is kept; every older one was pruned). Fix: raise checkpoint.max_disk_gb above "
            f"{size / 1e9:.3g}, or unset it")
