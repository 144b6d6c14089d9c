"""Adapters from packed trainer micro-batches to the algorithm package's losses (molt_hydra/algorithm).

An objective is called per micro-batch as `obj(out, mb, entropy, num_tokens=, global_batch_size=, dp_size=)` with
[S, L] tensors (one row per sample, right-padded, mask 0 on padding) and returns (loss to backpropagate, scalar
metrics), the contract of algorithm/loss.py. `mask_key` names the mask the trainer counts for the window
denominators; `entropy_coef` tells the trainer whether to compute entropy.
"""

from __future__ import annotations

from molt_hydra.algorithm.aggregation import aggregate_loss, masked_mean
from molt_hydra.algorithm.value_loss import value_loss


class SFTObjective:
    """SFT (inventory §2.10): token-mean of −log p over the loss mask."""
    mask_key, entropy_coef = "loss_mask", 0.0

    def __call__(self, logp, mb, entropy=None, *, num_tokens, global_batch_size, dp_size):
        m = mb[self.mask_key]
        loss = aggregate_loss(-logp, m, "token-mean", num_tokens=num_tokens, dp_size=dp_size)
        return loss, {"sft_loss": masked_mean(-logp.detach(), m)}


class ActorObjective:
    """algorithm.loss.PolicyLoss over experience keys old_logprobs, advantages, action_mask (+ rollout_logprobs,
    ref_logprobs when present); kl_coef is the controller's current coefficient.

    `old_from_forward`: the old log-probs are this forward's own, detached, and the samples carry none. Exact when the
    batch gets one optimizer step: the parameters that would give the old log-probs are the ones being trained, so a
    separate no-grad pass would compute the same numbers (TRL does the same at num_iterations=1)."""
    mask_key = "action_mask"

    def __init__(self, policy_loss, kl_coef: float = 0.0, old_from_forward: bool = False):
        self.policy_loss, self.kl_coef, self.old_from_forward = policy_loss, kl_coef, old_from_forward
        self.entropy_coef = policy_loss.entropy_coef

    def __call__(self, logp, mb, entropy=None, **window):
        old = logp.detach() if self.old_from_forward else mb["old_logprobs"]
        return self.policy_loss(logp, old, mb["advantages"], mb["action_mask"],
                                rollout_log_probs=mb.get("rollout_logprobs"), ref_log_probs=mb.get("ref_logprobs"),
                                entropy=entropy, kl_coef=self.kl_coef, **window)


class CriticObjective:
    """algorithm.value_loss over experience keys values (V_old), returns, action_mask."""
    mask_key, entropy_coef = "action_mask", 0.0

    def __init__(self, value_clip: float | None = 0.2):
        self.value_clip = value_clip

    def __call__(self, values, mb, entropy=None, *, num_tokens, global_batch_size, dp_size):
        return value_loss(values, mb["values"], mb["returns"], mb["action_mask"], value_clip=self.value_clip,
                          num_tokens=num_tokens, dp_size=dp_size)
