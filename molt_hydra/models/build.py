"""Build the actor / reference / critic module with HF transformers (`model.backend=hf`); the NeMo AutoModel backend
(models/automodel.py) builds and parallelizes its own model. Everything above (losses, checkpoints) is shared.

Weights are always created in fp32 (the master copy); the bf16 compute policy is applied by FSDP2's
MixedPrecisionPolicy in `parallel/fsdp.py`, not here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from molt_hydra.models import hub_cache, vlm
from molt_hydra.models.smollm2 import resolve_smollm2
from molt_hydra.models.tiny import TINY_SCHEME, resolve_model_path
# imported where used: transformers (heavy)

ROLES = ("actor", "ref", "critic")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # model.param_dtype


def resolve_path(path: str, weights: bool = True) -> str:
    """`tiny://NAME` and `smollm2://NAME` build a local model directory once; a hub id (org/name, no local path) is
    its snapshot in this host's HF cache (models/hub_cache.py: downloaded first if need be, its weights unless
    `weights` is off, for a tokenizer); a local path as is. Was: a hub id passed on as is, which the trainer's config
    loader refused ("does not exist"), so a recipe on Qwen/Qwen3-4B could not train even with the model cached."""
    if path.startswith("smollm2://"):
        return resolve_smollm2(path)
    if path.startswith(TINY_SCHEME) or os.path.exists(os.path.expanduser(path)):
        return resolve_model_path(path)
    return hub_cache.snapshot(path, weights)


def resolve_backend(backend: str) -> str:
    """`model.backend`: auto -> automodel when NeMo AutoModel is installed and a GPU is present, else hf."""
    # NeMo AutoModel hard-codes CUDA devices in from_pretrained (feasibility.md §4), so it is only a GPU choice.
    usable = torch.cuda.is_available() and importlib.util.find_spec("nemo_automodel") is not None
    if backend == "auto":
        return "automodel" if usable else "hf"
    if backend == "automodel" and not usable:
        raise RuntimeError("model.backend=automodel needs the nemo_automodel package and a CUDA device; "
                           "install it (see docs) or set model.backend=hf")
    if backend not in ("hf", "automodel"):
        raise ValueError(f"model.backend must be auto, hf or automodel, got {backend!r}")
    return backend


class CriticModel(nn.Module):
    """Backbone (decoder without lm_head) + fp32 Linear(hidden, 1) value head (Molt §2.9)."""

    def __init__(self, backbone: nn.Module, hidden_size: int, init_std: float):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.value_head = nn.Linear(hidden_size, 1, bias=False, dtype=torch.float32)
        nn.init.normal_(self.value_head.weight, std=init_std)

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kw):
        h = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                          use_cache=False).last_hidden_state
        return self.value_head(h.to(self.value_head.weight.dtype))[..., 0]

    def gradient_checkpointing_enable(self, **kw):
        self.backbone.gradient_checkpointing_enable(**kw)


def load_config(path: str, config_overrides: dict | None = None, random_init: bool = False):
    """The HF config of a (resolved) model directory with `config_overrides` applied; KV cache off for training."""
    import transformers

    if not Path(path).exists() and not random_init:
        raise FileNotFoundError(f"model path {path!r} does not exist")
    config = transformers.AutoConfig.from_pretrained(path)
    for k, v in (config_overrides or {}).items():
        if not hasattr(config, k):
            raise ValueError(f"config_overrides: {type(config).__name__} has no field {k!r}")
        setattr(config, k, v)
    config.use_cache = False
    return config


def build_model(path: str, *, role: str = "actor", attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False, random_init: bool = False,
                config_overrides: dict | None = None, init_device: str | torch.device = "cpu") -> nn.Module:
    """Return an fp32 module for `role` ("actor" | "ref" | "critic").

    random_init: build from the config alone (benchmarks); config_overrides: fields replaced in the HF config
    (e.g. num_hidden_layers for a shortened benchmark model). The critic has no lm_head and untied embeddings.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    import transformers

    path = resolve_path(path)
    config = load_config(path, config_overrides, random_init)
    cls = transformers.AutoModelForCausalLM
    if vlm.is_vlm(config):
        if role == "critic":
            raise NotImplementedError("a vision-language critic is not supported; use a critic-free estimator")
        cls = transformers.AutoModelForImageTextToText  # vision tower + decoder (HF path, also on GPU)
    elif role == "critic":
        config.tie_word_embeddings = False
        cls = transformers.AutoModel
    kw = dict(dtype=torch.float32, attn_implementation=attn_implementation)
    with torch.device(init_device):
        model = cls.from_config(config, **kw) if random_init else cls.from_pretrained(path, config=config, **kw)
        if role == "critic":
            model = CriticModel(model, config.hidden_size, getattr(config, "initializer_range", 0.02))
    if gradient_checkpointing and role != "ref":
        # non-reentrant: recompute runs inside the FSDP2 pre-forward hooks, so params are re-gathered in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if role == "ref":
        model.requires_grad_(False)
    model.train(role != "ref")
    return model


def decoder_layers(model: nn.Module):
    """The blocks (`model.layers` / `backbone.layers`; a ModuleDict in AutoModel's classes), the FSDP2 unit. A
    vision-language model's are its language model's (HF `get_decoder`), not the vision tower's that come first."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(getattr(decoder, "layers", None), (nn.ModuleList, nn.ModuleDict)):
        model = decoder
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and name.endswith("layers"):
            return list(mod.values()) if isinstance(mod, nn.ModuleDict) else mod
    raise ValueError(f"{type(model).__name__}: no decoder `layers` ModuleList found")
