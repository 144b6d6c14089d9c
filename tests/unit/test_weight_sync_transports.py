"""Weight buckets, and the NCCL / CUDA-IPC sync paths driven through the real send code (`push_from_rank`, the
transports) and the real worker-extension receive code.

NCCL and CUDA cannot run here: the broadcast path runs over the same `BroadcastGroup` (a torch process group from a
TCPStore) with gloo instead of NCCL, `FakeWorker` stands in for a GPU vLLM worker (it records what vLLM's
`load_weights` would be given), and `FakeEngine` for an engine actor handle. The CUDA-IPC test shares a CPU buffer
through the same torch reduction CUDA IPC uses. The GPU versions of these tests are in tests/gpu.
"""

import asyncio
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

# The CUDA IPC transports' handles are pickled (`transports.ipc_handle`); on these CPU stand-ins a CPU tensor's handle
# names its shared-memory file, which this process maps back to the same storage (torch's sharing cache)
torch.multiprocessing.set_sharing_strategy("file_system")
from molt_hydra.parallel.launch import free_port  # noqa: E402
from molt_hydra.runtime.roles import weight_transport  # noqa: E402
from molt_hydra.weight_sync.buckets import (ALIGN, bucket_weights, iter_weight_buckets,  # noqa: E402
                                            local_full_weights, pack_bucket, unpack_bucket)
from molt_hydra.weight_sync.receiver import WeightReceiver  # noqa: E402
from molt_hydra.weight_sync.sender import WeightSync, open_broadcast, push_from_rank  # noqa: E402
from molt_hydra.weight_sync.shared_memory import SharedMemoryTransport  # noqa: E402
from molt_hydra.weight_sync.shared_params import rank_shared_params  # noqa: E402
from molt_hydra.weight_sync.transports import BroadcastGroup, BroadcastTransport, CudaIpcTransport  # noqa: E402


def named_tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(16, 8, generator=g)),          # 512 B
            ("b.bias", torch.randn(8, generator=g).to(torch.bfloat16)),  # 16 B
            ("c.big", torch.randn(64, 8, generator=g)),             # 2048 B
            ("d.ids", torch.arange(6, dtype=torch.int64).view(2, 3))]  # 48 B


def test_buckets_are_bounded_and_keep_order():
    buckets = list(bucket_weights(named_tensors(), bucket_bytes=600))
    assert [[n for n, _ in b] for b in buckets] == [["a.weight", "b.bias"], ["c.big"], ["d.ids"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_weights(named_tensors(), 0))


def test_pack_unpack_roundtrip_is_exact_across_dtypes():
    metas, flat = pack_bucket(named_tensors())
    assert flat.dtype == torch.uint8 and flat.numel() == 512 + 16 + 2048 + 48
    for (n1, t1), (n2, t2) in zip(named_tensors(), unpack_bucket(metas, flat)):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2)
    with pytest.raises(ValueError, match="bytes"):
        unpack_bucket(metas, flat[:-1])


def gloo_groups(world: int) -> list[BroadcastGroup]:
    """`world` members of one real gloo `BroadcastGroup` (each joins from its own thread, as processes would)."""
    port = free_port()
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda r: BroadcastGroup("127.0.0.1", port, r, world, "cpu", timeout_s=30), range(world)))


class FakeWorker(WeightReceiver):
    """Stands in for a GPU vLLM worker: `reload_weights` records the tensors it was given."""

    device = torch.device("cpu")
    rank = 0  # vLLM worker rank inside its engine

    def __init__(self):
        self.loaded = {}

    def _vllm_begin_reload(self):
        pass

    def _vllm_finish_reload(self):
        pass

    def _load_into_model(self, bucket):
        self.loaded.update({n: t.clone() for n, t in bucket})


class FakeEngine:
    """Stands in for a `VLLMEngine` Ray handle: `.method.remote(...)` is awaitable; calls are logged in order."""

    def __init__(self, worker, log):
        self.worker, self.log, self.version = worker, log, 0
        self.stamps = None  # (began, ended) the engine reports for a single pass; None: the wall clock's now
        # a vLLM worker runs one RPC at a time, in order: two gloo receives of one group at once would abort gloo
        self.worker_thread = ThreadPoolExecutor(1)
        for name in ("begin_weight_update", "finish_weight_update", "worker_call", "load_weights_bytes",
                     "update_from_shared_params"):
            setattr(self, name, types.SimpleNamespace(remote=self._remote(name)))

    def _remote(self, name):
        async def call(*args):
            self.log.append(name if name != "worker_call" else args[0])
            run = asyncio.get_running_loop().run_in_executor
            if name == "worker_call":
                return [await run(self.worker_thread, getattr(self.worker, args[0]), *args[1:])]
            if name == "load_weights_bytes":  # the object store's call: safetensors bytes to every worker
                return await run(self.worker_thread, self.worker.load_safetensors_bytes, bytes(args[0]))
            if name == "begin_weight_update":  # pause (nothing to freeze here), then begin
                return [self.worker.begin_layerwise_reload()]
            if name == "finish_weight_update":  # finish, stamp, resume (nothing to resume), the coverage check
                version, check = args
                self.worker.finish_layerwise_reload()
                self.version = version
                return None if check is None or version is None else [self.worker.missing_weights(check)]
            if name == "update_from_shared_params":  # the single pass's one call: the worker's, then stamp, resume
                token_names_handles, version, check = args
                answer = await run(self.worker_thread, self.worker.update_from_shared_params, *token_names_handles,
                                   check)
                self.version = version
                return [answer], 0.0, self.stamps or (time.time(), time.time())  # no vLLM calls of its own here
        return lambda *args: call(*args)


