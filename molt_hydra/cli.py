"""`molt-run`: compose conf/ + recipe + overrides -> typed RunConfig -> validate -> plan -> run.

    molt-run                                   # the embedded default: tiny CPU run that visibly learns
    molt-run +recipe=qwen3_4b_math rollout.n_samples_per_prompt=16
    molt-run +recipe=qwen3_4b_math --cfg job   # print the resolved config, run nothing
    molt-run +recipe=qwen3_4b_math dry_run=true
    molt-run -m +recipe=sweep_estimators_is cluster=slurm   # one Slurm job per sweep point

Config mistakes never reach the runtime: the overrides are parsed and composed first (`compose_checked`: grammar, a key
given twice, unknown keys, wrong types, unknown group options), then `to_run_config` checks declared ranges, missing
values and single-group rules, and `validate` every cross-group rule; each message names the full key (or the override),
the reason and the fix, and the exit code is 2. A run is validated and planned once, before Hydra makes its output
directory (`point_problems`: a refused config leaves nothing behind; Hydra then makes the directory that was checked and
the run gets the checked config), a multirun every point before the first starts (`sweep_problems`). A dry run prints
its plan (every point's, for a multirun) and writes nothing. `molt-run --help` is conf/hydra/help/molt.yaml.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import logging
import logging.config
import math
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import hydra
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Glob, IntervalSweep, RangeSweep
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.nodes import AnyNode, BooleanNode, StringNode
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from molt_hydra.compat import VersionError
from molt_hydra.compat.hydra import composed_files, written_scalars
from molt_hydra.config.bounds import declared_bounds, expected, get, out_of_range
from molt_hydra.config.handoff_rules import RUN_DIRS
from molt_hydra.config.job_ignores import JOB_IGNORES, ignored_by
from molt_hydra.config.schema import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, ConfigError, RunConfig
from molt_hydra.config.store import CONF_DIR, register
from molt_hydra.config.yaml_text import yaml_text_problems



def _convert(node):
    try:
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        key = getattr(e, "full_key", None) or "config"
        message = str(e).splitlines()[0]
        fix = ("set it on the command line (key=value) or in the recipe" if "missing mandatory" in message.lower()
               else _fix(key, message))
        raise ConfigError(f"- {key}: {message}. Fix: {fix}") from None


def _fix(key: str, message: str) -> str:
    return ("write the value itself: molt-run checks the config before Hydra starts, where no ${hydra:...} resolves"
            if "HydraConfig was not set" in message else f"set {key} to {expected(RunConfig, key)}"
            if not key.startswith("hydra.") else f"set {key} as Hydra's own config takes it (`molt-run --cfg hydra` "
            "prints it), or leave it out")


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed config from the composed tree; declared ranges, MISSING values and `__post_init__` rules fail here, all
    at once: on failure every group is converted on its own, so the message lists one problem per broken group."""
    cfg, nested = _lists_resolved(cfg)
    nested += _nested_items(cfg)  # (a group holding one fails its own rules with a TypeError: that line is left out)
    problems = out_of_range(cfg, RunConfig) + [_not_a_key(key, "added with +") for key in _added_keys(cfg)] + nested
    problems += _interpolated_bools(cfg)
    try:
        run_cfg = _convert(cfg)
    except ConfigError as whole:
        per_group = []
        for name in cfg:
            if isinstance(node := cfg._get_node(name), DictConfig) and not any(
                    line.startswith(f"- {name}.") for line in nested):
                try:
                    _convert(node)
                except ConfigError as e:
                    per_group.append(str(e))
        problems += per_group or ([] if nested else [str(whole)])  # a root-level failure no single group reproduces
    if problems:
        raise ConfigError("\n".join(problems)) from None
    return run_cfg


def _added_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Keys of the composed tree that the schema does not declare: Hydra lets `+train.max_stepz=5` (and ++) through
    the typed schema, and the typed conversion drops them without a word. agent.runner holds the agent's kwargs."""
    known, added = declared_bounds(RunConfig), []
    for name in cfg:
        key = f"{prefix}{name}"
        if key in ("hydra", "agent.runner"):
            continue
        if isinstance(node := cfg._get_node(name), DictConfig) and any(k.startswith(f"{key}.") for k in known):
            added += _added_keys(node, f"{key}.")
        elif key not in known:
            added.append(key)
    return added


def _interpolated_bools(cfg: DictConfig, prefix: str = "") -> list[str]:
    """A true/false key given by an interpolation of anything but true or false (or null): OmegaConf converts what it
    resolves to as it would a written value, without a word (`parallelism.colocate=${data.max_len}` and a `${name}`
    of 'yes' ran as true), where the written ones are refused (`_converted`, config/yaml_text.py)."""
    lines = []
    for name in cfg:
        key, node = f"{prefix}{name}", cfg._get_node(name)
        if isinstance(node, DictConfig) and not node._is_interpolation() and key not in ("hydra", "agent.runner"):
            lines += _interpolated_bools(node, f"{key}.")
        elif isinstance(node, BooleanNode) and node._is_interpolation():
            try:  # resolved untyped (an AnyNode converts nothing)
                value = AnyNode(node._value(), parent=cfg)._dereference_node()._value()
            except OmegaConfBaseException:  # (the typed conversion names a key it cannot resolve)
                continue
            if not (value is None or isinstance(value, bool) or str(value).lower() in ("true", "false")):
                lines.append(f"- {key}: true or false, but {node._value()} resolves to the {type(value).__name__} "
                             f"{value!r}, which would be read as {str(BooleanNode(value)._value()).lower()}. Fix: "
                             f"interpolate a true/false key, or write {key}=true or {key}=false")
    return lines


def _typed_lists(cfg: DictConfig, prefix: str = ""):
    """(key, node) of each list of numbers, strings or bools in `cfg` (not Hydra's own, not the agent's kwargs), and
    of each mapping (a group, a section, agent.runner) given by an interpolation, whose type OmegaConf checks no more
    than such a list's: `train=${seed}` reached the checks as the int 42 (an AttributeError traceback)."""
    for name in cfg:
        key, node = f"{prefix}{name}", cfg._get_node(name)
        if isinstance(node, DictConfig) and node._is_interpolation() and key != "hydra":
            yield key, node
        elif isinstance(node, DictConfig) and key not in ("hydra", "agent.runner"):
            yield from _typed_lists(node, f"{key}.")
        elif isinstance(node, ListConfig) and node._metadata.element_type in (int, float, str, bool):
            yield key, node


def _nested_items(cfg: DictConfig) -> list[str]:
    """A list or mapping inside a list of numbers or strings: OmegaConf checks a typed list's scalar items only, so
    `train.optimizer.betas=[0.9,[1]]` and `cluster.setup=[[a]]` reached the run (or a TypeError far from the key)."""
    return [f"- {key}: a list of single values, got {OmegaConf.to_container(node)}. Fix: set {key} to "
            f"{expected(RunConfig, key)}" for key, node in _typed_lists(cfg) if not node._is_interpolation() and any(
                isinstance(node._get_node(i), (DictConfig, ListConfig)) for i in range(len(node)))]


def _lists_resolved(cfg: DictConfig) -> tuple[DictConfig, list[str]]:
    """`cfg`, each typed list (or mapping) given by an interpolation set to what it resolves to (in a copy), and the
    problems of those that are no such list (or mapping): OmegaConf converts and checks a list written out, not one an
    interpolation resolves to, so `train.optimizer.betas=${oc.decode:'[a,b]'}` ran with ['a', 'b'],
    `cluster.setup=${oc.env:SETUP}` with a string for a list."""
    keys, problems = [key for key, node in _typed_lists(cfg) if node._is_interpolation()], []
    cfg = copy.deepcopy(cfg) if keys else cfg
    for key in keys:
        try:
            value = OmegaConf.select(cfg, key)
        except OmegaConfBaseException:  # (one that cannot resolve: the conversion names it)
            continue
        parent, _, name = key.rpartition(".")
        try:
            (OmegaConf.select(cfg, parent) if parent else cfg)[name] = value
        except OmegaConfBaseException as e:
            problems.append(f"- {getattr(e, 'full_key', None) or key}: {str(e).splitlines()[0]} (its interpolation "
                            f"resolves to {value!r}). Fix: set {key} to {expected(RunConfig, key)}")
    return cfg, problems


