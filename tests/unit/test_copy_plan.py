"""The single pass's recorded copy plan (weight_sync/copy_plan.py) on CPU tensors: what a recording proves, what it
refuses, and that a replay gives the loaders' own result; then through the worker extension's `load_shared_params`.
The CUDA-graph replay of the same plan is tested on the GPU (tests/gpu/test_weight_sync_gpu.py)."""

import types

import pytest
import torch
from torch import nn

from molt_hydra.weight_sync.buckets import parameter_addresses
from molt_hydra.weight_sync.copy_plan import CopyPlan, record_copy_plan
from molt_hydra.weight_sync.transports import ipc_handle
from molt_hydra.weight_sync.receiver import WeightReceiver

torch.multiprocessing.set_sharing_strategy("file_system")  # a CPU tensor's handle names its shared-memory file


def trainer_weights():
    """fp32 trainer tensors, named as a checkpoint names them (q/k/v separate, fused into qkv by the engine)."""
    g = torch.Generator().manual_seed(0)
    return [(n, torch.randn(shape, generator=g)) for n, shape in
            [("q.weight", (4, 8)), ("k.weight", (2, 8)), ("v.weight", (2, 8)), ("norm.weight", (8,))]]


class FusedEngine(nn.Module):
    """bf16 engine tensors with vLLM's layout (q, k, v stacked in one qkv tensor) and vLLM-style loaders: narrow the
    fused tensor to the shard's rows, then `copy_` (which casts fp32 -> bf16)."""

    ROWS = {"q.weight": (0, 4), "k.weight": (4, 2), "v.weight": (6, 2)}

    def __init__(self):
        super().__init__()
        self.register_buffer("qkv", torch.zeros(8, 8, dtype=torch.bfloat16))
        self.register_buffer("norm", torch.zeros(8, dtype=torch.bfloat16))
        self.scratch = torch.zeros(8, dtype=torch.bfloat16)  # not a parameter or buffer

    def tensors(self):
        return [self.qkv, self.norm]

    def load(self, weights, transform=None):
        with torch.no_grad():
            for name, t in weights:
                t = transform(t) if transform else t
                if name in self.ROWS:
                    self.qkv.narrow(0, *self.ROWS[name]).copy_(t)
                else:
                    self.norm.copy_(t)

    def expected(self, weights):
        w = dict(weights)
        return torch.cat([w["q.weight"], w["k.weight"], w["v.weight"]]).to(torch.bfloat16), \
            w["norm.weight"].to(torch.bfloat16)


def test_a_copy_only_load_is_recorded_and_its_replay_serves_in_place_updates_bit_equal():
    weights, engine = trainer_weights(), FusedEngine()
    plan = record_copy_plan(lambda: engine.load(weights), weights, engine.tensors(), parameter_addresses(engine))
    assert isinstance(plan, CopyPlan)
    assert len(plan.copies) == 4 and plan.names == ["q.weight", "k.weight", "v.weight", "norm.weight"]
    assert plan.streams == CopyPlan.BRANCHES > 1  # the q/k/v row blocks and the norm do not overlap
    qkv, norm = engine.expected(weights)
    assert torch.equal(engine.qkv, qkv) and torch.equal(engine.norm, norm)  # the recorded load ran in full

    with torch.no_grad():  # an optimizer step on the trainer: in place, same storages
        for _, t in weights:
            t.mul_(-3).add_(0.25)
    qkv, norm = engine.expected(weights)
    assert not torch.equal(engine.qkv, qkv)
    assert plan.addresses == parameter_addresses(engine)
    plan.replay()
    assert torch.equal(engine.qkv, qkv) and torch.equal(engine.norm, norm)  # same bits as the loaders would give

    engine.norm = torch.zeros(8, dtype=torch.bfloat16)  # the engine replaced a parameter: the plan writes a dead one
    assert plan.addresses != parameter_addresses(engine)


class PaddedVocabEngine(nn.Module):
    """vLLM's VocabParallelEmbedding loader: the checkpoint's rows copied in, the padding rows filled with 0."""

    def __init__(self):
        super().__init__()
        self.register_buffer("embed", torch.full((6, 8), 7.0, dtype=torch.bfloat16))

    def load(self, weights):
        w = dict(weights)["q.weight"]  # 4 rows: 2 padding rows
        with torch.no_grad():
            self.embed[:w.shape[0]].copy_(w)
            self.embed[w.shape[0]:].fill_(0)


def test_a_vocab_padding_fill_is_replayed_with_the_copies():
    """A colocated engine's level-2 sleep discards its weights' memory, padding rows too: the replay must write them."""
    weights, engine = trainer_weights(), PaddedVocabEngine()
    plan = record_copy_plan(lambda: engine.load(weights), weights, [engine.embed], ())
    assert isinstance(plan, CopyPlan) and len(plan.fills) == 1
    engine.embed.fill_(float("nan"))  # what a woken, discarded allocation may hold
    plan.replay()
    q = dict(weights)["q.weight"].to(torch.bfloat16)
    assert torch.equal(engine.embed, torch.cat([q, torch.zeros(2, 8, dtype=torch.bfloat16)]))

    def overlapping_fill():
        with torch.no_grad():
            engine.embed[:4].copy_(dict(weights)["q.weight"])
            engine.embed[3:].fill_(0)  # writes a row the copy wrote: the order would matter

    assert record_copy_plan(overlapping_fill, weights, [engine.embed], ()) == \
        "a fill overlaps a copy (their order would matter)"