def test_pack_casts_floats_to_the_wire_dtype_and_aligns_every_tensor():
    bucket = [("odd.bf16", torch.randn(3).to(torch.bfloat16)),   # 6 bytes: the next tensor would start misaligned
              ("w.fp32", torch.randn(5, 3)), ("ids", torch.arange(3))]
    metas, flat = pack_bucket(bucket, torch.bfloat16)
    assert [m[1] for m in metas] == ["bfloat16", "bfloat16", "int64"]  # integers keep their dtype
    assert flat.numel() == 16 + 32 + 32  # 6, 30, 24 bytes, each rounded up to 16
    for (_, t0), (_, t1) in zip(bucket, unpack_bucket(metas, flat)):
        assert torch.equal(t1, t0.to(torch.bfloat16) if t0.is_floating_point() else t0)


def run_config(*overrides: str):
    """The validated RunConfig `molt-run` would build from these overrides."""
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from molt_hydra.runtime.validate import validate

    return validate(OmegaConf.to_object(compose_config(list(overrides))))


GPU_ONE_HOST = ["cluster=local_gpus", "cluster.memory_gb_per_device=139", "parallelism.trainer_devices=1"]


@pytest.mark.parametrize("overrides,transport", [
    ([], "shared_memory"),  # auto, CPU, one host
    (["rollout.weight_sync.transport=shared_memory"], "shared_memory"),
    (["rollout.weight_sync.transport=object_store"], "object_store"),
    (["cluster=slurm", "cluster.nodes=2", "parallelism.trainer_devices=2"], "object_store"),  # auto: other hosts
    ([*GPU_ONE_HOST], "nccl"),  # auto, GPU, engines on their own GPUs
    ([*GPU_ONE_HOST, "rollout.weight_sync.transport=nccl"], "nccl"),
    ([*GPU_ONE_HOST, "cluster.devices_per_node=1", "parallelism.colocate=true", "train.mode=sync"], "cuda_ipc"),
    ([*GPU_ONE_HOST, "cluster.devices_per_node=1", "parallelism.colocate=true", "train.mode=sync",
      "rollout.weight_sync.transport=cuda_ipc"], "cuda_ipc"),
    (["+recipe=tiny_lora_cpu"], "object_store"),  # LoRA: the adapter, wherever the engines are
])
def test_each_config_value_selects_its_transport(overrides, transport):
    """Every transport is reachable from `rollout.weight_sync.transport` (or `auto` on its placement) through a
    config that validates; the GPU ones are run through that value by tests/gpu."""
    assert weight_transport(run_config(*overrides)) == transport


@pytest.mark.parametrize("overrides,reason", [
    (["rollout.weight_sync.transport=nccl"], "this run is on CPU"),
    (["rollout.weight_sync.transport=cuda_ipc", "cluster=local_gpus", "parallelism.trainer_devices=1"],
     "must share each GPU"),
])
def test_validation_refuses_a_transport_the_placement_cannot_use(overrides, reason):
    from molt_hydra.config.schema import ConfigError

    with pytest.raises(ConfigError, match=f"rollout.weight_sync.transport: .*{reason}"):
        run_config(*overrides)


def wire_bytes(tensors, dtype) -> int:
    """Bytes a packed sync moves: floats in `dtype`, each tensor rounded up to the pack alignment."""
    sizes = [t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for _, t in tensors]
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


