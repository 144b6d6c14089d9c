"""The actor's loss: a policy surrogate from a registry (ppo, gspo, cispo, or a plugin's), weighted by the
train/rollout IS correction, aggregated per `loss_agg`, plus the optional KL-to-reference loss and entropy bonus
(Molt §2.5, §2.6, §2.8):

    total = agg(IS_weight * surrogate) + kl_coef * token_mean(approx_kl(logp, ref_logp))   (if kl.use_loss)
                                       - entropy_coef * token_mean(entropy)                (if entropy_coef)

All tensors are [B, L] and token-aligned (see models/logprobs.py): logp[t] is the log-prob of token t, mask[t] says
whether token t is trained on.

A surrogate is `fn(ratio, advantages, log_probs, action_mask, *, clip_eps_low, clip_eps_high, dual_clip,
policy_log_ratio) -> (per_token_loss [B, L], clip_ratio scalar)`; `ratio` = exp(policy_log_ratio) = pi_theta / pi_old,
already sanitised (+-30 clamp) and zero off the mask, as are the advantages.
"""

from __future__ import annotations

from typing import Callable

import torch

from molt_hydra.algorithm.aggregation import aggregate_loss, masked_mean
from molt_hydra.algorithm.is_correction import ISCorrection
from molt_hydra.algorithm.kl import LOG_RATIO_LIMIT, approx_kl, safe_log_ratio

POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def register_policy_loss(name: str):
    """Decorator adding a surrogate to POLICY_LOSSES; a second, different function under one name is an error."""
    def decorator(fn):
        if POLICY_LOSSES.get(name, fn) is not fn:
            raise ValueError(f"policy loss {name!r} already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return decorator


def get_policy_loss(name: str):
    if name not in POLICY_LOSSES:
        raise ValueError(f"Unknown policy loss {name!r} (algorithm.policy_loss). Registered: {sorted(POLICY_LOSSES)}. "
                         "A custom loss's module must be listed in algorithm.plugins.")
    return POLICY_LOSSES[name]


@register_policy_loss("ppo")
def ppo_loss(ratio, advantages, log_probs, action_mask, *, clip_eps_low, clip_eps_high, dual_clip=None, **_):
    """-min(r*A, clamp(r, 1-eps_low, 1+eps_high)*A); with dual clip c, tokens with A < 0 are also bounded by -c*A."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    loss = -torch.min(unclipped, clipped)
    if dual_clip is not None:
        # With A < 0 a huge ratio makes -min(...) unbounded; the dual clip caps that loss at -c*A.
        loss = torch.where(advantages < 0, -torch.max(torch.min(unclipped, clipped), dual_clip * advantages), loss)
    return loss, masked_mean((clipped < unclipped).float(), action_mask)


@register_policy_loss("gspo")
def gspo_loss(ratio, advantages, log_probs, action_mask, *, clip_eps_low, clip_eps_high, policy_log_ratio, **_):
    """PPO clipping on the sequence ratio s = exp(mean_t log r_t) (detached), while each token keeps its own
    gradient: s_t = exp(logp_t - sg(logp_t) + sg(log s))."""
    # clamped as PPO's token ratio is: a mean log-ratio past ~88 overflows exp() to an infinite loss and NaN grads
    seq_log_ratio = masked_mean(policy_log_ratio, action_mask, dim=-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).detach()
    # logp - sg(logp) is 0 in value; nan_to_num stops a -inf log-prob from turning it into NaN (value and gradient).
    seq_ratio = torch.exp(torch.nan_to_num(log_probs - log_probs.detach(), nan=0.0) + seq_log_ratio)
    unclipped = seq_ratio * advantages
    clipped = seq_ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    return -torch.min(unclipped, clipped), masked_mean((clipped < unclipped).float(), action_mask)


@register_policy_loss("cispo")
def cispo_loss(ratio, advantages, log_probs, action_mask, *, clip_eps_high, **_):
    """-sg(min(r, eps_high)) * A * logp: the IS weight is capped (eps_high is an absolute ceiling, e.g. 1.2) but never
    zeroes a token's gradient, which flows only through logp."""
    weight = ratio.clamp(max=clip_eps_high).detach()
    # a -inf (or NaN) log-prob on an action token gave +-inf, or NaN where A = 0 (inf * 0); its term is 0 here, the
    # limit of exp(logp) * logp, with no gradient (as PPO's clamped ratio gives it none)
    log_probs = torch.nan_to_num(log_probs, nan=0.0, posinf=0.0, neginf=0.0)
    return -weight * advantages * log_probs, masked_mean((ratio > clip_eps_high).float(), action_mask)


class PolicyLoss:
    """The configured actor loss, built from the validated config (runtime/roles.py): the config rejects the
    combinations Molt rejects (dual clip ppo-only and > 1, cispo's ceiling >= 1), naming the key."""

    def __init__(self, name: str = "ppo", *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
                 dual_clip: float | None = None, entropy_coef: float = 0.0, kl_use_loss: bool = False,
                 kl_estimator: str = "k1", loss_agg: str = "token-mean", is_correction: ISCorrection = ISCorrection(),
                 loss_scale_factor: float | None = None):
        self.surrogate = get_policy_loss(name)
        self.loss_agg, self.kl_estimator = loss_agg, kl_estimator
        # seq-mean-token-sum-norm's constant (Dr. GRPO: the token budget); the default, the micro-batch's padded
        # width, would weigh one sequence differently depending on which others share its micro-batch
        self.loss_scale_factor = loss_scale_factor
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.entropy_coef, self.kl_use_loss, self.is_correction = entropy_coef, kl_use_loss, is_correction

    def __call__(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 action_mask: torch.Tensor, *, rollout_log_probs: torch.Tensor | None = None,
                 ref_log_probs: torch.Tensor | None = None, entropy: torch.Tensor | None = None, kl_coef: float = 0.0,
                 num_tokens: int | torch.Tensor | None = None, global_batch_size: int | torch.Tensor | None = None,
                 dp_size: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss to backpropagate, detached scalar metrics) for one micro-batch.

        `log_probs` carry the gradient; `old_log_probs` are the trainer's log-probs at collection time (the PPO
        anchor and the IS numerator); `num_tokens` / `global_batch_size` / `dp_size` follow aggregation.py's
        global-window contract.
        """
        mask = action_mask.bool()
        policy_log_ratio = torch.where(mask, safe_log_ratio(log_probs, old_log_probs), 0.0)
        advantages = torch.where(mask, torch.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0), 0.0)
        ratio = policy_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
        per_token, clip_ratio = self.surrogate(
            ratio, advantages, log_probs, mask, clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
            dual_clip=self.dual_clip, policy_log_ratio=policy_log_ratio)
        metrics = {}
        if self.is_correction.enabled:
            if rollout_log_probs is None:
                raise ValueError(f"algorithm.is_correction.level={self.is_correction.level} needs rollout log-probs")
            weight, filtered = self.is_correction.weights(old_log_probs, rollout_log_probs, mask)
            per_token = weight * per_token
            metrics["is_filter_ratio"] = self.is_correction.filter_ratio(filtered, mask)
        window = dict(num_tokens=num_tokens, dp_size=dp_size)
        loss = aggregate_loss(per_token, mask, self.loss_agg, global_batch_size=global_batch_size,
                              loss_scale_factor=self.loss_scale_factor, **window)
        metrics.update(policy_loss=masked_mean(per_token.detach(), mask), policy_clip_ratio=clip_ratio.detach(),
                       policy_kl=masked_mean(-policy_log_ratio.detach(), mask),
                       advantage_mean=masked_mean(advantages, mask))
        if self.kl_use_loss and kl_coef > 0:
            if ref_log_probs is None:
                raise ValueError("algorithm.kl.use_loss=true with a positive KL coefficient needs reference log-probs")
            kl = approx_kl(log_probs, ref_log_probs, self.kl_estimator)
            loss = loss + kl_coef * aggregate_loss(kl, mask, "token-mean", **window)
            metrics["kl"] = masked_mean(kl.detach(), mask)
            metrics["logprobs_diff"] = masked_mean(safe_log_ratio(log_probs, ref_log_probs).detach(), mask)
        if self.entropy_coef:
            if entropy is None:
                raise ValueError("algorithm.entropy_coef is non-zero but no entropy was passed to the policy loss")
            loss = loss - self.entropy_coef * aggregate_loss(entropy, mask, "token-mean", **window)
            metrics["entropy_loss"] = masked_mean(entropy.detach(), mask)
        return loss, metrics
