"""Shared by the VLM trainer tests: a 1-rank FSDP2 worker on the tiny VLM, and log-probs from an HF forward."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.parallel.launch import free_port


@pytest.fixture(scope="module", autouse=True)
def one_rank_process_group():
    """The workers of a module share the 1-rank gloo group (init is idempotent); gone before the next module."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def hf_logprobs(model, sample, **kw) -> torch.Tensor:
    """log p(x[t] | x[<t]) straight from the definition, token 0 -> 0."""
    ids = sample["input_ids"][None]
    logits = model(input_ids=ids, **kw).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def vlm_worker(model_dir, **kw):
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    return TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=free_port(), model_path=model_dir, lr=1e-2,
                                     total_steps=2, timeout_s=120, **{"param_dtype": "fp32", **kw}))


def mixed_dp_rank(rank: int, world: int, port: int, out_dir: str, freeze: bool, model: str = "tiny://qwen25_vl_tiny"):
    """One DP rank of a VLM train step where rank 0 holds an image sample and rank 1 a text-only one."""
    import json

    from PIL import Image
    from transformers import AutoTokenizer

    from molt_hydra.models import vlm
    from molt_hydra.models.build import resolve_path
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    model_dir = resolve_path(model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    images = vlm.TrajectoryImages.for_model(model_dir)
    w = TrainerWorker(TrainerSpec(rank=rank, world_size=world, master_port=port, model_path=model_dir, lr=1e-2,
                                  param_dtype="fp32", timeout_s=60, freeze_visual_encoder=freeze))
    if rank == 0:
        ids = tok("x is 60", add_special_tokens=False)["input_ids"]
        ids = [images.placeholder_id] + ids
        ids, _, _, _, mm = images.expand(
            ids, [0.0] * len(ids), [-1] * len(ids), [], [Image.new("RGB", (56, 56), "red")])
    else:
        ids, mm = tok("the answer is yes", add_special_tokens=False)["input_ids"], {}
    sample = {"input_ids": torch.tensor(ids), "loss_mask": torch.ones(len(ids)), **mm}
    m = w.train_step([sample])
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"sft_loss": m["sft_loss"]}, f)
    w.shutdown()