@pytest.mark.parametrize("kind", ["broadcast_over_gloo", "cuda_ipc_cpu_stand_in"])
def test_gpu_transports_deliver_every_tensor_in_the_wire_dtype_and_bump_the_version(kind):
    log = []
    workers = [FakeWorker() for _ in range(2)]
    engines = [FakeEngine(w, log) for w in workers]
    if kind == "broadcast_over_gloo":
        sender, *receivers = gloo_groups(3)
        t = BroadcastTransport(sender, torch.bfloat16)
        for w, g in zip(workers, receivers):  # what init_weight_broadcast does on each engine worker
            w._weight_comm = g
    else:
        t = CudaIpcTransport(torch.bfloat16)
    sync = WeightSync(engines, t, timeout_s=10)
    report = asyncio.run(sync.sync(bucket_weights(named_tensors(), 600)))
    assert sync.version == 1 and report["weight_sync/tensors"] == 4
    # not fp32 bytes
    assert report["weight_sync/bytes"] == wire_bytes(named_tensors(), torch.bfloat16) < 512 + 16 + 2048 + 48
    assert [e.version for e in engines] == [1, 1]
    for w in workers:
        for name, t0 in named_tensors():
            want = t0.to(torch.bfloat16) if t0.is_floating_point() else t0
            assert w.loaded[name].dtype == want.dtype and torch.equal(w.loaded[name], want)
    # one call per engine before the buckets (pause + begin), one after (finish, stamp, resume)
    assert log[:2] == ["begin_weight_update"] * 2 and log[-2:] == ["finish_weight_update"] * 2
    assert log.count("begin_weight_update") == log.count("finish_weight_update") == 2
    assert all(w._loaded_names == {n for n, _ in named_tensors()} for w in workers)
    assert log.index("finish_weight_update") > max(i for i, m in enumerate(log) if m.startswith("receive_"))


class StandInTrainerRank:
    """Stands in for a TrainerWorker (rank 0, CPU): the real `iter_weight_buckets` over an fp32 module."""

    rank = 0
    device = torch.device("cpu")

    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        # what Ray's `actor.__ray_call__.remote(fn, *args)` does: run fn(actor, *args) in the actor
        self.__ray_call__ = types.SimpleNamespace(remote=lambda fn, *args: asyncio.to_thread(fn, self, *args))

    def weight_buckets(self, bucket_bytes, dtype=None, device="cpu"):
        return iter_weight_buckets(self.model, bucket_bytes, dtype, device)


COLOCATED_GPU = [*GPU_ONE_HOST, "cluster.devices_per_node=1", "parallelism.colocate=true", "train.mode=sync"]


@pytest.mark.parametrize("overrides", [
    ["rollout.weight_sync.transport=shared_memory"], ["rollout.weight_sync.transport=object_store"],
    [*GPU_ONE_HOST, "rollout.weight_sync.transport=nccl"], [*COLOCATED_GPU, "rollout.weight_sync.transport=cuda_ipc"],
])
def test_push_from_rank_sends_the_engine_dtype_and_stamps_the_version(overrides, monkeypatch):
    """Each transport, selected by its config value, through the real sender and receiver on CPU stand-ins: gloo plays
    NCCL's part, a CPU buffer's shared-memory handle CUDA IPC's, and `ray.put` hands the object store's bytes as they
    are (tests/integration/test_sync_probe.py runs it through Ray)."""
    import ray

    monkeypatch.setattr(ray, "put", lambda blob: blob)
    transport = weight_transport(run_config(*overrides))
    rank0, log = StandInTrainerRank(), []
    worker = FakeWorker()
    engine = FakeEngine(worker, log)
    if transport == "nccl":  # the set-up the runtime does once at start
        asyncio.run(open_broadcast(rank0, [engine], workers_per_engine=1, timeout_s=30))
        assert isinstance(rank0.weight_broadcast_group, BroadcastGroup) and worker._weight_comm.group.size() == 2
    metrics = push_from_rank(rank0, [engine], transport, 7, bucket_bytes=256, check_coverage=False,
                             timeout_s=120, dtype="bfloat16")  # shm: the first load imports vLLM
    state = rank0.model.state_dict()
    assert engine.version == 7
    assert metrics["weight_sync/tensors"] == len(state) == 4
    packed = transport != "object_store"  # each tensor aligned in a flat buffer; the object store sends safetensors
    assert metrics["weight_sync/bytes"] == (wire_bytes(state.items(), torch.bfloat16) if packed
                                            else sum(t.numel() * 2 for t in state.values()))
    for name, t in state.items():
        assert worker.loaded[name].dtype == torch.bfloat16 and torch.equal(worker.loaded[name], t.to(torch.bfloat16))


def test_gpu_transports_keep_two_buckets_in_flight_before_waiting_for_the_engines():
    """Pipelining: `push` returns once a bucket is sent, so the next bucket is packed while the engines load this one;
    a third bucket waits until the first one was answered; `drain` leaves nothing in flight."""
    async def scenario():
        answered = [asyncio.Event() for _ in range(3)]
        calls = []

        async def receive(*_):
            i = len(calls)
            calls.append(i)
            await answered[i].wait()
            return [1]

        engine = types.SimpleNamespace(worker_call=types.SimpleNamespace(remote=receive))
        t, bucket = CudaIpcTransport(torch.bfloat16), [("w", torch.ones(4))]
        await t.push([engine], bucket, lambda ref: ref)
        await t.push([engine], bucket, lambda ref: ref)  # returned although bucket 0 is not loaded yet
        third = asyncio.create_task(t.push([engine], bucket, lambda ref: ref))
        await asyncio.sleep(0.05)
        assert not third.done() and calls == [0, 1]
        answered[0].set()
        await asyncio.wait_for(third, 5)
        assert calls == [0, 1, 2]
        for event in answered[1:]:
            event.set()
        await t.drain()
        assert not t.in_flight

    asyncio.run(scenario())