def _not_a_key(key: str, how: str) -> str:
    if key.startswith("hydra."):
        return _not_a_hydra_key(key, how)
    keys = list(declared_bounds(RunConfig))
    parts = key.split(".")
    # spelled alike, or its section's keys of the same last name: a Molt flag's nesting (--algo.advantage.estimator
    # typed as algorithm.advantage.estimator is algorithm.estimator, which spelling alone does not offer); nearest first
    same_name = [k for k in keys if k.split(".")[0] == parts[0] and k.rsplit(".", 1)[-1] == parts[-1]]
    close = sorted(set(same_name + difflib.get_close_matches(key, keys, n=3)),
                   key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())[:3]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    # a config group's name misspelled (+recipes=x, clusters=slurm): was told of keys only, or of nothing
    groups = ["recipe", *(d.name for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra")]
    if "." not in key and (group := difflib.get_close_matches(key, groups, n=1)):
        value = how.split("=", 1)[1] if "=" in how else "NAME"
        hint = f"did you mean the config group {group[0]} ({'+' * (group[0] == 'recipe')}{group[0]}={value})? "
    return (f"- {key}: not a key of the config ({how}). Fix: {hint}`molt-run --cfg job` prints every key; "
            "agent.runner kwargs are added with +agent.runner.NAME=value")


def _not_a_hydra_key(key: str, how: str) -> str:
    """A key Hydra's own config lacks, set without +: was told of `molt-run --cfg job` and agent.runner's kwargs.
    Below a mapping of Hydra's that takes any name (hydra.job.env_set), the key is added with +."""
    from hydra.conf import HydraConf

    parent, _, name = key.removeprefix("hydra.").rpartition(".")
    try:
        node = OmegaConf.select(OmegaConf.structured(HydraConf), parent) if parent else OmegaConf.structured(HydraConf)
    except OmegaConfBaseException:  # (below a value, or a plugin's slot: the schema has no node there)
        node = None
    where = ".".join(["hydra", parent] if parent else ["hydra"])
    if isinstance(node, DictConfig) and not node._is_missing() and node._metadata.object_type in (None, dict):
        fix = f"{where} takes names of your own, each added with +: +{key}=VALUE"
    else:
        close = difflib.get_close_matches(name, list(node.keys()), n=1) if isinstance(node, DictConfig) else []
        fix = (f"did you mean {where}.{close[0]}? " if close else "") + "`molt-run --cfg hydra` prints Hydra's keys"
    return f"- {key}: not a key of Hydra's own config ({how}). Fix: {fix}"


# The primary config Hydra will compose, as --config-path / --config-name choose it (`primary_problems`): the
# pre-check composes the same one.
PRIMARY = {"path": str(CONF_DIR), "name": "config"}


def primary_problems(config_path: str | None, config_name: str | None) -> list[str]:
    """--config-path / --config-name set where the pre-check composes from (PRIMARY), as Hydra reads them: a relative
    --config-path names a folder of the molt_hydra package (hydra.main's module), not of the current directory."""
    PRIMARY.update(path=str(CONF_DIR), name=config_name or "config")
    if config_path is None:
        return []
    path = Path(config_path) if os.path.isabs(config_path) else CONF_DIR.parent / config_path
    if config_path.startswith("pkg://") or not path.is_dir():
        return [f"- --config-path {config_path}: Hydra would search {path} for the primary config, which is not a "
                "directory. Fix: give the absolute path of the directory holding your config (a relative one is read "
                "inside the molt_hydra package), or use --config-dir DIR to add DIR's recipes to molt's own"]
    PRIMARY["path"] = str(path.resolve())
    return []


def compose_checked(overrides: list[str], *, multirun: bool = False, config_dir: str | None = None,
                    hydra_config: bool = False) -> tuple[DictConfig | None, list[str]]:
    """Parse and compose the command line's overrides as Hydra will, before Hydra does: (the composed config, with its
    `hydra` node when `hydra_config`, and []) or (None, problems), every failure a line `- key: reason Fix: fix`
    (exit 2) instead of Hydra's report (exit 1). A sweep is composed at its first point."""
    parser, problems, pairs = OverridesParser.create(), [], []  # (override, its text): only those that parse
    for text in overrides:
        try:
            pairs += [(o, text) for o in parser.parse_overrides([text])]
            if not pairs[-1][0].key_or_group:  # (Hydra parses `=1` as a key named '')
                problems.append(f"- {text}: no key before the =. Fix: write key=value (`molt-run --cfg job` prints "
                                "every key)")
        except OverrideParseException as e:
            problems.append(f"- {text}: Hydra cannot parse this override ({str(e).splitlines()[0]}). Fix: write "
                            "key=value; quote a value holding , [ ] { } $, spaces or letters beyond ASCII for Hydra, "
                            "inside the shell's quotes (\"key='a, b'\"); see "
                            "https://hydra.cc/docs/advanced/override_grammar/basic/")
    if not multirun:
        problems += [f"- {text}: a sweep (a,b / range / glob), but this is not a multirun. Fix: quote the value "
                     f"(key='a,b'), give a list (key=[a,b]), or add -m to sweep" for o, text in pairs
                     if o.is_sweep_override()]
    problems += [_deleted(o.key_or_group, text) for o, text in pairs
                 if o.is_delete() and not o.key_or_group.startswith(("hydra", "agent.runner."))]
    problems += [line for o, text in pairs for line in [*_empty(o, text), *_added_to_hydra(o, text),
                                                        *_search_path_problems(o, text), *_set_by_hydra(o, text)]]
    if multirun:
        problems += oversized_sweep(pairs) + [
            f"- {text}: a sweep over dry_run would start some points and only plan the others. Fix: add dry_run=true "
            "to plan every point, or leave dry_run out to run them" for o, text in pairs
            if o.is_sweep_override() and o.key_or_group == "dry_run"]
    if problems := problems + repeated_keys(pairs):
        return None, problems
    parsed = [o for o, _ in pairs]
    search = _search_path(parsed, config_dir)
    if problems := unlisted_sweeps(parsed, overrides):
        return None, problems
    firsts = {text: next(iter(o.sweep_string_iterator()), None) for o, text in zip(parsed, overrides)
              if o.is_sweep_override()}  # (a glob: expand_globs made it a list)
    if None in firsts.values():  # (Hydra would launch 0 jobs and exit 0)
        return None, [f"- {text}: a sweep of no value, so the multirun would run nothing. Fix: give it at least one "
                      "value (range(a,b) needs a < b)" for text, first in firsts.items() if first is None]
    # a sweep (`-m a=1,2`) is checked at its first point; the sweeper composes the others, one job each
    overrides = [f"{o.get_key_element()}={firsts[text]}" if o.is_sweep_override() else text
                 for o, text in zip(parsed, overrides)]
    cfg, files, problems, kept = _composed(overrides, search, parsed, hydra_config)
    if cfg is None:
        return None, problems
    pairs = [pairs[i] for i in kept]  # (one set aside is told already)
    problems += _converted(cfg, pairs) + yaml_text_problems(cfg, files, multirun) + _unresolved(cfg, pairs)
    problems += _lists_resolved(cfg)[1]  # (a mapping given by one is read before the typed conversion)
    return (None, problems) if problems else (cfg, [])


def _composed(overrides: list[str], search: list[str], parsed: list, hydra_config: bool) -> tuple:
    """(the config composed, its YAML files, the composition's problems, the places of the overrides composed).
    Hydra stops at the first value it cannot take, so `rollout.n_samples_per_prompt=abc train.optimizer.lr=xyz` named
    only the first: an override of a value (no config group, not Hydra's) that fails is set aside and the rest composed
    again, so every such key is named at once (the config is then that of the rest, for the checks that follow on the
    overrides composed; its problems make the command fail)."""
    register()
    rest, problems, last = list(range(len(overrides))), [], None  # (places: a text may be given twice, ~a ~a)
    while True:
        texts = [overrides[i] for i in rest]
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=PRIMARY["path"], version_base="1.3"):
                cfg = compose(PRIMARY["name"], overrides=[*texts, *search], return_hydra_config=hydra_config)
                return cfg, _files(cfg, [parsed[i] for i in rest], texts, search), problems, rest
        except VersionError:  # (compat/hydra.py: another hydra-core, not the user's override)
            raise
        except Exception as e:  # noqa: BLE001 -- every composition failure is the user's override
            if str(e) == last:  # the one set aside was not its cause (a recipe's value): told once, as it is now
                problems.pop()
            problems.append(line := _composition_problem(e, texts))
            last = str(e)
        blamed = next((i for i in rest if not parsed[i].is_delete() and not _is_group(name := parsed[i].key_or_group)
                       and "/" not in name and not name.startswith("hydra") and (
                           line.startswith(f"- {overrides[i]}:") or f"({overrides[i]})" in line)), None)
        if blamed is None:  # (a group's choice or Hydra's own: what follows it depends on it)
            return None, [], problems, []
        rest.remove(blamed)


# (primary config, the overrides that may choose config groups) -> compat/hydra.py `composed_files` of them
_FILES: dict[tuple, list] = {}


def _files(cfg: DictConfig, parsed: list, overrides: list[str], search: list[str]) -> list:
    """The YAML configs composed into `cfg` (yaml_text_problems reads them), listed once per choice of config groups:
    listing them costs half a composition, and the points of a sweep over values (seed=1,2) compose the same ones.
    An override of a value (a key that is no mapping of `cfg`) chooses no config."""
    chooses = [text for o, text in zip(parsed, overrides) if o.key_or_group.startswith("hydra") or isinstance(
        found := OmegaConf.select(cfg, o.key_or_group, default=_ABSENT, throw_on_resolution_failure=False),
        DictConfig) or found is _ABSENT]
    key = (PRIMARY["path"], PRIMARY["name"], *search, *chooses)
    if key not in _FILES:
        _FILES[key] = composed_files(PRIMARY["name"], [*overrides, *search])
    return _FILES[key]


# the hydra node's keys molt-run reads before Hydra starts (the run and sweep directories are made from name)
HYDRA_READ = ("hydra.run.dir", "hydra.sweep.dir", "hydra.job.chdir")


def _unresolved(cfg: DictConfig, pairs: list) -> list[str]:
    """The command line's keys, then the config's keys HYDRA_READ interpolate (a recipe's `name: ${nope}`: was told as
    hydra.run.dir, with a fix for Hydra's config), then HYDRA_READ, that cannot resolve: `name=${name}`,
    `name=${oc.env:UNSET}` or `hydra.run.dir=${nope}` ended in a traceback where molt-run read the run directory; so
    did a value left ??? (`job=???`, `hydra.run.dir=???`: MissingMandatoryValue where molt-run first read it)."""
    problems, texts, read = [], {o.key_or_group: text for o, text in pairs if not o.is_delete()}, []
    for parent, _, name in (key.rpartition(".") for key in HYDRA_READ):
        node = OmegaConf.select(cfg, parent, default=None, throw_on_resolution_failure=False)
        raw = node._get_node(name)._value() if isinstance(node, DictConfig) and node._get_node(name) else None
        read += re.findall(r"\$\{([A-Za-z_][\w.]*)\}", raw) if isinstance(raw, str) else []
    for key in dict.fromkeys([*(k for k in texts if "/" not in k and not k.startswith("hydra.")),
                              *(k for k in read if not k.startswith("hydra.")), *HYDRA_READ]):
        try:
            OmegaConf.select(cfg, key, throw_on_resolution_failure=True, throw_on_missing=True)
        except OmegaConfBaseException as e:
            reason = str(e).splitlines()[0]
            if "HydraConfig was not set" in reason and key not in (*HYDRA_READ, *read) and "${hydra:" not in texts.get(
                    key, "${hydra:"):  # (`checkpoint.dir=${output_dir}/ckpt`, as its default: resolved where
                continue  # point_problems pins output_dir; was refused, told to write the path out)
            problems.append(f"- {key}: {reason} ({texts.get(key, 'its value')}). Fix: {_fix(key, reason)}")
        if problems:  # (the directories are made from the keys before them: one cause, one line)
            break
    return problems


def repeated_keys(pairs: list) -> list[str]:
    """A key (or config group) the command line gives more than once: Hydra applies each in turn, so the last one won
    without a word (`rollout.n_samples_per_prompt=4 rollout.n_samples_per_prompt=8` ran 8; a sweep `-m seed=1,2
    seed=3` ran seed=3 alone). One key with several values (`-m seed=1,2`) is one override, a sweep; `~key` undoes
    what comes before it in so many words (+agent.runner.NAME=v ~agent.runner.NAME)."""
    given: dict[tuple, list] = {}
    for o, text in pairs:
        if not o.is_delete():
            given.setdefault((o.key_or_group, o.package), []).append((o, text))
    return [f"- {key}: given {len(both)} times on the command line ({', '.join(text for _, text in both)}), but it "
            "holds one value: Hydra would keep the last without a word (or refuse two +adds). Fix: give "
            f"{key} once ({element}=VALUE); to run several values, sweep them in one override: -m {element}=A,B"
            for (key, _), both in given.items() if len(both) > 1
            for element in [both[-1][0].get_key_element()]]


# the most points a sweep may have: Slurm's default MaxArraySize (1001) holds one array of them; the basic launcher
# runs them one after another here, each checked first (~0.5 s). Listing 10**8 of them hung before the first started.
MAX_SWEEP_POINTS = 1000


def oversized_sweep(pairs: list) -> list[str]:
    """A sweep of more than MAX_SWEEP_POINTS points (the product of each swept key's count), counted without listing
    them: `-m seed=range(0,100000000)` hung while Hydra listed and molt-run checked its points."""
    sizes = {}
    for o, text in pairs:
        value = o.value() if o.is_sweep_override() else None
        if isinstance(value, RangeSweep) and value.start is not None and value.stop is not None and value.step:
            sizes[o.key_or_group] = (text, max(0, math.ceil((value.stop - value.start) / value.step)))
        elif isinstance(value, (ChoiceSweep, list)):
            sizes[o.key_or_group] = (text, len(value.list if isinstance(value, ChoiceSweep) else value))
    if (points := math.prod(n for _, n in sizes.values())) <= MAX_SWEEP_POINTS:
        return []
    return [f"- {' '.join(text for text, _ in sizes.values())}: a sweep of {points} points, more than "
            f"{MAX_SWEEP_POINTS} (each point is a run of its own). Fix: sweep fewer values, or split the sweep into "
            f"multiruns of at most {MAX_SWEEP_POINTS} points"]


def unlisted_sweeps(parsed: list, texts: list[str]) -> list[str]:
    """Sweeps whose values cannot be listed, which Hydra's basic sweeper met with a traceback (exit 1): interval(a,b),
    a sampling sweeper's continuous range (no such sweeper is installed), and range(a,b,0)."""
    problems = []
    for o, text in zip(parsed, texts):
        try:
            next(iter(o.sweep_string_iterator()), None) if o.is_sweep_override() else None
        except (HydraException, ValueError) as e:
            problems.append(f"- {text}: " + (
                "interval() is a continuous range that only a sampling sweeper (Optuna, Ax; none is installed) "
                "draws from; Hydra's basic sweeper runs listed values." if isinstance(o.value(), IntervalSweep) else
                f"its values cannot be listed ({str(e).splitlines()[0]}).") + " Fix: list the values (key=a,b,c), or "
                "give range(start,stop,step) with a non-zero step")
    return problems


def _deleted(key: str, text: str) -> str:
    """`~key`: every key of the typed config keeps a value, so a deleted one (or a deleted group's keys) fell back to
    the schema's default without a word (`~train` dropped config.yaml's max_steps: the run never ended), or crashed
    the composition (`~job`). The agent's kwargs (agent.runner.*) and Hydra's own keys may be deleted."""
    if key == "recipe":  # (no recipe is in the defaults list: only +recipe=NAME adds one)
        return (f"- {text}: no recipe is chosen by default, only by +recipe=NAME, so deleting it undoes the command "
                "line's own choice. Fix: drop ~recipe, and +recipe=NAME too for no recipe")
    if _is_group(key):
        return (f"- {text}: deletes the config group {key}, whose keys would then take the schema's defaults unseen. "
                f"Fix: choose another option ({key}=NAME), or set the keys you mean to change ({key}.KEY=VALUE)")
    if any(name.startswith(f"{key}.") for name in declared_bounds(RunConfig)):
        return (f"- {text}: deletes {key}, whose keys would then take the schema's defaults unseen. Fix: set the keys "
                f"you mean to change ({key}.KEY=VALUE); `molt-run --cfg job` prints their current values")
    if key not in declared_bounds(RunConfig):  # (`~nope`: no default to fall back to)
        return _not_a_key(key, text)
    return (f"- {text}: deletes {key}, which would then take its schema default unseen. Fix: set it instead "
            f"({key}=VALUE, or null where the schema allows it); `molt-run --cfg job` prints its current value")


def _empty(o, text: str) -> list[str]:
    """`group=[]` chooses no option of a config group: its keys took the schema's defaults unseen (`rollout=[]`, as
    `~rollout`), a recipe was dropped (`+recipe=[]`), or Hydra failed with a traceback (`hydra/launcher=[]`).
    `group=[a,b]` chooses several, merged one over the other without a word (`+recipe=[a,b]` combined two recipes,
    which `+recipe=a +recipe=b` refuses; `algorithm=[ppo_gae,grpo]` was told to unset algorithm.lam, never set).
    `key={}` merges an empty mapping into a group or section, which changes nothing: it neither clears nor resets it;
    Hydra's own node too (`hydra={}`, `hydra.run={}`: were let through without a word, as was `+hydra=[]`), which
    takes nothing but a mapping of its keys (`hydra=x`)."""
    key, value = o.key_or_group, o.value()
    if key == "hydra" and not o.is_delete() and not (isinstance(value, dict) and value):  # (hydra=x, hydra=null: was
        # told to write +hydra=x, or to choose an option of the group hydra; conf/hydra holds Hydra's groups, hydra is
        # a node of keys)
        fix = f"Fix: set the keys you mean to change (hydra.KEY=VALUE; `molt-run --cfg hydra` prints them), or leave " \
              f"{text} out"
        return [f"- {text}: an empty {'list' if isinstance(value, list) else 'mapping'} for Hydra's own config, which "
                "changes nothing: hydra is no config group to choose an option of, and merging nothing into it "
                f"neither clears nor resets it. {fix}" if value in ([], {}) else f"- {text}: hydra is Hydra's own "
                f"config, which takes its keys, not a value or an option of a config group. {fix}"]
    group, hydra_mapping = "/" in key or _is_group(key), False
    if group and isinstance(value, list) and len(value) > 1 and not o.is_delete():
        fix = ("give one +recipe=NAME (a recipe of your own, --config-dir DIR with DIR/recipe/NAME.yaml, can combine "
               "two)" if key == "recipe" else f"choose one ({o.get_key_element()}=NAME)" + (
                   "" if key.startswith("hydra/") else  # (Hydra sweeps none of its own config)
                   f", or sweep them: -m {o.get_key_element()}={','.join(map(str, value))}"))
        return [f"- {text}: chooses {len(value)} options of the config group {key}, which Hydra composes one over the "
                "other: the last one's keys win and the others' stay wherever it sets none, a mix of both. Fix: "
                f"{fix}"]
    if o.is_delete() or o.is_sweep_override() or not isinstance(value, (list, dict)) or value:
        return []
    if isinstance(value, dict) and key.startswith("hydra."):  # a mapping of Hydra's (run, job.env_set, ...), or a slot
        from hydra.conf import HydraConf  # the chosen plugin or logging preset fills (launcher, job_logging: unset)

        schema, path = OmegaConf.structured(HydraConf), key.removeprefix("hydra.")
        try:
            hydra_mapping = isinstance(OmegaConf.select(schema, path, throw_on_missing=False), DictConfig) or \
                OmegaConf.is_missing(schema, path)
        except OmegaConfBaseException:  # (a key below a plugin's slot, or none of Hydra's: composition reports it)
            pass
    if isinstance(value, list) and group:
        return [f"- {text}: chooses no option of the config group {key}, so none of its settings would be composed "
                f"(its keys left at the schema's defaults, or unset). Fix: choose one ({o.get_key_element()}=NAME; "
                f"`molt-run {'--hydra-help' if key.startswith('hydra') else '--help'}` lists them), or drop {text}"]
    if isinstance(value, dict) and (group or key == "agent.runner" or hydra_mapping or any(
            name.startswith(f"{key}.") for name in declared_bounds(RunConfig))):
        return [f"- {text}: an empty mapping, which Hydra merges into {key}: that changes nothing (it neither clears "
                f"nor resets {key}). Fix: set the keys you mean to change ({key.replace('/', '.')}.KEY=VALUE"
                f"{f', or another option: {key}=NAME' if group else ''}), or leave {text} out"]
    return []


def _added_to_hydra(o, text: str) -> list[str]:
    """`+hydra.KEY=v` (or ++) of a key Hydra's own config lacks: Hydra took it into its node and read it nowhere
    (`+hydra.run.dirr=x`, `+hydra.job.nmae=x`), without a word. Below a free-form node (job.env_set, callbacks, the
    launcher's, sweeper's and logging presets' slots) every key is someone's to read."""
    from hydra.conf import HydraConf

    key = o.key_or_group
    if not (o.is_add() or o.is_force_add()) or not key.startswith("hydra."):
        return []
    node, parts = OmegaConf.structured(HydraConf), key.split(".")[1:]
    for number, part in enumerate(parts):
        if not isinstance(node, DictConfig) or node._is_missing() or node._metadata.object_type in (None, dict):
            return []
        if part not in node.keys():
            close = difflib.get_close_matches(part, list(node.keys()), n=1)
            where = ".".join(["hydra", *parts[:number]])
            hint = f"did you mean {where}.{close[0]}? " if close else ""
            return [f"- {text}: adds {key}, a key Hydra's own config does not have, so Hydra would never read it. Fix: "
                    f"{hint}`molt-run --cfg hydra` prints Hydra's keys (set one without +)"]
        node = node._get_node(part)
    return []


def _search_path_problems(o, text: str) -> list[str]:
    """`hydra.searchpath=[...]`: each entry a place Hydra finds configs (recipes) in. An entry that names none was
    skipped without a word, as `--config-dir DIR` of no directory was; a value that is no list, or a scheme Hydra
    lacks, was refused with a fix about the schema's types (and naming "the command line", for the scheme)."""
    from molt_hydra.compat.hydra import search_path_problem

    if o.key_or_group != "hydra.searchpath" or o.is_delete() or o.is_sweep_override():
        return []
    fix = ("Fix: give the directory that holds recipe/NAME.yaml, \"hydra.searchpath=['file:///ABSOLUTE/DIR']\" (or "
           "pkg://PACKAGE), or use --config-dir DIR")
    if not isinstance(value := o.value(), list) or not all(isinstance(path, str) for path in value):
        return [f"- {text}: hydra.searchpath is a list of places to find configs in, got {value!r}. {fix}"]
    return [f"- {text}: Hydra would search {path} for configs, but it {why}, so none would be found there. {fix}"
            for path in value if (why := search_path_problem(path))]


# Hydra's own keys Hydra sets itself as a run starts, over any value given: key -> what chooses it instead
SET_BY_HYDRA = {"hydra.runtime": "hydra.run.dir (a multirun: hydra.sweep.dir) chooses the run's directory",
                "hydra.job.override_dirname": "hydra.job.config.override_dirname (kv_sep, item_sep, exclude_keys) "
                                              "shapes it",
                "hydra.job.config_name": "--config-name chooses the primary config",
                "hydra.overrides": "Hydra records the command line's overrides there"}


def _set_by_hydra(o, text: str) -> list[str]:
    """A key of SET_BY_HYDRA given on the command line: Hydra overwrote it without a word (hydra.runtime.output_dir=DIR
    ran in outputs/...), or recorded a command line that was not run (hydra.overrides.task=[...] in overrides.yaml)."""
    key = o.key_or_group
    entry = next((name for name in SET_BY_HYDRA if key == name or key.startswith(f"{name}.")), None)
    if entry is None or o.is_delete():
        return []
    return [f"- {text}: Hydra sets {entry} itself as the run starts, so the value given would change nothing (or "
            f"record what did not run). Fix: leave it out; {SET_BY_HYDRA[entry]}"]


def _is_group(key: str) -> bool:
    return key == "recipe" or (CONF_DIR / key).is_dir()


def quoted(value: str) -> str:
    """`value` quoted as Hydra's override grammar (and OmegaConf after it) reads it back exactly: a path of this
    machine may hold spaces, commas, quotes, brackets, `${` or non-ASCII letters, each of which broke `key=value`."""
    value = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)  # a quote escaped, backslashes before it too
    value = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, value)  # (and before the closing quote)
    return "'" + value.replace("${", "\\${") + "'"  # not an interpolation


