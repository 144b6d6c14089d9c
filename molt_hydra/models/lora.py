"""LoRA adapters (model.lora): PEFT's LoRA layers injected into the HF trainer model, the base frozen; the adapter's
names as PEFT saves them (what vLLM's LoRA loader reads), PEFT's directory format, and the merge for export.

The adapter is injected in place (`peft.inject_adapter_in_model`), not wrapped in a `PeftModel`: the trainer keeps
the HF model object it has (config, decoder layers, lm_head, gradient checkpointing), and each adapted Linear becomes
a `peft.tuners.lora.Linear` holding `base_layer` plus `lora_A.default` / `lora_B.default`. Both inits of
`model.lora.init` leave B = 0, so the first policy is exactly the base model the engines load (docs/lora.md).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn
# imported where used: peft and safetensors (heavy)

# adapter versions an engine keeps loadable (in vLLM's CPU-side cache and as directories): the current one and the
# older ones in-flight requests may still run under (async generation ahead of the trainer); GPU slots: the current
# and one older (a request of a third waits for a slot; config/validate.py refuses staleness the kept ones cannot hold)
ADAPTERS_KEPT, ADAPTER_SLOTS = 3, 2
ADAPTER = "default"  # PEFT's adapter name inside the model; PEFT drops it from the names it saves
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
HEAD = ("lm_head",)  # vLLM serves it (LogitsProcessorWithLoRA), tied or not; off by default, as in prime-rl
# model_type -> (default targets, every module vLLM's LoRA layers serve in that family). Dense families adapt every
# linear of the decoder (attention + MLP, as prime-rl and Tinker default); Qwen3-MoE its attention only: the routed
# experts are fused 3-D tensors in transformers 5 (no nn.Linear for PEFT) and the router is not a LoRA target vLLM
# serves. A family not listed needs model.lora.target_modules, which the trainer checks against the built model.
FAMILIES = {**dict.fromkeys(("qwen3", "qwen2", "llama", "mistral"), (ATTENTION + MLP, ATTENTION + MLP + HEAD)),
            "qwen3_moe": (ATTENTION, ATTENTION + HEAD)}


def resolve_targets(model_type: str | None, target_modules: list[str] | None) -> list[str] | None:
    """`model.lora.target_modules`, or the family's default; None when neither is known (an unlisted family)."""
    if target_modules:
        return list(target_modules)
    family = FAMILIES.get(model_type or "")
    return list(family[0]) if family else None


def engine_targets(targets: list[str]) -> list[str]:
    """The trainer's targets as vLLM's LoRA filter matches them (a module's last name part, or its whole name), where
    PEFT matches any suffix of parts: `mlp.down_proj` -> `down_proj`. A module vLLM wraps beyond the adapter's has no
    weights in it, so serves the base (as the trainer's). Before: a target of several parts, which the trainer adapts,
    wrapped nothing in the engines, which then served those modules without the adapter, without a word."""
    return sorted({t.rsplit(".", 1)[-1] for t in targets})


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """The trainer model's own name of an adapter tensor -> PEFT's saved name (vLLM's LoRA loader reads these):
    `model.layers.0.self_attn.q_proj.lora_A.default.weight` -> `base_model.model.model.layers.0...lora_A.weight`."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def peft_config(spec: dict, base_path: str | None = None):
    """`spec`: rank, alpha, dropout, target_modules (resolved), init (trainer kwargs of model.lora)."""
    from peft import LoraConfig

    init = {"default": True, "gaussian": "gaussian"}[spec["init"]]
    return LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                      target_modules=list(spec["target_modules"]), init_lora_weights=init, bias="none",
                      base_model_name_or_path=base_path)


def add_adapter(model: nn.Module, spec: dict) -> nn.Module:
    """Injects the adapter (fp32, like every trainer weight; FSDP2's policy casts it as the base) and freezes the
    base: only lora_A / lora_B require grad, so the optimizer holds them alone (parallel/optim.py). A tied lm_head's
    adapter adds to the logits only (the embedding stays the base's, as in vLLM's LoRA logits layer)."""
    from peft import inject_adapter_in_model

    # PEFT matches a target by its name's last parts and skips one matching nothing where another matches (before: a
    # misspelt name in a family config/ cannot check, e.g. [q_proj,v_prj], trained q_proj alone, without a word)
    targets, modules = list(spec["target_modules"]), dict(model.named_modules())
    matched = {t: [m for n, m in modules.items() if n == t or n.endswith(f".{t}")] for t in targets}
    unmatched = [t for t in targets if not matched[t]]
    # PEFT wraps an Embedding (or a GPT-2 Conv1D) too, but with tensors of other names and layouts than lora_A /
    # lora_B of a Linear, which the freeze, sync and merge here take (before: an embed_tokens adapter stayed frozen,
    # trained nothing without a word, and the export's merge failed at the run's end on its missing lora_A)
    other = [t for t in targets if any(not isinstance(m, nn.Linear) for m in matched[t])]
    kinds = sorted({type(m).__name__ for t in other for m in matched[t] if not isinstance(m, nn.Linear)})
    why = (f"{unmatched} match no module of {type(model).__name__}" if unmatched else
           f"{other} name {kinds} modules; an adapter is trained, synced and merged here for linear ones (nn.Linear) "
           "alone" if other else None)
    if why is None:
        try:
            with warnings.catch_warnings():  # PEFT's tied-lm_head warning is about merging, which `merged_state` unties
                warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
                model = inject_adapter_in_model(peft_config(spec), model, adapter_name=ADAPTER)
        except ValueError as e:  # PEFT's: a target of a kind its LoRA layers do not wrap
            why = str(e)
    if why is not None:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"model.lora.target_modules={targets}: {why}; this model's linear modules are {linears}. "
                         "Fix: set model.lora.target_modules to names from those")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    return model


def merged_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict of the adapted model -> the base's HF state dict with W + scale * B @ A in each adapted
    weight (PEFT's merge for plain LoRA), computed in fp32. An adapted tied lm_head comes out as a weight of its own
    (the merged model's config must untie it)."""
    out = {}
    for name, t in state.items():
        if is_adapter_param(name):
            continue
        if ".base_layer." in name:
            module = name.split(".base_layer.")[0]
            if name.endswith(".base_layer.weight"):
                a = state[f"{module}.lora_A.{ADAPTER}.weight"].float()
                b = state[f"{module}.lora_B.{ADAPTER}.weight"].float()
                t = (t.float() + scale * (b @ a)).to(t.dtype)
            name = name.replace(".base_layer.", ".")
        out[name] = t
    return out


def save_adapter(out_dir: str | Path, tensors: dict[str, torch.Tensor], spec: dict, base_path: str | None) -> None:
    """PEFT's format: adapter_model.safetensors (PEFT names) + adapter_config.json; `PeftModel.from_pretrained` and
    vLLM's `LoRARequest` both load the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(spec, base_path), indent=2))


def adapter_config(spec: dict, base_path: str | None) -> dict:
    """adapter_config.json's contents, as PEFT writes them (`LoraConfig.to_dict`), JSON-ready."""
    d = peft_config(spec, base_path).to_dict()
    return json.loads(json.dumps(d, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))