def test_shm_packs_the_next_bucket_into_the_other_slot_while_the_engines_load_one():
    """Pipelining on CPU: bucket 1 is packed (into the region's second slot) before the engines answered for bucket 0;
    bucket 2 reuses slot 0 only after bucket 0 was answered, and the bytes each load call was pointed at are its own."""
    async def scenario():
        answered = [asyncio.Event() for _ in range(3)]
        calls = []

        async def load(method, handle, metas, offset):
            assert method == "load_shared_bucket_recorded"
            calls.append(offset)
            await answered[len(calls) - 1].wait()
            return [(1, None, "not mapped")]  # one worker, its parameters not in a region of their own

        engine = types.SimpleNamespace(worker_call=types.SimpleNamespace(remote=load))
        transport = SharedMemoryTransport(torch.float32)
        buckets = [[("w", torch.full((4,), float(i)))] for i in range(3)]
        await transport.push([engine], buckets[0], lambda ref: ref)
        # returns although bucket 0 is not loaded yet
        await asyncio.wait_for(transport.push([engine], buckets[1], lambda ref: ref), 5)
        slot = transport.region.numel() // 2
        third = asyncio.create_task(transport.push([engine], buckets[2], lambda ref: ref))
        await asyncio.sleep(0.05)
        assert not third.done() and calls == [0, slot]
        assert transport.region[:16].view(torch.float32).tolist() == [0.0] * 4  # slot 0 still holds bucket 0
        answered[0].set()
        await asyncio.wait_for(third, 5)
        assert calls == [0, slot, 0] and transport.region[:16].view(torch.float32).tolist() == [2.0] * 4
        for event in answered[1:]:
            event.set()
        await transport.drain()
        assert not transport.in_flight

    asyncio.run(scenario())


def test_a_failed_pipelined_sync_leaves_nothing_in_flight_for_the_next_one():
    """An engine whose loads fail (it died) fails the sync (engines finished and resumed) and no bucket of it stays in
    flight: the next sync, to a healthy engine, is not failed by the old answers and delivers every tensor."""
    class Dying(FakeWorker):
        dead = True

        def load_shared_bucket_recorded(self, *args):
            if self.dead:
                raise RuntimeError("engine died")
            return super().load_shared_bucket_recorded(*args)

    log, worker = [], Dying()
    engine = FakeEngine(worker, log)
    transport = SharedMemoryTransport(torch.float32)
    one_per_bucket = 1  # 4 buckets: more than the two in flight
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(WeightSync([engine], transport, timeout_s=60).sync(bucket_weights(named_tensors(), one_per_bucket)))
    assert not transport.in_flight and log[-1] == "finish_weight_update" and engine.version is None
    worker.dead = False
    sync = WeightSync([engine], transport, timeout_s=60, version=1)
    asyncio.run(sync.sync(bucket_weights(named_tensors(), one_per_bucket)))
    assert sync.version == 2
    assert set(worker.loaded) == {n for n, _ in named_tensors()}


def test_shm_region_is_mapped_once_reused_across_syncs_and_replaced_when_a_bucket_outgrows_it():
    """The CPU path: buckets packed (cast to the wire dtype) into one memfd region the worker maps by path and loads
    from as views; no file is left behind, the same region serves every later sync, a larger bucket gets a new one."""
    import glob
    import os

    log, worker = [], FakeWorker()
    engine = FakeEngine(worker, log)
    transport = SharedMemoryTransport(torch.bfloat16)
    shm_files = set(glob.glob("/dev/shm/*molt*"))  # ours only: Ray / vLLM of other tests make their own
    report = asyncio.run(WeightSync([engine], transport, timeout_s=120).sync(bucket_weights(named_tensors(), 600)))
    assert report["weight_sync/bytes"] == wire_bytes(named_tensors(), torch.bfloat16)
    assert report["weight_sync/tensors"] == 4
    for name, t0 in named_tensors():
        want = t0.to(torch.bfloat16) if t0.is_floating_point() else t0
        assert worker.loaded[name].dtype == want.dtype and torch.equal(worker.loaded[name], want)
    path, size, token = transport.handle
    assert path == f"/proc/{os.getpid()}/fd/{transport.fd}" and size == 2 * 2048 // 2  # 2 slots of c.big in bf16
    assert worker._shared_region[0] == token and set(glob.glob("/dev/shm/*molt*")) <= shm_files

    second = [(n, t + 1) if t.is_floating_point() else (n, t) for n, t in named_tensors()]
    asyncio.run(WeightSync([engine], transport, timeout_s=120, version=1).sync(bucket_weights(second, 600)))
    assert transport.handle[2] == token and worker._shared_region[0] == token  # same region, not re-mapped
    assert torch.equal(worker.loaded["c.big"], (named_tensors()[2][1] + 1).to(torch.bfloat16))

    asyncio.run(WeightSync([engine], transport, timeout_s=120, version=2).sync([[("huge", torch.ones(4096))]]))
    assert transport.handle[1] == 2 * 4096 * 2 and transport.handle[2] != token  # grown: a new region, mapped anew
    assert worker._shared_region[0] == transport.handle[2] and torch.equal(worker.loaded["huge"],
                                                                          torch.ones(4096, dtype=torch.bfloat16))


