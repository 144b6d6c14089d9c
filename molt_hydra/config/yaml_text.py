"""A recipe's (or another composed YAML config's) unquoted number-like text under a string key. YAML reads `1.10`,
`1e3`, `0x10`, `010`, `1_000`, `yes` / `no` / `on` / `off` as a float, int or bool, and OmegaConf stores str() of that
in the string key, without a word: `name: 1.10` ran as name 1.1, `data.split: 0x10` looked for split 16, `name: yes`
ran as True. Refused as the command line's number for a string key is (cli._converted): the key, the file and line,
the value as YAML reads it and the fix, quoting it. So is a number of another key that YAML 1.1 reads otherwise than
its decimal digits (`seed: 010` is octal 8, `max_steps: 1:30` base 60, 90), and a true/false key given anything but
YAML's own true/false (`colocate: 2`, `colocate: y` were true, as the command line's `parallelism.colocate=2` is refused
for). A value the composition replaced (a later config, the command line) is left alone: it reaches no run."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig
from omegaconf._utils import get_yaml_loader
from omegaconf.nodes import BooleanNode, StringNode, ValueNode

from molt_hydra.config.store import RECIPES_DIR

TAG = "tag:yaml.org,2002:"
NUMBER_TAGS = {f"{TAG}{name}" for name in ("int", "float", "bool")}
SWEPT = "hydra.sweeper.params."  # its values are overrides of the app's keys, which the sweeper parses again


def yaml_text_problems(cfg: DictConfig, files: list[tuple[str, str, str]], multirun: bool) -> list[str]:
    """`files`: compat/hydra.py `composed_files`, (package, config path, source) in merge order. Hydra's own keys are
    not read, but for a multirun the recipe's hydra.sweeper.params of a string key (`name: 1.10` sweeps name=1.1)."""
    problems = []
    for package, config_path, source in files:
        if (path := _yaml_file(config_path, source)) is None:
            continue
        constructor = get_yaml_loader()("")
        for parts, scalar in _scalars(_composed(path, path.stat().st_mtime_ns), [p for p in package.split(".") if p]):
            key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
            swept = key.startswith(SWEPT)
            if key.startswith("hydra.") and not (swept and multirun) or scalar.tag == f"{TAG}null":
                continue
            node = _node(cfg, str(parts[3]).split(".") if swept else parts)  # (a param: the key it sweeps)
            where = f"{path} sets it to {scalar.value} (line {scalar.start_mark.line + 1})"
            if line := _misread(key, parts[-1], scalar, constructor.construct_object(scalar), node, where, swept):
                problems.append(line)
    return problems


def _misread(key: str, leaf, scalar, value, node, where: str, swept: bool) -> str | None:
    """The problem of one YAML scalar (`value` as YAML reads it) that reached `node` of the composed config, if any."""
    if isinstance(node, StringNode) and scalar.tag in NUMBER_TAGS and str(value) != scalar.value and (
            swept or node._value() == str(value)):
        quoted = (f'{leaf}: "\'{scalar.value}\'" (the quotes inside YAML\'s are Hydra\'s: the sweeper parses the value '
                  "again)" if swept else f"- '{scalar.value}'" if isinstance(leaf, int)  # (a list's item)
                  else f"{leaf}: '{scalar.value}'")
        return (f"- {key}: a string, but {where}, which YAML reads as the {type(value).__name__} {value!r}, so the run "
                f"would get {str(value)!r}. Fix: quote it there, {quoted}")
    if swept or not isinstance(node, ValueNode):  # (a swept bool or number: each point's own check)
        return None
    if isinstance(node, BooleanNode) and scalar.tag != f"{TAG}bool" and "${" not in scalar.value and \
            scalar.value.lower() not in ("true", "false") and node._value() == BooleanNode(value)._value():
        # (2, 0, y, n, 'yes': as the command line's are refused)
        return (f"- {key}: true or false, but {where}, which OmegaConf reads as {str(node._value()).lower()}. Fix: "
                f"write {leaf}: true or {leaf}: false there")
    if scalar.tag in NUMBER_TAGS and node._value() == value and (reading := _not_decimal(scalar.value, value)):
        return (f"- {key}: {where}, which YAML reads as {value!r} ({reading}). Fix: write the number meant in decimal "
                "digits (without a leading 0 or a colon)")
    return None


def _not_decimal(written: str, value) -> str | None:
    """YAML 1.1's readings of a number that are not the decimal one its digits show: `010` is octal 8, `1:30` is base
    60 (90). (The command line reads both otherwise: seed=010 is 10, 1:30 no number.)"""
    digits = written.replace("_", "")
    if re.fullmatch(r"[-+]?[0-9]+", digits) and int(digits) != value:
        return f"octal, not {int(digits)}"
    return "base 60: each part after a colon is sixtieths of the one before" if ":" in written else None


@functools.lru_cache(maxsize=256)
def _composed(path: Path, _mtime_ns: int) -> yaml.Node:
    """A YAML file's node tree, read once per version of the file (every point of a sweep composes the same files)."""
    return yaml.compose(path.read_text(), Loader=get_yaml_loader())


def _yaml_file(config_path: str, source: str) -> Path | None:
    """The YAML file of a composed config: a file source's, or a shipped recipe's (config/store.py puts those in the
    ConfigStore, read from RECIPES_DIR). Hydra's own (pkg://hydra.conf) and the typed schema have none."""
    if source.startswith("file://"):
        path = Path(source.removeprefix("file://")) / f"{config_path}.yaml"
    elif source.startswith("structured://") and config_path.startswith("recipe/"):
        path = RECIPES_DIR / f"{config_path.removeprefix('recipe/')}.yaml"
    else:
        return None
    return path if path.is_file() else None


def _scalars(node, parts: list):
    """(key's parts, YAML scalar node) of every scalar under `node`, a list's index an int (the top level's defaults
    list left out: `parts` starts with the config's package, none for _global_)."""
    if isinstance(node, yaml.MappingNode):
        for name, child in node.value:
            if not (parts == [] and name.value == "defaults"):
                yield from _scalars(child, [*parts, name.value])
    elif isinstance(node, yaml.SequenceNode):
        for number, child in enumerate(node.value):
            yield from _scalars(child, [*parts, number])
    elif isinstance(node, yaml.ScalarNode):
        yield parts, node


def _node(cfg, parts: list):
    for part in parts:
        if isinstance(cfg, DictConfig) and part in cfg:
            cfg = cfg._get_node(part)
        elif isinstance(cfg, ListConfig) and isinstance(part, int) and part < len(cfg):
            cfg = cfg._get_node(part)
        else:
            return None
    return cfg
