"""Slurm's notice before a time limit or a preemption: SIGUSR2, `hydra.launcher.signal_delay_s` ahead (sbatch
`--signal`). Under submitit its handler requeues the point and exits at once, so the requeued point went back to its
last periodic checkpoint (none with the presets' `checkpoint.save_steps=-1`: step 0 again). Here the run first ends
the step under way and saves a resumable checkpoint, then hands over to that handler (requeue, exit); without
submitit (a plain sbatch script), it stops after the save. A step that has not ended GRACE_S after the notice is cut
short like a Ctrl-C (the last checkpoint is kept) so the requeue still happens before Slurm's kill. job=sft (no event
loop: its main thread waits on its ranks) takes the notice through a plain handler that also tells its ranks, and
its cut is a KeyboardInterrupt in that thread.
"""

from __future__ import annotations

import _thread
import asyncio
import signal
import sys
import threading

GRACE_S = 60.0  # half of the presets' signal_delay_s (120 s): a step's end plus its save must fit before the kill
NOTICE = signal.SIGUSR2


def ignoring_the_notice(program: str) -> list[str]:
    """The command line that runs `program` with the notice ignored. Slurm signals every process of a job step (the
    Ray head's, and through srun the other nodes'): they must live on while the driver saves. Ignored stays ignored
    across exec, so all they start ignore it too."""
    return [sys.executable, "-c", f"import os, signal, sys; signal.signal(signal.{NOTICE.name}, signal.SIG_IGN); "
            "os.execv(sys.argv[1], sys.argv[1:])", program]


class PreemptionNotice:
    """`received`: set when the notice came (the controller saves and stops at the end of its step); `handover()`
    after the run's teardown: submitit's requeue, or an exit naming the saved checkpoint."""

    def __init__(self, run_dir: str | None = None) -> None:
        self.run_dir = run_dir  # named in the resume line (the default hydra.run.dir is new per command)
        self.received = asyncio.Event()
        self.saved_step: int | None = None
        self.stopped = False  # the training loop stopped on the notice (`saved`)
        self._previous = self._submitit = self._cut = self._loop = None
        self._installed = self._over = self._at_once = False

    def install(self, loop: asyncio.AbstractEventLoop | None = None, main_task: asyncio.Task | None = None,
                also=None, at_once: bool = False) -> None:
        """Through the run's event loop (RL): a step past the grace is cut by cancelling `main_task`. Without one
        (job=sft): a plain handler, the cut a KeyboardInterrupt in the main thread (as Ctrl-C's). `also()`: called
        as the notice comes (job=sft: sets the flag its ranks read at each step's end). `at_once`: before the run's
        body (the resume check, the models' build, Ray forming over the nodes): nothing to save yet, the
        KeyboardInterrupt comes at once (the caller hands over). A later install takes over from it; uninstall()
        restores the handler from before the first."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread takes signals (a notebook's run thread)
        if not self._installed:  # (installed already: at_once, before the run's body; the handler before it is kept)
            self._previous, self._installed = signal.getsignal(NOTICE), True
            # submitit's handler (submitit/core/job_environment.py, SignalHandler): a bound method; anything else
            # (the default action: terminate) is not handed over to
            named = getattr(self._previous, "__name__", "")
            self._submitit = self._previous if named == "checkpoint_and_try_requeue" else None
        self._loop, self._at_once = loop, at_once
        if loop is not None:
            loop.add_signal_handler(NOTICE, self._notice, lambda: loop.call_later(GRACE_S, main_task.cancel), also)
        else:
            cut = _interrupt_main_now if at_once else _interrupt_main_later
            signal.signal(NOTICE, lambda signum, frame: self._notice(cut, also))

    def _notice(self, cut_later, also) -> None:
        if self.received.is_set():
            return
        what = ("the run has not started, nothing to save: it stops now" if self._at_once else
                f"the run saves a checkpoint at the end of this step (cut short after {GRACE_S:.0f} s)")
        print(f"\n{NOTICE.name}: Slurm's notice of a time limit or a preemption: {what}, then "
              f"{'is requeued' if self._submitit else 'stops'}.", file=sys.stderr, flush=True)
        self.received.set()
        if also is not None:
            also()
        self._cut = None if self._over else cut_later()

    def over(self) -> None:
        """The run's body is over (its report and teardown follow): no step runs, nothing is to be cut short. Before,
        a cut due then cancelled the report or the teardown (a traceback last, Ray's processes left to the reaper)."""
        self._over = True
        if self._cut is not None:
            self._cut.cancel()

    def saved(self, step: int | None) -> None:
        """The loop stopped at a step's end (saved, unless checkpoint.save_steps=0): the teardown is not cut short."""
        self.saved_step, self.stopped = step, True
        if self._cut is not None:
            self._cut.cancel()

    def uninstall(self) -> None:
        if self._cut is not None:  # (job=sft's timer would interrupt whatever runs next in this process)
            self._cut.cancel()
        if not self._installed:
            return
        self._installed = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(NOTICE)
        # asyncio would leave the default action (terminate), as would a closed loop (its close resets the signal:
        # the handler before the run would be lost); None: a handler not set from Python
        signal.signal(NOTICE, signal.SIG_DFL if self._previous is None else self._previous)

    def handover(self) -> None:
        """After the teardown, outside the event loop: submitit requeues the point and exits (-1); elsewhere exit
        EXIT_INTERRUPTED with the step the next run resumes from."""
        from molt_hydra.config.schema import EXIT_INTERRUPTED

        where = f"checkpoint saved at step {self.saved_step}" if self.saved_step is not None else "no checkpoint saved"
        if self._submitit is not None:
            print(f"{NOTICE.name}: {where}; requeueing the point (it resumes with checkpoint.resume=auto).",
                  file=sys.stderr, flush=True)
            self._submitit(NOTICE, None)  # requeues and exits
        in_dir = f" hydra.run.dir={self.run_dir}" if self.run_dir else ""
        print(f"\nRun stopped on {NOTICE.name} (a time limit or a preemption): {where}; resume with "
              f"checkpoint.resume=auto{in_dir}.", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)


def _interrupt_main_now() -> None:
    raise KeyboardInterrupt  # (in the main thread: the handler runs there)


def _interrupt_main_later() -> threading.Timer:
    """job=sft's cut: a KeyboardInterrupt in the main thread GRACE_S from now (its ranks then end, as on Ctrl-C).
    `interrupt_main` is Python's SIGINT handling, which does nothing where SIGINT is ignored (a run started in the
    background, `molt-run ... &` in a script): Python's own handler is put in for the cut (was: no cut at all)."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):  # (called in the main thread)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(GRACE_S, _thread.interrupt_main)
    timer.daemon = True
    timer.start()
    return timer
