"""A trainer's checkpoints and `model.master_weights` (parallel/trainer.py save/load, one in-process rank on CPU,
bf16 compute, the tiny Qwen3): the trainer records its mode, so a resume under the other mode is refused before
anything loads, naming both; a warm start (weights only) under optimizer masters trains on from the loaded weights
(in the fp32 masters unrounded), not from the fp32 masters of the model as it was built."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.models.build import resolve_path
from molt_hydra.parallel.launch import free_port


@pytest.fixture(scope="module", autouse=True)
def one_rank_process_group():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def worker(mode: str, lr: float):
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    return TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=free_port(), model_path=resolve_path(
        "tiny://qwen3_tiny"), lr=lr, total_steps=10, param_dtype="bf16", master_weights=mode, timeout_s=120))


def sample() -> dict:
    ids = torch.arange(3, 35)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[16:] = True
    return {"input_ids": ids, "loss_mask": mask}


def weights(w) -> dict[str, torch.Tensor]:
    full = (p.full_tensor() if hasattr(p, "full_tensor") else p for _, p in w.model.named_parameters())
    return {n: t.detach().float().clone() for (n, _), t in zip(w.model.named_parameters(), full)}


def test_a_resume_under_the_other_mode_is_refused_naming_both(tmp_path):
    saver = worker("optimizer", 1e-2)
    saver.train_step([sample()])
    saver.save_checkpoint(str(tmp_path))
    with pytest.raises(ValueError) as err:
        worker("fsdp", 1e-2).load_checkpoint(str(tmp_path))
    assert str(err.value).startswith("model.master_weights: ") and "saved with model.master_weights=optimizer" in \
        str(err.value) and "this run has fsdp" in str(err.value)


def test_a_warm_start_under_optimizer_masters_goes_on_from_the_loaded_weights(tmp_path):
    saver = worker("fsdp", 5e-2)
    for _ in range(3):  # far from the weights the model is built with
        saver.train_step([sample()])
    saver.save_checkpoint(str(tmp_path))
    saved = {n: t.to(torch.bfloat16).float() for n, t in weights(saver).items()}  # as bf16 params hold them
    warm = worker("optimizer", 1e-9)  # a step that moves nothing visible: the masters decide what the params become
    built = weights(warm)
    assert max((built[n] - saved[n]).abs().max().item() for n in saved) > 1e-2
    warm.load_checkpoint(str(tmp_path), model_only=True)
    exact = weights(saver)  # the fp32 checkpoint reaches the fp32 masters unrounded
    masters = {n: warm.optimizer.state[p]["master"] for n, p in warm.model.named_parameters()}
    for n in saved:
        assert torch.equal(masters[n].float(), exact[n]), n
    assert any(not torch.equal(exact[n], saved[n]) for n in saved)  # rounding to bf16 would have changed some
    warm.train_step([sample()])
    after = weights(warm)
    for n in saved:
        torch.testing.assert_close(after[n], saved[n], rtol=1e-2, atol=1e-3, msg=n)
