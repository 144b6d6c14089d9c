"""Every recipe composes and validates; `dry_run=true` prints its plan through the real `molt-run` (every point of a
`-m` sweep); `--cfg job` prints the resolved config; `molt-run --help` lists the config groups and their options."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from _config_helpers import PLAN_HEADER, Recipe, compose_config, recipes, run_cli_many
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.store import CONF_DIR, RECIPES_DIR
from molt_hydra.runtime.validate import validate

RECIPES = recipes()
# `--cfg job` through the CLI for a recipe with only +recipe=... and one with a launch override (cluster=...);
# each CLI call costs ~2 s, and the compose path is the same for every recipe (checked in-process above).
CFG_RECIPES = [next(r for r in RECIPES if len(r.overrides) == 1 and not r.multirun),
               next(dataclasses.replace(r, argv=[*r.argv, "cluster=local_gpus"]) for r in RECIPES
                    if r.name == "qwen3_4b_math")]
GROUPS = ("model", "rollout", "algorithm", "agent", "cluster", "logger", "parallelism", "recipe")


def on_its_gpu(recipe: Recipe) -> list[str]:
    """A one-GPU recipe splits its GPU's memory, read from nvidia-smi where it runs; this machine has none, so the
    test says what an H200 would report."""
    return ["cluster.memory_gb_per_device=140"] if "override /cluster: one_gpu" in recipe.path.read_text() else []


def sweep_points(recipe: Recipe) -> list[list[str]]:
    """The override lists of every point of the recipe's sweep (one point, no extra overrides, for a plain recipe)."""
    if not recipe.multirun:
        return [[]]
    cfg = compose_config(recipe.overrides, hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params) or {}
    assert params, f"{recipe.name}: a `-m` recipe needs hydra.sweeper.params"
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(point) for point in itertools.product(*axes)]


