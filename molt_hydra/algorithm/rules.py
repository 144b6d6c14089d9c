"""Validation rules for the algorithm's open choices: the plugin modules import (their decorators register
estimators and losses), and the estimator and loss are registered names. Run first by runtime/validate.py: what the
estimator needs (groups, a reference, a critic, per-token KL) drives derive() and the other groups' rules.
`check_estimator_knobs` (run after derive()) refuses the knobs the estimator leaves unread: its context knobs, the
critic's, the reference's and the KL's; through `loss_and_kl_rules`, those of the policy loss, the IS correction and
the KL controller that change nothing or would break the math."""

from __future__ import annotations

import dataclasses

from molt_hydra.algorithm.advantage import ADVANTAGE_ESTIMATORS, KNOBS
from molt_hydra.algorithm.loss import POLICY_LOSSES
from molt_hydra.algorithm.plugins import load_plugins
from molt_hydra.config.schema import OptimizerConfig, RunConfig
from molt_hydra.config.validate import Problems, changed, trainer_roles

CRITIC_KNOBS = ("algorithm.value_clip", "model.critic_path", "train.critic.epochs",
                *(f"train.critic.optimizer.{f.name}" for f in dataclasses.fields(OptimizerConfig)))
KL_KNOBS = ("algorithm.kl.estimator", "algorithm.kl.use_loss", "algorithm.kl.target", "algorithm.kl.horizon")


def estimator_needs(cfg: RunConfig, problems: Problems) -> frozenset[str]:
    """Import algorithm.plugins, check both names against the registries; the estimator's needs (empty if unknown)."""
    a = cfg.algorithm
    for module in a.plugins:
        try:
            load_plugins([module])
        except ImportError as e:
            cause = e.__cause__ or e
            problems.check(False, "algorithm.plugins", f"cannot import {module!r} ({type(cause).__name__}: {cause}).",
                           "put the module on PYTHONPATH or fix its name" if isinstance(cause, ImportError) else
                           "fix the module's code: importing it must succeed")
    problems.check(a.estimator in ADVANTAGE_ESTIMATORS, "algorithm.estimator",
                   f"{a.estimator!r} is not a registered estimator.",
                   f"use one of {sorted(ADVANTAGE_ESTIMATORS)}, or register yours and list its module in "
                   "algorithm.plugins")
    problems.check(a.policy_loss in POLICY_LOSSES, "algorithm.policy_loss", f"{a.policy_loss!r} is not a registered "
                   "loss.", f"use one of {sorted(POLICY_LOSSES)}, or register yours and list its module in "
                   "algorithm.plugins")
    # derive() sets what distillation reads (Molt forces them): any other value would be overwritten unseen
    problems.table(((a.estimator != "on_policy_distill" or ok, key, f"on_policy_distill rewards each token with the "
                     f"k1 log-ratio to the teacher (Molt forces it), so {value} would change nothing.",
                     f"unset {key}") for ok, key, value in (
        (a.kl.estimator.value == "k1", "algorithm.kl.estimator", f"kl.estimator={a.kl.estimator.value}"),
        (not a.kl.use_loss, "algorithm.kl.use_loss", "kl.use_loss=true"),
        # the task reward never reaches its advantages: clipping it is inert
        (not changed(cfg, "algorithm.reward_clip"), "algorithm.reward_clip", f"reward_clip={list(a.reward_clip)}"))))
    return ADVANTAGE_ESTIMATORS[a.estimator].needs if a.estimator in ADVANTAGE_ESTIMATORS else frozenset()


