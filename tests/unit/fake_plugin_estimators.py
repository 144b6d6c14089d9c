"""A user's own estimator in a user's own module, selected with algorithm.plugins=[fake_plugin_estimators]."""

from molt_hydra.algorithm.advantage import register_advantage_estimator

SEEN_GROUPS: list[list[list[int]]] = []


@register_advantage_estimator("group_median_test", needs={"groups"})
def group_median(rewards, groups, ctx):
    """r_i - median(group), on every action token of the rollout's samples."""
    SEEN_GROUPS.append([list(g) for g in groups])
    centred = rewards.clone()
    for group in groups:
        centred[group] = rewards[group] - rewards[group].median()
    advantages = centred[ctx.sample_to_rollout][:, None] * ctx.action_mask
    return advantages, advantages
