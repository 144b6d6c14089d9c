"""Two processes on GPUs moving a real model's weights with the project's weight-sync code, without vLLM.

vLLM cannot be installed on the device (it pins another torch), so the receiving process runs the project's own
`WeightReceiver` on top of `StandInModelRunner`, a stand-in for vLLM's GPU model runner: it holds the HF
model in the engine dtype and its `load_weights` copies each tensor into the parameter of that name. The only methods
`StandInWorker` replaces are the ones that call into vLLM (layerwise-reload begin/finish, `load_weights` under vLLM's
config context). The sending process uses the project's send side: `push_from_rank` (the trainer rank's sync),
`iter_weight_buckets`, the transports and `WeightSync`; `StandInTrainerRank` stands in for a TrainerWorker's rank 0
without FSDP (the FSDP gathers are covered by test_trainer_gpu.py) and `StandInEngine` for the Ray handle of a
`VLLMEngine` (its weight-sync methods, forwarded to the receiving process over a pipe, as `collective_rpc` would).
Shared by tests/gpu/test_weight_sync_gpu.py and bench/gpu_weight_sync.py.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
import types

import torch
import torch.multiprocessing as mp

from molt_hydra.parallel.launch import free_port  # noqa: F401 (the tests' and the bench's)
from molt_hydra.weight_sync.buckets import iter_weight_buckets, local_full_weights
from molt_hydra.weight_sync.receiver import WeightReceiver

# Qwen3 layer shapes (hf config values of Qwen/Qwen3-0.6B and Qwen/Qwen3-4B); weights are random.
QWEN3_SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8),  # CPU smoke
}


def qwen3(shape: str, seed: int, dtype: torch.dtype, device: torch.device):
    """A random-init Qwen3 of the named shape, built directly on `device` in `dtype`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=4096, **QWEN3_SHAPES[shape])
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


class StandInModelRunner:
    """Stand-in for vLLM's GPU model runner: `get_model().load_weights` copies (name, tensor) pairs by name."""

    cast_before_copy = False  # a loader that casts into a temporary first: a copy plan cannot be proven for it

    def __init__(self, model):
        self.model = model
        self.params = dict(model.state_dict())

    def get_model(self):
        return self

    def load_weights(self, weights) -> set[str]:
        with torch.no_grad():
            for name, t in weights:
                param = self.params[name]
                param.copy_(t.to(param.dtype) if self.cast_before_copy else t)
        return {name for name, _ in weights}