# --- CUDA IPC in one pass: one trainer rank shares its own parameters, the worker maps them once per token ---

class CastingWorker(FakeWorker):
    """A worker whose loader copies by name into bf16 parameters of its own (as a vLLM loader casts into the engine's
    parameters); counts the IPC handles it opened."""

    def __init__(self, names_shapes):
        super().__init__()
        self.params = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in names_shapes}
        self.opened = 0

    def _open_ipc(self, handle):
        self.opened += 1
        return super()._open_ipc(handle)

    def _load_into_model(self, bucket):
        for name, t in bucket:
            self.params[name].copy_(t)

    def _engine_tensors(self):
        return list(self.params.values())

    def _engine_addresses(self):
        return tuple(t.data_ptr() for t in self.params.values())


class OneRank(StandInTrainerRank):
    """A one-rank trainer whose parameters are full tensors (TrainerWorker.local_weights on FSDP2 with dp=1)."""

    world_size = 1

    def local_weights(self):
        return local_full_weights(self.model)


def test_single_pass_loads_from_the_ranks_own_parameters_mapped_once_and_never_stale():
    rank0, log = OneRank(), []
    rank0.model.share_memory()  # as CUDA memory is: shareable where it is (sharing moves no storage, keeps the token)
    state = rank0.model.state_dict()
    worker = CastingWorker([(n, t.shape) for n, t in state.items()])
    engine = FakeEngine(worker, log)

    def sync(version):
        log.clear()
        return push_from_rank(rank0, [engine], "cuda_ipc", version, bucket_bytes=256, check_coverage=False,
                              timeout_s=10, dtype="bfloat16")

    def assert_engine_holds_the_ranks_weights():
        for name, t in rank0.model.state_dict().items():
            assert torch.equal(worker.params[name], t.detach().to(torch.bfloat16)), name

    metrics = sync(1)
    assert metrics["weight_sync/single_pass"] == 1.0 and engine.version == 1
    # one call per engine: begin, load, finish and the stamp together; the worker's own load is part of it
    assert log == ["update_from_shared_params"]
    assert 0 < metrics["weight_sync/engine_load_seconds"] < metrics["weight_sync/push_seconds"]
    assert metrics["weight_sync/push_seconds"] <= metrics["weight_sync/seconds"]
    assert metrics["weight_sync/engine_call_seconds"] == 0.0 and "weight_sync/begin_seconds" not in metrics
    assert metrics["weight_sync/tensors"] == 4
    assert metrics["weight_sync/bytes"] == sum(t.numel() * 2 for t in state.values())  # written in bf16, unpadded
    assert worker.opened == 4 and worker._loaded_names == set(state)  # the handles came with the first call
    assert_engine_holds_the_ranks_weights()
    # the views share the trainer's storages' memory (here on CPU the same shared pages, mapped again from the
    # pickled handle): nothing was copied on the trainer's side, and a write there is seen through the view
    mapped = dict(worker._shared_params[1])
    with torch.no_grad():
        for t in state.values():
            t.add_(1.0)
        assert all(torch.equal(mapped[n], t) for n, t in state.items())
        for t in state.values():
            t.sub_(1.0)

    with torch.no_grad():  # an optimizer step: in place, same storages
        for p in rank0.model.parameters():
            p.mul_(-2).add_(0.5)
    replayed = sync(2)
    assert log == ["update_from_shared_params"] and worker.opened == 4 and engine.version == 2  # nothing re-mapped
    assert worker.shared_load_path == "replay"  # the first sync's loader copies were proven and replayed
    assert metrics["weight_sync/replayed"] == 0.0 and replayed["weight_sync/replayed"] == 1.0
    assert_engine_holds_the_ranks_weights()  # the cached views served the new values

    rank0.model[1].weight = nn.Parameter(torch.randn(4, 16))  # a new storage (e.g. a reload): a new token
    sync(3)
    assert worker.opened == 8 and log == ["update_from_shared_params"]  # a new token: its handles with the call
    assert worker.shared_load_path == "record"  # the plan read the old views: recorded again
    assert_engine_holds_the_ranks_weights()

    # a replaced engine is a new handle: it gets the handles with its first call
    new_worker = CastingWorker([(n, t.shape) for n, t in rank0.model.state_dict().items()])
    replacement = FakeEngine(new_worker, log)
    push_from_rank(rank0, [replacement], "cuda_ipc", 4, bucket_bytes=256, check_coverage=False, timeout_s=10,
                   dtype="bfloat16")
    assert new_worker.opened == 4 and replacement.version == 4 and worker.opened == 8


