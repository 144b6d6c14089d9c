"""Agent targets: `pkg.module.Name`, or a python file `path/to/agent.py` (class `AgentRunner`, Molt's convention)
or `path/to/agent.py:Name`, resolved to the object they name."""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def resolve_target(target: str) -> Any:
    path, sep, name = target.partition(":") if ".py" in target else (target, "", "")
    if path.endswith(".py"):
        module = _import_file(Path(path))
        name = name or "AgentRunner"
        _defined_once(Path(module.__file__), name)
    else:
        module_name, _, name = target.rpartition(".")
        if not module_name:
            raise ValueError(f"agent target {target!r}: expected 'pkg.module.Name' or 'file.py[:Name]'")
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        where = f"agent file {module.__file__}" if path.endswith(".py") else module.__name__  # (not its module name)
        near = difflib.get_close_matches(name, [n for n in vars(module) if not n.startswith("_")], n=1)
        raise ValueError(f"agent target {target!r}: {where} has no attribute {name!r}"
                         + (f" (did you mean {near[0]!r}?)" if near else ""))
    return getattr(module, name)


def absolute_target(target: str) -> str:
    """A file target with its path made absolute here (the driver's working directory, where validation found it; a
    `~` expanded, as validation's import expands it, was: `/cwd/~/agent.py`, not there): the agent runners import it
    in Ray workers, whose working directory is another on a remote cluster."""
    path, sep, name = target.partition(":") if ".py" in target else (target, "", "")
    return f"{Path(os.path.expanduser(path)).absolute()}{sep}{name}" if path.endswith(".py") else target


def subclass(obj: type | str, base: type, need: str) -> type:
    """`obj`, or the class its target names, when it subclasses `base`; else a TypeError: `need`, got what."""
    obj = resolve_target(obj) if isinstance(obj, str) else obj
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise TypeError(f"{need}, got {obj!r}")
    return obj


def _defined_once(path: Path, name: str) -> None:
    """A file that defines the target's class (or function) twice loads the later one silently: an error naming both
    lines, since which one the author meant is a guess."""
    lines = [node.lineno for node in ast.parse(path.read_text(), str(path)).body
             if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]
    if len(lines) > 1:
        raise ValueError(f"agent file {path} defines {name} {len(lines)} times (lines {', '.join(map(str, lines))}); "
                         f"the last would run: remove or rename the others")


def _import_file(path: Path):
    path = Path(os.path.expanduser(path)).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"agent file {path} does not exist")
    # One module per file path, registered so that classes it defines pickle and compare by identity.
    module_name = f"molt_agent_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # its own directory first while it runs, as `python path/to/agent.py` has it: an agent file's top-level imports
    # of the modules beside it work (was: "No module named 'helpers'" for a helpers.py next to the agent)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        sys.path.remove(str(path.parent))  # (its first entry of that directory: an earlier one stays where it was)
    if str(path.parent) not in sys.path:  # after every installed package: a later import inside its functions finds
        # the modules beside it too, as under `python agent.py` (was: "No module named 'helpers'", every rollout),
        # while a `datasets.py` beside it shadows nothing the runner imports
        sys.path.append(str(path.parent))
    return module