class StandInWorker(WeightReceiver):
    """The project's receive side (receive_ipc / receive_broadcast / init_weight_broadcast / missing_weights) on a
    stand-in model runner; only the calls into vLLM (layerwise reload begin/finish, load under vLLM's config) are
    replaced."""

    def __init__(self, model, device: torch.device, model_dir: str | None):
        self.rank, self.device = 0, device
        self.model_runner = StandInModelRunner(model)
        self.model_config = types.SimpleNamespace(model=model_dir, hf_config=model.config, hf_text_config=model.config)

    def _vllm_begin_reload(self) -> None:
        pass

    def _load_into_model(self, bucket) -> None:
        self.model_runner.get_model().load_weights(bucket)

    def _vllm_finish_reload(self) -> None:
        pass

    def load_shared_params(self, *args):  # timed: the engine side of a single-pass sync, for the bench
        import time

        start = time.perf_counter()
        try:
            return super().load_shared_params(*args)
        finally:
            self.load_seconds = time.perf_counter() - start

    # --- for the checks and the baseline only ---

    def copy_plan_streams(self) -> int:
        return self._copy_plan.streams

    def replay_seconds(self, repeats: int = 5) -> float:
        """Best replay of the current copy plan alone (graph launch + stream sync) in this process: what the engine's
        GPU copies take from the mapped trainer memory, without the call, the address check or the Python around."""
        import time

        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self._copy_plan.replay()
            torch.cuda.current_stream(self.device).synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def last_load_seconds(self) -> float:
        """Wall time of the last `load_shared_params` in this process (loads or replay, and the stream sync)."""
        return self.load_seconds

    def share_weights(self) -> list:
        """IPC handles of every parameter, so the sender can compare bit for bit."""
        from torch.multiprocessing.reductions import reduce_tensor

        return [(n, reduce_tensor(t)) for n, t in self.model_runner.params.items()]

    def shared_load(self) -> tuple[str | None, str | None]:
        """How the last single-pass load ran ("record", "replay" or "loader") and why a copy plan was refused."""
        plan = getattr(self, "_copy_plan", None)
        return getattr(self, "shared_load_path", None), plan if isinstance(plan, str) else None

    def set_loader(self, cast_before_copy: bool = False, record_copy_plans: bool = True) -> None:
        """Switch the stand-in's loader (and whether copy plans are recorded); the current plan is dropped, as a
        real engine's loaders never change under a plan."""
        self.model_runner.cast_before_copy = cast_before_copy
        self.record_copy_plans = record_copy_plans
        self._copy_plan = None

    def shared_params_token(self) -> str | None:
        """The token of the trainer storages this worker has mapped (single-pass path), or None."""
        return getattr(self, "_shared_params", None) and self._shared_params[0]

    def baseline_broadcast(self, nbytes: int) -> None:
        """A plain broadcast of `nbytes` into a fresh buffer: the baseline a weight sync is compared with."""
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._weight_comm.broadcast(flat, src=0).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def serve(conn, shape: str, device: str, model_dir: str | None) -> None:
    """The receiving process: build the engine-side model (bf16, a different seed than the trainer's), optionally
    save it as the engine's checkpoint (what `missing_weights` checks against), then run worker calls until None."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = qwen3(shape, seed=1, dtype=torch.bfloat16, device=device)
    if model_dir:
        model.save_pretrained(model_dir)
    worker = StandInWorker(model, device, model_dir)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        method, args = msg
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as e:  # noqa: BLE001 - sent back and re-raised in the sending process
            conn.send(("error", f"{type(e).__name__}: {e}"))


class StandInEngine:
    """Stand-in for a `VLLMEngine` Ray handle: `handle.method.remote(*args)` sends the call at once (as Ray submits
    it) and returns an awaitable result. The pause and resume inside begin/finish_weight_update are vLLM scheduler
    calls: nothing to do without an engine. Several calls may be outstanding (the GPU transports keep buckets in
    flight): the receiving process answers in call order, and one reader thread hands each answer to its call."""

    def __init__(self, shape: str, device: str, model_dir: str | None = None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, shape, device, model_dir), daemon=True)
        self.process.start()
        if not self.conn.poll(600) or self.conn.recv() != "ready":
            raise RuntimeError("stand-in engine process did not start")
        self.answers: collections.deque = collections.deque()  # one future per outstanding call, in call order
        self.sending = threading.Lock()
        threading.Thread(target=self._read_answers, daemon=True).start()
        self.version = 0
        for name in ("begin_weight_update", "finish_weight_update", "worker_call", "update_from_shared_params"):
            setattr(self, name, types.SimpleNamespace(remote=getattr(self, f"_{name}")))

    def _read_answers(self) -> None:
        while True:
            try:
                answer = self.conn.recv()
            except (EOFError, OSError):
                return
            self.answers.popleft().set_result(answer)

    def _send(self, method: str, args) -> concurrent.futures.Future:
        answer = concurrent.futures.Future()
        with self.sending:
            self.answers.append(answer)
            self.conn.send((method, args))
        return answer

    def call(self, method: str, *args):
        """Blocking worker call (outside a sync)."""
        status, value = self._send(method, args).result()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def _submit(self, method: str, *args):
        answer = self._send(method, args)

        async def result():
            status, value = await asyncio.wrap_future(answer)
            if status != "ok":
                raise RuntimeError(value)
            return value
        return result()

    def _begin_weight_update(self):
        return self._submit("begin_layerwise_reload")

    def _finish_weight_update(self, version, check=None):
        done = self._submit("finish_layerwise_reload")
        checked = self._submit("missing_weights", check) if check is not None and version is not None else None

        async def stamp():  # resume: a vLLM scheduler call
            await done
            if version is not None:
                self.version = version
            return None if checked is None else [await checked]
        return stamp()

    def _update_from_shared_params(self, args, version, check):
        entered = time.time()
        done = self._submit("update_from_shared_params", *args, check)

        async def stamp():  # stamp and resume: vLLM calls, none here
            answer = await done
            self.version = version
            return [answer], 0.0, (entered, time.time())
        return stamp()

    def _worker_call(self, method: str, *args):
        one = self._submit(method, *args)

        async def per_worker():
            return [await one]
        return per_worker()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(30)


class StandInTrainerRank:
    """Stand-in for a TrainerWorker's rank 0 without FSDP: fp32 master weights on `device`, the real
    `iter_weight_buckets` (what `TrainerWorker.weight_buckets` calls) and `local_full_weights` (what
    `TrainerWorker.local_weights` calls; `single_pass=False` withholds it, so a cuda_ipc sync takes the bucketed path,
    as with dp > 1). `skip` leaves a tensor out of every sync."""

    rank, world_size = 0, 1

    def __init__(self, shape: str, device: torch.device, single_pass: bool = False, dtype=torch.float32):
        self.device = device
        self.model = qwen3(shape, seed=0, dtype=dtype, device=device)
        self.skip: set[str] = set()
        self.single_pass = single_pass

    def __setattr__(self, name, value):
        if name in ("skip", "single_pass"):  # what `local_weights` returns changes: look it up again next sync
            self.__dict__.pop("shared_params", None)
        super().__setattr__(name, value)

    def weight_buckets(self, bucket_bytes, dtype=None, device="cpu"):
        for bucket in iter_weight_buckets(self.model, bucket_bytes, dtype, device):
            kept = [(n, t) for n, t in bucket if n not in self.skip]
            if kept:
                yield kept

    def local_weights(self):
        weights = local_full_weights(self.model) if self.single_pass else None
        return None if weights is None else [(n, t) for n, t in weights if n not in self.skip]

    def optimizer_step(self, seed: int) -> None:
        """A real AdamW step on random gradients: the parameters change in place, their storages stay."""
        g = torch.Generator(self.device).manual_seed(seed)
        for p in self.model.parameters():
            p.grad = torch.randn(p.shape, generator=g, device=self.device, dtype=p.dtype)
        torch.optim.AdamW(self.model.parameters(), lr=1e-2).step()
        self.model.zero_grad(set_to_none=True)

    def expected(self) -> dict[str, torch.Tensor]:
        """What the engine must hold after a sync: every pushed tensor in bf16 (a tied lm_head is not pushed)."""
        return {n: t.detach().to(torch.bfloat16) for n, t in self.model.state_dict().items() if n != "lm_head.weight"}


def engine_weights(engine: StandInEngine) -> dict[str, torch.Tensor]:
    """The engine process's parameters, mapped into this process (CUDA IPC) for a bit-exact comparison."""
    return {n: rebuild(*args) for n, (rebuild, args) in engine.call("share_weights")}