def test_colocated_sync_is_one_call_per_engine_from_the_driver_with_the_offer_taken_at_the_release(monkeypatch):
    """The driver (runtime/calls.py `RoleCalls`) drives the single pass: the call that releases the trainer's cached
    memory before a colocated push brings the rank's offer, so the push itself is one call per engine and none to the
    trainer; a push without that release (a warm start, a replaced engine) asks for the offer first; the handles reach
    each engine once per token; an engine's failure is the weight sync's, named so."""
    from molt_hydra.config.schema import TimeoutsConfig, WeightSyncConfig
    from molt_hydra.runtime.calls import RoleCalls
    from molt_hydra.runtime.watchdog import RunFailed

    rank0, log, trainer_calls = OneRank(), [], []
    rank0.model.share_memory()
    run_in_rank = rank0.__ray_call__.remote
    rank0.__ray_call__ = types.SimpleNamespace(
        remote=lambda fn, *args: trainer_calls.append(fn.__name__) or run_in_rank(fn, *args))
    shapes = [(n, t.shape) for n, t in rank0.model.state_dict().items()]
    workers = [CastingWorker(shapes), CastingWorker(shapes)]
    engines = [FakeEngine(w, log) for w in workers]
    roles = types.SimpleNamespace(transport="cuda_ipc", actor=types.SimpleNamespace(num_ranks=1, workers=[rank0]),
                                  ref=None, critic=None, engines=engines)
    calls = RoleCalls(roles, TimeoutsConfig(), WeightSyncConfig(), "bfloat16")
    # the round trip's legs from stamps, not a race: the driver's clock reads 100 s at the call and at the answer;
    # engine 0 began 0.25 s after the call and ended 0.5 s before the answer, engine 1 0.125 s and 0.75 s
    from molt_hydra.weight_sync import shared_params
    monkeypatch.setattr(shared_params, "time", types.SimpleNamespace(time=lambda: 100.0))
    engines[0].stamps, engines[1].stamps = (100.25, 99.5), (100.125, 99.25)

    def assert_engines_hold_the_ranks_weights():
        for worker in workers:
            for name, t in rank0.model.state_dict().items():
                assert torch.equal(worker.params[name], t.detach().to(torch.bfloat16)), name

    async def colocated_sync(version):
        log.clear(), trainer_calls.clear()
        await calls.release_trainer_memory()
        return await calls.push_weights(version)

    async def scenario():
        metrics = await colocated_sync(1)
        assert trainer_calls == ["_release_cuda_cache"]  # the offer came with the release: the push called no rank
        assert log == ["update_from_shared_params"] * 2 and [e.version for e in engines] == [1, 1]
        assert metrics["weight_sync/single_pass"] == 1.0 and metrics["weight_sync/tensors"] == 4
        # each leg is the slowest engine's
        assert (metrics["weight_sync/to_engine_seconds"], metrics["weight_sync/from_engine_seconds"]) == (0.25, 0.75)
        assert [w.opened for w in workers] == [4, 4]  # the handles came with each engine's first call
        assert_engines_hold_the_ranks_weights()

        with torch.no_grad():  # an optimizer step: in place, the same storages
            for p in rank0.model.parameters():
                p.mul_(-2).add_(0.5)
        await colocated_sync(2)
        assert trainer_calls == ["_release_cuda_cache"] and [w.opened for w in workers] == [4, 4]
        assert [e.version for e in engines] == [2, 2]
        assert_engines_hold_the_ranks_weights()

        trainer_calls.clear()
        await calls.push_weights(3)  # no release before it: the offer is asked for, then the engines are called
        assert trainer_calls == ["offer_shared_params"] and [e.version for e in engines] == [3, 3]

        def broken(*args):
            raise RuntimeError("no CUDA memory to map")

        engines[1].update_from_shared_params = types.SimpleNamespace(remote=lambda *a: asyncio.to_thread(broken))
        with pytest.raises(RunFailed) as failed:
            await colocated_sync(4)
        assert failed.value.role == "weight sync" and "push of version 4 failed: RuntimeError: no CUDA memory" in str(
            failed.value)

    asyncio.run(scenario())


