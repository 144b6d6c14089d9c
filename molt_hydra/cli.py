"""`molt-run`: compose conf/ + recipe + overrides -> typed RunConfig -> validate -> plan -> run.

    molt-run                                   # the embedded default: tiny CPU run that visibly learns
    molt-run +recipe=qwen3_4b_math rollout.n_samples_per_prompt=16
    molt-run +recipe=qwen3_4b_math --cfg job   # print the resolved config, run nothing
    molt-run +recipe=qwen3_4b_math dry_run=true
    molt-run -m +recipe=sweep_estimators_is cluster=slurm   # one Slurm job per sweep point

Config mistakes never reach the runtime: the overrides are parsed and composed first (`compose_checked`: grammar,
unknown keys, wrong types, unknown group options), then `to_run_config` checks declared ranges, missing values and
single-group rules, and `validate` every cross-group rule; each message names the full key (or the override), the
reason and the fix, and the exit code is 2. A multirun validates and plans every point before the first starts
(`sweep_problems`). `molt-run --help` is conf/hydra/help/molt.yaml.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from molt_hydra.config.bounds import declared_bounds, out_of_range
from molt_hydra.config.schema import ConfigError, RunConfig
from molt_hydra.config.store import CONF_DIR, register

EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130  # as the shell reports a Ctrl-C (runtime/entrypoint.py exits with it once the run started)


def _convert(node):
    try:
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        key = getattr(e, "full_key", None) or "config"
        message = str(e).splitlines()[0]
        fix = ("set it on the command line (key=value) or in the recipe" if "missing mandatory" in message.lower()
               else "check the value's type against molt_hydra/config/schema.py")
        raise ConfigError(f"- {key}: {message}. Fix: {fix}") from None


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed config from the composed tree; declared ranges, MISSING values and `__post_init__` rules fail here, all
    at once: on failure every group is converted on its own, so the message lists one problem per broken group."""
    problems = out_of_range(cfg, RunConfig)
    try:
        run_cfg = _convert(cfg)
    except ConfigError as whole:
        per_group = []
        for name in cfg:
            if isinstance(node := cfg._get_node(name), DictConfig):
                try:
                    _convert(node)
                except ConfigError as e:
                    per_group.append(str(e))
        problems += per_group or [str(whole)]  # a root-level failure no single group reproduces
    if problems:
        raise ConfigError("\n".join(problems)) from None
    return run_cfg


def compose_checked(overrides: list[str], *, multirun: bool = False, config_dir: str | None = None,
                    hydra_config: bool = False) -> tuple[DictConfig | None, list[str]]:
    """Parse and compose the command line's overrides as Hydra will, before Hydra does: (the composed config, with its
    `hydra` node when `hydra_config`, and []) or (None, problems), every failure a line `- key: reason Fix: fix`
    (exit 2) instead of Hydra's report (exit 1). A sweep is composed at its first point."""
    parser, problems, parsed = OverridesParser.create(), [], []
    for text in overrides:
        try:
            parsed += parser.parse_overrides([text])
        except OverrideParseException as e:
            problems.append(f"- {text}: Hydra cannot parse this override ({str(e).splitlines()[0]}). Fix: write "
                            "key=value; quote a value holding , [ ] { } $ or spaces (key='a,b'); see "
                            "https://hydra.cc/docs/advanced/override_grammar/basic/")
    if not multirun:
        problems += [f"- {text}: a sweep (a,b / range / glob), but this is not a multirun. Fix: quote the value "
                     f"(key='a,b'), give a list (key=[a,b]), or add -m to sweep" for o, text in zip(parsed, overrides)
                     if o.is_sweep_override()]
    if problems:
        return None, problems
    try:  # a sweep (`-m a=1,2`) is checked at its first point; the sweeper composes the others, one job each
        overrides = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                     else text for o, text in zip(parsed, overrides)]
    except Exception:  # noqa: BLE001 -- a sweep kind without a first value (glob): left to the sweeper
        return None, []
    search = ([f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
              if config_dir and not any(o.key_or_group == "hydra.searchpath" for o in parsed) else [])
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=[*overrides, *search], return_hydra_config=hydra_config), []
    except Exception as e:  # noqa: BLE001 -- every composition failure is the user's override
        return None, [_composition_problem(e, overrides)]


