"""Build the runner that config names.

`agent.runner` is a `hydra.utils.instantiate`-shaped dict, `{"_target_": TARGET, **kwargs}`, where TARGET is
* a dotted path `pkg.module.Name`, or
* a python file `path/to/agent.py` (class `AgentRunner`, Molt's convention) or `path/to/agent.py:Name`.
Name may be a `Runner` subclass (built with the kwargs), or an `Env` / `ChatAgent` subclass (wrapped in
`StepEnvRunner` / `ChatAgentRunner`, the kwargs going to every fresh Env/agent instance).
Call this inside each runner process: runners hold a server and event-loop state and are not shipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from molt_hydra.agents.base import Env, Runner
from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner
from molt_hydra.agents.step_runner import StepEnvRunner
from molt_hydra.agents.targets import resolve_target


# Hydra's keys of an instantiate-shaped dict, not kwargs: `_recursive_: false` is Hydra's switch for "pass nested
# `_target_` dicts as they are" (agents/rules.py refuses them otherwise: this loader builds the top target alone)
HYDRA_KEYS = ("_target_", "_recursive_")


def load_runner(spec: str | Mapping, **kwargs: Any) -> Runner:
    """`spec`: the `agent.runner` dict (`_target_` + kwargs) or a target string; extra kwargs override."""
    if isinstance(spec, Mapping):
        kwargs = {**{k: v for k, v in spec.items() if k not in HYDRA_KEYS}, **kwargs}
        if "_target_" not in spec:
            raise ValueError(f"agent.runner needs a '_target_' key, got keys {sorted(spec)}")
        spec = spec["_target_"]
    obj = resolve_target(spec)
    if isinstance(obj, type) and issubclass(obj, Runner):
        return obj(**kwargs)
    if isinstance(obj, type) and issubclass(obj, (Env, ChatAgent)):  # the kwargs go to every fresh Env / agent
        return StepEnvRunner(obj, kwargs) if issubclass(obj, Env) else ChatAgentRunner(obj, kwargs)
    raise TypeError(f"agent target {spec!r} is {obj!r}; expected a Runner, Env or ChatAgent subclass")
