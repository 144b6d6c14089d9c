"""The trainer's fused log-prob head computes only the tokens a loss reads (the objective's mask; compute_logprobs'
`mask_key`), and with `share_prompts` a prompt group's prompt runs through the model once per micro-batch row: one
GRPO step either way equals, to float rounding, the same step over plain padded rows through full logits
(fused_head=False, every token of every sample), in loss, metrics, gradients and the returned old log-probs on the
mask; off the mask they are 0."""

from __future__ import annotations

import pytest
import torch

from molt_hydra.parallel.batching import shared_prompt_rows
from molt_hydra.parallel.launch import free_port

VARIANTS = {"full": dict(fused_head=False), "masked": dict(), "shared": dict(share_prompts=True)}


def grpo_samples() -> list[dict]:
    """Two prompts with 3 and 2 samples, one single-sample prompt; one response with a tool output (mask 0) inside."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for prompt_len, responses in [(6, [5, 8, 3]), (9, [4, 6]), (4, [7])]:
        prompt = torch.randint(0, 100, (prompt_len,), generator=g)
        for n in responses:
            ids = torch.cat([prompt, torch.randint(0, 100, (n,), generator=g)])
            mask = torch.arange(len(ids)) >= prompt_len
            if n == 8:
                mask[prompt_len + 3: prompt_len + 5] = False  # a tool's output between two model turns
            samples.append({"input_ids": ids, "action_mask": mask,
                            "advantages": torch.where(mask, torch.randn((), generator=g), 0.0),
                            "rollout_logprobs": torch.where(mask, -3.0, 0.0)})
    return samples


@pytest.fixture(scope="module")
def steps():
    """The same 1-rank gloo trainer (tiny model, same seed) stepped once per variant on the same samples."""
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.objectives import ActorObjective
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    port = free_port()
    samples, out = grpo_samples(), {}
    for name, kw in VARIANTS.items():
        w = TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=port, model_path="tiny://qwen3_tiny",
                                      timeout_s=120, lr=1e-3, max_tokens_per_micro_batch=40, seed=7, **kw))
        assert (w.head is not None) == (name != "full")
        grads, model_tokens = {}, []

        def keep_grads(optimizer, args, kwargs, w=w, grads=grads):  # the clipped gradients about to be applied
            for n, p in w.model.named_parameters():
                grads[n] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()

        w.optimizer.register_step_pre_hook(keep_grads)
        w.model.register_forward_pre_hook(lambda m, a, k, t=model_tokens: t.append(k["input_ids"].numel()),
                                          with_kwargs=True)
        loss = ActorObjective(PolicyLoss("ppo", entropy_coef=0.01), old_from_forward=True)
        metrics = w.train_step(samples, loss, return_logprobs=True)
        old = list(metrics.pop("logprobs"))
        recomputed = list(w.compute_logprobs(samples, mask_key="action_mask"))
        out[name] = dict(metrics=metrics, grads=grads, old=old, recomputed=recomputed, tokens=model_tokens)
    return samples, out


@pytest.mark.parametrize("variant", ["masked", "shared"])
def test_step_equals_full_logits_step_over_plain_rows(steps, variant):
    samples, out = steps
    got, want = out[variant], out["full"]
    for k in ("policy_loss", "entropy_loss", "policy_kl", "actor_grad_norm"):
        assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=1e-5, abs=1e-6), k
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in got["grads"].items():
        torch.testing.assert_close(g, want["grads"][name], atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in got["grads"].values())


@pytest.mark.parametrize("variant", ["masked", "shared"])
def test_old_logprobs_are_computed_on_the_mask_only(steps, variant):
    samples, out = steps
    for key in ("old", "recomputed"):  # the training forward's; compute_logprobs with mask_key after the equal step
        for s, a, b in zip(samples, out[variant][key], out["full"][key]):
            m = s["action_mask"]
            torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=1e-5)
            assert (a[~m] == 0).all()  # the fused head never computed the prompt's tokens
            assert (b[~m][1:] != 0).all()  # the logits path did (token 0 has no prediction)


def test_shared_prompts_run_each_prompt_once(steps):
    samples, out = steps
    prompts = [6, 9, 4]
    # training forward + compute_logprobs: each prompt once plus every response, in rows padded to the longest
    responses = sum(len(s["input_ids"]) for s in samples) - (3 * 6 + 2 * 9 + 4)
    assert sum(out["shared"]["tokens"]) >= 2 * (sum(prompts) + responses)
    assert sum(out["shared"]["tokens"]) < sum(out["masked"]["tokens"])


def test_shared_prompt_rows_layout():
    p, a, b = torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30])
    mask = lambda n: torch.arange(3 + n) >= 3  # noqa: E731
    rows = shared_prompt_rows([{"input_ids": torch.cat([p, a]), "m": mask(2)},
                               {"input_ids": torch.tensor([5, 6]), "m": torch.tensor([False, True])},
                               {"input_ids": torch.cat([p, b]), "m": mask(1)}], "m")
    assert rows["input_ids"].tolist() == [[10, 11, 12, 20, 21, 30], [5, 6, 0, 0, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 0, 1, 2, 3]]
    # token t of a sample is predicted from token t-1's place in its group's row (row 1 starts at 6)
    assert rows["sources"].tolist() == [[0, 0, 1, 2, 3], [0, 6, 0, 0, 0], [0, 0, 1, 2, 0]]
    seen = rows["attention_mask"][0, 0]
    assert seen[5].tolist() == [True, True, True, False, False, True]  # response b: the prompt and itself
    assert seen[4].tolist() == [True, True, True, True, True, False]  # response a, causal
    assert rows["attention_mask"][1, 0, 1].tolist() == [True, True, False, False, False, False]


def test_a_lora_adapted_lm_head_turns_the_fused_head_off_and_says_why(caplog):
    """model.lora.target_modules with lm_head: PEFT wraps it, so the fused head cannot read one weight; the trainer
    falls back to full logits and logs one line naming the head's type (never silently)."""
    import logging

    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    port = free_port()
    lora = dict(rank=4, alpha=8.0, dropout=0.0, init="default", target_modules=["q_proj", "lm_head"])
    with caplog.at_level(logging.WARNING, logger="molt_hydra.parallel.trainer"):
        w = TrainerWorker(TrainerSpec(rank=0, world_size=1, master_port=port, model_path="tiny://qwen3_tiny",
                                      timeout_s=120, lr=1e-3, seed=7, lora=lora))
    head = w.model.get_output_embeddings()
    assert w.head is None and type(head).__module__.startswith("peft.")
    assert f"fused log-prob head off (the lm_head is a {type(head).__module__}.{type(head).__name__} or has a " \
           "bias" in caplog.text