def test_single_pass_applies_only_to_cuda_ipc_from_one_rank_holding_whole_own_tensors():
    rank0, bf16 = OneRank(), torch.bfloat16
    shared = rank_shared_params(rank0, "cuda_ipc", bf16)
    assert [n for n, _ in shared.tensors] == list(rank0.model.state_dict())
    assert rank_shared_params(rank0, "cuda_ipc", bf16) is shared  # storages unchanged: the same one
    assert rank_shared_params(rank0, "nccl", bf16) is None
    assert rank_shared_params(rank0, "shared_memory", bf16) is None
    assert rank_shared_params(StandInTrainerRank(), "cuda_ipc", bf16) is None  # no local_weights: gathers
    rank0.world_size = 2
    assert rank_shared_params(rank0, "cuda_ipc", bf16) is None
    # a conversion that makes new tensors cannot be shared (the engine would read a temporary)
    assert local_full_weights(rank0.model, to_hf=lambda n, t: [(n, t.clone())]) is None
    assert len(local_full_weights(rank0.model, to_hf=lambda n, t: [(n, t[:1]), (n + ".rest", t[1:])])) == 8

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(tie_word_embeddings=True)
            self.embed = nn.Embedding(8, 4)
            self.lm_head = nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.embed.weight

    assert [n for n, _ in local_full_weights(Tied())] == ["embed.weight"]  # the engine re-ties its lm_head


# --- CPU, mapped in place: the worker's parameters live in a shared region the trainer writes into ---

class PlainCpuWorker(WeightReceiver):
    """A CPU worker with plain weights: bf16 parameters in vLLM's fused layout (q/k/v rows of one qkv), a tied head
    (its own Parameter on the embedding's storage) and vLLM-style loaders (narrow, then copy_ casting fp32 -> bf16)."""

    device = torch.device("cpu")
    rank = 0
    _loads_in_place = True
    ROWS = {"q.weight": (0, 4), "k.weight": (4, 2), "v.weight": (6, 2)}

    def __init__(self):
        model = nn.Module()
        model.qkv = nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16), requires_grad=False)
        model.embed = nn.Parameter(torch.zeros(5, 8, dtype=torch.bfloat16), requires_grad=False)
        model.head = nn.Parameter(model.embed.data, requires_grad=False)  # tied: a second Parameter, one storage
        model.bias = nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)
        self.model = model
        self.cache_resets = []  # what vLLM's model runner was asked to drop (outputs of the old weights)
        self.model_runner = types.SimpleNamespace(get_model=lambda: model,
                                                  reset_encoder_cache=lambda: self.cache_resets.append("encoder"),
                                                  reset_mm_cache=lambda: self.cache_resets.append("mm"))
        self.loader_calls = 0

    def _load_into_model(self, bucket):
        self.loader_calls += 1
        with torch.no_grad():
            for name, t in bucket:
                if name in self.ROWS:
                    self.model.qkv.narrow(0, *self.ROWS[name]).copy_(t)
                elif name == "head.weight":
                    pass  # tied: the engine's loader skips it
                else:
                    getattr(self.model, name.removesuffix(".weight")).copy_(t)

    def expected(self, weights):
        w = dict(weights)
        return {"qkv": torch.cat([w["q.weight"], w["k.weight"], w["v.weight"]]).to(torch.bfloat16),
                "embed": w["embed.weight"].to(torch.bfloat16)}


def plain_weights(seed, with_bias=False):
    g = torch.Generator().manual_seed(seed)
    names = [("q.weight", (4, 8)), ("k.weight", (2, 8)), ("v.weight", (2, 8)), ("embed.weight", (5, 8)),
             ("head.weight", (5, 8))] + ([("bias.weight", (8,))] if with_bias else [])
    return [(n, torch.randn(shape, generator=g)) for n, shape in names]


