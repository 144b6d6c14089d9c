"""The SFT job (`job=sft`): chat rows -> masked, packed micro-batches -> the same FSDP2 TrainerWorker as RL.

`run_sft` takes flat arguments (the CLI maps the config onto them). With `num_ranks > 1` it spawns local ranks;
under torchrun (RANK/WORLD_SIZE set by the launcher) each process runs its own rank. Per optimizer step the global
batch of `batch_size` samples is split over ranks (strided), so the loss is the window token mean over all of them
(inventory §2.10). Checkpoints every `save_steps` carry the consumed-sample count, and `resume=True` continues from
the latest one in `ckpt_path`; the final HF export goes to `output_dir`. On Slurm's notice (the caller sets `stop`:
runtime/preemption.py) the ranks save at the end of the step under way and return; an eval due at that step waits
for the resume, which runs it first (the grace is short: the save comes first, as in the RL loop).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from molt_hydra.config.schema import WEIGHTS_ALONE

# run_sft's `stop` (a shared multiprocessing Value): the caller sets STOP on Slurm's notice; the ranks, once they saved
# the step under way and stopped, leave STOPPED in it
STOP, STOPPED = 1, 2


def _eval_loss(worker, samples, rank, world) -> float:
    """Token-weighted −log p over loss masks of the eval set, reduced over ranks."""
    local = samples[rank::world] or samples[:1]
    lps = worker.compute_logprobs(local)
    own = local if samples[rank::world] else []
    s = torch.tensor([sum(float(-(lp * x["loss_mask"]).sum()) for lp, x in zip(lps, own)),
                      sum(float(x["loss_mask"].sum()) for x in own)])
    dist.all_reduce(s)
    return float(s[0] / s[1].clamp(min=1))


def _resume(worker, kw: dict, rank: int, total: int, per_epoch: int) -> tuple[dict | None, int]:
    """The client state resumed (None: none) and the step the run starts at. Loads `resume_step` (the run's checked
    choice), else the newest loadable checkpoint. A shard changed since its save (its CRC32 is checked as the load
    reads it: every rank raises) passes that checkpoint over, in one line, for the newest older one the checks pass,
    as the RL resume does (runtime/entrypoint.py _load_verified); with none left, the load's error (the file, the fix)
    ends the run. Before, job=sft failed on it. A step past this run's `total` (train.epochs lowered since the save)
    is refused: before, nothing was trained and the saved step's weights were exported as the shorter run's, exit 0."""
    from molt_hydra.parallel.checkpoint import DamagedCheckpoint, resolve_checkpoint

    if not (kw["resume"] and kw["ckpt_path"]):
        return None, 0
    root = kw["ckpt_path"]
    step = kw["resume_step"] or getattr(resolve_checkpoint(root), "name", None)
    while True:
        try:
            client = worker.load_checkpoint(root, model_only=kw["load_model_only"], step=step)
            start = 0 if kw["load_model_only"] else (client or {}).get("global_step", 0)
            if start > total:
                raise ValueError(f"train.epochs={kw['max_epochs']} makes {total} steps of {per_epoch} per epoch, but "
                                 f"the checkpoint resumed is at step {start} already. Fix: set train.epochs to "
                                 f"{start / per_epoch:g} or more, or {WEIGHTS_ALONE}")
            return client, start
        except DamagedCheckpoint as e:
            why, skipped = e.args[1], []
            older = resolve_checkpoint(root, skipped, checksums=True, older_than=Path(root) / step)
            if older is None:
                raise
        if rank == 0:  # (the next load overwrites all that the failed one loaded)
            for line in [why, *skipped]:
                print(f"Checkpoint passed over: {line}; resuming from {older} instead", file=sys.stderr, flush=True)
        step = older.name


def _samples(path: str, kw: dict) -> tuple[list, list | None]:
    """The train and eval samples, tokenized on this rank."""
    from transformers import AutoTokenizer

    from molt_hydra.data.sft_dataset import build_sft_samples, load_rows
    from molt_hydra.models.vlm import TrajectoryImages

    tok = AutoTokenizer.from_pretrained(path)
    data_kw = dict(input_key=kw["input_key"], output_key=kw["output_key"], max_len=kw["max_len"],
                   chat_template=kw["chat_template"], train_on_last_turn_only=kw["train_on_last_turn_only"],
                   image_key=kw["image_key"], max_images_per_prompt=kw["max_images_per_prompt"],
                   images=TrajectoryImages.for_model(path) if kw["image_key"] else None)
    train = build_sft_samples(load_rows(kw["train_data"]), tok, max_samples=kw["max_samples"],
                              source=_source(kw["train_data"], "train"), **data_kw)
    evals = build_sft_samples(load_rows(kw["eval_data"]), tok, source=_source(kw["eval_data"], "eval"),
                              **data_kw) if kw["eval_data"] is not None else None
    return train, evals


def _source(data, which: str) -> str:
    """How errors name the data: its file (or builtin task), or which rows a caller handed over as a list."""
    return str(data) if isinstance(data, (str, Path)) else f"the {which} rows"


def _checked_batch_size(kw: dict, world: int, samples: int) -> int:
    bs = kw["batch_size"]
    if bs % world:
        raise ValueError(f"train.batch_size={bs} does not divide over {world} ranks. Fix: set train.batch_size to a "
                         f"multiple of {world}")
    if bs > samples:  # (validation counts the rows; rows skipped here, logged above, can leave fewer samples)
        raise ValueError(f"{_source(kw['train_data'], 'train')}: {samples} SFT samples, fewer than the "
                         f"train.batch_size={bs} of one optimizer step: nothing would be trained. Fix: set "
                         f"train.batch_size <= {samples}, or give it more rows with a reply")
    return bs


def _rewind_metrics(path: Path, start: int, kept) -> None:
    """sft_metrics.jsonl as the RL run's metrics.jsonl on a resume (logging/sinks.py rewind_jsonl): the interrupted
    attempt's rows past `start` dropped, or at step 0 an earlier run's file moved aside, with a notice. Before, it
    only appended: a resume logged those steps twice, a new run in the same output_dir went on after the earlier one.
    kept: where run_sft's driver gets the count of rows left before this run's (it reads the spawned ranks' history
    from the file); None under torchrun."""
    from molt_hydra.logging.sinks import aside_stamp, rewind_jsonl

    moved = rewind_jsonl(path, start, key="global_step", aside=aside_stamp([path]) if start == 0 else None)
    if moved is not None:
        print(f"{path.parent}: an earlier run's metrics moved aside to {moved.name}; this run starts at step 0",
              flush=True)
    if kept is not None:
        kept.value = len(path.read_text().splitlines()) if path.exists() else 0


def _sft_rank(rank: int, world: int, port: int, kw: dict):
    from molt_hydra.models.build import resolve_path
    from molt_hydra.parallel.objectives import SFTObjective
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    path = resolve_path(kw["model_path"])
    train, evals = _samples(path, kw)
    bs = _checked_batch_size(kw, world, len(train))
    steps_per_epoch = len(train) // bs  # trailing partial batch dropped, as Molt does
    total = math.ceil(kw["max_epochs"] * steps_per_epoch)
    worker = TrainerWorker(TrainerSpec(path, rank=rank, world_size=world, master_port=port, total_steps=total,
                                       master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), **kw["worker"]))
    client, start = _resume(worker, kw, rank, total, steps_per_epoch)
    out = Path(kw["output_dir"])
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _rewind_metrics(out / "sft_metrics.jsonl", start, kw.get("kept"))
    history, stop, stopping = [], kw["stop"], False

    def record(rec: dict) -> None:  # every rank keeps the history; rank 0 writes it
        history.append(rec)
        if rank == 0:
            with (out / "sft_metrics.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")

    # the eval a notice's save skipped (see below), or the end's: first, on its own record
    if evals is not None and (start == total or (client or {}).get("eval_skipped") and not kw["load_model_only"]):
        record({"global_step": start, "eval sft_loss": _eval_loss(worker, evals, rank, world)})
    for step in range(start, total):
        epoch, i = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(kw["seed"] + epoch)).tolist()
        m = worker.train_step([train[j] for j in order[i * bs:(i + 1) * bs][rank::world]], SFTObjective())
        rec = {"global_step": step + 1, "epoch": epoch, "sft_loss": m["sft_loss"], "lr": m["actor_lr"],
               "grad_norm": m["actor_grad_norm"], "tokens_per_sec": m["perf/train_tokens_per_sec"],
               **{k: v for k, v in m.items()  # logger.debug_grad_norms (was: the non-finite count left out)
                  if k.startswith("actor_grad_norm/") or k == "actor_grad_nonfinite_params"}}
        last = step + 1 == total
        if stop is not None:  # each rank reads it at its own moment: they agree first (any rank that saw it)
            seen = torch.tensor([float(stop.value == STOP)])
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            stopping = bool(seen.item())
        due = evals is not None and ((kw["eval_steps"] > 0 and (step + 1) % kw["eval_steps"] == 0) or last
                                     or (kw["eval_steps"] <= 0 and (step + 1) % steps_per_epoch == 0))
        if due and not stopping:  # on the notice the save comes first (a short grace): the resume runs this eval
            rec["eval sft_loss"] = _eval_loss(worker, evals, rank, world)
        every = kw["save_steps"]  # N: every N steps and the last (as an RL run); -1: at the end only; 0: never
        if kw["ckpt_path"] and ((every > 0 and (step + 1) % every == 0) or (every != 0 and (last or stopping))):
            worker.save_checkpoint(kw["ckpt_path"], {"consumed_samples": (step + 1) * bs, "total_steps": total,
                                                     "train_data": kw["train_identity"],
                                                     "eval_skipped": due and stopping, "run_record": kw["run_record"]},
                                   keep=kw["keep"], max_disk_gb=kw["max_disk_gb"])  # (total: runtime _nothing_left)
        record(rec)
        if stopping:  # the step is saved (unless save_steps=0); no final export: the requeued run goes on
            stop.value = STOPPED
            break
    if kw["export_hf"] and not stopping:
        worker.export_hf(str(out / "hf"))
    worker.shutdown()
    return history


SFT_DEFAULTS = dict(lr=5e-6, lr_warmup_ratio=0.03, param_dtype="bf16")  # where the SFT job's differ from TrainerSpec's


def run_sft(model_path: str, train_data, output_dir: str, *, eval_data=None, input_key: str = "input",
            output_key: str | None = None, chat_template: str | None = None, train_on_last_turn_only: bool = False,
            max_len: int = 2048, max_samples: int | None = None, batch_size: int = 8, max_epochs: float = 1,
            eval_steps: int = -1, save_steps: int = -1, ckpt_path: str | None = None, keep: int = 3,
            resume: bool = False, export_hf: bool = True, num_ranks: int = 1, seed: int = 42,
            image_key: str | None = None, max_images_per_prompt: int = 0, max_disk_gb: float | None = None,
            load_model_only: bool = False, resume_step: str | None = None, stop=None, ignore_signals=(),
            run_record: dict | None = None, **trainer) -> list[dict]:
    """Train, evaluate, checkpoint and export; returns the per-step metric records (also in
    <output_dir>/sft_metrics.jsonl): sft_loss, lr, grad_norm, tokens_per_sec, and `eval sft_loss` where evaluated.
    trainer: TrainerSpec fields (parallel/trainer_spec.py: lr, param_dtype, max_tokens_per_micro_batch, the backend's
    options, ...), SFT_DEFAULTS where not given.
    load_model_only: `resume` loads the checkpoint's weights only and starts at step 0 with a fresh optimizer.
    resume_step: the step_<N> under ckpt_path to resume (the run's checked choice), else the newest loadable.
    stop: a multiprocessing Value("i", lock=False) shared with the caller (runtime/sft_job.py), who sets STOP on
    Slurm's notice: the ranks save at the end of the step under way (save_steps=0 aside) and return without the final
    export, leaving STOPPED. ignore_signals: signals the local ranks ignore (that notice: the caller acts on it).
    run_record: the run's record (runtime/run_record.py), in every checkpoint's client state, as an RL run's: a warm
    start restarted over its own steps (Slurm's requeue) is told by it (runtime/entrypoint.py _own_warm_start_steps)."""
    kw = {k: v for k, v in locals().items() if k != "trainer"}  # every argument above, as the ranks read them
    from molt_hydra.data.sft_dataset import data_identity

    kw["train_identity"] = data_identity(train_data)  # as read before its samples: a resume compares it (entrypoint.py)
    kw["worker"] = {**SFT_DEFAULTS, "seed": seed, **trainer}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        return _sft_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]), kw)
    from molt_hydra.parallel.launch import run_ranks
    kw["kept"] = kept = multiprocessing.get_context("spawn").Value("i", 0, lock=False)  # rank 0's (_rewind_metrics)
    run_ranks(_sft_rank, num_ranks, kw, timeout_s=max(kw["worker"].get("timeout_s", 600.0), 3600),
              ignore=ignore_signals)
    return [json.loads(x) for x in (Path(output_dir) / "sft_metrics.jsonl").read_text().splitlines()[kept.value:]]
