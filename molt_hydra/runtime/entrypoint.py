"""Run a validated config: write the run record, start the job it names, and end it cleanly — on success, on a
stalled role (stacks dumped, role named, exit 3), on a failed role or an I/O error (one message naming the role, the
cause and the checkpoint to resume from, exit 4; the traceback goes to <output_dir>/failure.txt) and on Ctrl-C /
SIGTERM (everything stopped, last checkpoint kept). The run's logs are closed before any process is ended, and every
process it started ends with it, so several runs in one process (a Hydra sweep, a notebook) each start clean.
Imports inside functions defer torch, Ray and the roles (seconds) to the job that needs them."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

from molt_hydra.compat import VersionError
from molt_hydra.compat.ray import auto_init_restored
from molt_hydra.config.schema import EXIT_INTERRUPTED, WEIGHTS_ALONE, RunConfig
from molt_hydra.runtime import ray_head, reaper
from molt_hydra.runtime.agent_runner import OUTPUT
from molt_hydra.runtime.preemption import PreemptionNotice
from molt_hydra.runtime.ray_head import EXIT_S, dead_head_within, stopped_head
from molt_hydra.runtime.run_lock import run_lock, unless_another_run
from molt_hydra.runtime.run_record import config_as_dict, record_end, record_interrupted, write_run_record
from molt_hydra.runtime.slurm_ray import RayClusterError, ray_cluster
from molt_hydra.runtime.watchdog import (EXIT_FAILED, EXIT_STALLED, RoleStalled, RunFailed, beside, describe,
                                        descendants, kill, shutdown_ray, stall_report)
from molt_hydra.runtime.writable import run_dirs, writes_checkpoint_dir


def run(cfg: RunConfig) -> None:
    notice = PreemptionNotice(cfg.output_dir)
    # one run per directory, from its first write to its end
    with run_lock(run_dirs(cfg)):
        try:
            with _stoppable(notice, saves=cfg.job.value != "eval"):
                _run(cfg, notice)
        except SystemExit as e:  # stopped by the user or Slurm's notice: said in its directory (molt-report), before
            if e.code == EXIT_INTERRUPTED:  # the lock is let go (a resume started then writes its own record)
                record_interrupted(cfg.output_dir)
            raise


@contextmanager
def _stoppable(notice: PreemptionNotice, saves: bool):
    """Ctrl-C or SIGTERM where the run's event loop does not take them (the resume check and the model's build before
    it, seconds of imports; job=sft): exit 130 with one line. Before, Ctrl-C there printed a KeyboardInterrupt
    traceback and SIGTERM ended the process without a word. So does Slurm's notice (nothing to save yet), through
    its handover (submitit's requeue, or exit 130); before, its default action ended the driver without a word."""
    main = threading.current_thread() is threading.main_thread()
    # SIGHUP (the terminal closed) too, unless ignored (nohup): before, its default action ended the driver there
    # without a word (exit -1). Its handler is put back after (molt-run's own: the loop's end reset it to the default)
    hangup = (signal.SIGHUP,) if main and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else ()
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, *hangup)} if main else {}
    notice.install(at_once=True)  # (the run's body takes it over: `_main`, job=sft's run_sft_job)
    try:
        yield
    except KeyboardInterrupt:
        if notice.received.is_set():
            notice.handover()
        print(f"\nInterrupted: the run stopped{KEPT if saves else ''}.", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        notice.uninstall()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(cfg: RunConfig, notice: PreemptionNotice) -> None:
    record = write_run_record(cfg, cfg.output_dir)
    resume_from, saved = _check_resume(cfg)
    if saved is not None and _nothing_left(cfg, resume_from, saved):
        record_end(cfg.output_dir, saved.get("rl_step", saved.get("global_step", 0)))
        return
    if cfg.job.value == "sft":
        _run_sft(cfg, resume_from, notice, record)
        return
    if saved is None:  # the loop starts at batch 0
        _refuse_an_earlier_dump(cfg)
    rows = _resumed_rows(cfg, resume_from, saved)
    _build_models(cfg)
    from molt_hydra.runtime.role_warnings import Shown

    shown = Shown(cfg.output_dir)  # before any Ray process starts: each inherits where its warnings go
    # Inside a Slurm allocation this forms Ray over every node first; elsewhere it starts nothing.
    try:
        # Ray's auto-init, which the run turns off (compat/ray.py), is back for this process's later Ray calls
        with auto_init_restored(), ray_cluster(cfg.cluster, Path(cfg.output_dir) / "ray"):
            code = _run_to_end(_main(cfg, record, resume_from, shown, notice, rows), notice)
    except RayClusterError as e:  # the nodes never formed one cluster: nothing else started
        print(f"\nRun failed: Ray cluster: {e}", file=sys.stderr)
        code = EXIT_FAILED
    finally:
        shown.stop()  # (done by _main's teardown, before its last words, when it ran)
    # Slurm's notice: requeue (or stop) now, unless the run ended anyway (a notice during its final save / export)
    if notice.stopped and code == 0 or notice.received.is_set() and code == EXIT_INTERRUPTED:
        notice.handover()
    if code == EXIT_STALLED:
        # A stalled role can leave a thread blocked in a Ray call that would hold interpreter exit: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:  # SystemExit: a notebook or a Python caller keeps its process
        sys.exit(code)


def _refuse_an_earlier_dump(cfg: RunConfig) -> None:
    """A run from batch 0 dumping its rollouts where another run's dump lies: the run stops before anything starts,
    naming them and the fix. Before: its batches overwrote theirs one by one and the earlier run's later ones stayed,
    so a replay of the directory trained on this run's batches, then on theirs, under this run's settings record.
    The dump of this run itself (its output_dir's, recorded beside it), restarted before its first checkpoint (Slurm's
    requeue), is written again from batch 0."""
    from molt_hydra.config.validate import REPLAY_RECORD

    dump = cfg.train.rollout_dump_dir
    earlier = sorted(Path(dump).glob("rollout_step*.pt")) if dump else []
    with suppress(OSError, ValueError, AttributeError):  # (no record, or not one of a run: another run's)
        if earlier and json.loads((Path(dump) / REPLAY_RECORD).read_text()).get("output_dir") == str(
                Path(cfg.output_dir).resolve()):
            return
    if earlier:
        print(f"\nRun failed: train.rollout_dump_dir={dump} holds an earlier run's dump ({len(earlier)} batch files, "
              "rollout_step*.pt); this run's batches would mix with them. Fix: point train.rollout_dump_dir at an "
              "empty directory, or move those files aside.", file=sys.stderr)
        sys.exit(EXIT_FAILED)


def _build_models(cfg: RunConfig) -> None:
    """The run's models are built here, once (a tiny:// model; tiny://idefics3_colors_warm: its warm start runs; a
    smollm2:// conversion), before Ray takes the cores; a failure names the model's key and exits 4. Was, for the
    reference or critic model: built as their roles started, 'Run failed: driver (I/O): FileNotFoundError: ...'."""
    from molt_hydra.models.build import resolve_path

    for key, path in (("model.path", cfg.model.path), ("model.ref_path", cfg.model.ref_path),
                      ("model.critic_path", cfg.model.critic_path)):
        try:  # (ValueError: a smollm2:// name its converter does not know; validation leaves those to it)
            if path is not None:
                resolve_path(path)
        except (RuntimeError, OSError, ValueError) as e:
            print(f"\nRun failed: {key}={path}: {e}", file=sys.stderr)
            sys.exit(EXIT_FAILED)


WARM_START = f"start from its weights alone: {WEIGHTS_ALONE}"  # (`_refuse_a_warm_start_among_its_steps`)


def _check_resume(cfg: RunConfig) -> tuple[Path | None, dict | None]:
    """checkpoint.resume, before anything starts: returns the checkpoint every role resumes and its client state (None
    for a warm start), read once here (it holds the queued batches; before, each check read it again). One passed
    over (a file missing, truncated, unreadable or changed since its save: the small files' CRC32s are checked here,
    the shards' as the roles load them, see _load_verified; a `latest` naming a missing one) is one line each; none
    loadable, where there are checkpoints or resume=must asks for one, ends the run naming the directory and the
    fix; so does a checkpoint saved under the other model.master_weights (a warm start aside), and resume=never (or
    a warm start) over an earlier run's checkpoints."""
    from molt_hydra.parallel.checkpoint import recover, resolve_checkpoint, saved_client_state, saved_master_weights

    c, skipped = cfg.checkpoint, []
    if cfg.job.value == "eval":  # (eval loads checkpoint.path)
        return None, None
    # a crash's leftover of a checkpoint or `best` is put back first (the export's by the next export), unless this run
    # cannot write there or another run writes there (the critic's dir is locked with the actor's)
    with suppress(OSError), unless_another_run("checkpoint.dir", c.dir) as free:
        for root in (c.dir, c.dir + "_critic") if free else ():
            recover(root)
    if c.resume.value == "never":
        _refuse_earlier_checkpoints(cfg)
        return None, None
    found = resolve_checkpoint(c.dir, skipped, checksums=True)
    for partial in sorted(Path(c.dir).glob(".tmp-step_*")):  # a run stopped mid-save: never a candidate
        print(f"Checkpoint passed over: {partial}: a save that never finished (the next save removes it)",
              file=sys.stderr)
    for line in skipped:
        print(f"Checkpoint passed over: {line}; resuming from {found or 'none'} instead" if found
              else f"Checkpoint not loadable: {line}", file=sys.stderr)
    if found is None and not skipped and c.resume.value == "auto":  # (before: a fresh start without a word)
        print(f"checkpoint.resume=auto: no checkpoint under checkpoint.dir={c.dir}, so the run starts from step 0 "
              "(to go on from a run, set checkpoint.dir, or output_dir, to its)", file=sys.stderr)
    if found is None and (skipped or c.resume.value == "must"):
        what = "no loadable checkpoint" if skipped else "no checkpoint"
        damaged = any(not line.endswith(": missing") for line in skipped)  # (not a `latest` naming a removed step)
        print(f"\nRun failed: checkpoint.resume={c.resume.value}: {what} under checkpoint.dir={c.dir}. Fix: point "
              "checkpoint.dir at a run's checkpoints, or start from step 0 with checkpoint.resume=never"
              + (" after moving the damaged ones aside." if damaged else "."), file=sys.stderr)
        sys.exit(EXIT_FAILED)
    # the two modes' optimizer states differ in kind: a resume across them is refused now, not once every role is up
    mode, state, own, warm = cfg.model.master_weights.value, None, False, None
    if found is not None:
        state = saved_client_state(found)
        own = c.load_model_only and _own_warm_start_steps(cfg, found, state)
        if c.load_model_only and not own:
            state, warm = None, state  # a warm start: its weights alone
    if state is not None and (saved := saved_master_weights(found, state)) != mode:
        print(f"\nRun failed: model.master_weights: {found} was saved with model.master_weights={saved}, this run "
              f"has {mode}; its optimizer state cannot be resumed across the two. Fix: set model.master_weights="
              f"{saved}, or {WARM_START}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    if state is not None:
        _refuse_another_jobs(cfg, found, state)
        _refuse_changed_config(cfg, found, state)
    elif found is not None:
        _refuse_a_warm_start_among_its_steps(cfg, found, warm)
    if own:  # (after the checks, which compare the command's config with the one the step recorded)
        c.load_model_only = False
    if found is not None:
        _check_critic(cfg, found)
    return found, state


def _check_critic(cfg: RunConfig, found: Path) -> None:
    """The critic resumes the actor's step: its files are checked here too (its rank's own check is the cheap one)."""
    from molt_hydra.parallel.checkpoint import problem
    from molt_hydra.runtime.plan import fsdp_roles

    c, critic = cfg.checkpoint, Path(cfg.checkpoint.dir + "_critic") / found.name
    if critic.parent.is_dir() and "critic" in fsdp_roles(cfg):
        why = "missing" if not critic.is_dir() else problem(critic, checksums=True)
        if why is not None:
            print(f"\nRun failed: checkpoint.resume={c.resume.value}: {critic}: {why}; the critic resumes the actor's "
                  f"{found.name}. Fix: move {found.name} (and any later step) out of checkpoint.dir={c.dir}, the one "
                  "before it is then resumed, or start from step 0 with checkpoint.resume=never", file=sys.stderr)
            sys.exit(EXIT_FAILED)


def _refuse_another_jobs(cfg: RunConfig, found: Path, state: dict) -> None:
    """A run resumes its own job's checkpoints only (job=rl's hold its loop: its step, data position and queued batches;
    job=sft's its consumed samples). Before: job=rl over a job=sft run's checkpoints (as in that run's output_dir, where
    resume=never's refusal offers checkpoint.resume=auto) started every role, then failed 'KeyError: 'loop''; job=sft
    over an RL run's went on at its optimizer's step count, its data position and LR schedule another run's."""
    saved = "rl" if "rl_step" in state or "loop" in state else "sft" if "consumed_samples" in state else None
    if saved not in (None, cfg.job.value):
        print(f"\nRun failed: checkpoint.resume={cfg.checkpoint.resume.value}: {found} is a job={saved} run's "
              f"checkpoint; job={cfg.job.value} resumes only its own. Fix: {WARM_START}, or point checkpoint.dir at a "
              f"job={cfg.job.value} run's checkpoints",
              file=sys.stderr)
        sys.exit(EXIT_FAILED)


def _refuse_changed_config(cfg: RunConfig, found: Path, state: dict) -> None:
    """The resume goes on as the saved run would have, or this says, before anything starts, which key changed since
    the save breaks that. Before: a changed train.optimizer.lr was ignored (the optimizer's and scheduler's state
    brought the saved one back), a changed batch size, LR schedule or advantage estimator went on from the saved step
    without a word, a changed seed or data failed only once every role was up, and train.max_steps below the saved
    step started every role, trained nothing and exported the saved step's weights as the shorter run's (job=sft: a
    changed seed reordered the epoch's samples past the saved position, skipping and repeating some, and a changed LR
    was ignored, all without a word). Now a key that changes the math (run_record.CHANGES_THE_MATH; job=sft's
    train.epochs is its length) is refused, naming both values and the fix; any other (a longer train.max_steps,
    logging, timeouts) goes on, named in one line, with what a longer run does to a decaying LR schedule."""
    from molt_hydra.config.job_ignores import ignored_by
    from molt_hydra.runtime.resume_lora import adapter_change, as_trained
    from molt_hydra.runtime.run_record import ABSENT, CHANGES_THE_MATH, config_changes

    if cfg.job.value == "sft":  # its batch size first, in words of its own (any checkpoint's: older ones too)
        _refuse_another_sft_order(cfg, found, state)
    if (saved := state.get("run_record", {}).get("config")) is None:
        print(f"Resuming {found}, saved before checkpoints recorded their config: keys changed since are not checked",
              file=sys.stderr)
        return
    # model.lora as trained on both sides: a default spelled out (alpha 2 x rank, the family's targets) is no change
    sft, t, now = cfg.job.value == "sft", cfg.train, config_as_dict(cfg)
    changed = config_changes(as_trained(saved), as_trained(now))
    step = state.get("global_step" if sft else "rl_step", 0)
    # (a key molt_hydra added or removed since the save is named, not refused: no value of it can be set back)
    # (a key the job never reads changes nothing it learns: job=sft keeps a recipe's rollout.* as they are, and its
    # command line may not set them back)
    math = {k for k in changed if any(k == m or m.endswith(".") and k.startswith(m) for m in CHANGES_THE_MATH)
            and ABSENT not in changed[k] and not (sft and k == "train.epochs") and ignored_by(cfg.job.value, k) is None}
    refused = [f"{k}={changed[k][1]} (saved with {changed[k][0]})" for k in sorted(math)]
    if not sft and t.max_steps is not None and t.max_steps < step:  # (equal: a finished run, saved and exported again)
        refused.append(f"train.max_steps={t.max_steps}, but it is at step {step} already (set it to {step} or more)")
    # job=sft's length: the saved run's steps per epoch are its last step over its (integer) epochs; the data, the
    # batch size and the seed are refused above if changed (was: refused by every rank once it had loaded the model)
    if sft and (epochs := saved.get("train", {}).get("epochs")) and (last := state.get("total_steps")) and (
            t.epochs * (per_epoch := last // epochs) < step):
        refused.append(f"train.epochs={t.epochs} makes {t.epochs * per_epoch} steps of {per_epoch} per epoch, but it "
                       f"is at step {step} already (set it to {-(-step // per_epoch)} or more)")
    if not sft and (episode := state["loop"]["generator"]["epoch"]) >= t.num_episodes:
        refused.append(f"train.num_episodes={t.num_episodes}, but it is in episode {episode + 1} already: no prompt "
                       f"is left (set it above {episode})")
    if refused:  # (another adapter, or none, on either side: a warm start cannot load its weights either)
        other = (change := adapter_change(now, saved)) and change[1]
        print(f"\nRun failed: {found} cannot be resumed as saved: " + "; ".join(refused) + ". Fix: set them back "
              f"(see its run_record.json), or {other or WARM_START}",
              file=sys.stderr)
        sys.exit(EXIT_FAILED)
    if changed:
        _name_changes(cfg, found, changed, step)


def _name_changes(cfg: RunConfig, found: Path, changed: dict, step: int) -> None:
    """The keys a resume goes on with although changed since the save, in one line; where the run's length changed
    (job=sft's: train.epochs), what that does to a decaying LR schedule."""
    t, sft = cfg.train, cfg.job.value == "sft"
    lines = [f"{k} {old} -> {new}" for k, (old, new) in changed.items()]
    longer = "train.epochs" in changed if sft else "train.max_steps" in changed or "train.num_episodes" in changed and (
        t.max_steps is None)
    decays = {o.scheduler for o in (t.optimizer, *([] if sft else [t.critic.optimizer]))} - {"constant"}
    stretched = (f"; the LR schedule ({', '.join(sorted(decays))}) now spans the new length, so the LR from step "
                 f"{step} on differs from the saved run's") if longer and decays else ""
    print(f"Resuming {found} with keys changed since its save: {', '.join(lines)}{stretched}", file=sys.stderr)


def _nothing_left(cfg: RunConfig, found: Path, state: dict) -> bool:
    """A resumed run whose checkpoint is at its last step already (job=rl: train.max_steps; job=sft: the last of the
    saved run's train.epochs, unchanged), and exported after that save where it exports (checkpoint.export_final):
    one line saying so, and True (exit 0, no role started). Before: every role started, nothing was trained, the same
    step was saved and exported again (minutes on GPU); job=sft also logged its last step's eval again, a second row
    of that step in sft_metrics.jsonl on each such resume. An export missing or older than the save (the run ended
    between the two: Slurm's notice at its last step, an export killed) still runs: its loop trains nothing and
    re-saves nothing (_train), the export is written."""
    c, t = cfg.checkpoint, cfg.train
    if cfg.job.value == "sft":  # (its last step is recorded at each save: the data decides it)
        same = (state.get("run_record") or {}).get("config", {}).get("train", {}).get("epochs") == t.epochs
        step, last, export = state.get("global_step", 0), state.get("total_steps") if same else None, Path(
            cfg.output_dir) / "hf"
        length, knob = f"the last of train.epochs={t.epochs}", "train.epochs"
    elif cfg.job.value == "rl":
        step, last, export = state.get("rl_step", 0), t.max_steps, Path(c.export_dir)
        length, knob = f"train.max_steps={t.max_steps}", "train.max_steps"
    else:
        return False
    saved_at = max(p.stat().st_mtime for p in (found, found / "run_record.json") if p.exists())
    if last is None or step < last or c.export_final and not (export.is_dir() and export.stat().st_mtime >= saved_at):
        return False
    print(f"Nothing left to run: {found} is at step {step}, {length}" + (f", exported to {export}" if c.export_final
          else "") + f"; nothing was trained, saved or exported. To train further, raise {knob}.", flush=True)
    return True


def _resumed_rows(cfg: RunConfig, found: Path | None, state: dict | None) -> tuple[list, list | None] | None:
    """job=rl resuming its loop: its rows, loaded now, before Ray (build_roles takes them), and refused, naming both
    and the fix, where they are not those the checkpoint was trained on (a prompt file changed since its save, at the
    same path). Before, that was found once every role had started (minutes on GPU). None: the roles load them."""
    from molt_hydra.rollout.generator import prompts_fingerprint, refuse_other_prompts
    from molt_hydra.runtime.roles import _load_rows

    if state is None or cfg.job.value != "rl":  # (nothing resumed, or a warm start)
        return None
    saved = state.get("loop", {}).get("generator", {}).get("prompts")
    if saved is None:  # (a checkpoint older than the fingerprint)
        return None
    try:
        rows = _load_rows(cfg, scoring=False)
    except Exception:  # noqa: BLE001 - the roles' load says what is wrong (as on a fresh run)
        return None
    try:
        refuse_other_prompts(saved, prompts_fingerprint(rows[0]), str(found))
    except ValueError as e:
        print(f"\nRun failed: data.train_path={cfg.data.train_path}: {e}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    return rows


def _refuse_another_sft_order(cfg: RunConfig, found: Path, state: dict) -> None:
    """job=sft resumes at sample global_step x train.batch_size of the epoch's order: under another batch size than
    the checkpoint's it skipped or repeated samples without a word (and stretched the LR schedule). Refused, naming
    both sizes and the fix; so is an order of other samples (`_refuse_other_sft_data`)."""
    steps, consumed, size = state.get("global_step", 0), state.get("consumed_samples"), cfg.train.batch_size
    if steps and consumed is not None and consumed != steps * size:
        print(f"\nRun failed: train.batch_size: {found} was saved after {steps} steps of {consumed // steps} samples "
              f"({consumed} consumed); train.batch_size={size} would resume at sample {steps * size}, skipping or "
              f"repeating data. Fix: set train.batch_size={consumed // steps}, or {WARM_START}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    _refuse_other_sft_data(cfg, found, state)


def _refuse_other_sft_data(cfg: RunConfig, found: Path, state: dict) -> None:
    """job=sft resumes at sample global_step x train.batch_size of a permutation of its samples: a data file written
    again since the save (at the same path) resumed over other samples, skipping and repeating some without a word.
    Refused, naming both identities and the fix (another seed or data.* key: `_refuse_changed_config`; job=rl's data:
    `_resumed_rows`)."""
    from molt_hydra.data.sft_dataset import data_identity

    if (was := state.get("train_data")) is not None and (now := data_identity(cfg.data.train_path)) != was:
        print(f"\nRun failed: {found} cannot be resumed as saved: data.train_path={cfg.data.train_path} holds other "
              f"data ({now}) than at the save ({was}): its samples' order would differ from the saved run's. Fix: "
              f"put the saved data back at that path, or {WARM_START}", file=sys.stderr)
        sys.exit(EXIT_FAILED)


def _refuse_earlier_checkpoints(cfg: RunConfig) -> None:
    """checkpoint.resume=never where checkpoint.dir holds an earlier run's checkpoints, and this run saves its own
    there: the run stops before anything starts, naming them and the fix. Before: its saves mixed with the earlier
    run's steps; retention (newest steps kept) removed each one of its own as soon as it was saved, while it was
    below theirs, and a later resume took the earlier run's newest step."""
    from molt_hydra.parallel.checkpoint import TAG

    c = cfg.checkpoint
    if c.save_steps == 0:  # this run writes no checkpoint
        return
    for root in (Path(c.dir), Path(c.dir + "_critic")):
        steps = sorted((int(m.group(1)) for p in root.glob("step_*") if (m := TAG.match(p.name)) and p.is_dir()))
        if steps:
            print(f"\nRun failed: checkpoint.resume=never, but {root} holds an earlier run's checkpoints (step_"
                  f"{steps[-1]} the newest); this run's would mix with them, and retention would remove this run's "
                  "as the oldest. Fix: checkpoint.resume=auto to go on from them, another checkpoint.dir (or "
                  "output_dir), or move them aside.", file=sys.stderr)
            sys.exit(EXIT_FAILED)


def _own_warm_start_steps(cfg: RunConfig, found: Path, state: dict) -> bool:
    """A warm start (checkpoint.load_model_only) whose checkpoint.dir newest step is one this warm start saved itself,
    restarted (Slurm's requeue, the same command again): it resumes that step whole, saying so, as any run resumes its
    own (`_check_resume` sets cfg's checkpoint.load_model_only false for the roles; the run's record keeps the
    command's). Told by the step's record of its run's config (job=rl; job=sft since its checkpoints hold one: before,
    an SFT warm start requeued by Slurm was refused as another run's steps). Before: refused as another run's steps
    (since ccf0991), and before that, trained again from step 0 over its own steps."""
    saved = (state.get("run_record") or {}).get("config", {}).get("checkpoint", {})
    same_dir = Path(saved.get("dir", "")).resolve() == Path(cfg.checkpoint.dir).resolve()
    if not (saved.get("load_model_only") and same_dir):
        return False
    print(f"checkpoint.load_model_only=true: {found} was saved by this warm start itself (started from its weights "
          f"in checkpoint.dir={cfg.checkpoint.dir}): resuming it whole, as a restart", file=sys.stderr)
    return True


def _refuse_a_warm_start_across_lora(cfg: RunConfig, found: Path, state: dict) -> None:
    """A warm start loads the checkpoint's weights by name into the model as this run builds it, and a LoRA run's
    engines serve model.path's base and receive only the adapter: refused before anything starts where the saved run's
    adapter (rank, targets, base) is not this run's. Was: every trainer rank failed to load ("Missing key in checkpoint
    state_dict: ...q_proj.base_layer.weight", or a size mismatch) with the fix to move the checkpoint aside as damaged,
    also for the warm start a refused resume of a full fine-tuning run under model.lora.rank suggests."""
    from molt_hydra.runtime.resume_lora import adapter_change

    saved = (state.get("run_record") or {}).get("config")
    if saved is None:  # (saved before checkpoints recorded their config: the load itself decides)
        return
    if (change := adapter_change(config_as_dict(cfg), saved)) is None:
        return
    from molt_hydra.models.rules import lora_off

    why, fix = change  # (the saved run's own adapter, or none: this run's other keys it leaves to the resume's check)
    asked = ("set model.lora.rank, model.lora.target_modules and model.path as saved" if
             saved.get("model", {}).get("lora", {}).get("rank") else f"turn LoRA off ({lora_off(cfg)})")
    print(f"\nRun failed: checkpoint.load_model_only=true: {found} {why}. Fix: {asked}, or {fix}", file=sys.stderr)
    sys.exit(EXIT_FAILED)


def _refuse_a_warm_start_among_its_steps(cfg: RunConfig, found: Path, state: dict) -> None:
    """A warm start (checkpoint.load_model_only) counts its steps from 0 again, and saves them into checkpoint.dir,
    the run's it starts from: refused before anything starts where a step there is past 0. Before: its step_<N>
    replaced that run's, retention (the newest steps kept) removed its own as soon as saved (a directory the driver
    then wrote run_record.json into: 'Run failed: driver (I/O): FileNotFoundError'), and a resume took that run's
    newest step. A copy of the checkpoint as step_0 of a directory of its own starts one cleanly. `state`: the
    checkpoint's client state, whose adapter must be this run's first (`_refuse_a_warm_start_across_lora`)."""
    _refuse_a_warm_start_across_lora(cfg, found, state)
    from molt_hydra.parallel.checkpoint import TAG
    from molt_hydra.runtime.plan import fsdp_roles

    c, critic = cfg.checkpoint, Path(cfg.checkpoint.dir + "_critic")
    if not writes_checkpoint_dir(cfg):  # (was: save_steps=0 alone, while eval's `best` replaced that run's)
        return
    roots = [Path(c.dir), *([critic] if critic.is_dir() and "critic" in fsdp_roles(cfg) else [])]
    steps = [int(m.group(1)) for root in roots for p in root.glob("step_*") if (m := TAG.match(p.name))]
    if max(steps, default=0) == 0:
        return
    best = " checkpoint.best_metric_key=none" if cfg.job.value == "rl" and cfg.eval.data_path else ""  # eval's best
    copies = " and ".join(f"cp -r {root / found.name} NEW{root.name.removeprefix(Path(c.dir).name)}/step_0"
                          for root in roots)
    print(f"\nRun failed: checkpoint.load_model_only=true: this run starts from {found}'s weights at step 0, and would "
          f"save its checkpoints into checkpoint.dir={c.dir}, among that run's (step_{max(steps)} the newest): "
          "retention would remove this run's as the oldest, a step of the same number would replace that run's, and "
          f"a resume would take that run's newest. Fix: copy it as step_0 of a directory of its own ({copies}) and "
          f"set checkpoint.dir=NEW, or save none with checkpoint.save_steps=0{best}; to go on with that run itself, "
          "checkpoint.load_model_only=false", file=sys.stderr)
    sys.exit(EXIT_FAILED)


def _run_sft(cfg: RunConfig, resume_from: Path | None, notice: PreemptionNotice, record: dict) -> None:
    """job=sft on its torch.multiprocessing ranks; a failure is one message naming the rank, printed last (before: a
    rank's traceback through Hydra's report). Slurm's notice: the ranks save the step under way, then the notice's
    handover (requeue, or exit 130), as an RL run's; a step past the grace is cut short (a KeyboardInterrupt: the ranks
    end) and handed over all the same."""
    from molt_hydra.runtime.sft_job import run_sft_job

    try:
        history = run_sft_job(cfg, resume_from, notice, record)
    except KeyboardInterrupt:
        if not notice.received.is_set():
            raise  # Ctrl-C / SIGTERM: _stoppable's exit 130
        print(f"\nInterrupted: the run stopped{KEPT}.", file=sys.stderr)
        notice.handover()
    except RoleStalled as e:  # a rank stopped by a signal (sft_job.py): its ranks are ended
        _stall_told(cfg, f"{e}".splitlines())
        print("\n" + "\n".join([str(e), *_resume_hint(cfg)]), file=sys.stderr)
        sys.exit(EXIT_STALLED)
    except Exception as e:  # noqa: BLE001 - the traceback goes to failure.txt
        rank = getattr(e, "error_index", None)  # torch.multiprocessing's: the rank that raised or died
        cause = (str(e).strip().splitlines() or [type(e).__name__])[-1]  # a rank's traceback ends with its error
        lines = _with_details(cfg, [f"Run failed: sft trainer{'' if rank is None else f' rank {rank}'}: {cause}.",
                                    *_resume_hint(cfg)], e)
        print("\n" + "\n".join(lines), file=sys.stderr)
        sys.exit(EXIT_FAILED)
    if notice.stopped:  # (not when the notice came after the last step: the run ended anyway)
        notice.handover()
    else:  # molt-report's "completed", as an RL run's
        record_end(cfg.output_dir, max((h.get("global_step", 0) for h in history), default=0))


def _run_to_end(coro, notice: PreemptionNotice) -> int:
    """asyncio.run, also where an event loop already runs in this thread (a notebook): the run then gets its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no loop here (the run starts outside the except block, so its own
        pass  # errors carry no unrelated context)
    else:  # (its thread takes no signal: the notice's at-once stop would interrupt this one, not the run)
        notice.uninstall()
        with ThreadPoolExecutor(1, thread_name_prefix="molt-run") as pool:
            return pool.submit(asyncio.run, coro).result()
    return asyncio.run(coro)


def _stop_signals(loop) -> tuple:
    """Ctrl-C / SIGTERM stop the run (the main task cancelled); only the main thread may take signals (not a notebook's
    run thread). So does SIGHUP (its terminal closed): before, it ended the driver and Ray's head processes at once
    (the default action), a save under way lost, the log's last line no word of it. SIGINT and SIGHUP ignored when
    the run started stay ignored, as Python leaves them before the loop: nohup, or a script's `molt-run ... &` (its
    shell ignores SIGINT for it, so that a Ctrl-C meant for the foreground does not reach it; was: taken here)."""
    main = threading.current_thread() is threading.main_thread()
    signals = tuple(sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                    if main and (sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN))
    for sig in signals:
        loop.add_signal_handler(sig, asyncio.current_task().cancel)
    return signals


def _close_logs(opened: list) -> None:
    for log in opened:
        try:
            log.close()
        except Exception as e:  # noqa: BLE001 - the roles are still ended after it
            print(f"closing the metric sinks: {describe(e)}", file=sys.stderr)


async def _main(cfg: RunConfig, record: dict, resume_from: Path | None, shown, notice: PreemptionNotice,
                rows: tuple | None = None) -> int:
    """`rows`: `_resumed_rows`' (None: the roles load them)."""
    loop = asyncio.get_running_loop()
    signals = _stop_signals(loop)
    # Slurm's notice (a save at the step's end) also while the roles start: before, there, its default action ended
    notice.install(loop, asyncio.current_task())  # the driver without a word (the engines' load: minutes on GPU)
    loop.set_exception_handler(_quiet_cancellations)
    from molt_hydra.runtime.roles import build_roles

    roles, opened = None, []  # opened: the run's logs, closed before any process is ended
    role_pids: dict[str, int] = {}  # filled as the roles start (a stall during their start names and dumps them)
    last_words: list[str] = []  # the failure message: printed after every teardown, so it is what the user sees last
    name_checkpoint = False  # an interruption or a stall: the checkpoint to resume from, named after the teardown
    try:
        try:
            roles = await build_roles(cfg, record, role_pids, rows)
            shown.role_pids = roles.role_pids  # (the same dict: a restarted engine's new pid is in it)
            if cfg.job.value == "eval":
                return await _eval_only(cfg, roles, opened)
            return await _train(cfg, roles, opened, resume_from, notice)
        finally:  # another Ctrl-C / SIGTERM would cut the report (the stall's probe: up to 10 s) or the teardown
            for sig in signals:  # short and leave processes behind; before, one during the report ended the run in
                loop.add_signal_handler(sig, _still_stopping)  # a traceback, its failure untold
            notice.over()  # (nor does Slurm's notice's cut)
    except RoleStalled as e:
        probe, name_checkpoint = roles is not None and e.role in ("rollout", "weight sync"), True
        return _stalled(cfg, role_pids, f"{e}", await roles.calls.probe_rollout() if probe else [], last_words)
    except asyncio.CancelledError:
        print(f"\nInterrupted: stopping every role{'' if cfg.job.value == 'eval' else KEPT}.", file=sys.stderr)
        name_checkpoint = True  # which one is named after the teardown: the last thing the user reads
        return EXIT_INTERRUPTED
    except BaseException as e:  # every other failure: one message, the traceback in a file; a BaseException too (a
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):  # remote one through Ray: was a traceback)
            raise
        stalled = await roles.calls.probe_rollout() if isinstance(e, RunFailed) and e.drops and roles else []
        if name_checkpoint := bool(stalled):  # every rollout failing can be a stuck engine (its requests time out)
            return _stalled(cfg, role_pids, f"rollout stalled: {e.cause}", stalled, last_words)
        last_words += await _report_failure(cfg, roles, e)
        return EXIT_FAILED
    finally:
        _close_logs(opened)
        if roles is not None:
            try:
                await asyncio.wait_for(roles.calls.shutdown(), 25)
            except Exception as e:  # still exit: Ray's own shutdown below ends every actor process
                print(f"shutdown: {e!r}", file=sys.stderr)
        started = descendants(os.getpid())
        shutdown_ray(started)
        kill(started)  # anything Ray's shutdown missed (e.g. a hung vLLM engine core) goes too
        reaper.stop()  # (the watcher that ends them when this process is killed)
        shown.stop()
        if name_checkpoint:  # read now that nothing writes: a save the teardown let finish is the one to name (before:
            last_words += _resume_hint(cfg)  # read before it, the step before the newest checkpoint was named)
        if last_words:
            sys.stdout.flush()
            print("\n" + "\n".join(last_words), file=sys.stderr, flush=True)
        for sig in signals:
            loop.remove_signal_handler(sig)
        notice.uninstall()


KEPT = "; the last checkpoint is kept"  # (an eval job saves none: `_main`'s interruption says nothing of one)


def _still_stopping() -> None:
    print("Already stopping every role; please wait.", file=sys.stderr, flush=True)


def _stalled(cfg: RunConfig, role_pids: dict[str, int], reason: str, not_answering: list[str],
             last_words: list[str]) -> int:
    """A role stopped making progress: its name, every role's stacks in a file, exit 3. `role_pids`: those of the
    roles started so far (before: none while they started, so a stopped engine's pid and stacks went untold)."""
    last_words += _stall_told(cfg, stall_report(cfg.output_dir, role_pids, reason, not_answering, ray_head.pids()))
    return EXIT_STALLED


def _stall_told(cfg: RunConfig, lines: list[str]) -> list[str]:
    """A stall's last words (returned), also in <output_dir>/failure.txt, as a failure's: molt-report's "failed:
    <role> stalled: ..." (was: "stopped at step N", as a run killed -9; no traceback here, the stacks file is the
    details). A full disk or a read-only output_dir leaves it untold there: the console says it."""
    with suppress(OSError):
        (Path(cfg.output_dir) / "failure.txt").write_text("\n".join(lines) + "\n")
    return lines


async def _report_failure(cfg: RunConfig, roles, error: Exception) -> list[str]:
    """One message (returned: the caller prints it last): the role, the cause, the drops and an example agent error
    (when nothing could be trained), the checkpoint to resume from. The traceback is written to
    <output_dir>/failure.txt, not to the terminal."""
    import ray

    from molt_hydra.parallel.group import RankStartFailed

    if isinstance(error, RunFailed):
        role, cause, drops = error.role, error.cause, {k: v for k, v in error.drops.items() if v}
    elif isinstance(error, RankStartFailed):
        role, cause, drops = error.role, describe(error.error), {}
    elif isinstance(error, TimeoutError) and not isinstance(error, ray.exceptions.RayError):
        # one of the runtime's own deadlines (an OSError since Python 3.11, yet no I/O; was: "driver (I/O)"): its
        # message names what ran late ("trainer group 'actor': rank(s) [1] ... not up after 600s")
        subject, _, rest = str(error).partition(": ")
        named = bool(rest) and re.fullmatch(r"[^:;()]{1,60}", subject) is not None
        role, cause, drops = subject if named else "driver", f"TimeoutError: {rest if named else error}", {}
    else:
        role, cause, drops = _actor_role(error), describe(error), {}
    # every role's calls fail with Ray's GCS or raylet (a Ray compat/ray.py was not written for: refused at its start);
    # a role that died with its node may be the first sign of a raylet still ending (its agent died): waited for;
    # or of one stopped by a signal (Ray's health check took its node for dead)
    lost = not isinstance(error, VersionError) and _node_lost(error)
    head = None if isinstance(error, VersionError) else await dead_head_within(EXIT_S if lost else 0)
    if (head := head or (stopped_head() if lost else None)) is not None and head.role != role:
        role, cause = head.role, f"{head.cause} (first seen as {role}: {cause})"
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) and not error.filename:
        # a write to an open file (metrics.jsonl ...) names no path: the run's directories' free space tells which
        dirs = (("output_dir", cfg.output_dir), ("checkpoint.dir", cfg.checkpoint.dir))
        with suppress(OSError):
            cause += " (free: " + ", ".join(f"{key}={path} {shutil.disk_usage(path).free / 1e9:.3g} GB"
                                            for key, path in dirs if Path(path).exists()) + ")"
    lines = [f"Run failed: {role}: {cause.rstrip('.')}."]  # (a cause's own full stop is not doubled)
    if drops:
        lines.append("  dropped samples by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(drops.items())))
        examples = {}
        with suppress(Exception):  # the summary is shown without examples
            examples = await roles.calls.example_errors() if roles is not None else {}
        # the runners' examples, then those of whole groups lost on the driver's side (a runner's reply that failed)
        driver = [(r, e) for r, e in getattr(error, "examples", {}).items() if examples.get(r) != e]
        for reason, example in sorted([*examples.items(), *driver]):
            if reason in drops:  # one line, cut short: agent code's message can be pages (an HTTP error's body)
                shown = " ".join(example.split())
                cut = f"... ({len(shown)} characters)" if len(shown) > 300 else ""
                lines.append(f"  example error ({reason}): {shown[:300] if cut else shown}{cut}")
    lines += _agent_output(cfg, role, drops)
    return _with_details(cfg, lines + _resume_hint(cfg), error)


def _agent_output(cfg: RunConfig, role: str, drops: dict) -> list[str]:
    """Where agent code's output is: every runner's where rollouts failed (their tracebacks, what agent code printed);
    a runner's own where it died, as agent code that crashed it (a segfault, os._exit) left its last words there and
    the cause is Ray's "the process died" alone (was: not pointed to)."""
    runner = re.fullmatch(r"agent runner ?(\d*)", role)
    if not drops and runner is None:
        return []
    index, kinds, what = ("*", "{out,err}", "each failure's traceback") if drops else \
        (runner[1] or "*", "err", "a crash's stack")
    if not any(Path(cfg.output_dir).glob(OUTPUT.format(index, "err"))):
        return []
    return [f"  agent code's output (print, logging, {what}): {Path(cfg.output_dir) / OUTPUT.format(index, kinds)}"]


def _node_lost(error: BaseException | None) -> bool:
    """A Ray actor died with its node somewhere in `error`'s chain of causes (Ray's "Owner's node has crashed", "its
    node has died"); an actor that died alone is reported at once."""
    import ray

    while error is not None:
        if isinstance(error, ray.exceptions.RayActorError) and re.search(r"node has (crashed|died)", str(error)):
            return True
        error = error.__cause__
    return False


def _with_details(cfg: RunConfig, lines: list[str], error: BaseException) -> list[str]:
    """`lines`, written with the traceback to <output_dir>/failure.txt, and a last line naming that file."""
    details = Path(cfg.output_dir) / "failure.txt"
    with suppress(OSError):
        details.write_text("\n".join(lines) + "\n\n" + "".join(traceback.format_exception(error)))
        lines = [*lines, f"Details (traceback): {details}"]
    return lines


def _resume_hint(cfg: RunConfig) -> list[str]:
    """The checkpoint a resume would start from (an eval job trains nothing: none of its own), and how: in this run's
    directory. Before, only 'checkpoint.resume=auto': the command run again took a new timestamped hydra.run.dir (the
    default), whose checkpoint.dir is empty, and started from step 0."""
    from molt_hydra.parallel.checkpoint import resolve_checkpoint

    if cfg.job.value == "eval":
        return []
    last = None
    with suppress(OSError):
        last = resolve_checkpoint(cfg.checkpoint.dir, checksums=True)  # as the resume will choose (small files)
    return [f"Last checkpoint: {last}; resume with checkpoint.resume=auto hydra.run.dir={cfg.output_dir}"
            if last is not None
            else "Last checkpoint: none (the run starts from step 0 again)"]


# The Ray actor classes of the roles, for a failure that reached the driver without a role's name on it
ACTOR_ROLES = {"VLLMEngine": "rollout engine", "AgentRunnerActor": "agent runner", "PolicyWorker": "actor",
               "TrainerWorker": "trainer (reference or critic)"}


def _actor_role(error: BaseException) -> str:
    """The role whose Ray actor raised `error` (named in Ray's `ray::Class.method()` line) or died (its `class_name:`
    line: an engine killed while it started was named 'driver'), else the driver."""
    import ray

    found = re.search(r"ray::(\w+)\.|class_name: (\w+)", str(error)) if isinstance(error, ray.exceptions.RayError) \
        else None
    if found:
        name = found.group(1) or found.group(2)
        return ACTOR_ROLES.get(name, name)
    # (a TimeoutError, an OSError since Python 3.11, is a deadline's, e.g. Ray's GetTimeoutError: no I/O)
    return "driver (I/O)" if isinstance(error, OSError) and not isinstance(error, TimeoutError) else "driver"


def _quiet_cancellations(loop, context: dict) -> None:
    """A gather left behind when the first failure ended the run: its CancelledError is not news; anything else is
    reported as asyncio would."""
    if not isinstance(context.get("exception"), asyncio.CancelledError):
        loop.default_exception_handler(context)


def _controller(cfg: RunConfig, roles, opened: list, wandb_id: str | None):
    """The loop's controller, logging through the run's logs (appended to `opened`: closed before any process ends)."""
    from molt_hydra.logging.progress import Progress
    from molt_hydra.logging.run_log import RunLog
    from molt_hydra.logging.sinks import MetricSinks
    from molt_hydra.runtime.controller import RLController

    w = cfg.logger.wandb
    sinks = MetricSinks(cfg.output_dir, run_name=w.run_name or Path(cfg.output_dir).name, config=config_as_dict(cfg),
                       wandb_mode=w.mode.value, project=w.project, entity=w.entity, group=w.group,
                       tensorboard=cfg.logger.tensorboard, resume_wandb_id=wandb_id,
                       dashboard=cfg.logger.wandb_dashboard)
    opened.append(RunLog(cfg.logger, cfg.output_dir, roles.tokenizer, sinks,
                         Progress(cfg.train.max_steps, cfg.logger.progress)))
    return RLController(cfg, roles, opened[-1])


async def _train(cfg: RunConfig, roles, opened: list, found: Path | None, notice: PreemptionNotice) -> int:
    """`found`: the checkpoint _check_resume chose (None: start at step 0)."""
    from molt_hydra.runtime.trainer_options import DTYPE_NAMES

    calls, c, state = roles.calls, cfg.checkpoint, None

    def head_watched(work):  # beside Ray's head and the roles' processes (no engine keeper: there is no loop)
        return beside(work, *ray_head.watchers(roles.role_pids, cfg.cluster.nodes == 1))

    if notice.received.is_set():  # Slurm's notice while the roles started: no step begun, nothing new to save.
        notice.saved(None)  # Before, the resume's load and push, the at-start eval and a whole step ran first
        return 0  # (often cut short at the grace)
    if found is not None:  # (minutes on GPU: watched as the start and the loop are)
        client, found = await head_watched(_load_verified(cfg, roles, found))
        state = None if c.load_model_only else client["loop"]  # a warm start: the loop, optimizer and data start fresh
    ctl = _controller(cfg, roles, opened, state["wandb_id"] if state else None)
    ctl.log.sinks.rewind(state["step"] if state else 0)  # 0: an earlier attempt here that saved no checkpoint
    if state is not None:
        ctl.restore(state)
        # `found` is this step's: a resume that trains no step (a run ended between its last save and its export)
        ctl.saved_step, roles.last_checkpoint = ctl.step, str(found)  # saves it no second time
        print(f"Resumed from {found} at step {ctl.step} (policy version {ctl.version}).")
    # The resume's push, the final save and the export run beside the run's watchers, as the loop does (before: only
    # their calls' deadlines, trainer_call_s 1800 s, told a rank stopped there; a dead GCS, Ray's own exit 60 s later).
    # After the loop, not beside the engine keeper: an engine lost then (the export's host memory) is no failure of a
    # finished run, and no replacement should compete with the save for memory
    ctl.preempted = notice.received  # (one during the load: no push, the loop stops before its first step)
    if found is not None and (c.load_model_only or ctl.version > 0) and not notice.received.is_set():
        await ctl.watched(calls.push_weights(ctl.version))  # (a warm start: version 0, the loaded weights)
    await ctl.run()
    if ctl.stopped_for_notice:  # saved at the step's end (not the end of training): no final save or export
        notice.saved(ctl.saved_step)
        return 0
    # 0: no resumable checkpoint at all. The loop's last step saved already (max_steps a multiple of save_steps): not
    # again (before: the same step written twice, minutes on GPU, its directory replaced by its copy)
    if c.save_steps != 0 and ctl.saved_step != ctl.step:
        await head_watched(ctl.save())
    export = (await head_watched(calls.ranks(roles.actor, "export_hf", c.export_dir, DTYPE_NAMES[
        cfg.model.param_dtype.value], merged=c.export_merged)))[0] if c.export_final else None
    ctl.log.progress.summary(_summary(cfg, roles, ctl, export))
    record_end(cfg.output_dir, ctl.step)
    return 0


async def _load_verified(cfg: RunConfig, roles, found: Path) -> tuple[dict, Path]:
    """Every trainer role loads `found` (the critic the actor's step: the two stay one step's pair), and each shard's
    CRC32 is checked as it is read (the resume check read only the small files: a shard is read once). A shard
    changed since its save passes the pair over, named, for the newest older checkpoint the resume check passes;
    with none left, the load's error (the file, the fix) ends the run. Returns the client state and the checkpoint."""
    from molt_hydra.parallel.checkpoint import resolve_checkpoint

    c = cfg.checkpoint
    while True:
        try:
            (client, *_) = await roles.calls.ranks(roles.actor, "load_checkpoint", c.dir, model_only=c.load_model_only,
                                                   step=found.name)
            if roles.critic is not None:
                await roles.calls.ranks(roles.critic, "load_checkpoint", c.dir + "_critic",
                                        model_only=c.load_model_only, step=found.name, role="critic")
            return client, found
        except RunFailed as e:
            why, skipped = _damage(e), []
            older = resolve_checkpoint(c.dir, skipped, checksums=True, older_than=found) if why else None
            if older is None:
                raise
        for line in [why, *skipped]:  # (the next load overwrites all that the failed one loaded)
            print(f"Checkpoint passed over: {line}; resuming from {older} instead", file=sys.stderr)
        found = older


def _damage(error: BaseException) -> str | None:
    """The damaged file a failed checkpoint load found ("<checkpoint>: <file>: <CRC32s>"), else None."""
    import ray

    from molt_hydra.parallel.checkpoint import DamagedCheckpoint

    while error is not None:  # RunFailed <- Ray's RayTaskError (the rank's error as its .cause) <- the rank's error
        if isinstance(error, ray.exceptions.RayTaskError):
            error = error.cause
        elif isinstance(error, DamagedCheckpoint):
            return error.args[1]
        else:
            error = error.__cause__
    return None


async def _eval_only(cfg: RunConfig, roles, opened: list) -> int:
    ctl = _controller(cfg, roles, opened, None)
    await ctl.watched(ctl.maybe_eval(force=True))  # (before, unwatched: a stopped engine hung it for eval's step_s)
    print(json.dumps(ctl.last_eval, indent=2))
    record_end(cfg.output_dir, 0)
    return 0


def _summary(cfg: RunConfig, roles, ctl, export) -> list[str]:
    rows = [json.loads(line) for line in open(Path(cfg.output_dir) / "metrics.jsonl")]
    rewards = [r["train/reward"] for r in rows if r.get("kind") == "train" and "train/reward" in r]
    lines = [f"steps: {ctl.step}   policy version: {ctl.version}"]
    t = cfg.train
    if t.max_steps is not None and ctl.step < t.max_steps:  # the loop ended on the data (was: not a word of it)
        passes = f"{t.num_episodes} pass{'es' if t.num_episodes > 1 else ''}"
        why = (f"the batches of train.rollout_replay_dir={t.rollout_replay_dir} ran out" if t.rollout_replay_dir
               else f"the prompts ran out: train.num_episodes={passes} over them; raise it to train longer")
        lines[0] = f"steps: {ctl.step} of train.max_steps={t.max_steps}   policy version: {ctl.version}   ({why})"
    if len(rewards) >= 2:
        k = min(5, len(rewards) // 2)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        lines.append(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({last - first:+.3f})")
    lines += [f"metrics:    {Path(cfg.output_dir) / 'metrics.jsonl'}", f"checkpoint: {roles.last_checkpoint}"]
    if export:
        lines.append(f"HF export:  {export}")
    if (run := ctl.log.sinks.wandb_run) is not None:
        lines.append(f"W&B:        {run.dir} ({run.settings.mode})")
    return lines