def _search_path(parsed: list, config_dir: str | None) -> list[str]:
    """`--config-dir DIR` as the override that makes Hydra search it (its recipes, DIR/recipe/NAME.yaml)."""
    return ([f"hydra.searchpath=[{quoted(f'file://{Path(config_dir).resolve()}')}]"]
            if config_dir and not any(o.key_or_group == "hydra.searchpath" for o in parsed) else [])


def expand_globs(overrides: list[str], config_dir: str | None) -> tuple[list[str], list[str]]:
    """A multirun's `glob(...)` sweeps written out as the lists of config-group options Hydra's sweeper will run, so
    that every point is checked before the first starts: (the overrides, []) or (None, problems) for a glob that
    selects nothing (Hydra would launch 0 jobs and exit 0), on a key that is no config group among them."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return overrides, []  # reported by compose_checked
    if not any(isinstance(o.value(), Glob) for o in parsed):
        return overrides, []
    register()
    GlobalHydra.instance().clear()
    expanded, problems = [], []
    with initialize_config_dir(config_dir=PRIMARY["path"], version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for o, text in zip(parsed, overrides):
            if not isinstance(o.value(), Glob):
                expanded.append(text)
            elif chosen := o.value().filter(loader.get_group_options(
                    o.key_or_group, config_name=PRIMARY["name"], overrides=_search_path(parsed, config_dir))):
                expanded.append(f"{o.get_key_element()}={','.join(chosen)}")
            else:
                problems.append(f"- {text}: glob() sweeps the options of a config group, and selects none here, so "
                                "the multirun would run nothing. Fix: match one of the group's options (model=glob("
                                "qwen3_*)), or list the values of a key (seed=1,2,3)")
    return (None, problems) if problems else (expanded, [])


def _converted(cfg: DictConfig, pairs: list, recipe: bool = False) -> list[str]:
    """A value OmegaConf converts to the key's type without a word, into something else than the user wrote.
    A true/false key given anything but true, false (or null): OmegaConf reads every non-zero number (2, -1) and
    yes / on / y as true, and 0 / no / off / n as false; `parallelism.colocate=2` meant something else.
    A string key (or list of strings) given what Hydra parses as a number or a bool: the run got its str(),
    `name=1.10` ran as name 1.1 (outputs/1.1/), `data.split=2024.10` looked for split 2024.1, `name=true` ran as True,
    `name=1e3` as 1000.0. A sweep's values too (`-m name=1.10,2.0`): the sweeper passes each point on as that str()
    (name=1.1), which its point's check read back as written. `recipe`: the pairs are hydra.sweeper.params' (the
    sweeper parses them as overrides), whose fix is written in the recipe's YAML."""
    parser, problems = OverridesParser.create(), []
    for o, text in pairs:
        if o.is_delete() or o.key_or_group.startswith("hydra."):
            continue
        node, value, key = cfg, o.value(), o.key_or_group
        for part in key.split("."):
            node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        if isinstance(node, BooleanNode) and not o.is_sweep_override() and not (  # (a sweep's: each point's own)
                value is None or isinstance(value, bool) or str(value).lower() in ("true", "false")
                or "${" in str(value)):  # quoted (key='true'), an interpolation: as they read
            read_as = str(node._value()).lower()
            problems.append(f"- {key}: true or false, got {value!r} (which would be read as {read_as}). Fix: write "
                            f"{key}=true or {key}=false")
        if not (isinstance(node, StringNode) or isinstance(node, ListConfig) and node._metadata.element_type is str):
            continue
        misread, fixed = [], text  # (the written number, what Hydra reads), the override with each one quoted
        for written, start, stop in reversed(written_scalars(text)):
            if str(read := parser.parse_override(f"x={written}").value()) != written:
                misread.insert(0, (written, read))
                fixed = f"{fixed[:start]}'{written}'{fixed[stop + 1:]}"
        fix = (f'in the recipe\'s hydra.sweeper.params, {key}: "{fixed.split("=", 1)[1]}" (the quotes inside YAML\'s '
               "are Hydra's)" if recipe else f"{fixed} (inside the shell's quotes: \"{fixed}\")")
        reads = " and ".join(f"{written} as the {type(read).__name__} {read!r}" for written, read in misread)
        gets = " and ".join(repr(str(read)) for _, read in misread)
        problems += [f"- {key}: a string, but Hydra reads {reads}, so the run would get {gets}. Fix: quote "
                     f"{'it' if len(misread) == 1 else 'each'}, {fix}"] if misread else []
    return problems


