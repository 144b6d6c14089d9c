"""Seconds per GB of a full weight sync into a running vLLM engine actor, for each transport available here, divided
by a plain in-memory copy of the same bytes measured in this process. Appends a row to RESULTS.md.

    flock /tmp/molt_heavy.lock python bench/weight_sync.py
"""

import asyncio
import datetime
import shutil
import tempfile
import time
from pathlib import Path

import torch

BUCKET_BYTES = 64 << 20


def build_model(out: Path) -> dict:
    """A random ~190 MB fp32 Qwen3 (tied embeddings) with the tiny tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from molt_hydra.models.tiny import resolve_model_path

    tiny = resolve_model_path("tiny://qwen3_tiny")
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    cfg = Qwen3Config(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=1024)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}


def main():
    import ray

    from molt_hydra.rollout.buckets import bucket_weights
    from molt_hydra.rollout.engine import VLLMEngine
    from molt_hydra.rollout.weight_sync import ObjectStoreTransport, SharedMemoryTransport, WeightSync

    tmp = Path(tempfile.mkdtemp(prefix="molt_bench_ws_"))
    try:
        weights = build_model(tmp)
        gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9

        def memcpy_s():
            start = time.perf_counter()
            _ = [t.clone() for t in weights.values()]
            return time.perf_counter() - start

        memcpy = min(memcpy_s() for _ in range(3)) / gb
        ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
        engine = ray.remote(VLLMEngine).options(max_concurrency=16, num_cpus=1).remote(
            str(tmp), dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_gb=1)
        ray.get(engine.start.remote())
        cells = [f"memcpy {memcpy:.3f} s/GB"]
        for name, transport in [("object_store", ObjectStoreTransport()), ("shm", SharedMemoryTransport())]:
            sync = WeightSync([engine], transport, check_coverage=True)
            asyncio.run(sync.sync(bucket_weights(weights.items(), BUCKET_BYTES)))  # warmup
            best = min(asyncio.run(sync.sync(bucket_weights(weights.items(), BUCKET_BYTES))).seconds for _ in range(3))
            cells.append(f"{name} {best / gb:.2f} s/GB (x{best / gb / memcpy:.0f} memcpy)")
        ray.get(engine.shutdown.remote())
        ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    line = (f"| {datetime.date.today()} | weight_sync | {gb * 1000:.0f} MB fp32 Qwen3, 1 engine, "
            f"{BUCKET_BYTES >> 20} MB buckets, full sync incl. pause/resume | " + " | ".join(cells) + " |")
    print(line)
    with open(Path(__file__).parent / "RESULTS.md", "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