def test_a_load_that_computes_allocates_or_writes_elsewhere_is_refused_and_still_runs():
    weights = trainer_weights()

    def refusal(load_with, engine=None):
        engine = engine or FusedEngine()
        return record_copy_plan(lambda: load_with(engine), weights, engine.tensors(), ()), engine

    reason, engine = refusal(lambda e: e.load(weights, transform=lambda t: t * 2))  # a loader that scales
    assert isinstance(reason, str) and "mul" in reason
    assert torch.equal(engine.norm, (dict(weights)["norm.weight"] * 2).to(torch.bfloat16))  # it ran in full
    reason, _ = refusal(lambda e: e.load(weights, transform=lambda t: t.to(torch.bfloat16)))  # casts to a temporary
    assert isinstance(reason, str) and "_to_copy" in reason
    reason, _ = refusal(lambda e: e.scratch.copy_(dict(weights)["norm.weight"]))  # writes a non-parameter
    assert reason == "a copy into a tensor that is not an engine parameter or buffer"
    reason, _ = refusal(lambda e: None)
    assert reason == "the loaders copied nothing"


class CpuWorker(WeightReceiver):
    """The worker extension on the fused CPU engine; `_open_ipc` gets `weight_sync.ipc_handle`s of CPU tensors in
    shared memory: the "mapped" view shares the trainer's memory, as a CUDA IPC mapping aliases its storage."""

    device = torch.device("cpu")

    def __init__(self):
        self.model_runner = types.SimpleNamespace(model=FusedEngine())  # as vLLM's model_runner.model
        self.transform = None

    @property
    def engine(self):
        return self.model_runner.model

    def _vllm_begin_reload(self):
        pass

    def _vllm_finish_reload(self):
        pass

    def _load_into_model(self, bucket):
        self.engine.load(bucket, self.transform)


def test_worker_records_on_a_new_token_replays_after_and_falls_back_when_unproven():
    weights, worker = trainer_weights(), CpuWorker()
    for _, t in weights:
        t.share_memory_()  # where CUDA memory already is: shareable in place
    names, handles = [n for n, _ in weights], [ipc_handle(t) for _, t in weights]

    def sync(token, with_handles=True):
        worker.begin_layerwise_reload()
        answer = worker.load_shared_params(token, names if with_handles else None, handles if with_handles else None)
        worker.finish_layerwise_reload()
        assert answer[-1] > 0  # the worker's own seconds (weight_sync/engine_load_seconds)
        return answer[:-1]

    def step():
        with torch.no_grad():
            for _, t in weights:
                t.add_(1.5)

    def assert_fresh():
        qkv, norm = worker.engine.expected(weights)
        assert torch.equal(worker.engine.qkv, qkv) and torch.equal(worker.engine.norm, norm)

    assert sync("a") == (4, "record", None)
    step()
    assert sync("a", with_handles=False) == (4, "replay", None)
    assert worker._loaded_names == set(names)  # the coverage check sees the replayed names
    assert_fresh()

    worker.engine.qkv = torch.zeros(8, 8, dtype=torch.bfloat16)  # a replaced parameter: record again
    step()
    sync("a", with_handles=False)
    assert worker.shared_load_path == "record"
    assert_fresh()

    worker.transform = lambda t: t * 1  # an unprovable loader on a new token: the loaders run on every sync
    step()
    sync("b")
    assert worker.shared_load_path == "record" and "mul" in worker._copy_plan
    step()
    n, path, why = sync("b", with_handles=False)
    assert (n, path) == (4, "loader") and "mul" in why
    assert_fresh()
    with pytest.raises(RuntimeError, match="no handles came with the trainer's new parameter token"):
        sync("c", with_handles=False)  # a token this worker never mapped, and no handles: the update fails


def test_copies_into_overlapping_destinations_keep_their_recorded_order():
    weights, engine = trainer_weights(), FusedEngine()
    w = dict(weights)

    def load():  # the last write wins: rows 0..3 of qkv from q, then rows 2..5 from k and v stacked
        engine.qkv.narrow(0, 0, 4).copy_(w["q.weight"])
        engine.qkv.narrow(0, 2, 2).copy_(w["k.weight"])
        engine.qkv.narrow(0, 4, 2).copy_(w["v.weight"])
        engine.qkv.narrow(0, 1, 2).copy_(w["k.weight"])

    plan = record_copy_plan(load, weights, engine.tensors(), ())
    assert plan.streams == 1
    engine.qkv.zero_()
    plan.replay()
    expected = torch.zeros(8, 8)
    expected[0:4], expected[2:4], expected[4:6], expected[1:3] = w["q.weight"], w["k.weight"], w["v.weight"], \
        w["k.weight"]
    assert torch.equal(engine.qkv, expected.to(torch.bfloat16))
