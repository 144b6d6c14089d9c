"""Weight buckets, and the NCCL / CUDA-IPC sync paths driven through the real worker-extension receive code.

NCCL and CUDA cannot run here: `FakeBroadcastGroup` stands in for NCCL (an in-process broadcast between threads),
`FakeWorker` stands in for a GPU vLLM worker (it records what `reload_weights` was given), and `FakeEngine` for an
engine actor handle. The CUDA-IPC test shares CPU tensors through the same torch reduction CUDA IPC uses.
"""

import asyncio
import threading
import types

import pytest
import torch

from molt_hydra.rollout.buckets import bucket_weights, pack_bucket, unpack_bucket
from molt_hydra.rollout.weight_sync import (BroadcastTransport, CudaIpcTransport, Transport, WeightSync,
                                            choose_transport)
from molt_hydra.rollout.worker_extension import WeightSyncWorkerExtension


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


def test_transport_follows_placement():
    assert choose_transport(on_gpu=False, colocated=False, same_host=True) is Transport.shm
    assert choose_transport(on_gpu=False, colocated=False, same_host=False) is Transport.object_store
    assert choose_transport(on_gpu=True, colocated=True, same_host=True) is Transport.cuda_ipc
    assert choose_transport(on_gpu=True, colocated=False, same_host=True) is Transport.nccl


class FakeBroadcastGroup:
    """Stands in for NCCL: rank 0's broadcast is copied into every receiver's buffer."""

    def __init__(self, receivers):
        self.sent = threading.Event()
        self.payload = None
        self.received = threading.Barrier(receivers + 1)

    def member(self, rank):
        group = self

        class Comm:
            def broadcast(self, tensor, src):
                assert src == 0
                if rank == 0:
                    group.payload = tensor.clone()
                    group.sent.set()
                else:
                    assert group.sent.wait(5), "sender never broadcast"
                    tensor.copy_(group.payload)
                group.received.wait(5)
                if rank == 0:
                    group.sent.clear()

        return Comm()


class FakeWorker(WeightSyncWorkerExtension):
    """Stands in for a GPU vLLM worker: `reload_weights` records the tensors it was given."""

    device = torch.device("cpu")

    def __init__(self):
        self.loaded = {}

    def begin_layerwise_reload(self):
        self._loaded_names = set()

    def _load_into_model(self, bucket):
        self.loaded.update({n: t.clone() for n, t in bucket})


class FakeEngine:
    """Stands in for a `VLLMEngine` Ray handle: `.method.remote(...)` is awaitable; calls are logged in order."""

    def __init__(self, worker, log):
        self.worker, self.log, self.version = worker, log, 0
        for name in ("pause", "resume", "begin_weight_update", "finish_weight_update", "worker_call"):
            setattr(self, name, types.SimpleNamespace(remote=self._remote(name)))

    def _remote(self, name):
        async def call(*args):
            self.log.append(name if name != "worker_call" else args[0])
            if name == "worker_call":
                return [await asyncio.to_thread(getattr(self.worker, args[0]), *args[1:])]
            if name == "begin_weight_update":
                self.worker.begin_layerwise_reload()
            if name == "finish_weight_update":
                self.version = args[0]
        return lambda *args: call(*args)


@pytest.mark.parametrize("kind", ["nccl_broadcast_fake_group", "cuda_ipc_cpu_stand_in"])
def test_gpu_transports_deliver_every_tensor_exactly_and_bump_the_version(kind):
    log = []
    workers = [FakeWorker() for _ in range(2)]
    engines = [FakeEngine(w, log) for w in workers]
    if kind == "nccl_broadcast_fake_group":
        group = FakeBroadcastGroup(2)
        t = BroadcastTransport(group.member(0), device="cpu")
        for rank, w in enumerate(workers, start=1):  # what init_weight_broadcast does on a GPU worker
            w._weight_comm = group.member(rank)
    else:
        t = CudaIpcTransport()
    report = asyncio.run(WeightSync(engines, t, timeout_s=10).sync(bucket_weights(named_tensors(), 600)))
    assert report.version == 1 and report.num_tensors == 4 and report.num_bytes == 512 + 16 + 2048 + 48
    assert [e.version for e in engines] == [1, 1]
    for w in workers:
        for name, t0 in named_tensors():
            assert torch.equal(w.loaded[name], t0)
    # pause first, resume last, versions stamped before resuming
    assert log[:4] == ["pause", "pause", "begin_weight_update", "begin_weight_update"]
    assert log[-2:] == ["resume", "resume"]
    assert all(w._loaded_names == {n for n, _ in named_tensors()} for w in workers)
    assert log.index("finish_weight_update") > max(i for i, m in enumerate(log) if m.startswith("receive_"))
