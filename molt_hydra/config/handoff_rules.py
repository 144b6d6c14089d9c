"""Rules on the names a run hands to other code later: names vLLM looks up when an engine starts, the W&B project,
string knobs set to nothing, the Ray address. Each of these used to pass `dry_run=true` and fail (or do nothing) at
run time.

Run by runtime/validate.py after every other rule (`name_rules` skips keys reported already). Names are checked
against the installed vLLM's own registries, imported only when the knob is set (importing vLLM costs seconds).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import typing
from urllib.parse import urlsplit

from molt_hydra.config.bounds import declared_bounds, get
from molt_hydra.config.schema import RunConfig

NAME_MAX = 255  # the longest file name (bytes) of Linux's file systems (ext4, xfs, btrfs, tmpfs, NFS)
PATH_MAX = 4096  # the longest path (bytes, with its terminating NUL) Linux's system calls take
# the directories the run makes, parents first (checkpoint.dir and export_dir default to ones under output_dir)
RUN_DIRS = ("output_dir", "checkpoint.dir", "checkpoint.export_dir", "train.rollout_dump_dir")
# rollout knobs passed to vLLM's EngineArgs under the same name; the values it takes are read from its field types
ENGINE_ARG_NAMES = ("attention_backend", "mm_encoder_attn_backend", "mamba_ssm_cache_dtype", "gdn_prefill_backend")


def _choice(problems, key: str, value, known, what: str) -> None:
    known = sorted(known)
    near = difflib.get_close_matches(str(value), known, n=1)
    hint = f" (did you mean {near[0]!r}?)." if near else "."
    problems.check(value in known, key, f"{value!r} is not {what}{hint}", f"use one of {known}, or unset {key}")


def _accepted_names(hint) -> set:
    """The names a type hint allows: a `Literal[...]`'s strings and an Enum's member names, through unions."""
    if typing.get_origin(hint) is typing.Literal:
        return set(typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return set(hint.__members__)
    return {v for arg in typing.get_args(hint) for v in _accepted_names(arg)}


def engine_name_rules(cfg, problems) -> None:
    """Names vLLM resolves when an engine starts, checked against the installed vLLM's EngineArgs field types and
    parser registries (public surfaces: no vLLM internals)."""
    r, agent = cfg.rollout, cfg.agent
    set_names = [key for key in ENGINE_ARG_NAMES if getattr(r, key) is not None]
    if set_names:
        import vllm.engine.arg_utils as arg_utils

        fields = {f.name: f.type for f in dataclasses.fields(arg_utils.EngineArgs)}
        for key in set_names:
            hint = eval(fields[key], vars(arg_utils)) if isinstance(fields[key], str) else fields[key]  # noqa: S307
            what = "a vLLM attention backend" if "att" in key else f"a value vLLM's EngineArgs.{key} takes"
            _choice(problems, f"rollout.{key}", getattr(r, key), _accepted_names(hint), what)
    if agent.tool_parser not in (None, "hermes"):  # hermes is vLLM's built-in default: no import for it
        from vllm.tool_parsers import ToolParserManager

        _choice(problems, "agent.tool_parser", agent.tool_parser,
                {*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers}, "a vLLM tool parser")
    if agent.reasoning_parser is not None:
        from vllm.reasoning import ReasoningParserManager

        _choice(problems, "agent.reasoning_parser", agent.reasoning_parser,
                ReasoningParserManager.list_registered(), "a vLLM reasoning parser")


def wandb_name_rules(cfg, problems) -> None:
    """The W&B project name, checked by W&B's own settings, as `wandb.init` checks it once the run's roles are up (was:
    `logger.wandb.project=team/proj` failed there with a UsageError, after the engines and trainer had started)."""
    w = cfg.logger.wandb
    if w.mode.value == "disabled" or cfg.job.value == "sft" or not w.project.strip() or w.project == "molt_hydra":
        return  # (no W&B run; a blank name is name_rules'; the default passes, and importing wandb costs ~0.5 s)
    import wandb

    try:
        wandb.Settings(project=w.project)
    except Exception as e:  # noqa: BLE001 -- wandb's UsageError (or pydantic's): its message says what is wrong
        entity, _, name = w.project.partition("/")
        problems.check(False, "logger.wandb.project", f"W&B refuses it: {str(e).splitlines()[0].rstrip('.')}.",
                       f"set logger.wandb.entity={entity} logger.wandb.project={name} (W&B takes the entity apart)"
                       if name and "/" not in name and w.entity is None else
                       "give a name of at most 128 characters without / \\ # ? % :")


def name_rules(cfg, problems) -> None:
    """A string knob set to empty (or blank) where its default is not empty names nothing: `data.input_key=`; nor
    does an empty entry of a list of names (`logger.debug_grad_norms_filter=['']` matched no parameter)."""
    reported = {line[2:].split(":", 1)[0] for line in problems.lines}
    for key, (_, default) in declared_bounds(RunConfig).items():
        value = get(cfg, key)
        if isinstance(value, list) and key not in reported:
            problems.check(not any(isinstance(v, str) and not v.strip() for v in value), key, f"{value!r} holds an "
                           "empty entry, which names nothing.", f"drop the empty entries of {key}")
            continue
        blank = isinstance(value, str) and not isinstance(value, enum.Enum) and not value.strip()
        if not blank or default == "" or key in reported:
            continue
        problems.check(False, key, f"is {value!r}, which names nothing.",  # (a MISSING default, ???: no fallback)
                       f"set {key} to a name" + (f", or {key}=null" if default is None else "" if default == "???"
                                                  else f", or leave it out (default {default!r})"))
    # `name` is a directory of the run's path (hydra.run.dir: outputs/<name>/<time>); Hydra failed to make a longer one
    # with a traceback, after every check had passed
    size = len(cfg.name.encode())
    problems.check(size <= NAME_MAX, "name", f"is {size} bytes long, but it names the run's directory (outputs/<name>/"
                   f"...), and a file system takes at most {NAME_MAX} bytes per name.",
                   f"shorten name to {NAME_MAX} bytes or fewer")
    # ... and one directory: a / made more of them, and `..` climbed out of outputs/ (outputs/../<time>)
    problems.check("/" not in cfg.name and cfg.name not in (".", ".."), "name",
                   f"is {cfg.name!r}, but it names one directory of the run's path (outputs/<name>/<time>), which "
                   "a / or a name of . or .. would move elsewhere.",
                   "use a name without / (e.g. - or _ in its place); hydra.run.dir or output_dir choose the directory")
    # a directory the run makes whose path the file system refuses: the plan's disk check (or the first write) failed
    # with a traceback, OSError: File name too long; one under a path reported already is left out (one cause)
    refused = []
    for key in RUN_DIRS:
        path = get(cfg, key)
        if not path or any(path.startswith(parent) for parent in refused):
            continue
        long = next((part for part in path.split("/") if len(os.fsencode(part)) > NAME_MAX), None)
        size = len(os.fsencode(os.path.abspath(path)))
        problems.check(long is None and size < PATH_MAX, key, (
            f"has a name of {len(os.fsencode(long))} bytes ({long[:40]!r}...), and a file system takes at most "
            f"{NAME_MAX} bytes per name." if long else f"is {size} bytes long as an absolute path, and Linux takes "
            f"paths below {PATH_MAX} bytes."),
            f"shorten {key}" + (" (hydra.run.dir sets it where the command line does not)" if key == "output_dir"
                                else ""))
        refused += [path] if long or size >= PATH_MAX else []
    address = cfg.cluster.ray_address
    if address is not None and address.strip() and address not in ("auto", "local"):
        try:
            parts = urlsplit(address if "://" in address else f"ray://{address}")
            ok = parts.scheme in ("ray", "http", "https") and bool(parts.hostname) and parts.port is not None
        except ValueError:  # a port out of range or not a number
            ok = False
        problems.check(ok, "cluster.ray_address", f"{address!r} is not an address Ray can join.",
                       "set it to HOST:PORT of a running Ray head (e.g. 10.0.0.1:6379), ray://HOST:10001, auto, or "
                       "null to start a Ray cluster here")