def _composition_problem(e: Exception, overrides: list[str]) -> str:
    chain = [e]  # (Hydra raises a config's own failure inside `except`, without `from`: its cause is the context)
    while (cause := chain[-1].__cause__ or (chain[-1].__context__ if isinstance(
            chain[-1], ConfigCompositionException) else None)) is not None and len(chain) < 5:
        chain.append(cause)
    text, reason = "\n".join(str(c) for c in chain), (str(chain[-1]).splitlines() or [type(chain[-1]).__name__])[0]
    key = next((c.full_key for c in chain if getattr(c, "full_key", None)), None)
    override = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] in ((key,) if key else ())), None) or next(
        (o for o in overrides if o.lstrip("+~").split("=", 1)[0] in text), "the command line")
    if line := _interpolated_choice(chain, overrides, key, reason) or _recipe_problem(chain, overrides):
        return line
    if type(e) is KeyError and e.args and str(e.args[0]) not in os.environ and any(  # (Hydra's copy of env_copy's
            "env_copy" in o for o in overrides):  # variables; a recipe's env_copy: told as a bare KeyError below)
        return (f"- hydra.job.env_copy: names {e.args[0]}, an environment variable that is not set here, which Hydra "
                f"copies into the job's environment. Fix: set it (export {e.args[0]}=...), or leave it out of the list")
    if "Cannot find primary config" in text:  # --config-name NAME
        return (f"- --config-name {PRIMARY['name']}: no such config in {PRIMARY['path']}. Fix: name a .yaml file of "
                "that directory (without .yaml), or leave --config-name out (molt's config)")
    if "Config group override must be a string" in text:  # `model=null`, `rollout=4`, `+recipe=null`: that group,
        # not the first one of the command line (`+recipe=NAME model=null` was told as the recipe)
        override = next((o for o in overrides if "=" in o and _is_group(o.lstrip("+~").split("=", 1)[0]) and not
                         isinstance(OverridesParser.create().parse_override(o).value(), (str, list))), override)
        element, name = override.split("=", 1)[0], override.lstrip("+~").split("=", 1)[0]
        return (f"- {override}: {name} is a config group, which takes the name of one of its options. Fix: choose one "
                f"({element}=NAME; `molt-run --help` lists them), or set a key of it ({name}.KEY=VALUE)"
                if name != "recipe" else f"- {override}: recipe is a config group, which takes the name of a recipe. "
                f"Fix: give +recipe=NAME (`molt-run --help` lists them), or leave it out")
    if "force-add of config groups is not supported" in text:  # `++recipe=NAME`, `++model=NAME`
        override = next((o for o in overrides if o.startswith("++") and _is_group(o[2:].split("=", 1)[0])), override)
        plain = override.lstrip("+")
        fix = f"+{plain}" if plain.startswith("recipe=") else plain
        return (f"- {override}: ++ force-adds a key; a config group is chosen with one + where the defaults list "
                f"lacks it (+recipe=NAME), else without (model=NAME). Fix: {fix}")
    if "Could not find" in text:  # a config group option that does not exist: `model=nope`, `+recipe=nope`
        return f"- {override}: no such option of that config group. Fix: use one of {_options(text)}"
    if "Could not delete" in text:  # `~agent.runner.NAME` of a kwarg the agent is not given
        override = next((o for o in overrides if o.startswith("~") and f"'{o[1:].split('=', 1)[0]}'" in text), override)
        return f"- {override}: {reason} Fix: drop {override}; `molt-run --cfg job` prints every key"
    if sweeper := next((o for o in overrides if o.lstrip("+~").startswith("hydra.sweeper.params")), None):
        return (f"- {sweeper}: hydra.sweeper.params cannot be set on the command line (Hydra leaves it unset there, "
                "and OmegaConf merges nothing into an unset dict). Fix: sweep the key itself, -m KEY=a,b, or set "
                "hydra.sweeper.params in a recipe, as recipes/sweep_estimators_is.yaml does")
    # the key typed, not its first missing part (its last name finds the one meant); below a value too (`x.y.z=4`)
    below = (given := override.lstrip("+~").split("=", 1)[0]).startswith(f"{key}.")
    if key and (below or any(isinstance(c, (ConfigKeyError, ConfigAttributeError)) for c in chain)):
        return _not_a_key(given if below else key, override)
    if group := re.search(r"Could not append to config\. An item is already at '([^']+)'", text):  # `+seed=1`
        return (f"- {override}: {group[1]} is a key of the config already; + adds a key it lacks. Fix: drop the +: "
                f"{override.lstrip('+')}")
    if group := re.search(r"Could not override '([^']+)'\.\s+(?:No match|Did you mean to override (\S+)\?)", text):
        fix = f"{group[2]}={override.split('=', 1)[1]}" if group[2] else f"add it with +{override.lstrip('+~')}"
        return f"- {override}: {group[1]} is in no defaults list, so there is nothing to override. Fix: {fix}"
    if group := re.search(r"Multiple values for (\S+)\.|(\S+) appears more than once in the final defaults", text):
        name = group[1] or group[2]  # `+recipe=a +recipe=b`; `+algorithm=rloo` beside the default algorithm
        added = [o for o in overrides if o.startswith("+") and o.lstrip("+").split("=", 1)[0] == name]
        fix = ("give one +recipe=NAME (a recipe of your own, --config-dir DIR with DIR/recipe/NAME.yaml, can combine "
               "two)" if name == "recipe" else f"choose one: {name}=NAME, without +, replaces the default {name}")
        return f"- {added[-1] if added else override}: {name} is chosen more than once. Fix: {fix}"
    return _keyless_problem(overrides, override, reason) if key is None else (
        f"- {key}: {reason} ({override}). Fix: {_fix(key.split('[')[0], reason)}")


def _keyless_problem(overrides: list[str], override: str, reason: str) -> str:
    """A composition failure that names no key. A key set below a list key that is null (`+data.train_probs.sub=1`)
    is told as a key below a value is: was OmegaConf's bare AssertionError, "- the command line: Unexpected type for
    root: NoneType"."""
    for o in overrides:
        if any((name := o.lstrip("+~").split("=", 1)[0]).startswith(f"{leaf}.") for leaf in declared_bounds(RunConfig)):
            return _not_a_key(name, o)
    return (f"- {override}: {reason}. Fix: give each key a value of the type molt_hydra/config/schema.py declares for "
            "it (`molt-run --cfg job` prints every key)")


def _interpolated_choice(chain: list[Exception], overrides: list[str], key: str | None, reason: str) -> str | None:
    """A config group's choice given by an interpolation that names no option: Hydra resolves it alone, before the
    config exists, in a scratch config of its own. `model=${seed}` was told as that scratch key (`- _dummy_: ...`, with
    a fix to set _dummy_), `model=${oc.decode:'5'}` (an AssertionError with no message) was an IndexError traceback."""
    chosen = next((o for o in overrides if re.search(r"\$\\?\{", o.partition("=")[2]) and (  # (a sweep's point: $\{)
        "/" in (name := o.lstrip("+~").split("=", 1)[0]) or _is_group(name))), None)
    if not chosen or not (key == "_dummy_" or isinstance(chain[-1], AssertionError) or
                          "interpolated config group" in "\n".join(str(c) for c in chain)):
        return None
    why = (reason if key == "_dummy_" else "it resolves to no option's name" if isinstance(chain[-1], AssertionError)
           else "Hydra applies no defaults list of a config chosen through an interpolation, and this one has one")
    return (f"- {chosen}: {why}. A config group's choice is resolved before the config is composed, to the name of one "
            "of its options: it may name another group's choice (${model}) or a resolver's value "
            f"(${{oc.env:VAR,NAME}}), no key of the config. Fix: name the option itself ({chosen.split('=', 1)[0]}"
            f"=NAME; `molt-run {'--hydra-help' if 'hydra' in chosen else '--help'}` lists them)")


def _options(text: str) -> list[str]:
    """The options Hydra lists in its 'Could not find GROUP/NAME' (a tab before each)."""
    return re.findall(r"^\t(\S+)$", text, re.M)


def _recipe_problem(chain: list[Exception], overrides: list[str]) -> str | None:
    """A composition failure of a recipe's own YAML (a user's, --config-dir DIR/recipe/NAME.yaml), named as its
    +recipe= override with the fix in the recipe: was a reason cut to "ConfigKeyError raised while composing config:"
    and a fix about the schema's types (no `# @package _global_` line; YAML that does not parse: "while parsing a flow
    sequence", neither file nor line), or a fix naming the command line (a defaults list that adds a group config.yaml
    chooses already, or chooses an option of a group that does not exist)."""
    recipe, text = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == "recipe"), None), "\n".join(
        str(c) for c in chain)
    if recipe is None:
        return None
    if isinstance(chain[0], (RecursionError, UnicodeDecodeError)):  # (was: "- the command line: maximum recursion")
        return (f"- {recipe}: its defaults list includes itself (or a config that includes it), which Hydra follows "
                "without end. Fix: drop that entry from the defaults lists" if isinstance(chain[0], RecursionError)
                else f"- {recipe}: a config it composes is not UTF-8 text ({chain[0]}). Fix: save it as UTF-8")
    if bad := next((c for c in chain if isinstance(c, yaml.MarkedYAMLError) and c.problem_mark), None):
        mark = bad.problem_mark
        return (f"- {recipe}: {mark.name} is no valid YAML at line {mark.line + 1}, column {mark.column + 1}: "
                f"{bad.problem}{f' ({bad.context})' if bad.context else ''}. Fix: correct the YAML there")
    group = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    if group and not any(o.lstrip("+~").split("=", 1)[0] == group[1] for o in overrides):
        return (f"- {recipe}: its defaults list chooses {group[2]} for {group[1]}, which has no such option. Fix: "
                f"choose one of {_options(text)} there" if _options(text) else f"- {recipe}: its defaults list "
                f"chooses from {group[1]}, which is no config group (a group without a leading / is read inside the "
                "recipe's own, recipe/). Fix: name molt's group with a leading / (- override /model: NAME)")
    if "Key 'recipe' not in" in text:  # (Hydra put its keys under recipe.*, the recipe group's own package)
        return (f"- {recipe}: the recipe has no `# @package _global_` line, so Hydra reads its keys under recipe.*, "
                "which is no key of the config. Fix: add the line `# @package _global_` to the comment lines it opens "
                "with (before its first key), as every shipped recipe has")
    group = re.search(r"Multiple values for (\S+)\. To override a value use 'override (\S+): (\S+)'", text)
    if group and not any(o.startswith("+") and o.lstrip("+").split("=", 1)[0] == group[1] for o in overrides):
        return (f"- {recipe}: its defaults list adds {group[1]} {group[3]}, which config.yaml chooses already (its "
                f"default {group[1]}), so {group[1]} is chosen twice. Fix: write it `- override /{group[2]}: "
                f"{group[3]}` in the recipe's defaults list")
    return None


ANNOUNCED_SWEEP = 20  # sweeps of more points than this say that their check is under way
SWEEP_OWN_DIRS = RUN_DIRS  # the directories a run writes: one sweep point's each


def sweep_problems(first: DictConfig, overrides: list[str], config_dir: str | None) -> list[str]:
    """Every point of `molt-run -m` validated and planned before the first one starts: `sweep_checked`'s problems."""
    return sweep_checked(first, overrides, config_dir)[0]


def sweep_checked(first: DictConfig, overrides: list[str], config_dir: str | None) -> tuple[list[str], list]:
    """Every point of `molt-run -m` validated and planned before the first one starts, where Hydra's basic launcher
    runs them here one after another: a point refused when its turn came ended the sweep there, after the points
    before it had run. The points are the basic sweeper's own (the config's hydra.sweeper.params, then the command
    line's sweeps, their product: compat/hydra.py `sweep_points`); `first` is the first point composed with its hydra
    node. Returns (each failing point's problems under a line naming the point, [(point, `checked`'s result)] of
    every point run here; none for submitit's, which run elsewhere)."""
    from molt_hydra.compat.hydra import sweep_points, sweep_subdir

    basic = first.hydra.sweeper._target_.endswith(".BasicSweeper")
    params = [f"{key}={value}" for key, value in (first.hydra.sweeper.get("params") or {}).items()] if basic else []
    parsed = OverridesParser.create().parse_overrides([*params, *overrides])
    texts = [f"hydra.sweeper.params.{text}" for text in params]
    if problems := oversized_sweep(list(zip(parsed, [*texts, *overrides]))) or unlisted_sweeps(parsed, texts) or \
            _converted(first, list(zip(parsed, params)), recipe=True):  # (the command line's: compose_checked)
        return problems, []  # (the Slurm launcher's points are the basic sweeper's too)
    if basic and (shared := shared_subdir(first, len(sweep_points(parsed))) or launcher_swept(
            parsed, [*texts, *overrides], overrides, config_dir)):
        return shared, []
    if not basic:  # another sweeper (optuna, ...) makes its points as it goes
        return [], []
    # submitit's points run elsewhere (a login node may lack their GPUs): each is checked as its dry run (config, plan,
    # the points' own directories), and again where it runs. Before, a bad point was submitted and failed in its job.
    submits = not first.hydra.launcher._target_.endswith(".BasicLauncher")
    points = sweep_points(parsed)
    if not points:  # (Hydra would launch 0 jobs and exit 0)
        return [f"- {' '.join(overrides)}: the sweep has no point, so the multirun would run nothing. Fix: give each "
                "swept key at least one value (range(a,b) with a < b)"], []
    if len(points) > ANNOUNCED_SWEEP:  # each point takes ~0.5 s: a long sweep's check is not a silent wait
        print(f"Checking each of the sweep's {len(points)} points before the first starts (composed, validated and "
              "planned one after another) ...", file=sys.stderr, flush=True)
    problems, owners, results, seen, failed = _repeated_points(points), {}, [], {}, []
    sweep_dir, raw = Path(os.path.abspath(first.hydra.sweep.dir)), str(first.hydra.sweep._get_node("subdir")._value())
    for number, point in enumerate(points):  # the point's own output directory, as Hydra will name it (a stand-in
        # where hydra.sweep.subdir reads what is known only as the point starts)
        as_run = [*(o for o in point if o.lstrip("+~").split("=", 1)[0] != "dry_run"), "dry_run=true"] if submits \
            else point  # (dry_run is given once: repeated_keys)
        cfg, errors = compose_checked(as_run, config_dir=config_dir, hydra_config=True)
        subdir = (sweep_subdir(cfg, number, submits) if cfg is not None else None) or str(number)
        if (owner := owners.setdefault(("dir", sweep_dir / subdir), number)) != number:
            failed.append((number, point, [
                f"- hydra.sweep.subdir: {raw!r} names {sweep_dir / subdir} for it and for sweep point #{owner}" + (
                    " (a key they differ in is left out of hydra.job.override_dirname: hydra.job.config."
                    "override_dirname.exclude_keys)" if "override_dirname" in raw else "") + ", so it would resume "
                "from, overwrite or be locked out of that point's files. Fix: put ${hydra.job.num} in it, or leave it "
                "out"]))
            continue
        errors, result = (errors, None) if cfg is None else point_problems(as_run, sweep_dir / subdir, config_dir, cfg)
        results += [] if submits else [(point, result)]  # (submitted, a dry sweep plans in its jobs too)
        for key in SWEEP_OWN_DIRS if result is not None else ():
            if (path := get(result[0], key)) and (owner := owners.setdefault((key, os.path.abspath(path)), number)) \
                    != number:
                errors.append(f"- {key}: {path} is sweep point #{owner}'s too, so this point would resume from, "
                              f"overwrite or be locked out of that point's files. Fix: leave {key} at its default "
                              "(under the point's output_dir), or sweep it with the points")
        if result is not None and (same := _same_config(result[0], number, point, seen)):
            errors.append(same)
        if errors:
            failed.append((number, point, errors))
    return problems + _failed_points(failed, len(points)), results


