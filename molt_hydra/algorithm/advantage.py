"""Advantage estimators behind a registry (Molt §2.1 steps 4-6, §2.2, §2.3).

An estimator is `fn(rewards [R], groups, ctx) -> (advantages [S, L], returns [S, L])`:
  rewards  one clipped reward per rollout (segments of one rollout share it and are counted once),
  groups   lists of rollout rows that share a prompt (group id), in first-seen order,
  ctx      the per-sample tensors (AdvantageContext).
Every estimator receives the real groups, including a user's own (Molt hands those singleton groups); each declares
what it needs so the runtime builds only that and validation can reject impossible setups:
  "groups"     uses the group structure (n_samples_per_prompt > 1 makes it meaningful)
  "values"     critic values (ctx.values); the run needs a critic
  "kl"         consumes the per-token KL to the reference as a reward penalty -kl_coef * kl (when kl.use_loss is off)
  "reference"  cannot work without a reference/teacher model at all
and which of the context's knobs (`algorithm.gamma`, `algorithm.lam`, `algorithm.whiten`) it reads, so validation
refuses one set for an estimator that ignores it (a plugin that does not declare `reads` is taken to read all three).

Register your own from any module listed in `algorithm.plugins`:

    @register_advantage_estimator("group_median", needs={"groups"})
    def group_median(rewards, groups, ctx): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, NamedTuple, Sequence

import torch

from molt_hydra.algorithm.aggregation import masked_sum

NEEDS = frozenset({"groups", "values", "kl", "reference"})
KNOBS = frozenset({"gamma", "lam", "whiten"})  # the AdvantageContext fields an estimator may read (`reads`)
GRPO_STD_EPS = 1e-9
WHITEN_VAR_FLOOR = 1e-8


class EstimatorSpec(NamedTuple):
    fn: Callable
    needs: frozenset[str]
    reads: frozenset[str] = KNOBS


ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_advantage_estimator(name: str, *, needs: Iterable[str] = (), reads: Iterable[str] = KNOBS):
    """Decorator adding `fn` to ADVANTAGE_ESTIMATORS; a second, different function under one name is an error."""
    needs, reads = frozenset(needs), frozenset(reads)
    if not needs <= NEEDS:
        raise ValueError(f"advantage estimator {name!r}: unknown needs {sorted(needs - NEEDS)}; "
                         f"choose from {sorted(NEEDS)}")
    if not reads <= KNOBS:
        raise ValueError(f"advantage estimator {name!r}: unknown reads {sorted(reads - KNOBS)}; "
                         f"choose from {sorted(KNOBS)}")

    def decorator(fn):
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name].fn is not fn:
            raise ValueError(f"advantage estimator {name!r} already registered")
        ADVANTAGE_ESTIMATORS[name] = EstimatorSpec(fn, needs, reads)
        return fn
    return decorator


def get_advantage_estimator(name: str) -> EstimatorSpec:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"Unknown advantage estimator {name!r} (algorithm.estimator). Registered: "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}. A custom estimator's module must be listed in "
                         "algorithm.plugins.")
    return ADVANTAGE_ESTIMATORS[name]


@dataclass
class AdvantageContext:
    sample_to_rollout: torch.Tensor  # [S] long: the rollout row (of `rewards`) each sample belongs to
    action_mask: torch.Tensor        # [S, L] bool
    kl: torch.Tensor                 # [S, L] per-token KL to the reference; zeros when there is none
    values: torch.Tensor | None      # [S, L] critic values at collection (estimators that need "values")
    kl_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = True


def group_rollouts(num_samples: int, group_ids: Sequence[Hashable] | None = None,
                   rollout_ids: Sequence[Hashable] | None = None) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """(first sample of each rollout, groups of rollout rows, sample -> rollout row [S]).

    Samples sharing a rollout id are one rollout (its first-seen sample gives its reward and group); rollouts sharing
    a group id form a group. Missing rollout ids -> each sample is its own rollout; missing group ids -> each rollout
    is its own group.
    """
    rollout_ids = range(num_samples) if rollout_ids is None else rollout_ids
    group_ids = rollout_ids if group_ids is None else group_ids
    if not len(rollout_ids) == len(group_ids) == num_samples:
        raise ValueError(f"{num_samples} samples but {len(rollout_ids)} rollout ids and {len(group_ids)} group ids")
    # rollout id -> its row; group id -> its rollout rows; each row's first sample; each sample's row
    row_of, groups, first_sample, sample_to_rollout = {}, {}, [], []
    for sample, (rollout_id, group_id) in enumerate(zip(rollout_ids, group_ids)):
        if rollout_id not in row_of:
            row_of[rollout_id] = len(first_sample)
            first_sample.append(sample)
            groups.setdefault(group_id, []).append(row_of[rollout_id])
        sample_to_rollout.append(row_of[rollout_id])
    return first_sample, list(groups.values()), torch.tensor(sample_to_rollout, dtype=torch.long)


def group_reward_std(rewards: torch.Tensor, group_ids: Sequence[Hashable], rollout_ids: Sequence[Hashable],
                     reward_clip: Sequence[float] | None) -> torch.Tensor:
    """Each sample's group's unbiased std of its rollouts' clipped rewards (0 for a group of one) [S] float64: how much
    a group's rewards tell its rollouts apart. Molt's `group_reward_std` metric is their mean over the samples."""
    first_sample, groups, sample_to_rollout = group_rollouts(len(rewards), group_ids, rollout_ids)
    rollout_rewards = rewards.double()[first_sample]
    if reward_clip is not None:
        rollout_rewards = rollout_rewards.clamp(reward_clip[0], reward_clip[1])
    stds = torch.zeros(len(first_sample), dtype=torch.float64)
    for rows in groups:
        if len(rows) > 1:
            stds[rows] = rollout_rewards[rows].std()
    return stds[sample_to_rollout]


def compute_advantages(estimator: str, rewards: torch.Tensor, action_mask: torch.Tensor, *,
                       group_ids: Sequence[Hashable] | None = None, rollout_ids: Sequence[Hashable] | None = None,
                       kl: torch.Tensor | None = None, values: torch.Tensor | None = None, kl_coef: float = 0.0,
                       gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
                       reward_clip: Sequence[float] | None = (-10.0, 10.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [S, L], returns [S, L]) in float32 for one training step's samples.

    `rewards` [S] is each sample's reward (segments of one rollout repeat it); `kl` [S, L] the per-token KL to the
    reference (kl.use_loss off), `values` [S, L] the critic's values. Advantages are zero off the action mask.
    """
    spec = get_advantage_estimator(estimator)
    if "values" in spec.needs and values is None:
        raise ValueError(f"algorithm.estimator={estimator} needs critic values: the run must build a critic")
    if "reference" in spec.needs and kl is None:
        raise ValueError(f"algorithm.estimator={estimator} needs the per-token KL to a reference/teacher model")
    mask = action_mask.bool()
    first_sample, groups, sample_to_rollout = group_rollouts(len(rewards), group_ids, rollout_ids)
    # float64: a constant group must centre to exactly 0 (float32 means of e.g. 0.1 do not), and GRPO then divides
    # that difference by std + 1e-9.
    rollout_rewards = rewards.double()[first_sample]
    if reward_clip is not None:
        rollout_rewards = rollout_rewards.clamp(reward_clip[0], reward_clip[1])
    ctx = AdvantageContext(
        sample_to_rollout=sample_to_rollout.to(mask.device), action_mask=mask,
        kl=torch.zeros(mask.shape, dtype=torch.float64, device=mask.device) if kl is None else kl.double(),
        values=None if values is None else values.double(),
        kl_coef=kl_coef, gamma=gamma, lam=lam, whiten=whiten)
    advantages, returns = spec.fn(rollout_rewards.to(mask.device), groups, ctx)
    if advantages.shape != mask.shape or returns.shape != mask.shape:
        raise ValueError(f"advantage estimator {estimator!r} returned shapes {tuple(advantages.shape)} and "
                         f"{tuple(returns.shape)}; expected the action mask's {tuple(mask.shape)}")
    # The policy loss would zero a non-finite advantage (Molt's sanitisation): the run would train on nothing, unseen
    if not (finite := torch.isfinite(advantages[mask])).all():
        cause = ": a reward is NaN" if rollout_rewards.isnan().any() else ": the critic's values are non-finite " \
            "there (a diverged critic)" if values is not None and not torch.isfinite(values[mask]).all() else ""
        raise ValueError(f"advantage estimator {estimator!r} gave {int((~finite).sum())} non-finite advantages on "
                         f"action tokens{cause}; the policy loss would zero them and learn nothing")
    # Molt leaves whitened values on masked positions (harmless only because the loss re-masks); here the invariant
    # "advantages are 0 off the action mask" holds for every estimator, plugins included.
    return torch.where(mask, advantages, 0.0).float(), returns.float()


