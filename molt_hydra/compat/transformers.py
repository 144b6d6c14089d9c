"""transformers: what this project reaches into, and the releases it is checked against.

Tested: transformers 5.19 (CPU, every CI run); the H200 device runs 5.17 / 5.18 (this patch is checked there by
`tests/gpu/test_moe_experts_gpu.py`). Any other major release is refused at trainer build. Reached into here:

- MoE experts (`install_experts`): transformers 5's fused experts modules (Qwen3-MoE `Qwen3MoeExperts`:
  `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], `act_fn`, called as `experts(hidden [T, H], top_k_index [T, k],
  top_k_weights [T, k])` by the sparse block) get their forward replaced in place (`__class__`, so parameter names,
  FSDP2 units, checkpoints and weight sync are unchanged): `grouped` by `models/moe_experts.py`'s grouped forward,
  `loop` by the module's own eager per-expert loop, the function under transformers' `@use_experts_implementation`
  dispatch (`inspect.unwrap`; that dispatch would otherwise pick by `config._experts_implementation`, in 5.19
  grouped_mm by default).
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

SUPPORTED_MAJOR = 5  # the fused 3-D experts layout arrived with transformers 5.0


def _experts_classes() -> tuple:
    """transformers 5's fused experts modules with the [E, 2I, H] / [E, H, I] layout and the (hidden_states,
    top_k_index, top_k_weights) forward that models/moe_experts.py replaces (Qwen3-VL-MoE's is a copy, no subclass)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

    return (Qwen3MoeExperts, Qwen3VLMoeTextExperts)


def _check_version() -> None:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major != SUPPORTED_MAJOR:
        raise RuntimeError(f"transformers {transformers.__version__}: the MoE experts patch (molt_hydra/compat/"
                           f"transformers.py) is written for transformers {SUPPORTED_MAJOR}.x's fused experts")


class PatchedExperts:
    """Marker base of a patched experts class; `experts_impl` is "grouped" or "loop"."""

    experts_impl: str


@functools.cache
def _patched(cls: type, impl: str) -> type:
    from molt_hydra.models.moe_experts import grouped_experts_forward

    forward = grouped_experts_forward if impl == "grouped" else inspect.unwrap(cls.forward)
    return type(f"{cls.__name__}_{impl}", (PatchedExperts, cls), {"forward": forward, "experts_impl": impl})


def install_experts(model: nn.Module, impl: str) -> list[nn.Module]:
    """Give every fused experts module of `model` the `impl` forward ("grouped" | "loop"); returns them."""
    _check_version()
    classes, found = _experts_classes(), []
    for module in model.modules():
        if isinstance(module, classes):
            base = next(c for c in type(module).__mro__ if c in classes)
            module.__class__ = _patched(base, impl)
            found.append(module)
    return found


def expert_widths(model: nn.Module) -> tuple[int, ...]:
    """(hidden, expert FFN) of the model's first experts module, () when it has none."""
    for module in model.modules():
        if isinstance(module, _experts_classes()):
            return tuple(module.down_proj.shape[1:])
    return ()


# --- weight loading (weight_sync) ---
# The receiver's coverage check (weight_sync/receiver.py) names checkpoint tensors by transformers' own checkpoint
# conversion mapping (`transformers.conversion_mapping`, transformers 5.x: its `rename_source_key` per transform);
# tests/unit/test_compat_weight_loading.py checks it on the installed release.


def checkpoint_to_model_name(model_keys: list[str]):
    """name -> the model's name for a checkpoint tensor, by the conversion mapping of the first of `model_keys`
    (class name, then model type) that has one (Qwen3-MoE: per-expert `experts.{e}.gate_proj.weight` ... ->
    `experts.gate_up_proj`); the identity when none has."""
    _check_version()
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    transforms = next((m for m in map(get_checkpoint_conversion_mapping, model_keys) if m), [])

    def model_name(name: str) -> str:
        for transform in transforms:
            name, _ = transform.rename_source_key(name)
        return name

    return model_name
