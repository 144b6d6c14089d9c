"""A run or sweep directory named after the time molt-run started (the default: `${now:%Y-%m-%d_%H-%M-%S}` in its
path) is one of this run's own: two runs or sweeps started within the same second got the same directory, where the
second's points ran in the first's (locked out of them, or resuming from what they had left) and shared its W&B group.
The directory is claimed by making it (mkdir fails where it exists, also for a process on another host of a shared
disk); one taken gets `_2`, `_3`, ... after its name, so it still reads as the time. A directory named without the
time is used as given: that is how a run or a sweep is resumed."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def own_dir(node: DictConfig) -> Path:
    """The directory of `node` (the hydra node's run or sweep), absolute: claimed (`claim`) where its name has the
    time in it, as given otherwise."""
    path, raw = Path(os.path.abspath(node.dir)), OmegaConf.to_container(node)["dir"]  # (unresolved: as written)
    return claim(path) if isinstance(raw, str) and "${now:" in raw else path


def claim(path: Path) -> Path:
    """`path` made, or, where it exists, the first of path_2, path_3, ... that did not: the one made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        mine = path if n == 1 else path.with_name(f"{path.name}_{n}")
        try:
            mine.mkdir()
            return mine
        except FileExistsError:
            continue
