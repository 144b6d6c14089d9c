"""Write the tiny Qwen3, Qwen3-MoE, Qwen2.5-VL and Idefics3 test models (random init, local BPE tokenizer, chat
template; the VLMs with a PIL image processor) to a directory.

    python scripts/make_tiny_model.py OUT_DIR [--seed 0]
"""

import argparse
from pathlib import Path

from molt_hydra.models import tiny_vlm
from molt_hydra.models.tiny import build

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in build(args.out_dir, args.seed).items():
        print(f"{name}: {path}")
    for name in tiny_vlm.TINY_VLM_MODELS:
        print(f"{name}: {tiny_vlm.build(args.out_dir / name, args.seed, name)}")
