"""The trainer's fused log-prob head computes only the tokens a loss reads (the objective's mask; compute_logprobs'
`mask_key`): one GRPO step with it equals, to float rounding, the same step through full logits (fused_head=False,
every token), in loss, metrics, gradients and the returned old log-probs on the mask; off the mask they are 0."""

from __future__ import annotations

import socket

import pytest
import torch


@pytest.fixture(scope="module")
def two_steps():
    """The same 1-rank gloo trainer (tiny model, same seed) stepped once with the fused head and once with logits."""
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    from molt_hydra.parallel.trainer import TrainerWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = torch.Generator().manual_seed(0)
    samples = []
    for prompt, response in [(5, 7), (9, 3), (4, 11), (6, 6), (8, 2)]:  # mixed lengths: padded rows, 3 micro-batches
        n = prompt + response
        mask = torch.arange(n) >= prompt
        samples.append({"input_ids": torch.randint(0, 100, (n,), generator=g), "action_mask": mask,
                        "advantages": torch.where(mask, torch.randn((), generator=g), 0.0),
                        "rollout_logprobs": torch.where(mask, -3.0, 0.0)})
    out = {}
    for fused in (True, False):
        w = TrainerWorker(rank=0, world_size=1, master_port=port, model_path="tiny://qwen3_tiny", timeout_s=120,
                          lr=1e-3, max_tokens_per_micro_batch=32, fused_head=fused, seed=7)
        assert (w.head is not None) == fused
        grads = {}

        def keep_grads(optimizer, args, kwargs, w=w, grads=grads):  # the clipped gradients about to be applied
            for name, p in w.model.named_parameters():
                grads[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()

        w.optimizer.register_step_pre_hook(keep_grads)
        loss = ActorObjective(PolicyLoss("ppo", entropy_coef=0.01), old_from_forward=True)
        metrics = w.train_step(samples, loss, return_logprobs=True)
        recomputed = w.compute_logprobs(samples, mask_key="action_mask")
        out[fused] = dict(metrics=metrics, grads=grads, old=list(metrics.pop("logprobs")), recomputed=list(recomputed))
    return samples, out


def test_masked_head_step_equals_full_logits_step(two_steps):
    samples, out = two_steps
    fused, full = out[True], out[False]
    for k in ("policy_loss", "entropy_loss", "policy_kl", "actor_grad_norm"):
        assert fused["metrics"][k] == pytest.approx(full["metrics"][k], rel=1e-5, abs=1e-6), k
    assert fused["grads"].keys() == full["grads"].keys()
    for name, g in fused["grads"].items():
        torch.testing.assert_close(g, full["grads"][name], atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in fused["grads"].values())


def test_old_logprobs_are_computed_on_the_mask_only(two_steps):
    samples, out = two_steps
    for s, a, b in zip(samples, out[True]["old"], out[False]["old"]):
        m = s["action_mask"]
        torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=1e-5)
        assert (a[~m] == 0).all()  # the fused head never computed the prompt's tokens
        assert (b[~m][1:] != 0).all()  # the logits path did (token 0 has no prediction)
    for s, a, b in zip(samples, out[True]["recomputed"], out[False]["recomputed"]):
        m = s["action_mask"]  # after the (equal) step: compute_logprobs with mask_key, same rule
        torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=1e-5)
        assert (a[~m] == 0).all() and (b[~m][1:] != 0).all()
