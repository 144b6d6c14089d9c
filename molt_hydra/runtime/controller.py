"""The RL loop: rollout -> experience -> advantages -> train -> weight sync -> metrics -> checkpoint.

One asyncio driver owns the order of events, so a run is a deterministic function of its seed:

* batch j is generated with policy version max(j - D, 0), where D = `train.queue_depth` in async mode and 0 in sync
  mode (every trained token then comes from the current policy; no in-flight carry-over);
* the weight sync after training step k waits until batch k + D exists (so it used version k), except under partial
  rollout, where the sync pauses in-flight requests and they finish under the new weights (tokens carry both versions);
* every trained sample's staleness (current version - oldest token version) is checked against `train.max_staleness`.

One exception, in the last bits only: CPU trainer ranks take every core of their node once the engines stop generating
(`engines_busy` around each generation); in async mode that point falls wherever the engines finish, and torch's
multi-threaded float reductions (sums, norms) differ from single-threaded ones by rounding.
`parallelism.borrow_idle_cpus=false` removes it: every rank keeps to its reserved CPUs on every step.

Every remote call has a deadline (runtime/watchdog.py); when one expires the stacks of every role are dumped, the role
is named and the run exits non-zero. A checkpoint holds the trainer state, the generator's position and the finished
but untrained batches, so `checkpoint.resume=auto` continues exactly; except under partial rollout, whose groups in
flight at the save (vLLM requests, not saved) start over under the resumed weights where the uninterrupted run finished
them across the weight sync.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from molt_hydra.algorithm.advantage import compute_advantages, get_advantage_estimator, group_reward_std
from molt_hydra.algorithm.drift import drift_metrics
from molt_hydra.algorithm.experience import collate, experience_metrics, select_trainable, stack_padded, trainer_rows
from molt_hydra.algorithm.kl import KLController, approx_kl
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import REPLAY_RECORD, replay_settings
from molt_hydra.models.rules import model_fields
from molt_hydra.parallel.objectives import ActorObjective, CriticObjective
from molt_hydra.parallel.retention import SNAPSHOTS
from molt_hydra.rollout.generator import RolloutBatch
from molt_hydra.runtime import ray_head
from molt_hydra.runtime.agent_runner import request_seed
from molt_hydra.runtime.trainer_options import DTYPE_NAMES, optimizer_steps_per_batch
from molt_hydra.runtime.watchdog import RunFailed, beside, deadline

# the namespaces of the metrics the loop adds to a step's after train_step (timing, sync, engines, routers, drift)
LOOP_NAMESPACES = ("timing", "perf", "rollout", "engine", "routing", "drift", "weight_sync", "agent", "eval")
TRAINER_PARTS = ("actor_idle_wait", "engine_sleep", "make_experience", "policy_train", "critic_train",
                 "weight_sync_wait", "trainer_release", "weight_sync", "sync_probe")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def rollout_stats(groups) -> dict[str, float]:
    """Molt's rollout/* metrics over every generated rollout of the step (before staleness drops)."""
    rows = [t for g in groups for t in g.trajectories]
    rewards = [float(t.reward) for t in {t.rollout_id: t for t in rows}.values()]  # a rollout's turns count once
    group_means = [_mean(float(t.reward) for t in {x.rollout_id: x for x in g.trajectories}.values())
                   for g in groups if g.trajectories]
    return {
        "rollout/reward_mean": _mean(rewards),
        "rollout/reward_std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/pass1": _mean(group_means),
        "rollout/num_rollouts": float(len(rewards)),
        "rollout/num_prompt_groups": float(len(groups)),
        "rollout/response_length_mean": _mean(t.num_generated for t in rows),
        "rollout/truncated_rate": _mean(float(bool(t.truncated)) for t in rows),
        "rollout/num_samples": float(len(rows)),
    }


