"""Math answers graded with math-verify (the reward of the math, python-tool and geo3k reference agents).

Timeouts are off inside math-verify (its signal-based timer only works on the main thread, and runners run agents
on event loops in other threads); agents call `grade_math` through `asyncio.to_thread` so the agent's
`timeout_s` bounds it instead. math-verify is imported at the first grade (deferred: it loads sympy).
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[starts[-1] : i - 1] if depth == 0 else None


def grade_math(response: str, label, require_boxed: bool = True) -> float:
    """1.0 when the response's last boxed answer equals `label` mathematically, else 0.0. Without a box: 0.0, or,
    with `require_boxed=False`, math-verify's own extraction of the response's last answer is graded. A list label
    is the answer tuple ("2, 3"; math-verify compares it as a set). A missing label is an error, not a grade: the
    string fallback below would reward an empty \\boxed{} against "" and \\boxed{None} against None."""
    from math_verify import parse, verify

    if isinstance(label, (list, tuple)):  # str() would give "['2', '3']", which matches no answer
        label = ", ".join(map(str, label))
    if label is None or not str(label).strip():
        raise ValueError(f"grade_math: the row has no label to grade against ({label!r}). Fix: point data.label_key "
                         "at the column of each row's answer, and give every row one")
    answer = last_boxed(response)
    if answer is None and require_boxed:
        return 0.0
    gold = parse(f"${label}$", parsing_timeout=None)
    pred = parse(response if answer is None else f"${answer}$", parsing_timeout=None)
    if answer is not None and not (gold and pred):
        return float(str(label).strip() == answer.strip())
    return float(bool(gold and pred) and verify(gold, pred, timeout_seconds=None))
