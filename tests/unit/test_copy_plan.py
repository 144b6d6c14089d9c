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


class ExpertsEngine(nn.Module):
    """vLLM's fused-MoE layout, w13 [E, 2I, H] (each expert's gate rows, then its up rows) and w2 [E, H, I], loaded
    expert by expert and projection by projection as vLLM's FusedMoE loader does (narrow, then `copy_`)."""

    E, I, H = 5, 3, 4

    def __init__(self):
        super().__init__()
        self.register_buffer("w13", torch.zeros(self.E, 2 * self.I, self.H, dtype=torch.bfloat16))
        self.register_buffer("w2", torch.zeros(self.E, self.H, self.I, dtype=torch.bfloat16))

    def load(self, per_expert):
        with torch.no_grad():
            for (e, projection), t in per_expert:
                if projection == "down":
                    self.w2[e].copy_(t)
                else:
                    self.w13[e].narrow(0, 0 if projection == "gate" else self.I, self.I).copy_(t)


def test_a_moe_loads_per_expert_copies_replay_as_one_copy_per_projection_bit_equal():
    """AutoModel keeps experts transposed ([E, H, 2I] and [E, I, H]) and pushes each expert's projection as a view;
    vLLM's loader writes it into its own expert: E x 3 recorded copies, replayed as 3 (gate, up, down)."""
    E, I, H = ExpertsEngine.E, ExpertsEngine.I, ExpertsEngine.H
    g = torch.Generator().manual_seed(1)
    gate_and_up, down = torch.randn(E, H, 2 * I, generator=g), torch.randn(E, I, H, generator=g)
    per_expert = [((e, p), view) for e in range(E) for p, view in
                  [("gate", gate_and_up[e, :, :I].T), ("up", gate_and_up[e, :, I:].T), ("down", down[e].T)]]
    engine = ExpertsEngine()
    weights = [("gate_and_up", gate_and_up), ("down", down)]
    plan = record_copy_plan(lambda: engine.load(per_expert), weights, [engine.w13, engine.w2], ())
    assert len(plan.copies) == 3 * E and len(plan.replayed) == 3
    assert sorted(tuple(dst.shape) for dst, _, _ in plan.replayed) == sorted([(E, I, H), (E, I, H), (E, H, I)])

    with torch.no_grad():  # the optimizer's step, in place
        gate_and_up.mul_(-2).add_(0.5)
        down.mul_(3)
    engine.w13.fill_(float("nan"))
    engine.w2.fill_(float("nan"))
    plan.replay()
    assert torch.equal(engine.w13, gate_and_up.transpose(1, 2).to(torch.bfloat16))  # [E, 2I, H]: gate rows, up rows
    assert torch.equal(engine.w2, down.transpose(1, 2).to(torch.bfloat16))


def test_only_copies_at_constant_steps_in_both_tensors_merge():
    """transformers-5 experts ([E, 2I, H], rows in vLLM's order) merge into one copy per fused tensor; copies whose
    sources do not advance with their destinations stay apart."""
    E, I, H = ExpertsEngine.E, ExpertsEngine.I, ExpertsEngine.H
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    per_expert = [((e, p), view) for e in range(E) for p, view in
                  [("gate", gate_up[e, :I]), ("up", gate_up[e, I:]), ("down", down[e])]]
    engine = ExpertsEngine()
    plan = record_copy_plan(lambda: engine.load(per_expert), [("gate_up", gate_up), ("down", down)],
                            [engine.w13, engine.w2], ())
    assert [tuple(dst.shape) for dst, _, _ in plan.replayed] == [(2 * E, I, H), (E, H, I)]  # gate, up interleaved

    reversed_experts = [((e, "down"), down[E - 1 - e]) for e in range(E)]  # sources step back: a view cannot
    plan = record_copy_plan(lambda: engine.load(reversed_experts), [("down", down)], [engine.w2], ())
    assert len(plan.replayed) == E
    down.add_(1)
    plan.replay()
    assert torch.equal(engine.w2, down.flip(0).to(torch.bfloat16))


def test_broadcast_sources_are_not_merged():
    """copy_ broadcasts: a source of another shape than its destination (a row's first element, a 0-d element)
    stays a copy of its own, though its steps would line up with its neighbours'."""
    src, dst = torch.arange(9.0).reshape(3, 3), torch.zeros(3, 3)

    def load():
        dst[0].copy_(src[0, :1])  # [1] broadcast over row 0
        dst[1].copy_(src[1])
        dst[2].copy_(src[2])

    plan = record_copy_plan(load, [("s", src)], [dst], ())
    assert len(plan.replayed) == 2  # rows 1 and 2 merged, row 0 alone
    src.mul_(-1)
    plan.replay()
    assert torch.equal(dst, torch.stack([src[0, 0].expand(3), src[1], src[2]]))

    elements, rows = torch.arange(3.0), torch.zeros(3, 3)
    plan = record_copy_plan(lambda: [rows[i].copy_(elements[i]) for i in range(3)], [("e", elements)], [rows], ())
    assert len(plan.replayed) == 3
    elements.add_(5)
    plan.replay()
    assert torch.equal(rows, elements[:, None].expand(3, 3))