def _failed_points(failed: list[tuple[int, list[str], list[str]]], total: int) -> list[str]:
    """Each failing sweep point's problem lines under a line naming the point; points failing with the very same lines
    (a bad value they share) under one line naming them all, the lines once: they were repeated for every point, 60
    times over in a sweep of 60 points."""
    groups: dict[tuple[str, ...], list[tuple[int, list[str]]]] = {}
    for number, point, errors in failed:
        groups.setdefault(tuple(errors), []).append((number, point))
    lines = []
    for errors, members in groups.items():  # (in the order of each group's first point)
        (number, point), count = members[0], len(members)
        which = "every point" if count == total else f"{count} points"
        lines += [f"sweep point #{number} of {total} ({' '.join(point)}):" if count == 1 else
                  f"sweep points {_numbers([n for n, _ in members])} of {total} ({which}, the same problems; "
                  f"#{number} is {' '.join(point)}):", *errors]
    return lines


def _numbers(numbers: list[int]) -> str:
    """Ascending point numbers, each run of three or more consecutive ones as its ends: #0-#59, #61, #63."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"#{r[0]}-#{r[-1]}" if len(r) > 2 else ", ".join(f"#{n}" for n in r) for r in runs)


def launcher_swept(parsed: list, texts: list[str], overrides: list[str], config_dir: str | None) -> list[str]:
    """A sweep over what hydra.launcher reads: a config group that chooses it (cluster=slurm,local, hydra/launcher=...)
    or a key it interpolates (cluster.nodes, cpus_per_node, time_min, partition, ...). Hydra starts one launcher for
    the whole multirun, composed from the command line without its sweeps, so each point got that one's launcher and
    Slurm request without a word: `-m cluster=slurm,local` ran both points here; `-m cluster=slurm
    cluster.time_min=60,240` gave both 60 minutes; `cluster.nodes=1,2` gave both one node (the second failed in it).
    So does the sweeper's hydra.sweeper.params: `-m +recipe=tiny_cpu,sweep_estimators_is` ran the sweep recipe's point
    once, its sweep dropped without a word, and `+recipe=sweep_estimators_is,tiny_cpu` had molt-run check 12 points of
    a multirun that ran 2."""
    fixed = [t for o, t in zip(parsed[len(parsed) - len(overrides):], overrides) if not o.is_sweep_override()]
    base, _ = compose_checked(fixed, config_dir=config_dir, hydra_config=True)
    if base is None:  # (its problems are the first point's too)
        return []
    ours, problems = _launcher_view(base), []
    sweeps = OmegaConf.to_container(base.hydra.sweeper).get("params") or {}
    reads = {key for raw in _launcher_view(base, resolve=False).values() if isinstance(raw, str)
             for key in re.findall(r"\$\{([A-Za-z_][\w.]*)\}", raw) if not key.startswith("hydra.")}
    for o, text in zip(parsed, texts):
        key = o.key_or_group
        if not o.is_sweep_override() or not ("/" in key or _is_group(key) or key in reads or key.startswith(
                "hydra.launcher")):
            continue
        for value in o.sweep_string_iterator():
            point, _ = compose_checked([*fixed, f"{o.get_key_element()}={value}"],
                                       config_dir=config_dir, hydra_config=True)
            own = OmegaConf.to_container(point.hydra.sweeper).get("params") or {} if point is not None else sweeps
            if own != sweeps:
                said = [" ".join(f"{k}={v}" for k, v in p.items()) or "none" for p in (own, sweeps)]
                problems.append(f"- {text}: {o.get_key_element()}={value} sets hydra.sweeper.params ({said[0]}), but "
                                "Hydra's sweeper reads them from the config composed without the command line's "
                                f"sweeps ({said[1]}), so that sweep would not run as written. Fix: run it as a "
                                f"multirun of its own (molt-run -m {o.get_key_element()}={value} ...)")
                break
            theirs = _launcher_view(point) if point is not None else ours
            if differ := [k for k in dict.fromkeys([*ours, *theirs]) if ours.get(k) != theirs.get(k)]:
                got = (f"the launcher {theirs.get('_target_')} instead of {ours.get('_target_')}" if "_target_" in
                       differ else ", ".join(f"hydra.launcher.{k}={theirs.get(k)!r} instead of {ours.get(k)!r}"
                                             for k in differ))
                problems.append(f"- {text}: sets what the launcher reads ({key}={value} asks for {got}), but Hydra "
                                "starts one launcher for the whole multirun, composed without its sweeps, so every "
                                f"point would get the latter. Fix: run one multirun per value of {key} "
                                f"(molt-run -m ... {o.get_key_element()}=VALUE)")
                break
    return problems


def _launcher_view(cfg: DictConfig, resolve: bool = True) -> dict:
    """{key: value} of each of hydra.launcher's keys (but `name`, the Slurm job's: cosmetic), a value that interpolates
    the config resolved (`resolve`); one of Hydra's own (${hydra.sweep.dir}, ${now:...}) is left as written."""
    todo, view = list(OmegaConf.to_container(cfg.hydra.launcher, resolve=False).items()), {}
    while todo:
        key, value = todo.pop()
        if isinstance(value, dict):
            todo += [(f"{key}.{name}", item) for name, item in value.items()]
        elif key != "name":
            view[key] = value
            if resolve and isinstance(value, str) and "${" in value and not re.search(r"\$\{(hydra[.:]|now:)", value):
                found = OmegaConf.select(cfg.hydra.launcher, key, throw_on_resolution_failure=False)
                view[key] = OmegaConf.to_container(found) if isinstance(found, (DictConfig, ListConfig)) else found
    return view


def shared_subdir(first: DictConfig, points: int) -> list[str]:
    """hydra.sweep.subdir, each point's directory under the sweep's, that does not resolve, or given as one name for all
    (`hydra.sweep.subdir=x`):
    every point ran in the same directory, resuming from or overwriting the one before, without a word (the check of
    each point's own directories stands in a directory per point, as Hydra makes them from the default subdir)."""
    from molt_hydra.compat.hydra import sweep_subdir

    raw = first.hydra.sweep._get_node("subdir")._value()
    if isinstance(raw, str) and "${" in raw:
        try:
            sweep_subdir(copy.deepcopy(first), 0, submits=False)  # (on a copy: it sets hydra.job.num)
        except ValueError as e:  # (was: a traceback from Hydra's launcher as the first point started)
            return [f"- hydra.sweep.subdir: {raw!r} does not resolve ({e}), so the sweep would fail as its first "
                    "point starts. Fix: name keys of the config, hydra.job.num or hydra.job.override_dirname"]
    if points < 2 or not isinstance(raw, str) or "${" in raw or not raw.strip():  # (blank: empty_dirs)
        return []
    return [f"- hydra.sweep.subdir: is {raw!r} for every point, so the {points} points would all run in "
            f"{os.path.join(os.path.abspath(first.hydra.sweep.dir), raw)}, each resuming from or overwriting the one "
            "before. Fix: make it differ per point, e.g. hydra.sweep.subdir='${hydra.job.num}', or leave it out "
            "(molt's default: ${hydra.job.num}_${hydra.job.override_dirname})"]


def _same_config(run_cfg: RunConfig, number: int, point: list[str], seen: dict) -> str | None:
    """A sweep point whose config, its output_dir aside (and the paths under it), is an earlier point's (`seen`: each
    config's first point and its values) though its values differ (the same values: _repeated_points): the rest of the
    command line sets what the swept values set, so `-m algorithm=grpo,rloo algorithm.estimator=rloo` ran rloo twice,
    without a word. The point's Hydra keys count as its config (a sweep over hydra.job.env_set.VAR runs other code),
    so does a directory it names itself (-m checkpoint.dir=A,B checkpoint.resume=auto goes on from each)."""
    from molt_hydra.runtime.run_record import config_as_dict

    tree = config_as_dict(run_cfg)
    own = json.dumps(tree.pop("output_dir"))[1:-1]
    values = tuple(sorted((o.key_or_group, repr(o.value())) for o in OverridesParser.create().parse_overrides(point)))
    mark = json.dumps([tree, [v for v in values if v[0].startswith("hydra")]], sort_keys=True, default=str).replace(
        f'"{own}/', '"${output_dir}/').replace(f'"{own}"', '"${output_dir}"')
    earlier, their_values = seen.setdefault(mark, (number, values))
    if earlier == number or their_values == values:
        return None
    return (f"- sweep point #{number}: runs the config of sweep point #{earlier}, its output_dir aside: the rest of "
            "the command line sets what the swept values set, so it would be the same run twice. Fix: drop the keys "
            "that set over what the sweep sets, or sweep those instead")


def _repeated_points(points: list[list[str]]) -> list[str]:
    """A sweep point that repeats an earlier one (`seed=1,1`, `lr=0.1,1e-1`: the values as Hydra parses them) would
    run the same configuration twice, a second run's time spent on nothing new."""
    parser, first_seen, problems = OverridesParser.create(), {}, []
    for number, point in enumerate(points):
        same = tuple(sorted((o.key_or_group, repr(o.value())) for o in parser.parse_overrides(point)))
        if (earlier := first_seen.setdefault(same, number)) != number:
            problems.append(f"- sweep point #{number} ({' '.join(point)}) repeats sweep point #{earlier}: the same "
                            "run twice. Fix: give each swept key distinct values")
    return problems


def point_problems(overrides: list[str], output_dir: Path, config_dir: str | None,
                   point: DictConfig | None = None) -> tuple[list[str], tuple | None]:
    """One run's config composed and put through `checked`, before Hydra makes its output directory (a refused config
    leaves no run directory behind): (its problem lines or [], `checked`'s (RunConfig, Plan) or None). `output_dir`
    stands in for the directory Hydra will make, unless the command line sets output_dir itself. `point`: a sweep
    point's config composed already, with the hydra node that named its directory."""
    own = any(o.lstrip("+~").split("=", 1)[0] == "output_dir" for o in overrides)
    if point is not None:
        with read_write(point), open_dict(point):
            del point["hydra"]  # (Hydra's task config has none)
            if not own:
                point.output_dir = str(output_dir)
    cfg, errors = (point, []) if point is not None else compose_checked(
        [*overrides, *([] if own else [f"output_dir={quoted(str(output_dir))}"])], config_dir=config_dir)
    if cfg is None:
        return errors, None
    try:  # per point: a sweep over job=rl,eval has points of either
        return [], checked(cfg, overrides)
    except ConfigError as e:
        return str(e).splitlines(), None


SLURM_RESOURCES = ("partition", "account", "qos", "constraint", "setup", "time_min")


