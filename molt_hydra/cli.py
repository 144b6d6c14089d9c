"""`molt-run`: compose conf/ + recipe + overrides -> typed RunConfig -> validate -> plan -> run.

    molt-run                                   # the embedded default: tiny CPU run that visibly learns
    molt-run +recipe=qwen3_4b_math rollout.n_samples_per_prompt=16
    molt-run +recipe=qwen3_4b_math --cfg job   # print the resolved config, run nothing
    molt-run +recipe=qwen3_4b_math dry_run=true
    molt-run -m +recipe=sweep_estimators_is cluster=slurm   # one Slurm job per sweep point

Config mistakes never reach the runtime: Hydra rejects unknown keys and wrong types while composing, `to_object`
rejects missing values and single-group rules, `validate` collects every cross-group rule; each message names the
full key, the reason and the fix, and the exit code is 2.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from molt_hydra.config.bounds import out_of_range
from molt_hydra.config.schema import ConfigError, RunConfig
from molt_hydra.config.store import CONF_DIR, register

EXIT_CONFIG_ERROR = 2


def _convert(node):
    try:
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        key = getattr(e, "full_key", None) or "config"
        message = str(e).splitlines()[0]
        fix = "set it on the command line (key=value) or in the recipe" if "missing mandatory" in message.lower() else (
            "check the value's type against molt_hydra/config/schema.py"
        )
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
            node = cfg._get_node(name)
            if isinstance(node, DictConfig):
                try:
                    _convert(node)
                except ConfigError as e:
                    per_group.append(str(e))
        problems += per_group or [str(whole)]  # a root-level failure no single group reproduces
    if problems:
        raise ConfigError("\n".join(problems)) from None
    return run_cfg


def _main(cfg: DictConfig) -> None:
    from molt_hydra.config.validate import validate
    from molt_hydra.runtime.sweep import set_wandb_group

    set_wandb_group(cfg)  # multirun points share one W&B group named after the sweep
    try:
        run_cfg = validate(to_run_config(cfg))
    except ConfigError as e:
        print(f"Config error(s):\n{e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)

    from molt_hydra.runtime.plan import make_plan

    plan = make_plan(run_cfg)
    print(plan.render())
    if run_cfg.dry_run:
        return

    from molt_hydra.runtime.entrypoint import run

    run(run_cfg, plan)


def main() -> None:
    register()
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_main)()


if __name__ == "__main__":
    main()
