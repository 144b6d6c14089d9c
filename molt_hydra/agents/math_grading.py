"""Math answers graded with math-verify (the reward of the math, python-tool and geo3k reference agents).

math-verify runs in worker processes, each grade under a deadline (GRADE_TIMEOUT_S): sympy evaluates what it parses,
and an answer such as 9^{9^{9^{9}}} is one big-integer power that never ends and holds the GIL throughout, so no
thread timer, signal or asyncio timeout can stop it (in-process, it froze the whole agent runner). A worker past the
deadline is killed and the answer graded 0.0 (what math-verify itself returns for a timed-out comparison). Workers
start on first use, at most MAX_WORKERS at once, and are reused; an idle one exits with its parent (its stdin closes).
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading

log = logging.getLogger(__name__)
# `\boxed{5}`, `\boxed {5}` (LaTeX takes a space before the brace) and `\boxed 5` (the argument up to `$` or line end)
_BOXED = re.compile(r"\\(?:boxed|fbox)(?:\s*(?=\{)|[ \t]+(?=[^\s${}]))")
GRADE_TIMEOUT_S = 10.0  # math-verify's own defaults: 5 s to parse, 5 s to verify
START_TIMEOUT_S = 120.0  # a worker's import of math-verify / sympy (seconds on a loaded machine)
MAX_WORKERS = min(8, os.cpu_count() or 1)
# The worker: one JSON [gold, prediction] a line in, one JSON [gold parsed, prediction parsed, equal] a line out.
# Timeouts off inside: its signal timer cannot interrupt a C-level computation either; the parent's deadline does.
_WORKER = """
import json, logging, resource, sys
logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "Timeout is disabled" warning: the parent times it
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a huge power: MemoryError, not the machine's memory
from math_verify import parse, verify
print("ready", flush=True)
for line in sys.stdin:
    try:
        gold, pred = (parse(text, parsing_timeout=None) for text in json.loads(line))
        out = [bool(gold), bool(pred), bool(gold and pred) and bool(verify(gold, pred, timeout_seconds=None))]
    except Exception:  # MemoryError included
        out = [True, True, False]
    print(json.dumps(out), flush=True)