# a group's option is told by one key: the model it trains, the agent it runs
IDENTITY = {"model": "path", "agent": "runner._target_"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_group_option_chosen_on_the_command_line_wins_over_the_recipe(recipe: Recipe):
    """`+recipe=NAME model=OTHER` trains OTHER (`agent=OTHER` runs it): a recipe chooses its model and agent through
    its defaults list; a model.path (agent.runner) in its body outranked the command line's choice, which then changed
    only some of that group's other fields."""
    own = compose_config(recipe.overrides)
    for group, key in IDENTITY.items():
        options = {p.stem: OmegaConf.select(OmegaConf.create({group: OmegaConf.load(p)}), f"{group}.{key}")
                   for p in sorted((CONF_DIR / group).glob("*.yaml"))}
        other = next(name for name, value in options.items() if value != OmegaConf.select(own, f"{group}.{key}"))
        chosen = compose_config([*recipe.overrides, f"{group}={other}"])
        assert OmegaConf.select(chosen, f"{group}.{key}") == options[other], (group, other)


def test_recipes_found():
    assert len(RECIPES) >= 7, [r.name for r in RECIPES]
    for r in RECIPES:
        assert f"+recipe={r.name}" in r.argv, f"{r.path}: its first-line command must select +recipe={r.name}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_recipe_composes_and_validates(recipe: Recipe, tmp_path):
    for point in sweep_points(recipe):
        cfg = compose_config([*recipe.overrides, *point, *on_its_gpu(recipe)], output_dir=str(tmp_path))
        run_cfg = OmegaConf.to_object(cfg)
        assert isinstance(run_cfg, RunConfig)
        validate(run_cfg)
        assert run_cfg.name == OmegaConf.load(recipe.path).name, "the recipe's own values must win over conf/"


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """All CLI calls of this module, started together: (recipe, 'dry_run' | 'cfg') -> result, plus 'help'."""
    base = tmp_path_factory.mktemp("cli")
    keys, calls = [], []
    for r in RECIPES:
        out = base / r.name
        dirs = ([f"hydra.sweep.dir={out}", "hydra.sweep.subdir=${hydra.job.num}"] if r.multirun
                else [f"hydra.run.dir={out}"])
        keys.append((r.name, "dry_run"))
        calls.append([*r.argv, "dry_run=true", *on_its_gpu(r), *dirs])
    for r in CFG_RECIPES:
        keys.append((r.name, "cfg"))
        calls.append([*r.overrides, "--cfg", "job"])
    keys.append("help")
    calls.append(["--help"])
    return dict(zip(keys, run_cli_many(calls)))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_recipe_dry_run_via_cli(recipe: Recipe, cli_runs):
    res = cli_runs[(recipe.name, "dry_run")]
    assert res.returncode == 0, res.describe()
    assert "Traceback" not in res.output, res.describe()
    points = len(sweep_points(recipe))
    assert res.stdout.count(PLAN_HEADER) == points, f"expected {points} plan(s)\n{res.describe()}"
    for section in ("Roles:", "Memory estimate per device"):
        assert res.stdout.count(section) == points, res.describe()


@pytest.mark.parametrize("recipe", CFG_RECIPES, ids=lambda r: r.name)
def test_cfg_job_prints_the_resolved_config(recipe: Recipe, cli_runs):
    res = cli_runs[(recipe.name, "cfg")]
    assert res.returncode == 0, res.describe()
    printed = yaml.safe_load(res.stdout)
    composed = yaml.safe_load(OmegaConf.to_yaml(compose_config(recipe.overrides, output_dir=None)))
    assert printed == composed, res.describe()
    assert printed["name"] == OmegaConf.load(recipe.path).name
    assert PLAN_HEADER not in res.stdout, "--cfg job must print the config and run nothing"


def test_help_lists_groups_and_options(cli_runs):
    res = cli_runs["help"]
    assert res.returncode == 0, res.describe()
    section = res.stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    listed = {}
    for line in section.splitlines():
        if ":" in line and not line.startswith("Compose"):
            group, options = line.split(":", 1)
            listed[group.strip()] = {o.strip() for o in options.split(",") if o.strip()}
    for group in GROUPS:
        folder = RECIPES_DIR if group == "recipe" else CONF_DIR / group
        expected = {p.stem for p in folder.glob("*.yaml")}
        assert expected, f"no options found for group {group} in {folder}"
        assert listed.get(group) == expected, f"--help lists {group}: {listed.get(group)}, expected {expected}"


def test_help_speaks_for_the_project(cli_runs):
    """--help opens with what molt-run does, then every shipped recipe and the common commands (conf/hydra/help)."""
    out = cli_runs["help"].stdout
    assert out.startswith("molt-run: agentic RL post-training"), out[:300]
    recipes_section = out.split("== Recipes (+recipe=NAME) ==", 1)[1].split("== Common commands ==", 1)[0]
    listed = {line.split()[0] for line in recipes_section.splitlines() if line.strip()}
    assert listed == {r.name for r in RECIPES}, recipes_section
    assert "molt-run +recipe=NAME dry_run=true" in out
    assert "powered by Hydra" not in out


def test_an_algorithm_chosen_beside_a_recipe_is_that_algorithm(option="rloo"):
    """Before: eight recipes set algorithm.estimator=grpo as a value, applied after the command line's group choice:
    `+recipe=tiny_cpu algorithm=ppo_gae` ran gae's lam with grpo's estimator (refused with `estimator grpo does not
    read it`). They choose the group instead (override /algorithm), which the command line's choice replaces."""
    estimator = yaml.safe_load((CONF_DIR / "algorithm" / f"{option}.yaml").read_text())["estimator"]
    for recipe in RECIPES:
        cfg = compose_config([*recipe.overrides, f"algorithm={option}"])
        assert cfg.algorithm.estimator == estimator, (recipe.name, cfg.algorithm.estimator)


def _readme_commands(program: str) -> list[list[str]]:
    """The README's command lines (a trailing backslash joins the next) that run `program` on 2 x 8 GPUs of Slurm:
    the arguments after it."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    return [shlex.split(line.split(program, 1)[1]) for line in lines if program in line and "cluster=slurm_2x8" in line]


def test_the_readmes_gpu_slurm_commands_validate(tmp_path):
    """The README's sweeps and sbatch'ed run on `cluster=slurm_2x8` (the README's example cluster) pass every check.
    Before: each was refused, `train.batch_size: must be a multiple of micro_batch_size x dp = 1 x 12 = 12, got 128`
    (qwen3_4b_math's 4 engines left 12 of the 16 GPUs to the trainer): the sweep at once, the sbatch'ed run in its
    job, after its wait in the queue."""
    from molt_hydra.cli import compose_checked, point_problems, sweep_problems

    sweeps, sbatched = _readme_commands("molt-run -m"), _readme_commands("launchers/molt.sbatch")
    assert len(sweeps) == 2 and len(sbatched) == 1
    for args in sweeps:
        first, problems = compose_checked([*args, "dry_run=true"], multirun=True, hydra_config=True)
        assert problems == [] and sweep_problems(first, [*args, "dry_run=true"], None) == [], args
    # (as launchers/molt.sbatch runs it under `sbatch -N 2`)
    as_run = [*sbatched[0], "cluster.nodes=2", "checkpoint.resume=auto", "dry_run=true"]
    assert point_problems(as_run, tmp_path / "run", None)[0] == []
