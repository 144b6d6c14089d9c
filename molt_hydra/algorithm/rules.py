"""Validation rules for the algorithm's open choices: the plugin modules import (their decorators register
estimators and losses), and the estimator and loss are registered names. Run first by runtime/validate.py: what the
estimator needs (groups, a reference, a critic, per-token KL) drives derive() and the other groups' rules."""

from __future__ import annotations

from molt_hydra.algorithm.advantage import ADVANTAGE_ESTIMATORS
from molt_hydra.algorithm.loss import POLICY_LOSSES
from molt_hydra.algorithm.plugins import load_plugins
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import Problems


def estimator_needs(cfg: RunConfig, problems: Problems) -> frozenset[str]:
    """Import algorithm.plugins, check both names against the registries; the estimator's needs (empty if unknown)."""
    a = cfg.algorithm
    for module in a.plugins:
        try:
            load_plugins([module])
        except ImportError as e:
            problems.check(False, "algorithm.plugins", f"cannot import {module!r} ({e.__cause__ or e}).",
                           "put the module on PYTHONPATH or fix its name")
    problems.check(a.estimator in ADVANTAGE_ESTIMATORS, "algorithm.estimator",
                   f"{a.estimator!r} is not a registered estimator.",
                   f"use one of {sorted(ADVANTAGE_ESTIMATORS)}, or register yours and list its module in "
                   "algorithm.plugins")
    problems.check(a.policy_loss in POLICY_LOSSES, "algorithm.policy_loss", f"{a.policy_loss!r} is not a registered "
                   "loss.", f"use one of {sorted(POLICY_LOSSES)}, or register yours and list its module in "
                   "algorithm.plugins")
    return ADVANTAGE_ESTIMATORS[a.estimator].needs if a.estimator in ADVANTAGE_ESTIMATORS else frozenset()