class RLController:
    def __init__(self, cfg: RunConfig, roles, log):
        """`roles`: the built runtime (runtime/roles.py) reached through `roles.calls`; `log`: logging/run_log.py."""
        self.cfg, self.roles, self.calls, self.log = cfg, roles, roles.calls, log
        self.depth = 0 if cfg.train.mode.value == "sync" else cfg.train.queue_depth
        self.step = 0  # training steps done
        self.version = 0  # policy version of the trainer's weights (and, after each sync, of the engines')
        self.queue: asyncio.Queue = asyncio.Queue()
        self.batches_made = 0  # batches handed to the queue (or restored into it)
        self.step_done = asyncio.Condition()
        self.batch_made = asyncio.Condition()
        self.best: tuple[str, float] | None = None
        self.next_eval: int | None = None
        self.exhausted = False
        self.held: tuple | None = None  # a batch out of the generator, not yet queued (see `produce`)
        self.untrainable: Counter = Counter()  # drop reasons over the current run of steps with nothing to train
        self.untrainable_steps = 0
        self.trainer_ahead = False  # a train step ran since the last weight sync: the trainer holds version + 1
        # cumulative counters (the runners' router counts, tool-call parse failures, engine restarts) as last logged,
        # and as saved in the resumed checkpoint: the processes counting them start from 0 again after a resume
        self.counters: dict[str, float] = {}
        self.counters_before: dict[str, float] = {}
        self.colocated = cfg.parallelism.colocate  # engines sleep while the trainer steps; the push wakes them
        self.preempted = asyncio.Event()  # Slurm's notice (runtime/preemption.py): save at this step's end and stop
        self.saved_step: int | None = None
        self.stopped_for_notice = False  # the loop ended on the notice, before its last step
        self.kl_ctl = KLController(cfg.algorithm.kl.coef, cfg.algorithm.kl.target, cfg.algorithm.kl.horizon)
        # the checkpoint's own dropout (config.json, a VLM's sub-configs too): its training forward drops out
        configs = [fields := model_fields(cfg.model.path) or {}, *(c for c in fields.values() if isinstance(c, dict))]
        self.checkpoint_dropout = any(("dropout" in k or "pdrop" in k) and "classifier" not in k and
                                      isinstance(v, (int, float)) and v > 0 for c in configs for k, v in c.items())
        self.trajectory_images = None  # VLM: expands each trajectory's images into the trainer's inputs
        if cfg.data.max_images_per_prompt:
            from molt_hydra.models.build import resolve_path
            from molt_hydra.models.vlm import TrajectoryImages
            self.trajectory_images = TrajectoryImages.for_model(resolve_path(cfg.model.path))

    # ------------------------------------------------------------------ producer
    async def produce(self) -> None:
        """Generate batch j once training step j - D is done (so the engines hold that step's weights)."""
        tail: dict[str, float] = {}  # the drops of a last batch that kept no group (never trained, so never logged)
        while not self.exhausted:
            j = self.batches_made
            t0 = time.perf_counter()
            async with self.step_done:
                await self.step_done.wait_for(lambda: self.step >= max(j - self.depth, 0))
            t1 = time.perf_counter()
            if self.cfg.train.rollout_replay_dir:  # batch j read back, not generated; a missing file ends the data
                path = Path(self.cfg.train.rollout_replay_dir) / f"rollout_step{j}.pt"
                batch = torch.load(path, weights_only=False) if path.exists() else RolloutBatch([], {}, exhausted=True)
            else:
                await self.calls.engines_busy(True, wait=False)
                batch = await self.roles.generator.generate_batch()
            batch.groups.sort(key=lambda g: (g.epoch, g.prompt_index))  # completion order is timing; training is not
            # a replay reads its batch: no rollout side to time (its read as "generation" was a tokens/s of the disk)
            timing = {"timing/rollout_read": time.perf_counter() - t1} if self.cfg.train.rollout_replay_dir else {
                "timing/generation": time.perf_counter() - t1, "timing/vllm_idle_wait": t1 - t0}
            # Held (a save meanwhile keeps it as queued) while the hint below is answered: before, a save then had
            # the generator past its prompts and no batch of them, and the resumed run skipped them.
            self.held = (batch, timing) if batch.groups else None
            if not self.cfg.train.rollout_replay_dir:  # CPU trainer ranks train on every core of their node only
                # while the engines are idle: the hints are sent, not awaited (round trips on the rollout's critical
                # path), except the one a sync step's training must see first (its thread count changes float sums)
                await self.calls.engines_busy(False, wait=self.depth == 0)
            if self.cfg.train.rollout_dump_dir and batch.groups:  # Molt's rollout dump: for replay or study
                path = Path(self.cfg.train.rollout_dump_dir) / f"rollout_step{j}.pt"
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(batch, path)  # and what generated it, which a replay must match (config/validate.py)
                record = path.parent / f".{REPLAY_RECORD}.tmp"  # whole or not at all (a kill mid-write: torn)
                # (its output_dir tells the run itself restarted from batch 0 from another: runtime/entrypoint.py)
                whose = {"output_dir": str(Path(self.cfg.output_dir).resolve())}
                record.write_text(json.dumps({**replay_settings(self.cfg), **whose}, indent=1, default=str))
                os.replace(record, path.parent / REPLAY_RECORD)
            if self.held is not None:
                held, self.held = self.held, None
                await self.queue.put(held)
            async with self.batch_made:  # wakes a weight sync waiting for this batch (or for the end of the data)
                self.batches_made += bool(batch.groups)
                self.exhausted = batch.exhausted or not batch.groups
                self.batch_made.notify_all()
            tail = {} if batch.groups else batch.metrics
        await self.queue.put((None, tail))  # the end of the data, after every batch

    def _nothing_to_train(self, tail: dict[str, float]) -> None:
        """The data ended before the first step had a batch: why (`tail`: the last batch's drops), and the fix."""
        replay = self.cfg.train.rollout_replay_dir
        if replay:
            raise RunFailed("rollout", f"train.rollout_replay_dir={replay} holds no rollout_step{self.batches_made}.pt "
                            "for the first step to train on. Fix: point it at the train.rollout_dump_dir of the run to "
                            "replay (its files start at rollout_step0.pt), or resume that run's checkpoints with it")
        drops = {k.removeprefix("rollout/dropped/"): int(v) for k, v in tail.items()
                 if k.startswith("rollout/dropped/") and k != "rollout/dropped/total" and v}
        raise RunFailed("rollout", "the data ran out before the first step had a batch: no prompt group was kept. Fix: "
                        "see the drops below (algorithm.dynamic_filtering's bounds, rollout.incomplete_groups, the "
                        "agent's failures), or give more data (data.max_samples, train.num_episodes)", drops=drops)

    # ------------------------------------------------------------------ one step
    async def train_step(self, batch, gen_timing: dict) -> dict[str, float]:
        """One training step on a generated batch: experience, the forward passes the advantages need, the
        advantages, the actor's and the critic's training, and the step's metrics (with "_frozen": no new weights)."""
        cfg, roles = self.cfg, self.roles
        timing = dict(gen_timing)
        metrics: dict[str, float] = {**batch.metrics, **rollout_stats(batch.groups)}
        t0 = time.perf_counter()
        exps = self._trainable(batch.groups, metrics)
        if not exps:  # everything was dropped (and counted): nothing to train on this step
            return {**metrics, **timing, "timing/make_experience": time.perf_counter() - t0, "actor_frozen": 1.0,
                    "_frozen": True}
        b = collate(exps, pad_token_id=roles.pad_token_id)
        steps = optimizer_steps_per_batch(cfg, len(exps))
        frozen = roles.critic is not None and self.step < cfg.train.critic.actor_freezing_steps
        one_pass = self.old_logprobs_from_training(steps, frozen)
        old_logp, ref_logp, values = await self._forward_passes(trainer_rows(b, exps), b.action_mask.shape, one_pass)
        advantages, returns = self._advantages(b, old_logp, ref_logp, values, metrics)
        sampled = self._sample_metrics(b, exps, returns, metrics)
        timing["timing/make_experience"] = time.perf_counter() - t0

        rows = trainer_rows(b, exps, advantages=advantages, rollout_logprobs=b.rollout_log_probs, values=values,
                            old_logprobs=old_logp, ref_logprobs=ref_logp if cfg.algorithm.kl.use_loss else None,
                            returns=returns if values is not None else None)
        metrics.update(actor_frozen=float(frozen), kl_coef=self.kl_ctl.value)
        t1 = time.perf_counter()
        if not frozen:
            trained = await self._train_actor(rows, steps, one_pass, b.action_mask.shape, metrics)
            old_logp = trained if one_pass else old_logp
        timing["timing/policy_train"] = time.perf_counter() - t1
        drift = drift_metrics(old_logp, b.rollout_log_probs, b.action_mask,
                              is_correction=roles.policy_loss.is_correction, policy_versions=b.policy_versions,
                              current_version=self.version)
        metrics.update({k: float(v) for k, v in drift.items()})
        if cfg.logger.dump_logprobs and self.step + 1 in cfg.logger.dump_logprobs_steps:  # this is step self.step + 1
            from molt_hydra.logging.logprob_dump import write_logprob_dump
            write_logprob_dump(Path(cfg.output_dir) / "logprobs" / f"step{self.step + 1}.tsv", b, old_logp,
                               [len(e.token_ids) for e in exps])
        if roles.critic is not None:
            t2 = time.perf_counter()
            epochs = cfg.train.critic.epochs or cfg.train.epochs
            m = await self.calls.ranks(roles.critic, "train_step", CriticObjective(cfg.algorithm.value_clip),
                                       shard=rows, num_optimizer_steps=steps, epochs=epochs, role="critic",
                                       calls=epochs)
            metrics.update(m[0])
            timing["timing/critic_train"] = time.perf_counter() - t2
        if "kl" in metrics:  # none measured (a frozen actor with kl.use_loss) is not a KL of 0 to steer by
            self.kl_ctl.update(metrics["kl"], cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt)
        metrics["_frozen"] = frozen
        if "timing/generation" in timing:
            generated = sum(e.action_mask.sum().item() for e in exps)
            timing["perf/rollout_tokens_per_sec"] = generated / max(timing["timing/generation"], 1e-9)
        # the samples' means last, an agent's Result.info key under "info/" where it names one of the step's own
        # metrics or falls in a namespace the loop logs into after the step (was: one overwrote the other without a
        # word, an info "kl" steered the adaptive KL controller, an info "timing/generation" failed a replay's step)
        metrics.update({f"info/{k}" if k in metrics or k in timing or k.partition("/")[0] in LOOP_NAMESPACES else k: v
                        for k, v in sampled.items()})
        return {**metrics, **timing}

    def _sample_metrics(self, b, exps: list, returns, metrics: dict[str, float]) -> dict[str, float]:
        """The step's means over its trained samples (returned: train_step adds them last), the group reward std
        and, with logger.debug_rollout, each sample's line (RunLog.samples)."""
        a = self.cfg.algorithm
        stds = group_reward_std(b.rewards, b.group_ids, b.rollout_ids, a.reward_clip)
        # Molt's, where its estimator groups (a groupless one's groups are its rollouts: always 0)
        if self.cfg.rollout.n_samples_per_prompt > 1 and "groups" in get_advantage_estimator(a.estimator).needs:
            metrics["group_reward_std"] = float(stds.mean())
        if self.cfg.logger.debug_rollout:
            self.log.samples(self.step + 1, exps, returns, b.action_mask, stds)
        return experience_metrics(exps, returns, b.action_mask)

    def _trainable(self, groups, metrics: dict[str, float]) -> list:
        """The batch's trainable experiences; the drops are counted into `metrics` and into the progress check."""
        t = self.cfg.train
        exps, drops = select_trainable(groups, self.cfg.data.max_len, self.trajectory_images, self.version,
                                       t.max_staleness, t.stale_samples.value == "drop", self.roles.actor.dp_size)
        for reason, n in {**drops, "total": sum(drops.values())}.items():
            metrics[f"rollout/dropped/{reason}"] = metrics.get(f"rollout/dropped/{reason}", 0.0) + n
        metrics["num_samples_trained"] = float(len(exps))
        self._check_progress(bool(exps), metrics)
        return exps

    async def _forward_passes(self, samples: list[dict], shape, one_pass: bool):
        """[B, L] old log-probs (None under one pass: the training forward gives them), the reference's log-probs
        and the critic's values (None without those roles), each from its role's no-grad forward."""
        roles, calls, out = self.roles, self.calls, []
        for group, role, kw in ((None if one_pass else roles.actor, "actor", {"mask_key": "action_mask"}),
                                (roles.ref, "reference", {"mask_key": "action_mask"}), (roles.critic, "critic", {})):
            per_rank = await calls.ranks(group, "compute_logprobs", shard=samples, role=role, **kw) if group else []
            out.append(stack_padded([x for rank in group.per_shard(per_rank) for x in rank], shape) if group else None)
        return tuple(out)

    def _advantages(self, b, old_logp, ref_logp, values, metrics: dict[str, float]):
        """Advantages and returns [B, L]; the KL to the reference joins the reward unless it is a loss term."""
        a = self.cfg.algorithm
        kl = None
        if ref_logp is not None and not a.kl.use_loss:  # each sample's mean over its action tokens, over the samples
            mask = b.action_mask.bool()
            kl = approx_kl(old_logp, ref_logp, a.kl.estimator.value) * mask
            for key, per_token in (("kl", kl), ("logprobs_diff", old_logp - ref_logp)):  # (the latter: Molt's too)
                per_token = torch.where(mask, per_token, 0.0)
                metrics[key] = float((per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean())
        return compute_advantages(
            a.estimator, b.rewards, b.action_mask, group_ids=b.group_ids, rollout_ids=b.rollout_ids, kl=kl,
            values=values, kl_coef=self.kl_ctl.value, gamma=a.gamma, lam=a.lam, whiten=a.whiten,
            reward_clip=a.reward_clip)

    async def _train_actor(self, rows: list[dict], steps: int, one_pass: bool, shape, metrics: dict[str, float]):
        """`train.epochs` epochs of actor steps on `rows` in one trainer call, whose metrics are over all of them;
        under one pass, the old log-probs its training forward gave [B, L]."""
        self.trainer_ahead = True
        objective = ActorObjective(self.roles.policy_loss, self.kl_ctl.value, one_pass)
        m = await self.calls.ranks(self.roles.actor, "train_step", objective, shard=rows, num_optimizer_steps=steps,
                                   return_logprobs=one_pass, epochs=self.cfg.train.epochs, calls=self.cfg.train.epochs)
        old_logp = stack_padded([x for rank in self.roles.actor.per_shard(m) for x in rank.pop("logprobs")],
                                shape) if one_pass else None
        metrics.update(m[0])
        return old_logp

    def old_logprobs_from_training(self, optimizer_steps: int, actor_frozen: bool) -> bool:
        """Whether the actor's training forward also gives the old log-probs (no separate no-grad pass): exact when
        the batch gets exactly one optimizer step (one window, one epoch), since the old log-probs are the trainer's
        at the parameters it is about to step from; not under dropout, LoRA's or the checkpoint's own (the training
        forward is not the policy that sampled), nor when the KL to the reference is a reward penalty (the
        advantages need the old log-probs before training) or the actor is frozen (nothing trains; drift metrics
        still need them)."""
        kl_in_reward = self.roles.ref is not None and not self.cfg.algorithm.kl.use_loss
        # the training forward drops out: LoRA's, or the checkpoint's own (the IS weights and drift would see it)
        dropout = bool(self.cfg.model.lora.rank and self.cfg.model.lora.dropout) or self.checkpoint_dropout
        return (optimizer_steps == 1 and self.cfg.train.epochs == 1 and not actor_frozen and not kl_in_reward
                and not dropout)

    def _check_progress(self, trainable: bool, metrics: dict[str, float]) -> None:
        """`train.max_untrainable_steps` steps in a row with every sample dropped end the run, with their drops."""
        if trainable:
            self.untrainable_steps, self.untrainable = 0, Counter()
            return
        self.untrainable_steps += 1
        prefix = "rollout/dropped/"
        self.untrainable.update({k.removeprefix(prefix): int(v) for k, v in metrics.items()
                                 if k.startswith(prefix) and k != prefix + "total" and v})
        if self.untrainable_steps >= self.cfg.train.max_untrainable_steps:
            raise RunFailed("trainer", f"{self.untrainable_steps} steps in a row had no trainable sample "
                            f"(train.max_untrainable_steps={self.cfg.train.max_untrainable_steps})",
                            drops=dict(self.untrainable))

    def _check_trained(self) -> None:
        """At the loop's end: a run none of whose steps had a trainable sample fails with their drops, also where it
        ended (train.max_steps, the data) before train.max_untrainable_steps could tell it. Before, it 'finished' with
        exit 0 and saved the untrained model. (The count goes on across a resume, as the loop's state.)"""
        if self.step and self.untrainable_steps == self.step:
            raise RunFailed("trainer", f"no step of the run had a trainable sample (it ended after {self.step}, before "
                            f"train.max_untrainable_steps={self.cfg.train.max_untrainable_steps} steps in a row could "
                            "tell it)", drops=dict(self.untrainable))

    async def sync_weights(self) -> dict[str, float]:
        """Version k -> k+1 on every engine, after batch k + D exists (unless partial rollout)."""
        t0 = time.perf_counter()
        if not self.cfg.train.partial_rollout:
            async with self.batch_made:
                await deadline(self.batch_made.wait_for(
                    lambda: self.batches_made > self.step + self.depth or self.exhausted),
                    self.cfg.train.timeouts.step_s, "rollout", "generating the batch the weight sync waits for")
        every, version = self.cfg.rollout.weight_sync.probe_every, self.version + 1
        probed = every and (version == 1 or version % every == 0)  # the first sync proves the path at once
        t1 = time.perf_counter()
        trainer_view = await self.calls.trainer_probe_view() if probed else None  # before the push wakes engines
        t2 = time.perf_counter()
        pushed = await self.push(version)  # trainer rank 0's weight_sync/* (which path ran)
        self.version, self.trainer_ahead = version, False
        synced = {**pushed, "timing/weight_sync_wait": t1 - t0}
        if probed:  # timed: its two halves, a forward and per-layer sums on each side, were in no part of the step's
            t3 = time.perf_counter()
            synced.update(await self.calls.sync_probe(version, trainer_view))
            synced["timing/sync_probe"] = t2 - t1 + time.perf_counter() - t3
        return synced

    async def push(self, version: int) -> dict[str, float]:
        """The trainer's weights to the engines, stamped `version`, timed (`timing/weight_sync`). Colocated, this is
        also what wakes the engines: first the trainer releases its cached memory (`timing/trainer_release`, a phase
        of its own), and after the push the step's sleep / wake phases are read back."""
        start = time.perf_counter()
        if not self.colocated:
            return {**await self.calls.push_weights(version), "timing/weight_sync": time.perf_counter() - start}
        resident = await self.calls.release_trainer_memory()
        released = time.perf_counter()
        pushed = await self.calls.push_weights(version)
        synced = time.perf_counter()
        phases = await self.calls.engine_phase_metrics(version)
        wake = sum(v for k, v in phases.items() if k.startswith("engine/wake_"))
        return {**pushed, **phases, **resident, "timing/trainer_release": released - start,
                "timing/weight_sync": synced - released, "timing/engine_wake": wake}

    # ------------------------------------------------------------------ eval and checkpoints
    async def maybe_eval(self, force: bool = False) -> None:
        e = self.cfg.eval
        due = force or (e.every_steps > 0 and self.step >= (self.next_eval or e.every_steps))
        if self.roles.eval_rows is None or not due:
            return
        if e.every_steps > 0:
            self.next_eval = (self.step // e.every_steps + 1) * e.every_steps
        # the training's sampling but for eval.*'s (eval.max_new_tokens=None: the training's turn cap; was 256 where
        # rollout.max_new_tokens was None too), top_k and min_tokens too (was: -1 and 1 whatever the training's)
        training = self.roles.generator.sampling
        sampling = dataclasses.replace(training, max_tokens=e.max_new_tokens or training.max_tokens,
                                       temperature=e.temperature, top_p=e.top_p,
                                       seed=request_seed(self.cfg.seed, "eval"))
        t0 = time.perf_counter()
        m = await deadline(self.roles.generator.evaluate(self.roles.eval_rows, e.n_samples_per_prompt, sampling,
                                                          max_inflight=e.batch_size),
                           self.cfg.train.timeouts.step_s, "rollout", "eval")
        m["timing/eval"] = time.perf_counter() - t0
        self.log.eval(self.step, m)
        key = self.cfg.checkpoint.best_metric_key or next((k for k in sorted(m) if k.endswith("_pass1")), "")
        if key not in m and key not in ("", "none"):  # a data source validation cannot see (was: not a word)
            returned = ", ".join(k for k in m if k.startswith("eval_"))
            print(f"eval at step {self.step}: checkpoint.best_metric_key={key} is no metric this evaluation returned "
                  f"({returned}): no checkpoint is kept as the best. Fix: name one of them (a data source whose every "
                  "rollout failed returns none: eval_dropped_*)", flush=True)
        # (a saved best of another key, checkpoint.best_metric_key changed on a resume, is not this key's to beat)
        if key in m and key != "none" and (self.best is None or self.best[0] != key or m[key] > self.best[1]):
            self.best = (key, m[key])
            if self.roles.actor is not None:  # the best policy so far, an HF snapshot (job=eval has nothing to save)
                best = Path(self.cfg.checkpoint.dir) / "best"
                await self.calls.ranks(self.roles.actor, "export_hf", str(best),
                                       DTYPE_NAMES[self.cfg.model.param_dtype.value])
                (best / "best.json").write_text(json.dumps({"step": self.step, "metric": key, "value": m[key]}))
        self.last_eval = m

    def client_state(self) -> dict:
        queued = [item for item in self.queue._queue if item[0] is not None]  # trained first after a resume
        queued += [self.held] if self.held is not None else []  # (queued after them)
        return {"step": self.step, "version": self.version, "generator": self.roles.generator.state_dict(),
                "queued": queued, "batches_made": self.step + len(queued), "best": self.best,
                "next_eval": self.next_eval, "kl_coef": self.kl_ctl.value, "wandb_id": self.log.sinks.wandb_id,
                "untrainable": (self.untrainable_steps, dict(self.untrainable)), "counters": self.counters}

    async def save(self) -> None:
        """A resumable checkpoint: trainer state (DCP) plus the loop's own state and the run record, all inside the
        trainer's atomic save, so a checkpoint is either complete or absent."""
        ckpt, keep = self.cfg.checkpoint, self.cfg.checkpoint.max_num
        # the counters up to this save (a due eval's requests too), which a resume goes on from
        counted = {**await self.calls.router_metrics(), **self.calls.keeper.metrics()}
        self.counters = {k: v + self.counters_before.get(k, 0.0) for k, v in counted.items()}
        state = {"rl_step": self.step, "loop": self.client_state(), "run_record": self.roles.run_record}
        # The critic's first: the actor's step_<N> (renamed into place last) marks the step complete, so a crash
        # between the two leaves a critic step no resume reads, never an actor step whose critic is missing (a
        # resume then failed).
        # Both are tagged step_<RL step>: the roles' optimizer step counts differ (a frozen actor, critic.epochs).
        # The critic's retention keeps its copy of the actor's newest step, which a resume takes if the actor's fails
        if self.roles.critic is not None:
            await self.calls.ranks(self.roles.critic, "save_checkpoint", ckpt.dir + "_critic", {"rl_step": self.step},
                                   keep=keep, max_disk_gb=ckpt.max_disk_gb, tag=self.step, hold=self.saved_step,
                                   role="critic")
        (path, *_) = await self.calls.ranks(self.roles.actor, "save_checkpoint", ckpt.dir, state, keep=keep,
                                            max_disk_gb=ckpt.max_disk_gb, tag=self.step)
        (Path(path) / "run_record.json").write_text(json.dumps(self.roles.run_record, indent=2))  # for humans
        if ckpt.save_hf:
            snapshot = Path(ckpt.dir) / SNAPSHOTS / f"step_{self.step}"  # (pruned with its step: retention.py)
            await self.calls.ranks(self.roles.actor, "export_hf", str(snapshot), DTYPE_NAMES[
                self.cfg.model.param_dtype.value])
        self.roles.last_checkpoint, self.saved_step = path, self.step

    def restore(self, state: dict) -> None:
        for key in ("step", "version", "batches_made", "best", "next_eval"):
            setattr(self, key, state[key])
        # the schedule is this run's eval.every_steps (a resume may change it), from the step on. Due at once: the eval
        # the save skipped (Slurm's notice saves before it), or this step's where the saved run had evaluated none yet
        if (every := self.cfg.eval.every_steps) > 0:
            due = self.step % every == 0 if self.next_eval is None else self.next_eval <= self.step
            self.next_eval = self.step if due else (self.step // every + 1) * every
        self.roles.generator.load_state_dict(state["generator"])
        # (rollout/generator.py) a partial rollout's groups in flight at the save, vLLM requests, were not saved
        if self.cfg.train.partial_rollout and (pending := len(state["generator"]["pending"])):
            print(f"Resuming under train.partial_rollout: the {pending} prompt groups in flight at the save start over "
                  f"under the resumed weights (policy version {self.version}), where the uninterrupted run finished "
                  "them from the tokens they had, some of older versions, so the steps that train them can differ "
                  "from that run's (a resume is exact with train.partial_rollout=false)", flush=True)
        for item in state["queued"]:
            self.queue.put_nowait(item)
        self.kl_ctl.value = state["kl_coef"]
        # the steps in a row with nothing trainable go on counting (a checkpoint older than the count: from 0)
        steps, drops = state.get("untrainable", (0, {}))
        self.untrainable_steps, self.untrainable = steps, Counter(drops)
        self.counters = self.counters_before = state.get("counters", {})  # (a checkpoint older than them: from 0)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> dict:
        if self.preempted.is_set():  # Slurm's notice before the first step (the resume's load, its push): nothing new
            self.stopped_for_notice = True  # to save; before, the at-start eval and a whole step ran first
            return {}
        await self.watched(self.calls.freeze_heaps())
        e = self.cfg.eval
        if e.at_start and self.step > 0:  # a resume goes on with the schedule it stopped in (was: skipped silently)
            schedule = (f"the eval schedule goes on (every {e.every_steps} steps)" if e.every_steps > 0
                        else "no other eval is scheduled (eval.every_steps=-1)")
            print(f"eval.at_start: skipped, the run resumes at step {self.step}: the at-start eval is a fresh "
                  f"run's (of the weights before step 1); {schedule}.", flush=True)
        # at step 0, eval.at_start; on resume, the eval a preemption's save skipped (none else is due there)
        await self.watched(self.maybe_eval(force=self.step == 0 and e.at_start))
        # sync mode, a batch saved queued: it trains first, as it would have, with the engines idle (a replay run
        # sends no hints: its ranks keep their threads)
        if self.depth == 0 and not self.queue.empty() and not self.cfg.train.rollout_replay_dir:
            await self.watched(self.calls.engines_busy(False, wait=True))
        return await self.watched(self._steps(), self.produce())

    def watched(self, work, *more):
        """`work` (and `more`: the producer) beside the run's watchers (watchdog.beside), whose failure ends it wherever
        it waits (a weight sync waiting for a batch): the keeper, which replaces dead engines (its failure: too many
        restarts), and those of ray_head.watchers (Ray's GCS and raylet, roles stopped by a signal, the reaper)."""
        keeper = self.calls.keeper.watch(lambda: self.version + self.trainer_ahead)
        return beside(work, *more, keeper, *ray_head.watchers(self.roles.role_pids, self.cfg.cluster.nodes == 1))

    async def _steps(self) -> dict:
        cfg, max_steps, keeper = self.cfg, self.cfg.train.max_steps, self.calls.keeper
        last: dict[str, float] = {}
        while max_steps is None or self.step < max_steps:
            t0 = time.perf_counter()
            batch, gen_timing = await deadline(self.queue.get(), cfg.train.timeouts.step_s, "rollout",
                                               "generating a batch")
            if batch is None:  # the data is done
                if self.step == 0:  # (was: "run finished, steps: 0", exit 0, e.g. every group dynamic-filtered)
                    self._nothing_to_train(gen_timing)
                break
            waited = time.perf_counter() - t0
            if self.colocated:  # the engines' memory goes to the trainer until the next push wakes them
                t1 = time.perf_counter()
                await self.calls.sleep_engines()
                gen_timing = {**gen_timing, "timing/engine_sleep": time.perf_counter() - t1}
            metrics = await self.train_step(batch, gen_timing)
            frozen = metrics.pop("_frozen", False)
            # the runners' counts are read during the weight sync (its round trip off the step's critical path); in
            # sync mode nothing generates meanwhile, so they are the step's own. Frozen: no new weights, no sync
            # metrics; colocated engines are still woken, with the weights and version they had.
            sync = self.sync_weights() if not frozen else self.push(self.version) if self.colocated else asyncio.sleep(
                0, {})
            counts, synced = await asyncio.gather(self.calls.router_metrics(), sync)
            self.counters = {k: v + self.counters_before.get(k, 0.0) for k, v in {**counts, **keeper.metrics()}.items()}
            metrics.update({**self.counters, "timing/actor_idle_wait": waited, **synced})
            async with self.step_done:
                self.step += 1
                self.step_done.notify_all()
            metrics["timing/step_total"] = total = time.perf_counter() - t0
            # Trainer side: sequential parts of this step. Rollout side runs concurrently: busy vs idle.
            for part in TRAINER_PARTS:
                metrics[f"timing/share/{part}"] = metrics.get(f"timing/{part}", 0.0) / total
            if "timing/generation" in metrics:
                busy, idle = metrics["timing/generation"], metrics["timing/vllm_idle_wait"]
                metrics["timing/share/rollout_busy"] = busy / max(busy + idle, 1e-9)
            self.log.step(self.step, metrics, batch)
            last = metrics
            save_every, preempted = cfg.checkpoint.save_steps, self.preempted.is_set()
            if not preempted:  # before the save: its checkpoint holds the eval schedule and best after this step's
                await self.maybe_eval()
            if save_every > 0 and self.step % save_every == 0 or preempted and save_every != 0:
                await self.save()
            if preempted:  # (an eval due now runs first thing on resume: its `next_eval` is this step)
                self.stopped_for_notice = True
                break
        self.log.flush()  # the last step, whatever logger.every_steps
        if not self.stopped_for_notice:  # (a resume after the notice goes on counting)
            self._check_trained()
        return last
