"""Hydra: what this project reaches into, and the releases it is checked against.

Written for hydra-core 1.3.x (tested: 1.3.8, every CI run) and hydra-submitit-launcher 1.2.x; another release is
refused, naming the installed one.
Reached into here: `hydra._internal.utils.get_args_parser`, the parser `hydra.main` reads the command line with, so
that `molt-run` checks the composed config (all errors in one message) before Hydra starts; and
`hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments`, the basic sweeper's own product of its
overrides into points, so that a multirun is validated point by point before its first point runs, and the
launchers' hydra.job.num and hydra.job.id, each point's directory (`sweep_subdir`); and the submitit plugin's
`SlurmLauncher.launch` and `LocalLauncher.launch`, replaced (`report_submitit_sweeps`); and the basic launcher's
`run_job` (`held_points_refused`), wrapped; and
`hydra.core.plugins.Plugins.discover`, the launcher and sweeper classes Hydra can start (`plugin_classes`) and its
shell-completion plugins
(`completion_shells`); and the submitit launcher's mapping of its keys onto submitit's executor
(`submitit_refused`) and the types it takes (`submitit_types`: the sbatch writer's signature); and its config
sources (`_internal.sources_registry`), for hydra.searchpath's entries
(`search_path_problem`); and the override grammar's generated parser
(`hydra.grammar.gen`), for the text of each number as the user wrote it (`written_scalars`); and
`hydra._internal.defaults_list.create_defaults_list` with the config loader's
`_parse_overrides_and_create_caching_repo`, for the configs a composition reads (`composed_files`).
"""

from __future__ import annotations

import functools

from molt_hydra.compat import written_for
# imported where used: hydra's internals (only when molt-run parses its command line)

SUPPORTED = {"hydra-core": ("1.3",)}


def get_args_parser():
    """Hydra's own command-line parser (its `overrides`, `multirun`, `help`, `info`, `config_dir`, ... flags)."""
    written_for("molt-run's command-line check", "hydra", SUPPORTED)
    from hydra._internal.utils import get_args_parser as hydras

    return hydras()


def plugin_classes(kind: str) -> list[str]:
    """The `_target_`s Hydra can start as hydra.launcher or hydra.sweeper (`kind`): its discovered plugin classes (Hydra
    refuses any other with a RuntimeError traceback when the multirun starts)."""
    written_for("molt-run's launcher check", "hydra", SUPPORTED)
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher
    from hydra.plugins.sweeper import Sweeper

    found = Plugins.instance().discover({"launcher": Launcher, "sweeper": Sweeper}[kind])
    return sorted(f"{c.__module__}.{c.__name__}" for c in found)


def submitit_refused(target: str, keys: list[str]) -> tuple[list[str], list[str]] | None:
    """For a submitit launcher class `target` (hydra.launcher._target_): (the keys of hydra.launcher its executor
    refuses, the keys it takes), as its launch maps them onto submitit's parameters (a key of BaseQueueConf as is,
    another prefixed with the executor's name); None for another launcher. A refused one was submitit's NameError
    traceback once the multirun had started."""
    written_for("molt-run's submitit launcher check", "hydra", {"hydra-submitit-launcher": ("1.2",)})
    from hydra.utils import get_class
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
    from omegaconf import OmegaConf
    from submitit.core.plugins import get_executors

    if not issubclass(launcher := get_class(target), BaseSubmititLauncher):
        return None
    takes = sorted({*OmegaConf.structured(BaseQueueConf).keys(), "max_num_timeout",
                    *get_executors()[launcher._EXECUTOR]._valid_parameters()})
    return [key for key in keys if not key.startswith("_") and key not in takes], takes