"""


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (balanced braces), or None. Also `\\boxed {5}` and, as
    math-verify and the MATH benchmark's grader read it, `$\\boxed 5$` (was: both graded 0.0, as if unboxed), where
    the text has no braced box (a prose mention after one, "as \\boxed above", is no answer)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    braced = [s for s in starts if text.startswith("{", s)]
    if not braced:
        return re.split(r"[$\n]", text[starts[-1]:], maxsplit=1)[0].strip() if starts else None
    depth, i = 1, braced[-1] + 1
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[braced[-1] + 1 : i - 1] if depth == 0 else None


def grade_math(response: str, label, require_boxed: bool = True, timeout_s: float = GRADE_TIMEOUT_S) -> float:
    """1.0 when the response's last boxed answer equals `label` mathematically, else 0.0. Without a box: 0.0, or,
    with `require_boxed=False`, math-verify's own extraction of the response's last answer is graded. A dict label
    is unwrapped (`answer_of`); a list label is the answer tuple ("2, 3"; math-verify compares it as a set). A
    missing label is an error, not a grade: the string fallback below would reward an empty \\boxed{} against ""
    and \\boxed{None} against None. A comparison past `timeout_s` is 0.0. A response of None (an OpenAI message's
    content when the reply was tool calls alone) has no answer: 0.0 (was: a TypeError out of the regex, which dropped
    each such rollout as agent_exception instead of scoring it)."""
    if response is None:
        response = ""
    elif not isinstance(response, str):
        raise TypeError(f"grade_math: the response is {type(response).__name__} {response!r:.60}, not text; pass the "
                        "reply's text (e.g. message.content)")
    given, label = label, answer_of(label)
    if isinstance(label, (list, tuple)):  # str() would give "['2', '3']", which matches no answer
        label = ", ".join(map(str, label))
    if label is None or not str(label).strip():
        raise ValueError(f"grade_math: the row has no label to grade against ({given!r:.80}). Fix: point "
                         "data.label_key at the column of each row's answer, and give every row one")
    answer = last_boxed(response)
    if answer is None and require_boxed:
        return 0.0
    verdict = _WORKERS.run(f"${label}$", response if answer is None else f"${answer}$", timeout_s)
    if verdict is None:
        return 0.0
    gold_parsed, pred_parsed, equal = verdict
    if answer is not None and not (gold_parsed and pred_parsed):
        return float(str(label).strip() == answer.strip())
    return float(equal)


def answer_of(label):
    """The answer a label holds (Molt's math grader unwraps the same): the label itself, or a dict's `ground_truth`,
    `answer`, `target` or `label`, else that of its nested `reward_model`, `extra_info` or `solution` (whose
    `extracted` comes first); e.g. data.label_key=reward_model of the prep scripts' {"ground_truth": "3", "style": ..}.
    (Was: a dict label was graded as its text, so no answer ever matched.)"""
    if not isinstance(label, dict):
        return label
    for key in ("ground_truth", "answer", "target", "label"):
        if label.get(key) is not None:
            return answer_of(label[key])
    for key in ("reward_model", "extra_info", "solution"):
        if isinstance(inner := label.get(key), dict):
            found = inner.get("extracted") if key == "solution" else None
            if (found := answer_of(inner) if found is None else found) is not None:
                return found
    return None  # grade_math: "no label to grade against"


class _Workers:
    """Idle math-verify worker processes, shared by the threads that grade (agents grade via asyncio.to_thread)."""

    def __init__(self):
        self.idle: list[subprocess.Popen] = []
        self.lock, self.slots = threading.Lock(), threading.BoundedSemaphore(MAX_WORKERS)

    def run(self, gold: str, pred: str, timeout_s: float) -> list | None:
        """The worker's verdict, or None past `timeout_s` (that worker is killed). A worker that dies grading (a crash,
        the OOM killer) is replaced and the answer graded again, once; one that dies on it twice is the answer's doing
        (a C-level abort on it): None, with a warning naming it. Was: None at the first death, without a word, so a
        right answer was graded 0.0 whenever the OOM killer took its worker."""
        with self.slots:
            for attempt in (1, 2):
                with self.lock:
                    proc = self.idle.pop() if self.idle else None
                if proc is None or proc.poll() is not None:  # none idle, or that one died while idle (OOM killer...)
                    proc = self._start()
                try:
                    proc.stdin.write(json.dumps([gold, pred]) + "\n")
                    proc.stdin.flush()
                    line = self._line(proc, timeout_s)
                except OSError:  # it died between the check and the write (a broken pipe): as a death grading
                    proc.kill()
                    proc.wait()
                    line = ""
                if line is None:
                    return None
                if line:
                    with self.lock:
                        self.idle.append(proc)
                    return json.loads(line)
                log.warning("grade_math: the math-verify worker died (exit code %s) grading %.80r against %.40r%s",
                            proc.returncode, pred, gold, "; grading it again" if attempt == 1 else
                            " a second time: graded 0.0, as a comparison past its deadline is")
        return None

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        if self._line(proc, START_TIMEOUT_S) != "ready":
            raise RuntimeError(f"grade_math: the math-verify worker did not start within {START_TIMEOUT_S:.0f} s "
                               f"(exit code {proc.returncode}; its error is above). Fix: pip install math-verify")
        return proc

    @staticmethod
    def _line(proc: subprocess.Popen, timeout_s: float) -> str | None:
        """The worker's next output line; "" when it ended (it died); None (the worker killed) when none comes within
        `timeout_s`."""
        if select.select([proc.stdout], [], [], timeout_s)[0]:
            if line := proc.stdout.readline():
                return line.strip()
            proc.wait()
            return ""
        proc.kill()
        proc.wait()
        return None


_WORKERS = _Workers()
