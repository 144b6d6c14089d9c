"""A torn line in <output_dir>/role_warnings.jsonl (runtime/role_warnings.py): a role's process killed mid-write, or a
write a full disk cut short, leaves part of a line with no newline; the next warning is appended after it, and the two
read as one line that is no JSON. Before, `Shown` raised json.JSONDecodeError there: its thread died printing a
traceback, and `stop()` raised it again in the run's teardown, before the run's last words (its failure message, the
checkpoint to resume from), which were never printed."""

import json
import os

from molt_hydra.runtime.role_warnings import ENV, Shown


def _warning(pid: int, text: str) -> str:
    return json.dumps({"pid": pid, "ppid": 1, "kind": f"molt_hydra.x:{text}", "text": text}) + "\n"


def test_a_torn_line_is_skipped_with_the_warning_glued_to_it_and_the_later_ones_are_shown(tmp_path, capsys):
    shown = Shown(tmp_path)
    shown.role_pids = {"actor rank 0": 11, "rollout engine 0": 12}
    torn = _warning(11, "cut short")[:20]
    (tmp_path / "role_warnings.jsonl").write_text(torn + _warning(12, "after the torn one") + _warning(11, "next"))
    shown.stop()
    assert capsys.readouterr().err.strip().splitlines() == ["actor rank 0: warning: next"]
    assert ENV not in os.environ
