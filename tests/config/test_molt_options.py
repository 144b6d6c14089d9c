"""The option mapping is complete: every Molt option in docs/molt_options.md maps to a schema field or says why it was
dropped, every option of Molt's inventory (§1 tables, §1.6 dead flags) has a row, and every schema field has a doc."""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import inspect
import re
import typing
from pathlib import Path

import pytest

from molt_hydra.config.schema import RunConfig

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "molt_options.md"
INVENTORY = Path(__file__).resolve().parents[3] / "shared" / "reference" / "molt_inventory.md"
HEADER = ["Molt option", "molt_hydra", "status", "note"]
STATUSES = ("works", "refused", "absent")
BACKTICKED = re.compile(r"`([^`]+)`")


# ------------------------------------------------------------------------------------------------------ schema walk
def field_docs(cls: type) -> dict[str, str]:
    """`{field: one-line doc}` of a schema dataclass, read from the string literal that follows each field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        node.target.id: nxt.value.value
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }


def schema_classes(root: type = RunConfig) -> dict[str, type]:
    """`{dotted prefix: dataclass}` of every dataclass reachable from RunConfig ('' is the root)."""
    out, todo = {}, [("", root)]
    while todo:
        prefix, cls = todo.pop()
        out[prefix] = cls
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                todo.append((f"{prefix}{f.name}.", hints[f.name]))
    return out


def schema_keys() -> set[str]:
    """Every full key of the schema, nested dataclass fields included (`algorithm.is_correction.level`)."""
    return {prefix + f.name for prefix, cls in schema_classes().items() for f in dataclasses.fields(cls)}


# -------------------------------------------------------------------------------------------------------- the doc
@dataclasses.dataclass
class Row:
    line: int
    option: str
    keys: list[str] | None  # None = dropped
    status: str
    note: str


def doc_rows() -> list[Row]:
    rows, in_table = [], False
    for n, line in enumerate(DOC.read_text().splitlines(), 1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not in_table:  # the header row of a table
            assert cells == HEADER, f"docs/molt_options.md:{n}: table header must be {HEADER}, got {cells}"
            in_table = True
            continue
        if set(line) <= set("|-: "):
            continue
        assert len(cells) >= 4, f"docs/molt_options.md:{n}: need 4 columns: {line}"
        option, target, status, note = cells[0], cells[1], cells[2], " | ".join(cells[3:])
        assert status in STATUSES, f"docs/molt_options.md:{n}: status must be one of {STATUSES}, got {status!r}"
        m = re.fullmatch(r"`([^`]+)`", option)
        assert m, f"docs/molt_options.md:{n}: the Molt option must be one backticked name, got {option!r}"
        if target == "dropped":
            keys = None
        else:
            keys = BACKTICKED.findall(target)
            assert keys and re.fullmatch(r"`[^`]+`(, `[^`]+`)*", target), (
                f"docs/molt_options.md:{n}: molt_hydra column must be `dropped` or backticked schema keys, "
                f"got {target!r}")
        rows.append(Row(n, m.group(1), keys, status, note))
    return rows


def test_doc_has_rows():
    rows = doc_rows()
    assert len(rows) > 100, f"only {len(rows)} rows parsed from {DOC}; the table format changed?"


def test_every_row_maps_to_a_schema_field_or_a_reason():
    keys = schema_keys()
    bad = []
    for row in doc_rows():
        if row.keys is None:
            if len(row.note.strip()) < 10:
                bad.append(f"line {row.line}: `{row.option}` is dropped without a reason")
        else:
            bad += [f"line {row.line}: `{row.option}` -> `{k}` is not a schema key" for k in row.keys if k not in keys]
            if not row.note.strip():
                bad.append(f"line {row.line}: `{row.option}` has an empty note")
    assert not bad, "\n".join(bad)


def test_status_matches_the_code():
    """absent = no field; a row whose field config/validate.py refuses (NOT_IMPLEMENTED) is `refused`, and a refused row
    says why in its note."""
    from molt_hydra.config.validate import NOT_IMPLEMENTED

    bad = []
    for row in doc_rows():
        if (row.keys is None) != (row.status == "absent"):
            bad.append(f"line {row.line}: `{row.option}` is {row.status} but maps to {row.keys or 'dropped'}")
        if row.keys and any(k in NOT_IMPLEMENTED for k in row.keys) and row.status != "refused":
            bad.append(f"line {row.line}: `{row.option}` maps to a refused field but is marked {row.status}")
        if row.status == "refused" and "Refused" not in row.note:
            bad.append(f"line {row.line}: `{row.option}` is refused without saying why (**Refused** ...)")
    assert not bad, "\n".join(bad)


def test_schema_walk_sees_nested_groups():
    """Guard the walk itself: nested dataclasses two levels down are reached."""
    keys = schema_keys()
    for k in ("algorithm.is_correction.level", "train.critic.optimizer.lr", "rollout.weight_sync.transport",
              "logger.wandb.project", "seed"):
        assert k in keys


# ----------------------------------------------------------------------------------------------- the inventory
def _section(text: str, start: str, end: str) -> str:
    i = text.index(start)
    j = text.index(end, i + len(start))
    return text[i:j]


def _expand(token: str) -> list[str]:
    """`--actor.{optim, muon.*}` -> ['--actor.optim', '--actor.muon.*'];
    `--actor.loss_agg_mode seq-...` -> first word."""
    m = re.fullmatch(r"(.*)\{(.*)\}(.*)", token)
    if m:
        return [f"{m.group(1)}{part.strip()}{m.group(3)}" for part in m.group(2).split(",")]
    return [token.split()[0]]


def inventory_option_names(text: str) -> list[str]:
    """Option names of inventory §1: first-column names of the §1.1/1.2/1.4/1.5 tables and the §1.6 dead flags."""
    names = []
    for sub, nxt in (("### 1.1", "### 1.2"), ("### 1.2", "### 1.3"), ("### 1.4", "### 1.5"), ("### 1.5", "### 1.6")):
        for line in _section(text, sub, nxt).splitlines():
            if not line.startswith("|") or set(line) <= set("|-: "):
                continue
            first = line.strip().strip("|").split("|")[0]
            if first.strip().startswith(("Flag", "Env var")):
                continue  # a header row (`Flag (`--{prefix}…`)` names no option)
            previous = None
            for token in BACKTICKED.findall(first):
                if token.startswith("_") and previous:  # `MOLT_FSDP_DEBUG_GRADS` / `_FILTER` / `_TOPK`
                    token = previous + token
                else:
                    previous = token
                names += _expand(token)
    for token in BACKTICKED.findall(_section(text, "### 1.6", "\n## 2")):
        if token.startswith("--"):
            names += [_expand(token)[0].replace("<prefix>", "*")]
    return names


def _covered(name: str, doc_names: list[str]) -> bool:
    """An inventory name is covered by a doc row named the same, or (optimizer block names like `muon.lr`, listed
    without their `--actor.` / `--critic.` / SFT prefix) by a doc row ending in it; `*` matches anything."""
    want = name.removeprefix("--")
    return any(fnmatch.fnmatchcase(d, want) or fnmatch.fnmatchcase(d, "*." + want) for d in doc_names)


def test_every_inventory_option_has_a_row():
    if not INVENTORY.exists():
        pytest.skip(f"Molt inventory not found at {INVENTORY} (it lives in ../shared beside the repo); "
                    "the completeness check against it cannot run here")
    names = inventory_option_names(INVENTORY.read_text())
    assert len(names) > 150, f"parsed only {len(names)} option names from the inventory; its format changed?"
    doc_names = [r.option.removeprefix("--") for r in doc_rows()]
    missing = sorted({n for n in names if not _covered(n, doc_names)})
    assert not missing, f"Molt options without a row in docs/molt_options.md: {missing}"


def test_inventory_parser_expands_compound_cells():
    text = ("### 1.1\n| Flag | Default |\n|---|---|\n| `--a.{x, y.*}` | 1 |\n### 1.2\n### 1.3\n### 1.4\n### 1.5\n"
            "| Env var | Default |\n|---|---|\n| `K_A` / `_B` | 1 |\n| Example: `E1` (5), `E2` | | |\n"
            "### 1.6\n* `--<prefix>m.n` (x), `--z.w seq` no\n\n## 2.")
    assert inventory_option_names(text) == ["--a.x", "--a.y.*", "K_A", "K_A_B", "E1", "E2", "--*m.n", "--z.w"]
    assert _covered("--a.y.*", ["a.y.lr"]) and _covered("muon.lr", ["actor.muon.lr"]) and not _covered("b", ["ab"])


# ------------------------------------------------------------------------------------------------- field docs
@pytest.mark.parametrize("prefix", sorted(schema_classes()), ids=lambda p: p.rstrip(".") or "RunConfig")
def test_every_schema_field_has_a_one_line_doc(prefix):
    cls = schema_classes()[prefix]
    docs = field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [f"{prefix}{n}" for n in names if not docs.get(n, "").strip()]
    assert not missing, f"fields without a doc string: {missing}"
    multi = [f"{prefix}{n}" for n in names if "\n" in docs[n]]
    assert not multi, f"doc strings must be one line: {multi}"