def submitit_types(target: str) -> dict[str, tuple[type, ...]]:
    """For a submitit launcher class `target`: {hydra.launcher key: the types submitit takes for it} of its keys typed
    as numbers, booleans, lists or mappings (a string-typed key takes any scalar: `account=1234` is written as it
    reads). The keys of BaseQueueConf are the AutoExecutor's own, asserted as the sweep is submitted; the Slurm
    executor's others are typed by the sbatch writer's signature (array_parallelism=abc was its TypeError)."""
    written_for("molt-run's submitit launcher check", "hydra", {"hydra-submitit-launcher": ("1.2",)})
    written_for("molt-run's submitit parameter types", "hydra", {"submitit": ("1.5",)})  # (its _make_sbatch_string)
    import typing

    import submitit
    from hydra.utils import get_class
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import _make_sbatch_string

    hints = typing.get_type_hints(_make_sbatch_string) if get_class(target)._EXECUTOR == "slurm" else {}
    generic = {key: hint for key, hint in submitit.AutoExecutor._typed_parameters().items()
               if key in OmegaConf.structured(BaseQueueConf)}
    plain = {int: (int,), float: (int, float), bool: (bool,), list: (list,), dict: (dict,)}
    types = {}
    for key, hint in {**hints, **generic}.items():
        kinds = [typing.get_origin(h) or h for h in typing.get_args(hint) or (hint,) if h is not type(None)]
        kinds = [list if k is typing.get_origin(typing.Iterable[str]) else k for k in kinds]
        if len(kinds) == 1 and kinds[0] in plain:
            types[key] = plain[kinds[0]]
    return types


def completion_shells() -> list[str]:
    """The shells `--shell-completion install=SHELL` serves: Hydra's discovered completion plugins."""
    written_for("molt-run's shell-completion check", "hydra", SUPPORTED)
    from hydra.core.plugins import Plugins
    from hydra.plugins.completion_plugin import CompletionPlugin

    return sorted(c.provides() for c in Plugins.instance().discover(CompletionPlugin))


def search_path_problem(path: str) -> str | None:
    """Why Hydra would find no config at the hydra.searchpath entry `path` (None if it can): a scheme no config source
    reads, a file:// (or bare) path that is no directory, a pkg:// that is no package. Hydra skips such an entry
    without a word (and a scheme it lacks is a ValueError naming no override)."""
    written_for("molt-run's hydra.searchpath check", "hydra", SUPPORTED)
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins

    Plugins.instance()  # (registers the config sources)
    scheme, known = ConfigRepository._get_scheme(path), SourcesRegistry.instance().types
    if scheme not in known:
        schemes = ", ".join(f"{name}://" for name in sorted(known))
        return f"has a scheme no config source of Hydra's reads (they read {schemes})"
    if known[scheme]("hydra.searchpath", path).available():
        return None
    return "names no directory" if scheme == "file" else "names no source of configs (a Python package, for pkg://)"


def sweep_points(overrides: list) -> list[list[str]]:
    """Every point of a sweep over the parsed `overrides` (Hydra `Override`s), as the basic sweeper makes them: each
    point the list of `key=value` overrides its job composes with."""
    written_for("molt-run's sweep check", "hydra", SUPPORTED)
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [point for batch in BasicSweeper.split_arguments(overrides, None) for point in batch]


def sweep_subdir(point, number: int, submits: bool) -> str | None:
    """hydra.sweep.subdir of sweep point `number` (`point`: its config composed with its hydra node, which holds its
    hydra.job.override_dirname), resolved as Hydra's launchers resolve it as the point starts: the basic launcher sets
    hydra.job.num and hydra.job.id to the number, submitit's hydra.job.num to it, hydra.job.id to the Slurm job's.
    None where it reads what is known only then: submitit's job id, the time (${now:...}), HydraConfig
    (${hydra:...}); ValueError where it does not resolve."""
    written_for("molt-run's sweep check", "hydra", SUPPORTED)
    from omegaconf import OmegaConf, open_dict, read_write
    from omegaconf.errors import OmegaConfBaseException

    raw = str(point.hydra.sweep._get_node("subdir")._value())
    if "now:" in raw or "hydra:" in raw or submits and "job.id" in raw:
        return None
    with read_write(point.hydra), open_dict(point.hydra):
        point.hydra.job.num = point.hydra.job.id = number
    try:
        return str(OmegaConf.select(point, "hydra.sweep.subdir", throw_on_resolution_failure=True))
    except OmegaConfBaseException as e:  # Hydra's launcher would fail on it as the point starts, with a traceback
        raise ValueError(str(e).splitlines()[0]) from e