def check_estimator_knobs(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """Knobs the run's estimator leaves unread, refused: the advantage context's knobs it does not declare in `reads`,
    the critic's without a critic, a reference path without a reference, the KL's while no KL is computed."""
    a, job = cfg.algorithm, cfg.job.value
    if job != "rl":  # no estimator, critic, reference or KL: config/job_ignores.py refuses or sets their keys aside
        return
    loss_and_kl_rules(cfg, problems)
    if a.estimator not in ADVANTAGE_ESTIMATORS:
        return  # reported by estimator_needs
    reads = ADVANTAGE_ESTIMATORS[a.estimator].reads
    for name in sorted(KNOBS - reads):
        readers = sorted(n for n, spec in ADVANTAGE_ESTIMATORS.items() if name in spec.reads)
        problems.check(not changed(cfg, f"algorithm.{name}"), f"algorithm.{name}", f"estimator {a.estimator} does "
                       "not read it, so it changes nothing.", f"unset algorithm.{name}, or use an estimator that "
                       f"reads it ({', '.join(readers)})")
    problems.table(((not changed(cfg, key), key, f"it tunes the critic, but estimator {a.estimator} trains none, so "
                     "it changes nothing.", f"unset {key}, or algorithm=ppo_gae (a critic-trained estimator)")
                    for key in CRITIC_KNOBS if "values" not in needs))
    problems.check(cfg.model.ref_path is None or "reference" in trainer_roles(cfg, needs), "model.ref_path",
                   f"no reference model is built (algorithm.kl.coef={a.kl.coef}, estimator "
                   f"{a.estimator} needs no teacher), so it changes nothing.",
                   "unset model.ref_path, or set algorithm.kl.use_loss=true (a KL loss to that reference)")
    kl_fix = "set algorithm.kl.coef > 0" + ("" if "kl" in needs else " with algorithm.kl.use_loss=true")
    problems.table(((a.kl.coef > 0 or not changed(cfg, key), key, "it shapes the KL penalty, but "
                     "algorithm.kl.coef=0 computes none, so it changes nothing.", f"{kl_fix}, or unset {key}")
                    for key in KL_KNOBS))
    problems.check(a.kl.coef == 0 or a.kl.target is not None or not changed(cfg, "algorithm.kl.horizon"),
                   "algorithm.kl.horizon", "it paces the adaptive KL controller, but algorithm.kl.target=null keeps "
                   "the coefficient fixed, so it changes nothing.",
                   "set algorithm.kl.target, or unset algorithm.kl.horizon")


def loss_and_kl_rules(cfg: RunConfig, problems: Problems) -> None:
    """An RL run's policy-loss, IS-correction and KL-controller knobs that change nothing or break the math."""
    a = cfg.algorithm
    problems.check(a.policy_loss != "cispo" or not changed(cfg, "algorithm.clip_eps_low"), "algorithm.clip_eps_low",
                   "cispo caps its importance weight at clip_eps_high only and has no lower bound, so it changes "
                   "nothing.", "unset algorithm.clip_eps_low, or use algorithm.policy_loss=ppo or gspo")
    c = a.is_correction
    # (mode / low / high while level=off: config/validate.py algorithm_rules)
    problems.check(c.mode.value != "trunc" or not changed(cfg, "algorithm.is_correction.low"),
                   "algorithm.is_correction.low", "mode=trunc only caps the weight at high (TIS), so it changes "
                   "nothing.", "unset algorithm.is_correction.low, or set mode=mask or clip")
    # a token the trainer and the engine agree on has ratio 1: a band without it drops or rescales every such token
    # (trunc reads no floor)
    bad = "low" if c.mode.value != "trunc" and c.low > 1.0 else "high" if c.high < 1.0 else None
    problems.check(c.level.value == "off" or bad is None, f"algorithm.is_correction.{bad}",
                   f"the band [{c.low}, {c.high}] excludes 1, the ratio of a token the trainer and the engine agree "
                   f"on, so mode={c.mode.value} would {'drop' if c.mode.value == 'mask' else 'rescale'} every "
                   "on-policy token.", f"set algorithm.is_correction.{bad} so that low <= 1 <= high (e.g. 0.5, 5.0)")
    # vLLM's processed log-probs are renormalised over the top k tokens (as over top_p's nucleus: config/validate.py),
    # so every ratio pi_train / pi_rollout would be the kept mass (< 1), not the drift: mask drops, clip/trunc rescale
    problems.check(c.level.value == "off" or cfg.rollout.top_k == -1, "rollout.top_k", "IS correction compares "
                   f"full-distribution log-probs, but top_k={cfg.rollout.top_k} renormalises vLLM's over the "
                   f"{cfg.rollout.top_k} likeliest tokens: each ratio pi_train / pi_rollout would be the kept mass, "
                   "not the train/rollout drift.", "set rollout.top_k=-1 or algorithm.is_correction.level=off")
    problems.check(a.estimator != "on_policy_distill" or a.kl.coef > 0, "algorithm.kl.coef", "on_policy_distill's "
                   "advantages are -coef x (log pi_student - log pi_teacher), so coef=0 makes every advantage 0 and "
                   "the run learns nothing from the teacher.", "set algorithm.kl.coef > 0 (its default is 1.0)")
    # d k1 / d logp = 1 whatever logp_ref: as a loss it adds coef * mean grad log pi (zero in expectation) and never
    # pulls towards the reference (Molt only printed a recommendation)
    problems.check(not (a.kl.use_loss and a.kl.coef > 0 and a.kl.estimator.value == "k1"), "algorithm.kl.estimator",
                   "k1 as a loss has the gradient grad log pi whatever the reference's log-probs (zero in "
                   "expectation), so algorithm.kl.use_loss=true would not pull the policy towards the reference.",
                   "set algorithm.kl.estimator=k3 (or k2) with algorithm.kl.use_loss=true, or use_loss=false")
    # the adaptive update multiplies the coefficient by 1 + e * n / horizon with e down to -0.2: at n / horizon >= 5 a
    # KL below target (the first step's, ~0) makes it <= 0, turning the penalty into a bonus for leaving the reference
    samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    problems.check(a.kl.coef == 0 or not a.kl.target or a.kl.horizon > 0.2 * samples, "algorithm.kl.horizon",
                   f"the adaptive KL update scales the coefficient by 1 + e * {samples} / {a.kl.horizon} per step "
                   f"(e in [-0.2, 0.2]; {samples} = rollout.batch_size x rollout.n_samples_per_prompt), which is <= 0 "
                   "when the KL is below target: the coefficient would turn negative.",
                   f"set algorithm.kl.horizon > {int(0.2 * samples)} (e.g. the default 10000)")
