"""GPU recipes start as their first line says: each carries its own cluster preset (a command-line cluster= still
wins), and model.attn_implementation is refused where the trainer backend has no such attention."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config, recipes  # noqa: E402

from molt_hydra.config.schema import ConfigError  # noqa: E402
from molt_hydra.config.validate import validate  # noqa: E402

GPU_RECIPES = ["qwen3_4b_math", "qwen3_moe_geo3k", "qwen3_4b_sft"]


def run_config(overrides: list[str]):
    return validate(OmegaConf.to_object(compose_config(overrides)))


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_validates_from_its_first_line_alone(name):
    recipe = next(r for r in recipes() if r.name == name)
    assert recipe.overrides == [f"+recipe={name}"]  # no cluster=... needed on the command line
    cfg = run_config(recipe.overrides)
    assert cfg.cluster.device.value == "cuda" and cfg.cluster.devices_per_node == 8


def test_command_line_cluster_beats_the_recipe_preset():
    cfg = OmegaConf.to_object(compose_config(["+recipe=qwen3_4b_math", "cluster=slurm_2x8"]))
    assert cfg.cluster.nodes == 2  # slurm_2x8, not the recipe's one-node local_gpus

AUTOMODEL_INSTALLED = importlib.util.find_spec("nemo_automodel") is not None


@pytest.mark.parametrize("overrides,refused", [
    (["model.attn_implementation=te", "model.backend=hf"], True),            # not a transformers value
    (["model.attn_implementation=flash_attention_2", "model.backend=automodel"], True),  # not an AutoModel value
    # auto resolves as the trainer does: AutoModel on GPU where nemo_automodel is installed, else HF
    (["model.attn_implementation=flash_attention_2", "model.backend=auto"], AUTOMODEL_INSTALLED),
    (["model.attn_implementation=te", "model.backend=automodel"], False),
    (["model.attn_implementation=sdpa", "model.backend=auto"], False),
])
def test_attention_must_be_a_value_of_the_trainer_backend(overrides, refused):
    args = ["+recipe=qwen3_4b_math", *overrides]
    if not refused:
        assert run_config(args).model.attn_implementation.value == overrides[0].split("=")[1]
        return
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        run_config(args)
