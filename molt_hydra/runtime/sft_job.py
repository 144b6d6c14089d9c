"""`job=sft`: supervised fine-tuning on the same model / FSDP2 path as the RL trainer (parallel/sft.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from contextlib import contextmanager, suppress
from pathlib import Path

from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.preemption import NOTICE, PreemptionNotice
from molt_hydra.runtime.trainer_options import trainer_options
from molt_hydra.runtime.watchdog import RoleStalled, descendants, kill, stall_report, watch_stopped


def run_sft_job(cfg: RunConfig, resume_from: Path | None, notice: PreemptionNotice, record: dict) -> list[dict]:
    """`resume_from`: the checkpoint the run's resume check chose (every rank loads that one). `notice`: Slurm's
    (runtime/preemption.py), taken here while the ranks train: they save at the end of the step under way and stop,
    and `notice.saved` names the step (the caller hands over: requeue or exit 130). Before, job=sft took no notice:
    submitit requeued it at once, without a save. `record`: the run's record, saved in every checkpoint."""
    import multiprocessing

    from molt_hydra.models.build import resolve_path
    from molt_hydra.parallel.sft import STOP, STOPPED, run_sft

    d, t, c = cfg.data, cfg.train, cfg.checkpoint
    stop = multiprocessing.get_context("spawn").Value("i", 0, lock=False)  # read by the ranks at each step's end
    notice.install(also=lambda: setattr(stop, "value", STOP))
    try:
        with _stopped_rank_ends_the_run(cfg):
            history = run_sft(
                resolve_path(c.path or cfg.model.path), d.train_path, cfg.output_dir, eval_data=cfg.eval.data_path,
                input_key=d.input_key, output_key=d.output_key, chat_template=d.chat_template,
                train_on_last_turn_only=d.train_on_last_turn_only, max_len=d.max_len, max_samples=d.max_samples,
                batch_size=t.batch_size, max_epochs=t.epochs, eval_steps=cfg.eval.every_steps, save_steps=c.save_steps,
                ckpt_path=c.dir, keep=c.max_num, resume=c.resume.value != "never", export_hf=c.export_final,
                num_ranks=cfg.parallelism.trainer_devices, seed=cfg.seed, image_key=d.image_key,
                max_images_per_prompt=d.max_images_per_prompt, max_disk_gb=c.max_disk_gb,
                load_model_only=c.load_model_only, resume_step=resume_from.name if resume_from is not None else None,
                stop=stop, ignore_signals=(NOTICE,), run_record=record, **trainer_options(cfg, t.optimizer))
    finally:
        notice.uninstall()
    if stop.value == STOPPED:  # (the last record is the step they stopped at)
        notice.saved(history[-1]["global_step"] if c.save_steps != 0 else None)
    return history


def _rank_pids() -> dict[str, int]:
    """This process's ranks (multiprocessing's spawned children), by rank: they start in rank order."""
    found = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "--", "--multiprocessing-fork"],
                           capture_output=True, text=True).stdout.split()
    return {f"sft trainer rank {i}": pid for i, pid in enumerate(sorted(map(int, found)))}


async def _watch_ranks(cfg: RunConfig) -> None:
    """watch_stopped over the ranks, once every one started; a stall dumps their stacks and kills them (which ends
    run_ranks' wait), then raises RoleStalled whose text is the run's last words."""
    while len(ranks := _rank_pids()) < cfg.parallelism.trainer_devices:
        await asyncio.sleep(0.5)
    try:
        await watch_stopped(ranks)
    except RoleStalled as e:
        words = stall_report(cfg.output_dir, ranks, str(e), [])
        kill([p for pid in ranks.values() for p in (pid, *descendants(pid))])
        raise RoleStalled(e.role, "", 0, "\n".join(words)) from None


@contextmanager
def _stopped_rank_ends_the_run(cfg: RunConfig):
    """A rank stopped by a signal (SIGSTOP) for ~60 s ends the run naming it, as an RL run's roles: the same
    watch_stopped, on a thread (run_ranks waits on this one, where the notice's signals go). Before: the other ranks
    waited on it in their collective, and run_ranks' wait for the job's end was 3600 s at least."""
    loop, stall = asyncio.new_event_loop(), []
    task = loop.create_task(_watch_ranks(cfg))

    def watch() -> None:
        with suppress(asyncio.CancelledError):
            try:
                loop.run_until_complete(task)
            except RoleStalled as e:
                stall.append(e)
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()

    thread = threading.Thread(target=watch, name="sft-stopped-ranks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with suppress(RuntimeError):  # (its loop closed: it ended on a stall)
            loop.call_soon_threadsafe(task.cancel)
        thread.join()
        if stall:  # the ranks' end (killed) is the stall's
            raise stall[0]
