"""The toy task's Env (recipes/agents/toy.py) that also writes wall-clock stamps for bench/startup_cost.py:
`<stamp_dir>/first_request` when the first episode is reset (its prompt is about to go to the engine) and
`<stamp_dir>/first_response` when the first generated response reaches `step`. Only the first of each is kept."""

import os
import time
from pathlib import Path

from molt_hydra.agents import Result

_TOY = Path(__file__).resolve().parents[2] / "recipes" / "agents" / "toy.py"


def _toy_env():
    from molt_hydra.agents.loading import resolve_target

    return resolve_target(f"{_TOY}:ToyEnv")


def _stamp(directory: str, name: str) -> None:
    try:
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(repr(time.time()))


class StampToyEnv(_toy_env()):
    def __init__(self, stamp_dir: str):
        self.stamp_dir = stamp_dir

    def reset(self, sample):
        _stamp(self.stamp_dir, "first_request")
        return super().reset(sample)

    async def step(self, state) -> Result:
        _stamp(self.stamp_dir, "first_response")
        return await super().step(state)
