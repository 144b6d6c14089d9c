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
from molt_hydra.config.validate import trainer_backend  # noqa: E402
from molt_hydra.runtime.validate import validate  # noqa: E402

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


def test_qwen3_vl_moe_geo_gpu_validates_and_plans_on_one_colocated_gpu():
    """The geo3k recipe's family on one H200 (tests/gpu/test_vlm_gpu.py runs it): one GPU, colocated, images,
    R3 allowed on the VL-MoE (its experts are in text_config), and a plan whose phases fit an H200's 140 GiB."""
    from molt_hydra.runtime.plan import make_plan

    recipe = next(r for r in recipes() if r.name == "qwen3_vl_moe_geo_gpu")
    assert recipe.overrides == ["+recipe=qwen3_vl_moe_geo_gpu"]
    cfg = run_config([*recipe.overrides, "cluster.memory_gb_per_device=140"])
    assert cfg.cluster.device.value == "cuda" and cfg.cluster.devices_per_node == 1 and cfg.parallelism.colocate
    assert cfg.rollout.routing_replay and cfg.data.max_images_per_prompt == 1 and cfg.train.max_steps >= 10
    plan = make_plan(cfg)
    assert set(plan.phases) == {"generate", "train", "wake + sync"}
    assert all(sum(parts.values()) < 140 for parts in plan.phases.values())
    # the same knob on a dense VLM is refused: the rule reads the experts from the VLM's text_config
    with pytest.raises(ConfigError, match="rollout.routing_replay"):
        run_config([*recipe.overrides, "cluster.memory_gb_per_device=140", "model.path=tiny://qwen25_vl_tiny"])


def gpu_recipes_on_auto_backend() -> list[str]:
    chosen = []
    for r in recipes():
        cfg = OmegaConf.to_object(compose_config(r.overrides))
        if cfg.cluster.device.value == "cuda" and cfg.model.backend.value == "auto":
            chosen.append(r.name)
    return chosen


@pytest.mark.parametrize("name", gpu_recipes_on_auto_backend())
def test_a_gpu_recipe_on_backend_auto_also_validates_where_automodel_is_installed(name):
    """model.backend=auto resolves to AutoModel on a GPU node that has it (validate.trainer_backend): a recipe left on
    auto must hold under both backends, or say `model.backend: hf` (as qwen3_moe_r3_gpu does, for aux_loss_coef)."""
    for backend in ("automodel", "hf"):  # an H200's memory: colocated recipes split it, and no nvidia-smi here
        cfg = run_config([f"+recipe={name}", f"model.backend={backend}", "cluster.memory_gb_per_device=141"])
        assert trainer_backend(cfg) == backend
