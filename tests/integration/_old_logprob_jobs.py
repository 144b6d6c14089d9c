"""Rank function for tests/integration/test_old_logprob_pass.py: the controller's train step (runtime/controller.py)
driving a real FSDP2 trainer rank (gloo, one process) through an in-process stand-in for the Ray calls, which records
every trainer method the step calls."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch


class InProcessCalls:
    """`RoleCalls.ranks` for one in-process rank: the real TrainerWorker method, called directly (no Ray)."""

    def __init__(self, worker):
        self.worker, self.called = worker, []

    async def ranks(self, group, method, *args, shard=None, role="actor", calls=1, **kw):
        self.called.append((method, dict(kw)))
        return [getattr(self.worker, method)(*((shard,) if shard is not None else ()), *args, **kw)]


def batch(model_name: str, prompts: int = 2, group: int = 4, seed: int = 0):
    """A finished rollout batch: prompts x group trajectories of varied lengths, engine log-probs near the tiny
    model's (uniform over 512 tokens: log 1/512 = -6.24) so some IS ratios pass the filter and some do not; MoE: the
    engine's experts for every token but the last (vLLM records none for it)."""
    from molt_hydra.agents.base import Trajectory
    from molt_hydra.rollout.generator import FinishedGroup, RolloutBatch

    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(prompts):
        trajs = []
        for k in range(group):
            n_prompt, n_resp = 3 + p, 4 + (5 * k + p) % 6
            ids = torch.randint(1, 512, (n_prompt + n_resp,), generator=g).tolist()
            lp = (-6.24 + 0.8 * torch.randn(n_resp, generator=g)).tolist()
            t = Trajectory(token_ids=ids, logprobs=[0.0] * n_prompt + lp, versions=[-1] * n_prompt + [0] * n_resp,
                           action_ranges=[(n_prompt, n_prompt + n_resp)], reward=float(k % 3 == 0) + 0.1 * k,
                           group_id=f"g{p}", rollout_id=f"g{p}-{k}")
            if model_name.startswith("tiny://qwen3_moe"):
                experts = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2 * len(ids))])
                t.routed_experts = experts.view(len(ids), 2, 2).tolist()[:-1] + [None]
            trajs.append(t)
        groups.append(FinishedGroup(prompt_index=p, epoch=0, trajectories=trajs))
    return RolloutBatch(groups, {}, exhausted=False)


def controller_step(rank, world_size, port, out, cfg, model_name, force_two_pass):
    """One controller train step; saves its logged metrics, the trainer calls it made and the weights after it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from molt_hydra.algorithm.is_correction import ISCorrection
    from molt_hydra.algorithm.loss import PolicyLoss
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    from molt_hydra.runtime.controller import RLController

    a = cfg.algorithm
    w = TrainerWorker(TrainerSpec(rank=rank, world_size=world_size, master_port=port, model_path=model_name, lr=1e-2,
                                  max_tokens_per_micro_batch=40, timeout_s=120,
                                  routing_replay=cfg.rollout.routing_replay))
    policy_loss = PolicyLoss(a.policy_loss, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
                             entropy_coef=a.entropy_coef, loss_agg=a.loss_agg.value,
                             is_correction=ISCorrection(a.is_correction.level.value, a.is_correction.mode.value,
                                                        a.is_correction.low, a.is_correction.high))
    calls = InProcessCalls(w)
    roles = SimpleNamespace(actor=SimpleNamespace(num_ranks=1, dp_size=1, per_shard=list), ref=None, critic=None,
                            pad_token_id=0, policy_loss=policy_loss, calls=calls)
    ctl = RLController(cfg, roles, log=None)
    if force_two_pass:  # the reference computation: the separate no-grad pass, as before the one-pass path
        ctl.old_logprobs_from_training = lambda *_: False
    metrics = asyncio.run(ctl.train_step(batch(model_name), {"timing/generation": 1.0}))
    model = get_state_dict(w.model, w.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))[0]
    torch.save({"metrics": metrics, "called": calls.called, "model": model}, out)
    w.shutdown()


class RoleCalls:
    """`RoleCalls.ranks` for one in-process rank per role: the real TrainerWorker method of the group's `worker`,
    called directly (no Ray); records each call's role, method, keywords, shard and other arguments."""

    def __init__(self):
        self.called = []

    async def ranks(self, group, method, *args, shard=None, role="actor", calls=1, **kw):
        self.called.append((role, method, dict(kw), shard, args))
        return [getattr(group.worker, method)(*((shard,) if shard is not None else ()), *args, **kw)]


def epochs_step(rank, world_size, port, out, cfg):
    """One controller train step of PPO with a critic (gae) over `train.epochs` epochs, then the same epochs as
    separate train steps (one optimizer step each) on fresh actor and critic ranks from the same weights: their
    metrics, and both runs' weights after the step."""
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    from molt_hydra.runtime.controller import RLController
    from molt_hydra.runtime.roles import _policy_loss

    def ranks():
        spec = dict(rank=rank, world_size=world_size, master_port=port, model_path=cfg.model.path, lr=1e-2,
                    max_tokens_per_micro_batch=40, timeout_s=120)
        return {role: SimpleNamespace(num_ranks=1, dp_size=1, per_shard=list,
                                      worker=TrainerWorker(TrainerSpec(role=role, **spec)))
                for role in ("actor", "critic")}

    calls, trained = RoleCalls(), ranks()
    roles = SimpleNamespace(ref=None, pad_token_id=0, policy_loss=_policy_loss(cfg), calls=calls, **trained)
    metrics = asyncio.run(RLController(cfg, roles, log=None).train_step(batch(cfg.model.path), {}))
    fresh, separate = ranks(), {}
    for role, method, _, shard, (objective,) in (c for c in calls.called if c[1] == "train_step"):
        if role not in separate:  # each epoch as a train step of its own: the metrics of its optimizer step
            separate[role] = [fresh[role].worker.train_step(shard, objective) for _ in range(cfg.train.epochs)]
    torch.save({"metrics": metrics, "separate": separate, "called": [c[:3] for c in calls.called],
                "weights": {k: [full_weights(g[k].worker) for g in (trained, fresh)] for k in trained}}, out)
    for group in (trained, fresh):
        for r in group.values():
            r.worker.shutdown()


def full_weights(w) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(w.model, w.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))[0]
