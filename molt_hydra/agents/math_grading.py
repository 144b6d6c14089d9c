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
    with `require_boxed=False`, math-verify's own extraction of the response's last answer is graded."""
    from math_verify import parse, verify

    answer = last_boxed(response)
    if answer is None and require_boxed:
        return 0.0
    gold = parse(f"${label}$", parsing_timeout=None)
    pred = parse(response if answer is None else f"${answer}$", parsing_timeout=None)
    if answer is not None and not (gold and pred):
        return float(str(label).strip() == answer.strip())
    return float(bool(gold and pred) and verify(gold, pred, timeout_seconds=None))