def wire_bytes(rank: StandInTrainerRank) -> int:
    return sum(t.numel() * 2 for t in rank.expected().values())


# --- measurements (reported by the tests, recorded by bench/gpu_weight_sync.py) ---

def sync_seconds(rank: StandInTrainerRank, engine: StandInEngine, transport: str, bucket_bytes: int,
                 repeats: int = 3) -> float:
    """Best of `repeats` whole `push_from_rank` calls (path selection, pause .. finish, send-side packing and casting
    included), after a warm-up."""
    import time

    from molt_hydra.weight_sync import push_from_rank

    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        push_from_rank(rank, [engine], transport, engine.version + 1, bucket_bytes=bucket_bytes,
                       check_coverage=False, timeout_s=600, dtype="bfloat16")
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def call_seconds(engine: StandInEngine, repeats: int = 20) -> float:
    """Median round trip of a worker call that does nothing (the stand-in's per-call cost, paid 3x per sync)."""
    import statistics
    import time

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.call("shared_params_token")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cast_copy_seconds(rank: StandInTrainerRank, repeats: int = 5) -> float:
    """Best one-call `torch._foreach_copy_` of every pushed fp32 tensor into a bf16 tensor of its own, in one process:
    the traffic of the single-pass sync (read fp32, write bf16) with none of its per-tensor or per-call costs."""
    import time

    src = [t.detach() for n, t in rank.model.state_dict().items() if n != "lm_head.weight"]
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize(rank.device)
        start = time.perf_counter()
        torch._foreach_copy_(dst, src)
        torch.cuda.synchronize(rank.device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def graph_copy_seconds(rank: StandInTrainerRank, streams: int, repeats: int = 5) -> float:
    """Best replay of a `CopyPlan` (one CUDA graph, copies spread over `streams`) of every pushed tensor into a bf16
    tensor of its own, in one process: a replayed plan with no worker call, IPC mapping or Python around it."""
    import time

    from molt_hydra.weight_sync.copy_plan import CopyPlan

    src = [t.detach() for n, t in rank.model.state_dict().items() if n != "lm_head.weight"]
    plan = CopyPlan([(torch.empty_like(t, dtype=torch.bfloat16), t, False) for t in src], [], ())
    plan.streams = streams
    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize(rank.device)
        start = time.perf_counter()
        plan.replay()
        torch.cuda.synchronize(rank.device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def device_copy_seconds(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Best `dst.copy_(src)` of `nbytes` on one GPU."""
    import time

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def broadcast_seconds(rank: StandInTrainerRank, engine: StandInEngine, nbytes: int, repeats: int = 3) -> float:
    """Best plain broadcast of `nbytes` (one buffer) over the same group, until the receiver has it."""
    import time

    flat = torch.empty(nbytes, dtype=torch.uint8, device=rank.device)
    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize(rank.device)
        start = time.perf_counter()
        done = engine._submit("baseline_broadcast", nbytes)
        rank.weight_broadcast_group.broadcast(flat, src=0).wait()
        asyncio.run(done)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def connect(rank: StandInTrainerRank, engine: StandInEngine, port: int) -> None:
    """The NCCL group {trainer rank 0, engine worker}: both ends join at once (what `weight_sync.open_broadcast`
    does through Ray), the engine's through the worker extension's `init_weight_broadcast`."""
    from concurrent.futures import ThreadPoolExecutor

    from molt_hydra.weight_sync.transports import BroadcastGroup

    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.call, "init_weight_broadcast", "127.0.0.1", port, 1, 2, 300)
        rank.weight_broadcast_group = BroadcastGroup("127.0.0.1", port, 0, 2, rank.device, 300)
        joined.result()
