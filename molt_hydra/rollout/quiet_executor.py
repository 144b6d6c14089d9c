"""vLLM's multiprocess executor for CPU engines, with shared-memory queue readers that sleep when idle.

vLLM's `MessageQueue` readers (each worker waiting for the scheduler's next step, the engine core waiting for the
workers' outputs) spin on sched_yield for `SpinCondition.busy_loop_s` (1 s) after their last read before they block on
the queue's zmq notify socket. vLLM 0.32 has no setting for it (vllm/utils/ompmultiprocessing.py: "TODO: make
scheduler proc sleep when idle"). On a few cores that spinning takes CPU from the trainer and the agents: the worker
spins through the first second of every training phase, the engine core through every forward of the worker.
vLLM's `distributed_executor_backend` accepts an Executor subclass: this one is vLLM's `MultiprocExecutor` whose
readers, once the queues exist, spin `READER_BUSY_LOOP_S` at most: the engine core's response queues here, every
worker's scheduler-output queue through `collective_rpc`. A reader that stops spinning is woken by the writer's
notify (vLLM's own idle path).
"""

from __future__ import annotations

import sys

from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

# Spin through the gaps inside one generation burst (a step's hand-offs take well under a millisecond to a few ms
# on CPU), block soon after it ends. Not 0: a reader that polls for every message misses notifies sent less than
# ~1 ms apart (the writer's zmq PUB keeps one in flight, SNDHWM=1) and waits 5 s for vLLM's recheck; measured with
# 0: a 0.45 s generation phase took 22-240 s.
READER_BUSY_LOOP_S = 0.05


class QuietMultiprocExecutor(MultiprocExecutor):
    def _post_init_executor(self) -> None:
        super()._post_init_executor()
        for queue in self.response_mqs:
            queue._spin_condition.busy_loop_s = READER_BUSY_LOOP_S
        self.collective_rpc(quiet_worker_reader, args=(READER_BUSY_LOOP_S,))


def quiet_worker_reader(worker, busy_loop_s: float) -> float:
    """Runs in a worker through `collective_rpc`: sets its scheduler-output queue's busy loop; returns it."""
    spin = _worker_proc().rpc_broadcast_mq._spin_condition
    spin.busy_loop_s = busy_loop_s
    return spin.busy_loop_s


def worker_busy_loop_s() -> float:
    """In a worker, inside a `collective_rpc` call: its scheduler-output queue's busy loop in seconds."""
    return _worker_proc().rpc_broadcast_mq._spin_condition.busy_loop_s


def _worker_proc() -> WorkerProc:
    """The `WorkerProc` running the current `collective_rpc` call, found up the stack: vLLM calls the RPC from
    `WorkerProc._execute_worker_rpc` (the worker itself holds no reference to its `WorkerProc`)."""
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(caller := frame.f_locals.get("self"), WorkerProc):
            return caller
        frame = frame.f_back
    raise RuntimeError("no vLLM WorkerProc up the stack of this RPC: vLLM's worker loop changed, "
                       "update molt_hydra/rollout/quiet_executor.py")