def whiten_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean) / sqrt(max(var, 1e-8)) with mean and population variance over the action tokens of the whole batch;
    applied at every position (masked ones become -mean/std). An empty mask gives zeros."""
    if (count := mask.sum()) == 0:
        return torch.zeros_like(advantages)
    mean = masked_sum(advantages, mask) / count
    var = masked_sum((advantages - mean).square(), mask) / count
    return (advantages - mean) * var.clamp(min=WHITEN_VAR_FLOOR).rsqrt()


def _per_group(rewards: torch.Tensor, groups: list[list[int]], ctx: AdvantageContext, fn) -> torch.Tensor:
    """Each group's rollout rewards replaced by `fn` of them (a tensor of the group's size), each rollout's value
    then on every action token of its samples."""
    out = rewards.clone()
    for group in groups:
        out[group] = fn(rewards[group])
    return out[ctx.sample_to_rollout][:, None] * ctx.action_mask


def _kl_penalized_rewards(ctx: AdvantageContext, sample_rewards: torch.Tensor | None) -> torch.Tensor:
    """Per-token reward -kl_coef * kl, plus each sample's reward on its last action token (rows without an action
    token get none), zeroed off the action mask."""
    token_rewards = -ctx.kl_coef * ctx.kl
    if sample_rewards is not None:
        positions = torch.arange(ctx.action_mask.shape[-1], device=ctx.action_mask.device)
        last = torch.where(ctx.action_mask, positions, -1).max(-1).values
        rows = (last >= 0).nonzero().squeeze(-1)
        token_rewards = token_rewards.index_put((rows, last[rows]), sample_rewards[rows], accumulate=True)
    # `where`, not `* mask`: a NaN / inf off the mask (no meaning there) would stay NaN and flow into every earlier
    # token's return through the discounted sum
    return torch.where(ctx.action_mask, token_rewards, 0.0)


@register_advantage_estimator("reinforce", needs={"kl"}, reads={"gamma", "whiten"})
def reinforce(rewards, groups, ctx):
    """REINFORCE++: returns G_t = r_t + gamma * G_{t+1} over every position (observation and prompt tokens are discount
    steps with zero reward, and keep their G), whitened over the batch."""
    token_rewards = _kl_penalized_rewards(ctx, rewards[ctx.sample_to_rollout])
    if ctx.gamma == 1.0:
        returns = token_rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.zeros_like(token_rewards)
        running = torch.zeros_like(token_rewards[:, 0])
        for t in reversed(range(token_rewards.shape[-1])):
            running = token_rewards[:, t] + ctx.gamma * running
            returns[:, t] = running
    return (whiten_advantages(returns, ctx.action_mask) if ctx.whiten else returns), returns


@register_advantage_estimator("reinforce_baseline", needs={"groups"}, reads={"whiten"})
def reinforce_baseline(rewards, groups, ctx):
    """r_i - mean(group), whitened over the batch (a singleton group gives 0 before whitening)."""
    returns = _per_group(rewards, groups, ctx, lambda r: r - r.mean())
    return (whiten_advantages(returns, ctx.action_mask) if ctx.whiten else returns), returns


@register_advantage_estimator("rloo", needs={"groups"}, reads=())
def rloo(rewards, groups, ctx):
    """r_i minus the mean of the OTHER rewards of its group; a singleton keeps its raw reward (Molt, deliberate)."""
    advantages = _per_group(rewards, groups, ctx, lambda r: r - (r.sum() - r) / (len(r) - 1) if len(r) > 1 else r)
    return advantages, advantages


@register_advantage_estimator("grpo", needs={"groups"}, reads=())
def grpo(rewards, groups, ctx):
    """(r_i - mean) / (std + 1e-9) with the unbiased (n-1) std; a singleton (std taken as 0) and a zero-variance group
    give 0."""
    advantages = _per_group(
        rewards, groups, ctx, lambda r: (r - r.mean()) / ((r.std() if len(r) > 1 else 0.0) + GRPO_STD_EPS))
    return advantages, advantages


@register_advantage_estimator("dr_grpo", needs={"groups"}, reads=())
def dr_grpo(rewards, groups, ctx):
    """r_i - mean(group), not divided by the std (Dr. GRPO); a singleton group gives 0."""
    advantages = _per_group(rewards, groups, ctx, lambda r: r - r.mean())
    return advantages, advantages


@register_advantage_estimator("on_policy_distill", needs={"kl", "reference"}, reads=())
def on_policy_distill(rewards, groups, ctx):
    """A_t = -kl_coef * kl_t on action tokens, kl = log pi_student - log pi_teacher (k1); the task reward is ignored."""
    advantages = _kl_penalized_rewards(ctx, None)
    return advantages, advantages


@register_advantage_estimator("gae", needs={"values", "kl"}, reads={"gamma", "lam", "whiten"})
def gae(rewards, groups, ctx):
    """GAE(gamma, lambda) on the KL-penalised token rewards. Masked tokens (observations, padding) are transparent: an
    action token bootstraps from the next ACTION token's value, and the advantage carries across the gap unchanged.
    Advantages are whitened then re-masked; returns = (A + V) * mask, the un-whitened value target."""
    mask = ctx.action_mask.to(ctx.values.dtype)
    token_rewards = _kl_penalized_rewards(ctx, rewards[ctx.sample_to_rollout])
    values = torch.where(ctx.action_mask, ctx.values, 0.0)  # (not * mask: see _kl_penalized_rewards)
    advantages = torch.zeros_like(values)
    next_value = running = torch.zeros_like(values[:, 0])  # both rebound (not updated in place) in the loop
    for t in reversed(range(values.shape[-1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + ctx.gamma * next_value - values[:, t]
        step = delta + ctx.gamma * ctx.lam * running
        next_value = values[:, t] * m + (1 - m) * next_value
        running = step * m + (1 - m) * running
        advantages[:, t] = running
    returns = (advantages + values) * mask
    advantages = advantages * mask
    return (whiten_advantages(advantages, ctx.action_mask) * mask if ctx.whiten else advantages), returns