def launcher_problems(first: DictConfig, overrides: list[str], multirun: bool) -> list[str]:
    """Slurm settings where nothing submits: submitit's launcher submits only a multirun's points, so `cluster=slurm`
    without -m (outside an allocation) would run here, and cluster.{partition,...} set on the command line of a run
    that submits nothing would change nothing (an sbatch'ed run takes its resources from sbatch's own options)."""
    if plugins := plugin_problems(first):
        return plugins
    submits = first.hydra.launcher._target_.endswith(".SlurmLauncher")
    if submits and not multirun and not os.environ.get("SLURM_JOB_ID"):
        return ["- hydra/launcher: the cluster preset selects the Slurm launcher, which submits the points of a "
                "multirun; without -m this run would start here, on this machine. Fix: add -m to submit it, or "
                "sbatch launchers/molt.sbatch"]
    if submits and multirun:  # (submitit's own check of srun is a RuntimeError traceback once Hydra starts)
        return notice_problems(first) if shutil.which("srun") else [
            "- hydra/launcher: the cluster preset selects the Slurm launcher, which submits each point with sbatch, "
            "but this machine has no Slurm (srun is not on PATH). Fix: run molt-run -m on a Slurm login node, or "
            "choose a preset that runs here (cluster=local, cluster=local_gpus)"]
    why = "the launcher is Hydra's basic one, which runs the points here" if multirun else "no Slurm job is submitted"
    keys = [f"cluster.{name}" for name in SLURM_RESOURCES]
    return [f"- {key}: a Slurm resource of the submitit launcher, but {why}, so it changes nothing. Fix: unset it; "
            "submit with -m and a Slurm cluster preset (cluster=slurm), or give it to sbatch (-p, -A, -q, -C, -t)"
            for key in dict.fromkeys(o.lstrip("+~").split("=", 1)[0] for o in overrides) if key in keys]


def notice_problems(first: DictConfig) -> list[str]:
    """submitit's count of requeues, and Slurm's notice (USR2, hydra.launcher.signal_delay_s before the time limit),
    as a Slurm point takes it (runtime/preemption.py): the step under way ends (cut short GRACE_S after the notice), a
    checkpoint is saved, the point is requeued. A delay of GRACE_S or less let Slurm's kill come first: the point
    ended TIMEOUT, not requeued. A time limit no longer than the delay had the notice sent as the job started (~20 s
    in): the point was requeued before its first step, again each time, until submitit's max_num_timeout ran out."""
    from molt_hydra.runtime.preemption import GRACE_S

    count = OmegaConf.select(first, "hydra.launcher.max_num_timeout")
    if type(count) is not int or count < 0:  # (submitit's requeue: `count - timed_out` in the point's signal handler)
        return [f"- hydra.launcher.max_num_timeout: {count!r}, but it is how many times submitit requeues a point that "
                "reaches its time limit, an integer >= 0 (not a number: the point's first notice failed it with a "
                "TypeError, not requeued; below 0: no point was requeued, even when preempted). Fix: set it to an "
                "integer >= 0 (the preset's 3; 0: a point at its time limit is not requeued)"]
    delay, limit = (OmegaConf.select(first, f"hydra.launcher.{key}") for key in ("signal_delay_s", "timeout_min"))
    if not isinstance(delay, int) or not isinstance(limit, int):
        return []
    if limit * 60 <= delay:
        return [f"- cluster.time_min: {limit} min, but Slurm's notice comes hydra.launcher.signal_delay_s={delay} s "
                "before the time limit, so as the job starts: each point would be requeued before its first step. Fix: "
                f"a cluster.time_min well above {delay / 60:g} min (a step and a save must fit between), or a smaller "
                "hydra.launcher.signal_delay_s"]
    return [] if delay > GRACE_S else [
        f"- hydra.launcher.signal_delay_s: {delay} s, but a point given Slurm's notice is cut short only {GRACE_S:g} s "
        "after it (the step under way ends, a checkpoint is saved), so Slurm's kill would come first and the point "
        f"would end without being requeued. Fix: set it above {GRACE_S:g} plus a save (the preset's 120)"]


def plugin_problems(first: DictConfig) -> list[str]:
    """hydra.launcher and hydra.sweeper name a plugin class Hydra can start for a multirun: `hydra.launcher=null` ended
    in an AttributeError traceback here, `hydra.sweeper._target_=x` in Hydra's RuntimeError once the multirun began.
    Hydra's callbacks name a class it can import; each of these takes the keys given (`+hydra.launcher.timeout_min=60`
    for the basic launcher, a callback's unknown class: Hydra's instantiate error, exit 1, once Hydra had started)."""
    from hydra.utils import get_class

    from molt_hydra.compat.hydra import plugin_classes, submitit_refused

    problems = []
    for name in ("launcher", "sweeper"):
        node = first.hydra[name]
        target = node.get("_target_") if isinstance(node, DictConfig) else node
        if target not in (known := plugin_classes(name)):
            problems.append(f"- hydra.{name}: {target!r} is no {name} Hydra can start (its plugins: {known}). Fix: "
                            f"choose one with hydra/{name}=NAME (`molt-run --hydra-help` lists them), or leave it out")
        else:
            problems += _refused_keys(f"hydra.{name}", node, get_class(target), f"choose another {name} with "
                                      f"hydra/{name}=NAME (`molt-run --hydra-help` lists them)")
        if name == "launcher" and target in known and target.startswith("hydra_plugins.hydra_submitit_launcher.") \
                and (refused := submitit_refused(target, list(node))):
            problems += [f"- hydra.launcher.{key}: submitit's launcher takes no such parameter (it takes "
                         f"{refused[1]}), so the multirun would fail as it submits. Fix: drop hydra.launcher.{key}, "
                         "or name one it takes" for key in refused[0]] + _submitit_values(node, target)
    for name, node in (OmegaConf.select(first, "hydra.callbacks") or {}).items():
        if node is None:  # (Hydra starts none)
            continue
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        try:
            problems += _refused_keys(f"hydra.callbacks.{name}", node, get_class(target), "")
        except Exception as e:  # noqa: BLE001 -- whatever importing the user's class raises
            problems.append(f"- hydra.callbacks.{name}._target_: Hydra cannot import {target!r} "
                            f"({str(e).splitlines()[0]}). Fix: name a hydra.experimental.callback.Callback class as "
                            f"pkg.module.Name, or drop hydra.callbacks.{name}")
    return problems


def _submitit_values(node: DictConfig, target: str) -> list[str]:
    """hydra.launcher's values as submitit takes them: one of another type (`array_parallelism=abc`, `mem_gb=abc`,
    `timeout_min=1.5`) passed every check and failed the sweep as it was submitted (an AssertionError or TypeError
    traceback, exit 1, its directory made); array_parallelism below 1 is Slurm's `%0`: no limit, every point at once."""
    from molt_hydra.compat.hydra import submitit_types

    problems = []
    for key, types in submitit_types(target).items():
        value = OmegaConf.select(node, key, throw_on_resolution_failure=False)
        value = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
            takes = " or ".join(t.__name__ for t in types)
            problems.append(f"- hydra.launcher.{key}: {value!r}, but submitit takes {takes} there, so the multirun "
                            f"would fail as it submits. Fix: set it to a value of type {takes}, or leave it out")
    if isinstance(at_once := node.get("array_parallelism"), int) and not isinstance(at_once, bool) and at_once < 1:
        problems.append(f"- hydra.launcher.array_parallelism: {at_once}, but it is how many of the sweep's points "
                        f"Slurm runs at once, and Slurm reads %{at_once} as no limit: every point would start at once. "
                        "Fix: set it to 1 or more (the preset's 256)")
    problems += [f"- hydra.launcher.{key}: {value!r}, but a sweep point is one task on one node, which starts Ray and "
                 "has the other nodes join it (runtime/slurm_ray.py), and submitit waits for a result from each of "
                 "nodes x tasks_per_node tasks: the point would train, then be reported failed. Fix: leave it at 1; "
                 "ask for nodes with cluster.nodes=N" for key in ("nodes", "tasks_per_node")
                 if (value := node.get(key)) not in (None, 1) and type(value) is int]  # (another type: told above)
    return problems


def _refused_keys(key: str, node: DictConfig, cls: type, fix: str) -> list[str]:
    """The keys of `node` (besides _target_ and Hydra's other _keys_) that `cls` takes no argument for."""
    parameters = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    takes = [name for name in parameters if name not in ("self", "args")]
    return [f"- {key}.{name}: {cls.__name__} takes no such argument (it takes {takes}), so Hydra could not start it. "
            f"Fix: drop {key}.{name}{'; or ' + fix if fix else ''}" for name in node
            if not str(name).startswith("_") and name not in parameters]


def chdir_problems(first: DictConfig) -> list[str]:
    """hydra.job.chdir=true would run the job from its output directory, where every relative path of the config
    (data, model, checkpoint.path, ...), checked from here, would name another file or none."""
    return ["- hydra.job.chdir: true runs the job from its output directory, where the config's relative paths "
            "(checked from here) would name other files. Fix: leave hydra.job.chdir=false (the run writes under "
            "output_dir either way)"] if first.hydra.job.chdir else []


def mode_problems(first: DictConfig, multirun: bool, overrides: list[str]) -> list[str]:
    """A multirun's settings without -m. hydra.mode=MULTIRUN (on the command line or in a recipe): Hydra ran a
    multirun that molt-run had checked as one run, its sweep points unchecked (a dry run printed one plan, none of
    theirs). hydra.sweeper.params (a sweep recipe's, `+recipe=sweep_estimators_is`): Hydra ran one config, none of the
    sweep's points, each swept key at its composed value, without a word; the command line may set them all (one
    point, chosen). `multirun` is also true under --cfg, which prints the config (a sweep recipe's too), runs none."""
    if multirun:
        return []
    mode, params = OmegaConf.select(first, "hydra.mode"), OmegaConf.select(first, "hydra.sweeper.params") or {}
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    unset = [f"{key}={value}" for key, value in params.items() if key not in given]
    problems = ["- hydra.mode: MULTIRUN makes Hydra run a multirun, but without -m molt-run checks one run, not the "
                "sweep's points. Fix: add -m (--multirun) and leave hydra.mode out"] if getattr(
        mode, "name", mode) == "MULTIRUN" else []
    if unset:
        problems.append(f"- hydra.sweeper.params: sweeps {' '.join(unset)}, but without -m Hydra runs one config, none "
                        "of the sweep's points (each of those keys at its composed value). Fix: add -m (--multirun) to "
                        f"run the sweep, or set {' '.join(item.split('=')[0] + '=VALUE' for item in unset)} to run one "
                        "of its points")
    return problems


def logging_problems(first: DictConfig) -> list[str]:
    """Hydra's logging presets (hydra.job_logging, hydra.hydra_logging) as logging.config.dictConfig will read them:
    a level it does not know, a version but 1, a handler class it cannot import, a handler or formatter named but not
    defined, and a hydra.job.name holding a / (the log file's name: a directory that is never made) failed Hydra's
    logging setup with a traceback ('Unable to configure root logger'), after molt-run's checks, as the run started."""
    names, problems = logging.getLevelNamesMapping(), []
    for tree in ("hydra.job_logging", "hydra.hydra_logging"):
        node = OmegaConf.select(first, tree, default=None, throw_on_resolution_failure=False)
        conf = OmegaConf.to_container(node) if isinstance(node, DictConfig) else {}
        todo, defined = [(tree, conf)], {part: set(conf.get(part) or {}) for part in ("handlers", "formatters")}
        if conf and conf.get("version") != 1:
            problems.append(f"- {tree}.version: is {conf.get('version')!r}, and logging's dict config has version 1 "
                            "only. Fix: set it to 1")
        while todo:
            key, value = todo.pop()
            if isinstance(value, str) and "${" in value:  # resolved, as Hydra reads it (${oc.env:LOGLEVEL,INFO}); one
                try:  # that cannot resolve here (${hydra.runtime...}, set as the run starts) is left to Hydra
                    value = OmegaConf.select(first, key, throw_on_resolution_failure=True)
                except OmegaConfBaseException:
                    continue
            if isinstance(value, dict):
                todo += [(f"{key}.{name}", item) for name, item in value.items()]
            elif key.endswith(".level") and not isinstance(value, int) and str(value) not in names:
                problems.append(f"- {key}: {value!r} is no logging level, so Hydra's logging setup would fail as the "
                                f"run starts. Fix: set it to one of {', '.join(names)}")
            elif (part := key.rsplit(".", 1)[-1]) in ("handlers", "formatter") and (missing := [
                    name for name in (value if isinstance(value, list) else [value]) if name not in defined[
                        "handlers" if part == "handlers" else "formatters"]]):
                problems.append(f"- {key}: names {missing}, which {tree} does not define (it defines "
                                f"{sorted(defined['handlers' if part == 'handlers' else 'formatters'])}). Fix: name "
                                "one it defines, or define it there")
            elif key.endswith(".class") and key.startswith(f"{tree}.handlers."):
                try:
                    logging.config.BaseConfigurator({}).resolve(str(value))
                except ValueError as e:
                    problems.append(f"- {key}: {str(e).splitlines()[0]}. Fix: name a logging.Handler class as "
                                    "pkg.module.Name (logging.StreamHandler, logging.FileHandler)")
    if "/" in str(OmegaConf.select(first, "hydra.job.name", default="")):
        problems.append(f"- hydra.job.name: is {first.hydra.job.name!r}, which names the job's log file, and a / in it "
                        "a directory no one makes. Fix: a name without /")
    return sorted(problems)