def test_shm_writes_into_a_plain_cpu_engines_parameters_in_place_after_one_recorded_sync():
    """Sync 1 goes through the engine's loaders (which move its parameters into a shared region of their own and
    record their copies); from sync 2 on the trainer writes every bucket into those parameters itself: no bucket goes
    to the engine, the result is bit-equal to the loaders' (fp32 -> bf16 casts included), the tied head stays tied.
    A tensor the recording never saw goes through the loaders once and is written in place after that."""
    log, worker = [], PlainCpuWorker()
    engine, transport = FakeEngine(worker, log), SharedMemoryTransport(torch.bfloat16)
    sync = WeightSync([engine], transport, timeout_s=60)
    one_per_bucket = 1  # fused qkv split across buckets

    first = plain_weights(0)
    assert asyncio.run(sync.sync(bucket_weights(first, one_per_bucket)))["weight_sync/in_place"] == 0.0
    # outputs of the old weights are dropped when the update begins (paused): there is no reload to finish after it
    assert worker.cache_resets == ["encoder", "mm"]
    assert transport.mapped is None and log.count("load_shared_bucket_recorded") == 5
    for name, want in worker.expected(first).items():
        assert torch.equal(getattr(worker.model, name), want)
    handle = worker.begin_layerwise_reload()
    assert handle is not None and worker.model.head.data_ptr() == worker.model.embed.data_ptr()
    region = torch.from_file(handle[0], shared=True, size=handle[1], dtype=torch.uint8)
    assert region.untyped_storage().nbytes() == handle[1]  # the parameters' storage is that memfd region
    assert worker.model.qkv.untyped_storage().data_ptr() == worker._parameter_map[1].untyped_storage().data_ptr()

    log.clear()
    second = plain_weights(1)
    report = asyncio.run(sync.sync(bucket_weights(second, one_per_bucket)))
    assert transport.mapped is not None and "load_shared_bucket_recorded" not in log and worker.loader_calls == 5
    assert transport.written == {n for n, _ in second} and report["weight_sync/tensors"] == 5
    assert report["weight_sync/in_place"] == 1.0
    for name, want in worker.expected(second).items():
        assert torch.equal(getattr(worker.model, name), want)
    assert torch.equal(worker.model.head, worker.expected(second)["embed"])  # tied: the same storage, written once

    log.clear()
    third = plain_weights(2, with_bias=True)  # a tensor the plan does not know: the loaders, once
    asyncio.run(sync.sync(bucket_weights(third, one_per_bucket)))
    assert log.count("load_shared_bucket_recorded") == 1 and worker.loader_calls == 6
    assert torch.equal(worker.model.bias, third[-1][1].to(torch.bfloat16))
    log.clear()
    fourth = plain_weights(3, with_bias=True)
    asyncio.run(sync.sync(bucket_weights(fourth, one_per_bucket)))
    assert "load_shared_bucket_recorded" not in log and worker.loader_calls == 6
    assert torch.equal(worker.model.bias, fourth[-1][1].to(torch.bfloat16))
    assert torch.equal(worker.model.qkv, worker.expected(fourth)["qkv"])

    # a sync through the loaders while the plan exists (another engine was not mapped yet: a replacement) records
    # the whole load again: it replaces the plan (no copy twice), and the next sync is in place again
    transport.mapped = None
    transport.begin = lambda answers, begin=transport.begin: begin([[None], *answers])
    asyncio.run(sync.sync(bucket_weights(plain_weights(4, with_bias=True), one_per_bucket)))
    assert log.count("load_shared_bucket_recorded") == 6 and worker.loader_calls == 12
    del transport.begin
    fifth = plain_weights(5, with_bias=True)
    assert asyncio.run(sync.sync(bucket_weights(fifth, one_per_bucket)))["weight_sync/in_place"] == 1.0
    assert worker.loader_calls == 12
    assert torch.equal(worker.model.qkv, worker.expected(fifth)["qkv"])


def test_a_worker_whose_loaders_compute_keeps_the_loaders_on_every_sync():
    """A recording that saw more than copies (here a loader that scales into a temporary) gives no plan: every sync
    keeps going through the loaders, and each still lands."""
    class Scaling(PlainCpuWorker):
        def _load_into_model(self, bucket):
            super()._load_into_model([(n, t * 1) for n, t in bucket])

    log, worker = [], Scaling()
    transport = SharedMemoryTransport(torch.bfloat16)
    sync = WeightSync([FakeEngine(worker, log)], transport, timeout_s=60)
    for seed in range(3):
        weights = plain_weights(seed)
        asyncio.run(sync.sync(bucket_weights(weights, 1)))
        assert transport.mapped is None and not transport.plans
        assert torch.equal(worker.model.qkv, worker.expected(weights)["qkv"])
    assert worker.loader_calls == 15


def test_a_tensor_kept_on_a_parameters_memory_keeps_the_parameters_where_they_are():
    """A module attribute aliasing a parameter's memory (a cache a layer built from its weight) would go on reading
    the old memory if the parameter moved into the shared region: such a worker is not mapped, its loaders write in
    place on every sync, and the alias sees each update."""
    class Caching(PlainCpuWorker):
        def __init__(self):
            super().__init__()
            self.model.cached = self.model.qkv.data[:4]  # e.g. a view a layer keeps for its kernel

    log, worker = [], Caching()
    transport = SharedMemoryTransport(torch.bfloat16)
    sync = WeightSync([FakeEngine(worker, log)], transport, timeout_s=60)
    for seed in range(3):
        weights = plain_weights(seed)
        asyncio.run(sync.sync(bucket_weights(weights, 1)))
        assert transport.mapped is None and worker.begin_layerwise_reload() is None
        assert torch.equal(worker.model.cached, worker.expected(weights)["qkv"][:4])
    assert worker.loader_calls == 15
