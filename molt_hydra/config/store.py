"""Register the typed schema and the shipped recipes with Hydra's ConfigStore.

`conf/` holds the default values of every group; `recipes/NAME.yaml` are deltas over it (`# @package _global_`),
selected with `+recipe=NAME`. Both ship inside the package (molt_hydra/conf and molt_hydra/recipes point at the
repo's top-level folders), so a non-editable install finds them too. User recipes in `--config-dir DIR`
(as DIR/recipe/NAME.yaml) or on `hydra.searchpath` are found by Hydra the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from molt_hydra.config.schema import RunConfig

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = PACKAGE_ROOT / "conf"
RECIPES_DIR = PACKAGE_ROOT / "recipes"


def _package_path(name: str) -> str:
    """`${molt:recipes}` in YAML: the shipped recipes folder, wherever the package is installed."""
    return str({"recipes": RECIPES_DIR, "conf": CONF_DIR}[name])


def recipe_summaries() -> str:
    """`${molt_recipes:}` in the --help text: each shipped recipe with the first line of its description."""
    lines = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        comment = " ".join(l[1:].strip() for l in path.read_text().splitlines()[1:]
                           if l.startswith("#") and "@package" not in l)
        about = re.split(r"[:;]\s|\.\s|\.$", comment, maxsplit=1)[0]
        lines.append(f"  {path.stem:22s} {about if len(about) <= 100 else about[:97] + '...'}")
    return "\n".join(lines)


def register() -> None:
    cs = ConfigStore.instance()
    if "molt_schema.yaml" in cs.repo:  # registered already (the CLI checks overrides before Hydra starts)
        return
    OmegaConf.register_new_resolver("molt", _package_path, replace=True)
    OmegaConf.register_new_resolver("molt_recipes", recipe_summaries, replace=True)
    cs.store(name="molt_schema", node=RunConfig)
    for recipe in sorted(RECIPES_DIR.glob("*.yaml")):
        cs.store(group="recipe", name=recipe.stem, node=OmegaConf.load(recipe), package="_global_")

