"""Build the runner that config names.

`agent.runner` is a `hydra.utils.instantiate`-shaped dict, `{"_target_": TARGET, **kwargs}`, where TARGET is
* a dotted path `pkg.module.Name`, or
* a python file `path/to/agent.py` (class `AgentRunner`, Molt's convention) or `path/to/agent.py:Name`.
Name may be a `Runner` subclass (built with the kwargs), or an `Env` / `ChatAgent` subclass (wrapped in
`StepEnvRunner` / `ChatAgentRunner`, the kwargs going to every fresh Env/agent instance).
Call this inside each runner process: runners hold a server and event-loop state and are not shipped.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from molt_hydra.agents.base import Env, Runner


def resolve_target(target: str) -> Any:
    path, sep, name = target.partition(":") if ".py" in target else (target, "", "")
    if path.endswith(".py"):
        module = _import_file(Path(path))
        name = name or "AgentRunner"
    else:
        module_name, _, name = target.rpartition(".")
        if not module_name:
            raise ValueError(f"agent target {target!r}: expected 'pkg.module.Name' or 'file.py[:Name]'")
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"agent target {target!r}: {module.__name__} has no attribute {name!r}")
    return getattr(module, name)


def _import_file(path: Path):
    path = path.expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"agent file {path} does not exist")
    # One module per file path, registered so that classes it defines pickle and compare by identity.
    module_name = f"molt_agent_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_runner(spec: str | Mapping, **kwargs: Any) -> Runner:
    """`spec`: the `agent.runner` dict (`_target_` + kwargs) or a target string; extra kwargs override."""
    if isinstance(spec, Mapping):
        kwargs = {**{k: v for k, v in spec.items() if k != "_target_"}, **kwargs}
        if "_target_" not in spec:
            raise ValueError(f"agent.runner needs a '_target_' key, got keys {sorted(spec)}")
        spec = spec["_target_"]
    obj = resolve_target(spec)
    if isinstance(obj, type) and issubclass(obj, Runner):
        runner = obj(**kwargs)
    elif isinstance(obj, type) and issubclass(obj, Env):
        from molt_hydra.agents.step_runner import StepEnvRunner

        runner = StepEnvRunner(obj, env_kwargs=kwargs)
    else:
        from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner

        if not (isinstance(obj, type) and issubclass(obj, ChatAgent)):
            raise TypeError(f"agent target {spec!r} is {obj!r}; expected a Runner, Env or ChatAgent subclass")
        runner = ChatAgentRunner(obj, agent_kwargs=kwargs)
    return runner