def report_submitit_sweeps() -> None:
    """hydra-submitit-launcher's SlurmLauncher.launch and LocalLauncher.launch replaced by compat/slurm_launcher.py
    `launch` (sbatch's refusal as a config error; every point waited for, the failed ones listed). A replaced method,
    not a subclass: Hydra instantiates a launcher only from its `hydra_plugins` package. Called before Hydra starts."""
    written_for("molt-run's submitit sweeps", "hydra", {"hydra-submitit-launcher": ("1.2",)})
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

    from molt_hydra.compat.slurm_launcher import launch

    SlurmLauncher.launch = launch
    LocalLauncher.launch = launch


def held_points_refused(held, refused) -> None:
    """Hydra's basic launcher runs each multirun point with `hydra.core.utils.run_job`, which makes the point's output
    directory and writes its log and .hydra/ (config.yaml, overrides.yaml) there before the task starts: a point whose
    directory another run holds (`held(output_dir)`) runs `refused(task_cfg)` as its task instead, with neither
    written. Before, such a point replaced the running run's .hydra/ and logged into its cli.log, then was refused by
    the run lock. Called before Hydra starts."""
    written_for("molt-run's multirun points", "hydra", SUPPORTED)
    import copy
    import os

    from hydra._internal.core_plugins import basic_launcher
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write

    run_job = getattr(basic_launcher.run_job, "__wrapped__", basic_launcher.run_job)

    @functools.wraps(run_job)
    def guarded(*, config, job_dir_key, job_subdir_key, **kw):
        HydraConfig.instance().set_config(config)  # (as run_job does: the subdir may read hydra:job.num)
        out = os.path.join(str(OmegaConf.select(config, job_dir_key)), str(OmegaConf.select(config, job_subdir_key)))
        if held(os.path.abspath(out)):
            config = copy.deepcopy(config)
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None
            kw.update(task_function=refused, configure_logging=False)
        return run_job(config=config, job_dir_key=job_dir_key, job_subdir_key=job_subdir_key, **kw)

    basic_launcher.run_job = guarded


def written_scalars(override: str) -> list[tuple[str, int, int]]:
    """Each unquoted number or true/false of `override`'s value, as written: (its text, first and last character).
    Hydra's parser keeps the value it reads (1.10 -> 1.1) and its sweeper passes each point on as str() of that value,
    so the text the user wrote is found in the parse tree alone (an element of one INT, FLOAT or BOOL token)."""
    written_for("molt-run's check of written values", "hydra", SUPPORTED)
    from hydra.grammar.gen.OverrideLexer import CommonTokenStream, InputStream, OverrideLexer
    from hydra.grammar.gen.OverrideParser import OverrideParser

    numbers, found = (OverrideLexer.INT, OverrideLexer.FLOAT, OverrideLexer.BOOL), []
    parser = OverrideParser(CommonTokenStream(OverrideLexer(InputStream(override))))
    parser.removeErrorListeners()  # (parsed by Hydra already: an override that fails reaches no check of this)
    nodes = [parser.override()]
    while nodes:
        node = nodes.pop()
        if isinstance(node, OverrideParser.PrimitiveContext):
            tokens = [c.symbol for c in node.getChildren() if c.symbol.type != OverrideLexer.WS]
            if len(tokens) == 1 and tokens[0].type in numbers:
                found.append((tokens[0].text, tokens[0].start, tokens[0].stop))
        elif hasattr(node, "getChildren"):
            nodes += list(node.getChildren())
    return sorted(found, key=lambda t: t[1])


def composed_files(config_name: str, overrides: list[str]) -> list[tuple[str, str, str]]:
    """(package, config path, its source) of every config Hydra composes for `overrides`, in merge order: a source is
    file:///DIR (the YAML is DIR/<config path>.yaml), pkg://... or structured:// (the ConfigStore). Hydra's defaults
    list and the repository it composes from (the command line's hydra.searchpath in it) are its internals."""
    written_for("molt-run's check of the configs' YAML", "hydra", SUPPORTED)
    from hydra._internal.defaults_list import create_defaults_list
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    parsed, repo = loader._parse_overrides_and_create_caching_repo(config_name, overrides)
    found = []
    for default in create_defaults_list(repo=repo, config_name=config_name, overrides_list=parsed,
                                        prepend_hydra=True, skip_missing=False).defaults:
        if default.config_path and (result := repo.load_config(default.config_path)) is not None:
            found.append((default.package or "", default.config_path, result.path))
    return list(dict.fromkeys(found))
