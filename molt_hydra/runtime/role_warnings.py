"""Warnings the roles log reach the terminal. Ray keeps actor output in its session files (log_to_driver=False: vLLM is
chatty), so a warning of molt_hydra's own loggers in a trainer rank, an engine (its engine core too) or an agent
runner was never seen: model.compile_blocks building no graph, prompts cut to fit the context, the MoE experts' slow
fallback. The driver names a file in ENV before Ray starts; every process of the run inherits it and molt_hydra's
import calls `attach` there (molt_hydra/__init__.py); the driver's `Shown` prints the first warning of each kind,
naming its role, while the run goes on. Every one stays in <output_dir>/role_warnings.jsonl."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path

ENV = "MOLT_HYDRA_ROLE_WARNINGS"  # an internal channel from the driver to the processes it starts, not a switch


class _ToFile(logging.Handler):
    def __init__(self, path: str):
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        line = json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "kind": f"{record.name}:{record.msg}",
                           "text": record.getMessage()})
        try:
            with open(self.path, "a") as f:  # one short append per warning: whole lines from every process
                f.write(line + "\n")
        except OSError:  # (a node that does not see output_dir: the warning is still in Ray's session log)
            pass


def attach() -> None:
    """In a process the run started: molt_hydra's warnings also go to the run's file. And to the process's stderr (in
    Ray's session files, linked in output_dir for agent runners: runtime/agent_runner.py `link_output`), as Python's
    last-resort handler wrote them before this one shadowed it: was, each failed rollout's traceback (and every
    warning past its first in the terminal) was written nowhere."""
    path, logger = os.environ.get(ENV), logging.getLogger("molt_hydra")
    if path and not any(isinstance(h, _ToFile) for h in logger.handlers):
        logger.addHandler(_ToFile(path))
        to_stderr = logging.StreamHandler()  # sys.stderr
        to_stderr.setLevel(logging.WARNING)
        to_stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        to_stderr.addFilter(lambda record: not logging.getLogger().handlers)  # root's own handler writes it already
        logger.addHandler(to_stderr)


class Shown:
    """The driver's side: sets ENV for the processes it starts; a thread prints each new kind of warning once as
    "<role>: warning: <text>", from when `role_pids` (role name -> pid, the run's; an engine core is its engine's
    child) is set: the warnings of the roles' start wait for their names."""

    def __init__(self, output_dir: str | Path):
        self.path, self.role_pids, self.seen = Path(output_dir) / "role_warnings.jsonl", None, {}
        self.read = self.path.stat().st_size if self.path.is_file() else 0  # a resumed run's file: from its end
        os.environ[ENV] = str(self.path)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="molt-role-warnings", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self.stopping.wait(1.0):
            if self.role_pids is not None:
                self._show_new()

    def _show_new(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.read)
                lines = f.readlines()
        except OSError:  # none written yet
            return
        for line in lines:
            if not line.endswith(b"\n"):  # a line still being written: read it whole next time
                break
            self.read += len(line)
            try:
                w = json.loads(line)
            except ValueError:  # a line torn by a process killed mid-write, or by a full disk, then another after it:
                continue  # skipped (before: this thread died in a traceback, and the run's end too, its message lost)
            self.seen[w["kind"]] = self.seen.get(w["kind"], 0) + 1
            if self.seen[w["kind"]] == 1:
                by_pid = {pid: role for role, pid in (self.role_pids or {}).items()}
                role = by_pid.get(w["pid"]) or (f"{by_pid[w['ppid']]} (engine core)" if w["ppid"] in by_pid
                                                else f"process {w['pid']}")
                print(f"{role}: warning: {w['text']}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        """The last warnings shown (before the run's last words), and how many more of the same kinds the file
        holds."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.thread.join()
        self._show_new()
        os.environ.pop(ENV, None)
        if (repeats := sum(self.seen.values()) - len(self.seen)) > 0:
            print(f"{repeats} more warning(s) of the kinds above: {self.path}", file=sys.stderr, flush=True)
