"""Declared ranges of numeric fields: stated where the field is declared (`ranged(...)` in config/schema.py), checked
here by one walk over the schema, which reports every out-of-range value at once (full key, reason, fix).

The walk reads values by attribute, so it checks the composed DictConfig (before the dataclasses' own
`__post_init__` rules run) and the typed RunConfig alike. A list field's range applies to each element.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

BOUNDS = "bounds"  # the dataclass field-metadata key
INT64 = 2**63  # an integer's magnitude must stay below it: torch, Ray and vLLM take integers as C int64
# a float's magnitude must stay within it: the trainer's and vLLM's tensors are float32 at most (bf16's range is the
# same), where a larger value is inf and an inf coefficient or temperature makes the loss or the sampling NaN
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_WHY = " and within float32 (|x| <= 3.4e38): past it a value is inf in the trainer's and vLLM's float32 math"
# ... and the other end: a non-zero value below float32's (and bf16's) smallest normal is 0 there or loses its digits;
# an AdamW eps of 1e-300 became 0 (0 / 0: NaN weights), a max_grad_norm of 1e-300 zeroed every gradient
FLOAT32_TINY = 1.1754943508222875e-38
TINY_WHY = (" and, unless 0, at least 1.2e-38 in magnitude: below float32's smallest normal the trainer's and vLLM's "
            "float32 math rounds a value to 0 or loses its digits")


@dataclass(frozen=True)
class Bounds:
    """Closed (ge/le) or open (gt/lt) limits; `also` lists sentinel values allowed outside them (e.g. -1 = auto);
    `why` says why a limit is where it is, where that is not the field's definition (a plausibility ceiling).
    A value must be finite (inf / nan never hold), an integer a 64-bit one, a float one float32 holds (neither past
    its largest nor, unless 0, below its smallest normal)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple = ()
    why: str = ""

    def describe(self) -> str:
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        one_side = [f"{op} {limit}" for op, limit in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                    if limit is not None]
        text = f"in {low}, {high}" if low and high else one_side[0] if one_side else "a finite number"
        return " or ".join([*map(str, self.also), text])

    def holds(self, v: float) -> bool:
        return v in self.also or math.isfinite(v) and not _too_wide(v) and self.within(v)

    def within(self, v: float) -> bool:
        """Inside the stated limits (the sentinels and the number format aside)."""
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))


def _too_wide(v: float) -> bool:
    return abs(v) >= INT64 if isinstance(v, int) else abs(v) > FLOAT32_MAX or _too_small(v)


def _too_small(v: float) -> bool:
    return isinstance(v, float) and 0 < abs(v) < FLOAT32_TINY


def ranged(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None, also: tuple = (),
           why: str = "") -> Any:
    """A dataclass field whose value (or each element, for a list) must lie in the stated range; None always passes
    (an Optional field left unset). `ranged(1, ge=1)`; `ranged(-1, ge=1, also=(-1,))`; `ranged(factory=..., lt=1)`."""
    return field(default=default, default_factory=factory, metadata={BOUNDS: Bounds(ge, gt, le, lt, tuple(also), why)})


def declared_bounds(root: type) -> dict[str, tuple[Bounds | None, Any]]:
    """`{full key: (Bounds or None, default)}` of every leaf field of the schema; None = no range declared."""
    out: dict[str, tuple[Bounds | None, Any]] = {}
    todo = [("", root)]
    while todo:
        prefix, cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                todo.append((f"{prefix}{f.name}.", hints[f.name]))
            else:
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                out[prefix + f.name] = (f.metadata.get(BOUNDS), default)
    return out


def get(node: Any, key: str) -> Any:
    """The value at a dotted key (`train.optimizer.lr`) of a config node, read by attribute."""
    for part in key.split("."):
        node = getattr(node, part)
    return node


def out_of_range(cfg: Any, root: type) -> list[str]:
    """Error lines (`- key: reason Fix: fix`) for every value outside its declared range. Values that cannot be read
    here (a missing value, a broken interpolation, a wrong type) are left to the typed conversion, which names them."""
    lines = []
    for key, (bounds, default) in declared_bounds(root).items():
        if bounds is None:
            continue
        try:
            value = get(cfg, key)
        except Exception:  # noqa: BLE001 -- reported by the typed conversion with its own message
            continue
        is_list = isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig"
        values = list(value) if is_list else [value]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and not bounds.holds(v) for v in values):
            wide = any(isinstance(v, int) and _too_wide(v) for v in values)
            huge = bounds.le is None and bounds.lt is None and any(  # (an upper limit below it says enough)
                isinstance(v, float) and math.isfinite(v) and abs(v) > FLOAT32_MAX for v in values)
            tiny = any(_too_small(v) and bounds.within(v) for v in values)  # (a limit it fails says enough)
            # ("must be >= 1e-05, got inf" read as if inf held: the limit it fails is named)
            nonfinite = any(isinstance(v, float) and not math.isfinite(v) for v in values) and (
                bounds.describe() != "a finite number")
            lines.append(f"- {key}: {'each value ' if is_list else ''}must be {bounds.describe()}"
                         f"{' and a 64-bit integer (below 2**63)' if wide else ''}"
                         f"{' and finite' if nonfinite else ''}"
                         f"{FLOAT32_WHY if huge else ''}"
                         f"{TINY_WHY if tiny else ''}"
                         f"{f' ({bounds.why})' if bounds.why else ''}, "
                         f"got {values if is_list else value}. Fix: set {key} within that range "
                         f"(default {'null' if default is None else default})")
    return lines


def expected(root: type, key: str) -> str:
    """What the schema takes at a dotted key, for a message's fix: `an integer >= 1 (default 32)`, `one of [cpu, cuda]
    (default cpu)`, `a string (required: no default)`; a list element's key (`betas[0]`) names its list."""
    key, cls, hint, meta = re.sub(r"\[\d+\]$", "", key), root, None, None
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return "a value of the type molt_hydra/config/schema.py declares for it"
        hint, meta = typing.get_type_hints(cls)[part], fields[part]
        cls = hint
    bounds, default = meta.metadata.get(BOUNDS), declared_bounds(root).get(key, (None, None))[1]
    if dataclasses.is_dataclass(hint):
        return f"its keys ({key}.KEY=VALUE), not a value"
    shown = ("required: no default" if default is dataclasses.MISSING or default == "???" else
             f"default {_yaml(default)}")
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) is typing.Union
    within = bounds is not None and (bounds.ge, bounds.gt, bounds.le, bounds.lt) != (None,) * 4
    return (f"{_kind(args[0] if optional else hint)}{f' {bounds.describe()}' if within else ''}"
            f"{', or null' if optional else ''} ({shown})")


def _kind(hint: Any) -> str:
    if typing.get_origin(hint) is list:
        return f"a list of {_kind(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return f"one of [{', '.join(m.value for m in hint)}]"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, "a mapping")


def _yaml(value: Any) -> str:
    """A default as it is written on the command line: null, true, 'text', an enum's bare name."""
    if isinstance(value, Enum):
        return value.value
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(
        value, str) else str(value)