LOG_FIX = "name a file in a writable directory (or leave it out: the log goes to the run's directory)"


def log_dirs(first: DictConfig) -> dict[str, Path]:
    """{hydra.*_logging.handlers.NAME.filename: its directory} of each log file named outright (no ${...}, which puts
    it under the run's directory): logging opens it as Hydra starts the job, where one that cannot be made was a
    FileNotFoundError / NotADirectoryError traceback, after molt-run's checks."""
    found = {}
    for tree in ("hydra.job_logging", "hydra.hydra_logging"):
        node = OmegaConf.select(first, f"{tree}.handlers", default=None, throw_on_resolution_failure=False)
        for name, handler in (OmegaConf.to_container(node) if isinstance(node, DictConfig) else {}).items():
            if isinstance(file := (handler or {}).get("filename"), str) and "${" not in file:
                found[f"{tree}.handlers.{name}.filename"] = Path(os.path.abspath(file)).parent
    return found


# what an empty hydra directory key makes of the run's files: Hydra joins '' into the current directory, without a word
EMPTY_DIRS = {"hydra.run.dir": "the run would write its .hydra/, log and checkpoints straight into {cwd}",
              "hydra.sweep.dir": "the points' directories would be made straight in {cwd}",
              "hydra.sweep.subdir": "every point would write into the sweep directory itself, over the others' files"}


def empty_dirs(first: DictConfig, multirun: bool) -> list[str]:
    """hydra.run.dir (a multirun: hydra.sweep.dir and .subdir) given as '' or blanks, which names no directory."""
    keys = ("hydra.sweep.dir", "hydra.sweep.subdir") if multirun else ("hydra.run.dir",)
    values = {key: OmegaConf.select(first, key, throw_on_resolution_failure=False) for key in keys}  # (subdir: job.num)
    return [f"- {key}: is {value!r}, which names no directory: {EMPTY_DIRS[key].format(cwd=os.getcwd())}. Fix: give "
            f"it a directory, or leave {key} out (molt's default: `molt-run --cfg hydra` prints it)"
            for key, value in values.items() if value is not None and not str(value).strip()]


def job_ignored(first: DictConfig, overrides: list[str]) -> list[str]:
    """The command line's keys (and config groups) that `first.job` has no use for (JOB_IGNORES), one line each."""
    job, lines = getattr(first.job, "value", first.job), []
    for key in dict.fromkeys(o.lstrip("+~").split("=", 1)[0] for o in overrides):
        if (reason := ignored_by(job, key)) is not None:
            lines.append(f"- {key}: job={job} {reason}, so it changes nothing. Fix: unset {key} for job={job}")
    return lines


def unread_on_command_line(first: DictConfig, overrides: list[str]) -> list[str]:
    """Keys the run would not read, refused where the command line sets them: the composed config (conf/config.yaml,
    a recipe) or a multirun point (runtime/sweep.py) sets them too, where they are left alone.
    train.optimizer.lr under LoRA with Muon: every adapter matrix steps at muon_lr, no AdamW group is left
    (models/rules.py `_lora_muon` refuses the other AdamW knobs). logger.wandb.group with W&B disabled: no run to
    group (config/validate.py refuses W&B's other names). train.micro_batch_size under train.dynamic_batch: the trainer
    takes train.max_tokens_per_micro_batch as its budget then (runtime/trainer_options.py); conf/config.yaml sets it.
    data.input_key (and the other columns) under job=eval over builtin:// eval data: no column is read (a recipe's
    keys name its training data's columns; data/rules.py refuses them where the run's own data is builtin).
    rollout.temperature (batch_size, top_p, max_new_tokens) under job=eval where eval.temperature is set.
    train.batch_size under train.force_on_policy, other than the rollout step's samples, which replace it (derive)."""
    from molt_hydra.data.prompts import BUILTIN
    from molt_hydra.data.rules import COLUMN_KEYS
    from molt_hydra.models.rules import LORA_MUON_INERT

    given, o = {text.lstrip("+~").split("=", 1)[0] for text in overrides}, first.train.optimizer
    wandb_mode, job = (getattr(v, "value", v) for v in (first.logger.wandb.mode, first.job))  # (job=sft: JOB_IGNORES)
    specs = [part.strip() for part in (first.eval.data_path or "").split(",")]
    builtin_eval = job == "eval" and bool(specs) and all(s.startswith(BUILTIN) for s in specs)
    step, batch = _step_samples(first), OmegaConf.select(first, "train.batch_size", throw_on_resolution_failure=False)
    return [f"- {key}: {reason} Fix: {fix}" for key, unread, reason, fix in (
        *((key, builtin_eval, f"job=eval reads eval.data_path={first.eval.data_path} only, builtin:// tasks that "
           "generate their own rows: no column is read, so it changes nothing.", f"unset {key}, or point "
           "eval.data_path at a dataset that has that column") for key in COLUMN_KEYS),
        # eval.* left null samples with the rollout's value (config/validate.py derive); job=eval samples nothing else
        *((f"rollout.{name}", job == "eval" and first.eval[name] is not None, f"job=eval samples with "
           f"eval.{name}={first.eval[name]}, and rollout.{name} only stands in for an eval.{name} left null, so it "
           "changes nothing.", f"unset rollout.{name} (eval.{name} sets the evaluation's)")
          for name in ("batch_size", "temperature", "top_p", "max_new_tokens")),
        ("train.optimizer.lr", first.model.lora.rank is not None and getattr(o.name, "value", o.name) == "muon",
         f"model.lora.rank={first.model.lora.rank}: {LORA_MUON_INERT}", "drop train.optimizer.lr and set "
         "train.optimizer.muon_lr (the adapter's step size), or train.optimizer.name=adamw"),
        ("logger.wandb.group", wandb_mode == "disabled" and job != "sft",
         "it groups the W&B run, but logger.wandb.mode=disabled "
         "starts none, so it changes nothing.", "unset logger.wandb.group, or set logger.wandb.mode=offline (or "
         "auto/online)"),
        ("train.micro_batch_size", first.train.dynamic_batch and job != "eval", "it budgets a micro-batch as "
         "micro_batch_size x data.max_len tokens, but train.dynamic_batch=true budgets it by "
         "train.max_tokens_per_micro_batch, so it changes nothing.", "drop train.micro_batch_size and set "
         "train.max_tokens_per_micro_batch, or set train.dynamic_batch=false"),
        # (was: replaced without a word, though docs/molt_options.md says the two must agree)
        ("train.batch_size", job == "rl" and first.train.force_on_policy and step is not None and batch != step,
         f"train.force_on_policy=true steps once over each rollout step's samples, rollout.batch_size x "
         f"rollout.n_samples_per_prompt = {step}, which the run takes as train.batch_size: {batch} would be replaced.",
         f"set train.batch_size={step} (or drop it), or set train.force_on_policy=false")) if unread and key in given]


def _step_samples(cfg: DictConfig) -> int | None:
    """rollout.batch_size x rollout.n_samples_per_prompt of a composed config; None where either is no int (a bad
    value: its own check reports it)."""
    values = [OmegaConf.select(cfg, f"rollout.{name}", throw_on_resolution_failure=False)
              for name in ("batch_size", "n_samples_per_prompt")]
    return values[0] * values[1] if all(isinstance(v, int) for v in values) else None


def _exit_config_error(text: str) -> None:
    print(f"Config error(s):\n{text}", file=sys.stderr)
    sys.exit(EXIT_CONFIG_ERROR)


# A recipe is a starting point: the keys it sets that the chosen job has no use for are set aside (schema defaults),
# so that `+recipe=NAME job=eval` scores any recipe's model and `+recipe=NAME job=sft data.train_path=...` fine-tunes
# it; the command line's own are refused (JOB_IGNORES covers each key set aside here). job=eval scores the model with
# the engines alone: a recipe's training-only choices (its algorithm, the teacher or critic that algorithm starts, its
# trainer placement, its training data, an SFT recipe's targets) are read by no part of it. A GPU recipe's
# parallelism.colocate would otherwise give the one engine half its GPU and sleep mode, beside no trainer; its
# data.train_path had the data keys judged against rows eval never reads (data.input_key=xyz passed over builtin eval
# data) and was loaded at the start. job=sft trains one model on its data's replies: an RL recipe's algorithm, its
# teacher, its rollout-loop and placement knobs and its eval sampling were refused one by one, so that switching an RL
# recipe to job=sft meant deleting them by hand, while job=eval took the same recipe.
JOB_SETS_ASIDE = {
    "eval": ("algorithm", "model.ref_path", "model.critic_path", "train.critic", "parallelism",
             "checkpoint.best_metric_key",
             *(f"data.{name}" for name in ("train_path", "train_probs", "split", "max_samples", "output_key",
                                           "train_on_last_turn_only", "chat_template")),
             *(f"logger.{name}" for name in ("every_steps", "sample_table_every", "dump_trajectories",
                                             "debug_rollout", "debug_grad_norms"))),
    "sft": tuple(key for key, reason in JOB_IGNORES["sft"].items() if reason is not None and key not in (
        "rollout", "agent", "train.max_steps", "logger.wandb.group")),  # (read by no rule under job=sft)
}


def _set_aside(cfg: DictConfig) -> DictConfig:
    if (job := getattr(cfg.job, "value", cfg.job)) not in JOB_SETS_ASIDE:
        return cfg
    cfg, defaults = cfg.copy(), OmegaConf.structured(RunConfig)
    for key in JOB_SETS_ASIDE[job]:
        OmegaConf.update(cfg, key, OmegaConf.select(defaults, key), merge=False)
    return cfg


def validated(cfg: DictConfig, overrides: list[str]) -> RunConfig:
    """The composed `cfg` typed and validated as the run takes it, raising ConfigError with every problem: the keys of
    the command line (`overrides`, the user's) that the job ignores (JOB_IGNORES) or the run would not read, and, with
    the keys the job ignores set aside, every rule of runtime/validate.py."""
    from molt_hydra.runtime.validate import validate  # deferred: it imports the agents (seconds)

    lines = job_ignored(cfg, overrides) + unread_on_command_line(cfg, overrides)
    try:
        run_cfg = validate(to_run_config(_set_aside(cfg)))
    except ConfigError as e:
        lines.append(str(e))
    if lines:
        raise ConfigError("\n".join(lines))
    return run_cfg


def checked(cfg: DictConfig, overrides: list[str]):
    """Everything a run is checked against before it starts, raising ConfigError: the config `validated` (`overrides`:
    the command line it was composed with), the machine and the data files the run reads (not in a dry run: it plans
    a GPU recipe anywhere, before its data), the plan (which derives the colocated memory split and refuses one that
    cannot fit), the installed vLLM of a run that starts engines, the directories the run writes (one not writable
    exits as runtime/writable.py says). Returns (RunConfig, Plan)."""
    # deferred: the runtime imports torch, Ray and the agents (seconds), which --help and a config error never need
    from molt_hydra.compat.vllm import preflight
    from molt_hydra.config.validate import missing_gpu
    from molt_hydra.data.rules import missing_data_files
    from molt_hydra.runtime.plan import make_plan
    from molt_hydra.runtime.writable import check_outputs

    run_cfg = validated(cfg, overrides)
    if not run_cfg.dry_run and (problem := missing_gpu(run_cfg) or missing_data_files(run_cfg)):  # (a dry run plans
        raise ConfigError(problem)  # a recipe anywhere, before its data is prepared)
    plan = make_plan(run_cfg)
    if not run_cfg.dry_run and run_cfg.job.value != "sft" and (
            problem := preflight(run_cfg.cluster.device.value, run_cfg.train.partial_rollout)):
        raise ConfigError(problem)
    if not run_cfg.dry_run:
        check_outputs(run_cfg)
    return run_cfg, plan


# output_dir -> `checked`'s (RunConfig, Plan) of the run checked before Hydra started, which Hydra runs next in this
# process: composing, validating and planning again would cost as much (a multirun's points are each checked again)
_CHECKED: dict[str, tuple] = {}


