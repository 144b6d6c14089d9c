"""transformers: what this project reaches into, and the releases it is checked against.

Written for transformers 5.x (tested: 5.19 on CPU, every CI run; 5.17 / 5.18 on the H200 device, where the experts
patch is checked by `tests/gpu/test_moe_experts_gpu.py`); any other major release is refused by each function below,
naming the installed version. Reached into here (`transformers.models.*` is transformers' internal layout):

- MoE experts (`install_experts`): transformers 5's fused experts modules (Qwen3-MoE `Qwen3MoeExperts`:
  `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], `act_fn`, called as `experts(hidden [T, H], top_k_index [T, k],
  top_k_weights [T, k])` by the sparse block) get their forward replaced in place (`__class__`, so parameter names,
  FSDP2 units, checkpoints and weight sync are unchanged): `grouped` by the given grouped forward
  (models/moe_experts.py), `loop` by the module's own eager per-expert loop, the function under transformers'
  `@use_experts_implementation` dispatch (`inspect.unwrap`; that dispatch would otherwise pick by
  `config._experts_implementation`, in 5.19 grouped_mm by default).
- MoE routers (`install_routers`, `router_modules`): Qwen3-MoE's `Qwen3MoeTopKRouter` and Qwen3-VL-MoE's
  `Qwen3VLMoeTextTopKRouter` (`weight` [E, H], `top_k`, `hidden_dim`, forward(hidden) -> (logits, weights, indices))
  get a mixin's forward in place, the same way (models/moe_routing.py).
- PIL image processors of the tiny VLMs (`qwen2_vl_image_processor`, `idefics3_image_processor`: no torchvision).
- the causal-LM class name of a model type (`causal_lm_architecture`), for AutoModel's own class lookup.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

from molt_hydra.compat import written_for

if TYPE_CHECKING:  # torch stays unimported until a model exists (the config checks import models/tiny*.py)
    from torch import nn
# imported where used: transformers' model modules (heavy)

SUPPORTED = {"transformers": ("5",)}  # the fused 3-D experts layout and the TopKRouter modules arrived with 5.0


def _moe_classes() -> tuple[tuple, tuple]:
    """(fused experts classes, top-k router classes) of transformers 5 (Qwen3-VL-MoE's are copies, no subclasses)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts, Qwen3VLMoeTextTopKRouter

    return (Qwen3MoeExperts, Qwen3VLMoeTextExperts), (Qwen3MoeTopKRouter, Qwen3VLMoeTextTopKRouter)


@functools.cache
def _subclass(mixin: type, cls: type, name: str, attrs: tuple = ()) -> type:
    return type(name, (mixin, cls), dict(attrs))


class PatchedExperts:
    """Marker base of a patched experts class; `experts_impl` is "grouped" or "loop"."""

    experts_impl: str


def install_experts(model: nn.Module, impl: str, grouped_forward) -> list[nn.Module]:
    """Give every fused experts module of `model` the `impl` forward ("grouped": `grouped_forward`, "loop": the
    module's own eager loop); returns them. Modules patched before are patched again (another impl)."""
    written_for("the MoE experts patch", "transformers", SUPPORTED)
    classes, found = _moe_classes()[0], []
    for module in model.modules():
        if isinstance(module, classes):
            base = next(c for c in type(module).__mro__ if c in classes)
            forward = grouped_forward if impl == "grouped" else inspect.unwrap(base.forward)
            module.__class__ = _subclass(PatchedExperts, base, f"{base.__name__}_{impl}",
                                         (("forward", forward), ("experts_impl", impl)))
            found.append(module)
    return found


def expert_widths(model: nn.Module) -> tuple[int, ...]:
    """(hidden, expert FFN) of the model's first experts module, () when it has none."""
    for module in model.modules():
        if isinstance(module, _moe_classes()[0]):
            return tuple(module.down_proj.shape[1:])
    return ()


def install_routers(model: nn.Module, mixin: type) -> list[tuple[str, nn.Module]]:
    """Make every top-k softmax MoE router of `model` a subclass (`mixin`, its class) in place; returns the newly
    patched ones with their names, in module order."""
    written_for("the MoE router patch", "transformers", SUPPORTED)
    classes, found = _moe_classes()[1], []
    for name, module in model.named_modules():
        if isinstance(module, classes) and not isinstance(module, mixin):
            module.__class__ = _subclass(mixin, type(module), f"Replayable{type(module).__name__}")
            found.append((name, module))
    return found


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every top-k softmax MoE router of `model`, patched or not."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _moe_classes()[1])]


def qwen2_vl_image_processor(**kwargs):
    """Qwen2-VL's PIL image processor (Qwen2.5-VL and Qwen3-VL use it; no torchvision)."""
    written_for("the Qwen2-VL PIL image processor", "transformers", SUPPORTED)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**kwargs)


def idefics3_image_processor(**kwargs):
    written_for("the Idefics3 PIL image processor", "transformers", SUPPORTED)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(**kwargs)


def causal_lm_architecture(model_type: str) -> str:
    """The causal-LM class name transformers maps `model_type` to (e.g. "qwen3" -> "Qwen3ForCausalLM")."""
    written_for("the causal-LM class mapping", "transformers", SUPPORTED)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


# --- weight loading (weight_sync) ---
# The receiver's coverage check (weight_sync/receiver.py) names checkpoint tensors by transformers' own checkpoint
# conversion mapping (`transformers.conversion_mapping`, transformers 5.x: its `rename_source_key` per transform);
# tests/unit/test_compat_weight_loading.py checks it on the installed release.


def checkpoint_to_model_name(model_keys: list[str]):
    """name -> the model's name for a checkpoint tensor, by the conversion mapping of the first of `model_keys`
    (class name, then model type) that has one (Qwen3-MoE: per-expert `experts.{e}.gate_proj.weight` ... ->
    `experts.gate_up_proj`); the identity when none has."""
    written_for("the checkpoint conversion mapping", "transformers", SUPPORTED)
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    transforms = next((m for m in map(get_checkpoint_conversion_mapping, model_keys) if m), [])

    def model_name(name: str) -> str:
        for transform in transforms:
            name, _ = transform.rename_source_key(name)
        return name

    return model_name
