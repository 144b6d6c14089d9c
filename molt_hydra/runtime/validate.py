"""Validate a run's config: derive the values left to defaults, run every rule of every layer, fail once with all.

The driver sits here, above the layers whose knowledge the rules need: config/validate.py holds the rules on the
config alone (one function a group), models/, data/, agents/, algorithm/ and logging/ each hold theirs in a `rules.py`
beside what they check. Each rule names the full key, the reason and the fix; nothing starts when one fails.
"""

from __future__ import annotations

from molt_hydra.agents.rules import check_agent
from molt_hydra.algorithm.rules import check_estimator_knobs, estimator_needs
from molt_hydra.config import handoff_rules
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import RULES, Problems, check_ranges, derive
from molt_hydra.data.rules import check_data
from molt_hydra.logging.rules import check_logger
from molt_hydra.models.rules import check_lora, check_model


def validate(cfg: RunConfig) -> RunConfig:
    check_ranges(cfg)
    problems = Problems()
    needs = estimator_needs(cfg, problems)
    derive(cfg, needs)
    for rule in (*RULES, check_estimator_knobs, check_lora):
        rule(cfg, problems, needs)
    for rule in (check_model, check_data, check_agent, check_logger, handoff_rules.engine_name_rules,
                 handoff_rules.wandb_name_rules, handoff_rules.name_rules):  # name_rules last: it skips keys reported
        rule(cfg, problems)
    problems.raise_if_any()
    return cfg