def _main(cfg: DictConfig) -> None:
    from molt_hydra.runtime.sweep import set_wandb_group

    set_wandb_group(cfg)  # multirun points share one W&B group named after the sweep
    if (result := _CHECKED.pop(str(cfg.output_dir), None)) is None:
        from hydra.core.hydra_config import HydraConfig

        try:  # (a point started elsewhere, checked when it was submitted: its command line is Hydra's task overrides)
            result = checked(cfg, list(HydraConfig.get().overrides.task))
        except ConfigError as e:
            _exit_config_error(str(e))
    run_cfg, plan = result
    print(plan.render())
    if run_cfg.dry_run:
        return
    from molt_hydra.runtime.entrypoint import run
    from molt_hydra.runtime.sweep import going_on_after_a_failure

    with going_on_after_a_failure():  # a local sweep's failed point: the others still run
        run(run_cfg)


def _output_dir_in_use(output_dir: str) -> bool:
    from molt_hydra.runtime.run_lock import in_use

    return in_use("output_dir", output_dir)


def _refused_point(cfg: DictConfig) -> None:
    """A local multirun point whose output directory another run holds: refused as its run would be, and recorded as
    a failed point (the sweep goes on)."""
    from molt_hydra.runtime.run_lock import refuse_if_held
    from molt_hydra.runtime.sweep import going_on_after_a_failure

    with going_on_after_a_failure():
        refuse_if_held({"output_dir": str(cfg.output_dir)})


def main() -> None:
    # Ctrl-C or SIGTERM while the config is composed, validated and planned (seconds of imports): one line, exit 130,
    # no traceback; the run, once started, takes both itself (runtime/entrypoint.py). So does SIGHUP (the terminal
    # closed) unless ignored (nohup): before, its default action ended the process without a word (exit -1).
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _interrupt)
    try:
        _check_then_run()
    except KeyboardInterrupt:
        print("\nInterrupted before the run started.", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_then_run() -> None:
    from molt_hydra.compat.hydra import get_args_parser, held_points_refused, report_submitit_sweeps

    register()
    parser, problems = get_args_parser(), []
    parser.error = _argument_error
    args = parser.parse_args()
    modes = [flag for flag, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                   ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:  # (Hydra's own refusal is a ValueError traceback)
        _exit_config_error(f"- {' '.join(modes)}: Hydra takes one of these at a time. Fix: keep one of {modes}")
    if args.cfg is None and not args.help and (args.resolve or args.package is not None):  # (Hydra's: --resolve a
        # ValueError traceback once the run had passed its checks, a dry run none; --package ignored without a word)
        flag = "--resolve" if args.resolve else f"--package {args.package}"
        _exit_config_error(f"- {flag}: shapes what --cfg prints, and this command line has no --cfg, so nothing "
                           f"would take it. Fix: add --cfg job (or --cfg hydra, --cfg all) to print the config, or "
                           f"drop {flag}")
    if args.experimental_rerun is not None:  # (Hydra's: a ValueError traceback for a missing file, else no check)
        _exit_config_error(f"- --experimental-rerun {args.experimental_rerun}: Hydra reruns a config.pickle, which "
                           "molt-run neither writes nor checks before it starts. Fix: run molt-run again with the "
                           "overrides the run recorded in <its output_dir>/.hydra/overrides.yaml")
    if args.config_dir and not Path(args.config_dir).is_dir():  # (Hydra searches it for nothing, without a word)
        _exit_config_error(f"- --config-dir {args.config_dir}: not a directory, so none of its recipes would be found. "
                           "Fix: point it at the directory that holds recipe/NAME.yaml")
    if primary := primary_problems(args.config_path, args.config_name):
        _exit_config_error("\n".join(primary))
    if args.shell_completion and (completion := completion_problems(args.overrides)):
        _exit_config_error(completion)
    if not (args.help or args.hydra_help or args.info or args.shell_completion):
        problems = _command_line_problems(args)
        if problems and not args.cfg:
            _exit_config_error("\n".join(problems))
    elif not args.shell_completion and (failed := compose_checked(args.overrides, multirun=args.multirun,
                                                                  config_dir=args.config_dir)[1]):
        _exit_config_error("\n".join(failed))  # --help / --info compose the overrides too (before: a traceback)
    if args.multirun:
        report_submitit_sweeps()  # a submitit sweep's refusal and failed points, reported (compat/hydra.py)
        held_points_refused(_output_dir_in_use, _refused_point)  # before Hydra writes a point's .hydra/ and log
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_main)()
    if args.multirun:
        from molt_hydra.runtime.sweep import exit_if_points_failed

        exit_if_points_failed()
    if problems:  # --cfg: the config is printed, then why a run of it would be refused
        _exit_config_error("\n".join(problems))


def _argument_error(message: str) -> None:
    """argparse's refusal of the command line, which printed its usage, then the reason, and no fix. The overrides are
    one run of words to argparse: more after a flag (`dry_run=true --config-dir DIR +recipe=x`) are 'unrecognized'."""
    words = message.removeprefix("unrecognized arguments: ").split() if message.startswith("unrecognized") else []
    if words and all("=" in word and not word.startswith("-") for word in words):
        _exit_config_error(f"- {' '.join(words)}: overrides after a flag that follows other overrides, which Hydra "
                           "does not read (it takes one run of them). Fix: give all the overrides together, before or "
                           "after the flags (molt-run --config-dir DIR dry_run=true +recipe=NAME)")
    flag, reason = message.removeprefix("argument ").split(": ", 1) if message.startswith("argument ") else (
        " ".join(words) or "molt-run", message)
    _exit_config_error(f"- {flag}: {reason}. Fix: `molt-run --hydra-help` lists the flags and what each takes; an "
                       "override is key=value")


def completion_problems(overrides: list[str]) -> str | None:
    """`--shell-completion` takes one subcommand, install=SHELL, uninstall=SHELL or query=SHELL (query is the installed
    completion's own call, with the line typed so far in COMP_LINE): anything else (none, two, a config override, an
    unknown shell, query by hand) was Hydra's ValueError or KeyError traceback."""
    from molt_hydra.compat.hydra import completion_shells

    shells, words = completion_shells(), [o.split("=", 1) for o in overrides]
    if len(words) == 1 and len(words[0]) == 2 and words[0][0] in ("install", "uninstall", "query") and \
            words[0][1] in shells and (words[0][0] != "query" or "COMP_LINE" in os.environ):
        return None
    return (f"- --shell-completion {' '.join(overrides)}".rstrip() + ": takes one subcommand, install=SHELL or "
            f"uninstall=SHELL (SHELL one of {shells}); query=SHELL is the installed completion's own call. Fix: "
            'eval "$(molt-run --shell-completion install=bash)" in your shell (its rc file to keep it)')


def _command_line_problems(args) -> list[str]:
    """The command line checked before Hydra starts: overrides (a composition failure ends the process here), launcher,
    then every sweep point or the run (`--cfg`: the config as a dry run checks it, neither this machine nor the
    directories)."""
    overrides, problems = expand_globs(args.overrides, args.config_dir) if args.multirun else (args.overrides, [])
    first, problems = (None, problems) if problems else compose_checked(
        overrides, multirun=args.multirun, config_dir=args.config_dir, hydra_config=True)
    if first is None:  # (ends here even under --cfg: Hydra could not compose it)
        _exit_config_error("\n".join(problems))
    if problems := (launcher_problems(first, overrides, args.multirun) + chdir_problems(first)
                    + mode_problems(first, args.multirun or bool(args.cfg), overrides)
                    + empty_dirs(first, args.multirun)
                    + logging_problems(first)):
        return problems
    if args.multirun:
        if not first.dry_run:  # one line naming the key, before each point's directories fail on it (4 lines each)
            from molt_hydra.runtime.writable import fail_unless_writable

            # submitit makes its folder as it submits (%j: each job's id): one it cannot make was a traceback there;
            # checked where submitit makes it (~ expanded, up to the first part naming a job)
            folder = OmegaConf.select(first, "hydra.launcher.submitit_folder", default="", throw_on_resolution_failure=
                                      False)
            if folder:
                from submitit.core.utils import JobPaths
            known = {"hydra.launcher.submitit_folder": JobPaths.get_first_id_independent_folder(str(folder))} \
                if folder else {}
            fail_unless_writable({"hydra.sweep.dir": Path(os.path.abspath(first.hydra.sweep.dir)), **log_dirs(first),
                                  **known}, dict.fromkeys(log_dirs(first), LOG_FIX))
        problems, points = sweep_checked(first, overrides, args.config_dir)
        if points and not problems and all(result[0].dry_run for _, result in points):
            _dry_sweep(points)
        if not problems:  # a directory of this sweep's own (runtime/fresh_dir.py), which Hydra makes next
            from molt_hydra.runtime.fresh_dir import own_dir

            # after the words as typed (glob() expanded is on no command line: it went after a trailing flag)
            add_override(f"hydra.sweep.dir={quoted(str(own_dir(first.hydra.sweep)))}", args.overrides)
        return problems
    if args.cfg:
        if args.package not in (None, "", "_global_") and OmegaConf.select(first, args.package, default=_ABSENT) in (
                _ABSENT, None):  # (before: Hydra's "Package ... not found in config", exit 1, no fix)
            _exit_config_error(f"- --package {args.package}: no such key (or a null one) in the config, so there is "
                               "nothing to print. Fix: name a key `molt-run --cfg job` prints (e.g. --package model), "
                               "or leave --package out")
        run_dir = Path(os.path.abspath(first.hydra.run.dir))
        if args.resolve and not any(o.lstrip("+~").split("=", 1)[0] == "output_dir" for o in overrides):
            # under --cfg Hydra sets no hydra.runtime.output_dir, so --resolve failed on output_dir with a traceback
            add_override(f"output_dir={quoted(str(run_dir))}", overrides)
        as_dry = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "dry_run"]  # (given once: repeated_keys)
        return point_problems([*as_dry, "dry_run=true"], run_dir, args.config_dir)[0]
    return _check_run(first, overrides, args.config_dir)  # before Hydra makes its run directory


_ABSENT = object()


def add_override(text: str, overrides: list[str]) -> None:
    """`text` added to the command line Hydra parses next (sys.argv), right after the user's `overrides`: argparse
    reads them as one run of words, so after a trailing flag (`--cfg job seed=1 --resolve`, `+recipe=x --config-dir
    DIR`) the added override was "unrecognized arguments: hydra.run.dir=...", exit 2, once the config had passed."""
    argv, n = sys.argv, len(overrides)
    ends = [i + n for i in range(len(argv) - n, 0, -1) if n and argv[i:i + n] == overrides]
    argv.insert(ends[0] if ends else len(argv), text)


def _dry_sweep(points: list) -> None:
    """A multirun of dry runs, every point checked: each point's plan, and the process ends; nothing is written (Hydra
    would make the sweep directory and each point's, with .hydra/ and a log)."""
    for number, (point, (_, plan)) in enumerate(points):
        print(f"== sweep point #{number} of {len(points)} ({' '.join(point)}) ==")
        print(plan.render())
    print(f"Dry run: nothing started, nothing written ({len(points)} sweep points planned).")
    sys.exit(0)


def _check_run(first: DictConfig, overrides: list[str], config_dir: str | None) -> list[str]:
    """One run checked before Hydra starts: its problems, or none and then either the dry run's plan printed and the
    process ended (a dry run writes nothing: Hydra would make the run directory, .hydra/ and cli.log), or the run
    handed to Hydra, which makes this directory (pinned: `${now:...}` resolves anew in Hydra's own compose) and gets
    the checked config (`_CHECKED`)."""
    from molt_hydra.runtime.writable import fail_unless_writable

    run_dir = Path(os.path.abspath(first.hydra.run.dir))  # as Hydra makes hydra.runtime.output_dir
    if not first.dry_run:  # named as the key that sets it (as OutputWritable does); .hydra/ goes to output_subdir,
        # which may lie outside the run directory (hydra.output_subdir=/abs: was a FileExistsError traceback)
        sub = Path(os.path.normpath(run_dir / (first.hydra.output_subdir or "")))
        fail_unless_writable({"hydra.run.dir": run_dir, **({} if sub.is_relative_to(run_dir) else {
            "hydra.output_subdir": sub}), **log_dirs(first)}, dict.fromkeys(log_dirs(first), LOG_FIX))
    problems, result = point_problems(overrides, run_dir, config_dir)
    if problems:
        return problems
    run_cfg, plan = result
    if run_cfg.dry_run:
        print(plan.render())
        print(f"Dry run: nothing started, nothing written (the run would write to {run_cfg.output_dir}).")
        sys.exit(0)
    from molt_hydra.runtime.fresh_dir import own_dir
    from molt_hydra.runtime.run_lock import refuse_if_held
    from molt_hydra.runtime.writable import run_dirs

    if (mine := own_dir(first.hydra.run)) == run_dir:  # (taken: Hydra's compose checks the run in mine again)
        _CHECKED[run_cfg.output_dir] = result
        refuse_if_held(run_dirs(run_cfg))  # (a directory taken anew is this run's own)
    add_override(f"hydra.run.dir={quoted(str(mine))}", overrides)
    return []


if __name__ == "__main__":
    main()