def _composition_problem(e: Exception, overrides: list[str]) -> str:
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 5:
        chain.append(chain[-1].__cause__)
    text = "\n".join(str(c) for c in chain)
    key = next((c.full_key for c in chain if getattr(c, "full_key", None)), None)
    override = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] in ((key,) if key else ())), None) or next(
        (o for o in overrides if o.lstrip("+~").split("=", 1)[0] in text), "the command line")
    if "Could not find" in text:  # a config group option that does not exist: `model=nope`, `+recipe=nope`
        options = re.findall(r"^\t(\S+)$", text, re.M)
        return f"- {override}: no such option of that config group. Fix: use one of {options}"
    if key and any(isinstance(c, (ConfigKeyError, ConfigAttributeError)) for c in chain):
        close = difflib.get_close_matches(key, list(declared_bounds(RunConfig)), n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return (f"- {key}: not a key of the config ({override}). Fix: {hint}`molt-run --cfg job` prints every key; "
                "agent.runner kwargs are added with +agent.runner.NAME=value")
    reason = str(chain[-1]).splitlines()[0]
    return (f"- {key or override}: {reason} ({override}). Fix: give a value of the type and choices that "
            "molt_hydra/config/schema.py declares for it")


def sweep_problems(first: DictConfig, overrides: list[str], config_dir: str | None) -> list[str]:
    """Every point of `molt-run -m` validated and planned before the first one starts, where Hydra's basic launcher
    runs them here one after another: a point refused when its turn came ended the sweep there, after the points
    before it had run. The points are the basic sweeper's own (the config's hydra.sweeper.params, then the command
    line's sweeps, their product: compat/hydra.py `sweep_points`); `first` is the first point composed with its hydra
    node. Returns each failing point's problems under a line naming the point."""
    from molt_hydra.compat.hydra import sweep_points
    from molt_hydra.runtime.plan import make_plan
    from molt_hydra.runtime.validate import validate

    if not (first.hydra.sweeper._target_.endswith(".BasicSweeper")
            and first.hydra.launcher._target_.endswith(".BasicLauncher")):
        # another sweeper (optuna, ...) makes its points as it goes; submitit runs each point as a job of its own
        # (one refused point ends alone), validated where it runs: a login node may lack the GPUs or packages
        return []
    params = [f"{key}={value}" for key, value in (first.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides([*params, *overrides])
    points = sweep_points(parsed)
    problems = []
    for number, point in enumerate(points):  # the point's own output directory is Hydra's to make: a stand-in here
        cfg, errors = compose_checked([*point, f"output_dir={Path.cwd() / 'multirun' / str(number)}"],
                                      config_dir=config_dir)
        try:
            if cfg is not None:
                make_plan(validate(to_run_config(cfg)))
        except ConfigError as e:
            errors = [str(e)]
        if errors:
            problems += [f"sweep point #{number} of {len(points)} ({' '.join(point)}):", *errors]
    return problems


SLURM_RESOURCES = ("partition", "account", "qos", "constraint", "setup", "time_min")


def launcher_problems(first: DictConfig, overrides: list[str], multirun: bool) -> list[str]:
    """Slurm settings where nothing submits: submitit's launcher submits only a multirun's points, so `cluster=slurm`
    without -m (outside an allocation) would run here, and cluster.{partition,...} set on the command line of a run
    that submits nothing would change nothing (an sbatch'ed run takes its resources from sbatch's own options)."""
    submits = first.hydra.launcher._target_.endswith(".SlurmLauncher")
    if submits and not multirun and not os.environ.get("SLURM_JOB_ID"):
        return ["- hydra/launcher: the cluster preset selects the Slurm launcher, which submits the points of a "
                "multirun; without -m this run would start here, on this machine. Fix: add -m to submit it, or "
                "sbatch launchers/molt.sbatch"]
    if submits and multirun:
        return []
    why = "the launcher is Hydra's basic one, which runs the points here" if multirun else "no Slurm job is submitted"
    keys = [f"cluster.{name}" for name in SLURM_RESOURCES]
    return [f"- {key}: a Slurm resource of the submitit launcher, but {why}, so it changes nothing. Fix: unset it; "
            "submit with -m and a Slurm cluster preset (cluster=slurm), or give it to sbatch (-p, -A, -q, -C, -t)"
            for key in dict.fromkeys(o.lstrip("+~").split("=", 1)[0] for o in overrides) if key in keys]


def sft_ignored(first: DictConfig, overrides: list[str]) -> list[str]:
    """rollout.*, agent.* and train.max_steps given on the command line of job=sft: SFT starts no engine, runs no
    agent and trains train.epochs (the composed defaults set some of these keys, so the rule reads the command line,
    not a change from the schema)."""
    if first.job != "sft":
        return []
    keys = dict.fromkeys(o.lstrip("+~").split("=", 1)[0] for o in overrides)
    why = {key: "trains train.epochs over its data (set those instead)" if key == "train.max_steps" else
           "starts no rollout engine and runs no agent" for key in keys
           if key.split(".", 1)[0] in ("rollout", "agent") or key == "train.max_steps"}
    return [f"- {key}: job=sft {reason}, so it changes nothing. Fix: unset {key} for job=sft"
            for key, reason in why.items()]


def _exit_config_error(text: str) -> None:
    print(f"Config error(s):\n{text}", file=sys.stderr)
    sys.exit(EXIT_CONFIG_ERROR)


def _main(cfg: DictConfig) -> None:
    # deferred: the runtime imports torch, Ray and the agents (seconds), which --help and a config error never need
    from molt_hydra.compat.vllm import preflight
    from molt_hydra.config.validate import missing_gpu
    from molt_hydra.runtime.plan import make_plan
    from molt_hydra.runtime.sweep import set_wandb_group
    from molt_hydra.runtime.validate import validate

    set_wandb_group(cfg)  # multirun points share one W&B group named after the sweep
    try:
        run_cfg = validate(to_run_config(cfg))
        if not run_cfg.dry_run and (problem := missing_gpu(run_cfg)):  # the machine, before the plan for it
            raise ConfigError(problem)
        print(make_plan(run_cfg).render())  # the plan derives the colocated memory split, refuses one that cannot fit
    except ConfigError as e:
        _exit_config_error(str(e))
    if run_cfg.dry_run:
        return
    # the vLLM build this run will start: a supported one, before anything starts
    if run_cfg.job.value != "sft" and (problem := preflight(run_cfg.cluster.device.value,
                                                            run_cfg.train.partial_rollout)):
        _exit_config_error(problem)
    from molt_hydra.runtime.entrypoint import run

    run(run_cfg)


def main() -> None:
    # Ctrl-C or SIGTERM while the config is composed, validated and planned (seconds of imports): one line, exit 130,
    # no traceback; the run, once started, takes both itself (runtime/entrypoint.py)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _check_then_run()
    except KeyboardInterrupt:
        print("\nInterrupted before the run started.", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_then_run() -> None:
    from molt_hydra.compat.hydra import get_args_parser, report_slurm_sweeps

    register()
    args = get_args_parser().parse_args()
    if not (args.help or args.hydra_help or args.info or args.shell_completion or args.config_name or args.config_path):
        first, problems = compose_checked(args.overrides, multirun=args.multirun, config_dir=args.config_dir,
                                          hydra_config=True)
        if first is not None:
            problems = launcher_problems(first, args.overrides, args.multirun) + sft_ignored(first, args.overrides)
        if first is not None and args.multirun and not problems:
            problems = sweep_problems(first, args.overrides, args.config_dir)
        if problems:
            _exit_config_error("\n".join(problems))
    if args.multirun:
        report_slurm_sweeps()  # a Slurm sweep's refusal and failed points, reported (compat/hydra.py)
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_main)()


if __name__ == "__main__":
    main()
