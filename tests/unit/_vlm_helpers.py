"""Shared by the VLM trainer tests: a 1-rank FSDP2 worker on the tiny VLM, and log-probs from an HF forward."""

from __future__ import annotations

import socket

import pytest
import torch


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    return TrainerWorker(rank=0, world_size=1, master_port=_port(), model_path=model_dir, lr=1e-2, total_steps=2,
                         param_dtype="fp32", timeout_s=120, **kw)
