"""Every remote call the driver makes to the built roles, each under its deadline (runtime/watchdog.py): trainer-rank
calls, the runners' router metrics, the weight push, the engine probe and the shutdown. Takes the handles and its two
config groups, never the root config."""

from __future__ import annotations

import asyncio
import functools
import gc
from contextlib import suppress
from statistics import fmean

import ray

from molt_hydra.config.schema import TimeoutsConfig, WeightSyncConfig
from molt_hydra.runtime.watchdog import RoleStalled, RunFailed, deadline, describe

WRITERS = ("save_checkpoint", "export_hf")  # trainer calls that write to disk: a failure there is the writer's


class RoleCalls:
    def __init__(self, roles, timeouts: TimeoutsConfig, weight_sync: WeightSyncConfig, engine_dtype: str,
                 max_model_len: int | None = None):
        """`roles`: the built handles (runtime/roles.py `Roles`); `engine_dtype`: the dtype on the wire;
        `max_model_len`: the engines' (the sync probe's sequence stays shorter)."""
        self.roles, self.timeouts, self.weight_sync, self.engine_dtype = roles, timeouts, weight_sync, engine_dtype
        self.max_model_len = max_model_len
        self.engines_lock = asyncio.Lock()  # a weight push and an engine replacement never overlap
        self.keeper = None  # runtime/engine_keeper.py, when dead engines are replaced
        self.pushed = False  # the engines hold pushed weights (a warm start's at version 0 too), not the model path's
        self.shared_push = None  # weight_sync/shared_params.py: the single pass, driven from here (one trainer rank)
        self.offer: tuple | None = None  # (the trainer's offer,) taken with the release just before a push
        self.failed_hint: tuple[str, BaseException] | None = None  # an unawaited hint's (rank, error), for the next

    async def ranks(self, group, method: str, *args, shard: list | None = None, role: str = "actor", calls: int = 1,
                    **kw) -> list:
        """Call `method` on every rank of a trainer group (each with its data-parallel slice of `shard`, if given)
        under the trainer-call deadline (`calls` of them: a train step's epochs, each one call's work); every rank's
        result, in rank order."""
        from molt_hydra.algorithm.experience import NumpyPickled

        per_rank = ([(NumpyPickled(part), *args) for part in group.shard(shard)] if shard is not None
                    else [args] * group.num_ranks)
        refs = [getattr(w, method).remote(*a, **kw) for w, a in zip(group.workers, per_rank)]
        named = "checkpoint writer ({} rank {})" if method in WRITERS else "{} rank {}"
        return await _every(refs, self.timeouts.trainer_call_s * calls, role, method,
                            lambda rank, _: named.format(role, rank), peers_s=PEERS_S)

    async def engines_busy(self, busy: bool, wait: bool) -> None:
        """Every CPU trainer rank learns whether the rollout engines generate (parallel/group.py): while they do not
        (a sync step's training; an async step's after its batch is generated), a rank trains on its share of all
        of its node's cores, not only on the CPUs Ray reserved for it, which the engines need while they generate.
        `wait`: return once every rank has the hint (a sync step's training must start on every core: the thread
        count changes float reductions); otherwise return at once: hints carry increasing numbers, so a late one never
        overrides a newer one, and a hint that failed is raised by the next call."""
        if self.failed_hint is not None:
            who, error = self.failed_hint
            raise RunFailed(who, f"engines_busy failed: {describe(error)}") from error
        # each answer with its rank's name: the reference's and the critic's ranks get the hint too (before, a dead
        # reference rank was reported as 'actor: engines_busy failed')
        sent = [(f"{role} rank {i}", asyncio.ensure_future(ref)) for role, g in _trainer_groups(self.roles)
                for i, ref in enumerate(g.engines_busy(busy))]
        if wait and sent:
            await _every([answer for _, answer in sent], self.timeouts.trainer_call_s, "actor", "engines_busy",
                         lambda i, _: sent[i][0], peers_s=PEERS_S)
        for who, answer in sent if not wait else ():
            answer.add_done_callback(functools.partial(self._hint_answered, who))

    def _hint_answered(self, who: str, answer: asyncio.Future) -> None:
        if not answer.cancelled() and answer.exception() is not None and self.failed_hint is None:
            self.failed_hint = (who, answer.exception())

    async def freeze_heaps(self) -> None:
        """Every role's start-up objects (imports, model, engine) leave the garbage collector's view (`gc.freeze`, as
        vLLM's engine core does after its start): else each full collection walks them all again, 0.2-0.4 s of CPU
        every few steps per process on 2 cores. Not collected first (that would delay the first step); start-up
        garbage in reference cycles stays, once."""
        r = self.roles
        actors = [*r.engines, *r.runners, *(w for _, g in _trainer_groups(r) for w in g.workers)]
        await deadline(asyncio.gather(*(a.__ray_call__.remote(lambda _: gc.freeze()) for a in actors)),
                       self.timeouts.engine_call_s, "roles", "gc.freeze")
        gc.freeze()

    async def router_metrics(self) -> dict[str, float]:
        """Cumulative request / retry / timeout / engine-death counts over every runner's router."""
        total: dict[str, float] = {}
        for per_runner in await _every([r.router_metrics.remote() for r in self.roles.runners],
                                       self.timeouts.engine_call_s, "agent runner", "router metrics"):
            for k, v in per_runner.items():
                total[k] = total.get(k, 0.0) + v
        return total

    async def push_weights(self, version: int) -> dict:
        """The trainer's weights to every engine, stamped `version`. An engine found dead when a push fails is
        replaced first (it gets its weights from the retried push)."""
        result = await self._replacing_dead(lambda: self.push_to(version, self.roles.engines), None)
        self.pushed = True
        return result

    async def _replacing_dead(self, work, version: int | None):
        """`work()`, a call on every engine; where it fails and an engine is found dead, that engine is replaced (given
        `version`'s weights; None: the retried work gives them) and `work()` runs again. Under the engines lock: a
        push and a replacement never overlap. Before, only the push replaced: an engine core dying during a colocated
        step's sleep, or after a push (its sleep metrics, the sync probe), ended the run."""
        async with self.engines_lock:
            try:
                return await work()
            except (RunFailed, ray.exceptions.RayError):
                dead = await self.keeper.dead_engines() if self.keeper is not None else []
                if not dead:
                    raise
            for index in dead:
                await self.keeper.replace(index, version)
            return await work()

    async def push_to(self, version: int, engines: list) -> dict:
        """`version` onto `engines`. The single pass (one trainer rank whose parameters the engines read by CUDA IPC)
        is driven from here: one call per engine. Otherwise every trainer rank gathers full tensors bucket by bucket
        (FSDP collectives); rank 0 pushes each bucket through the placement's transport and stamps `version`."""
        from molt_hydra.weight_sync import push_from_rank

        ws, t, what = self.weight_sync, self.timeouts, f"push of version {version}"
        offer = await self._shared_params_offer(what)
        if offer is not None:
            return await self._push_shared_params(offer, version, engines)
        calls = [w.__ray_call__.remote(push_from_rank, engines, self.roles.transport, version,
                                       bucket_bytes=ws.bucket_mb << 20, check_coverage=ws.check_coverage,
                                       timeout_s=t.engine_call_s, dtype=self.engine_dtype)
                 for w in self.roles.actor.workers]

        def who(rank: int, error: Exception) -> str:
            if isinstance(error, TimeoutError):  # an engine call timed out inside the rank (Ray re-raises this type)
                raise RoleStalled("weight sync", what, t.engine_call_s) from error
            # a dead rank is named as such; anything else is the push's failure
            return f"actor rank {rank}" if isinstance(error, ray.exceptions.RayActorError) else "weight sync"

        return (await _every(calls, t.engine_call_s, "weight sync", what, who))[0]

    def _single_rank_ipc(self) -> bool:
        return self.roles.transport == "cuda_ipc" and self.roles.actor is not None and self.roles.actor.num_ranks == 1

    async def _shared_params_offer(self, what: str):
        """The trainer rank's single-pass offer (weight_sync/shared_params.py), or None (the bucketed path): the one
        taken with the release of its cached memory just before this push (a colocated step), else asked now."""
        if self.offer is not None:
            (offer,), self.offer = self.offer, None
            return offer
        if not self._single_rank_ipc():
            return None
        from molt_hydra.weight_sync.shared_params import offer_shared_params

        ref = self.roles.actor.workers[0].__ray_call__.remote(offer_shared_params, "cuda_ipc", self.engine_dtype,
                                                               self.shared_push and self.shared_push.token)
        return (await _every([ref], self.timeouts.trainer_call_s, "actor", what))[0]

    async def _push_shared_params(self, offer, version: int, engines: list) -> dict:
        """The single pass from the driver: one call per engine (round trip driver -> engine; the trainer's rank is not
        on the way), under the engine-call deadline; a failure is the weight sync's."""
        from molt_hydra.weight_sync.sender import WeightSync
        from molt_hydra.weight_sync.shared_params import SharedParamsPush

        self.shared_push = self.shared_push or SharedParamsPush()
        self.shared_push.take(offer)
        self.shared_push.mapped &= {*self.roles.engines, *engines}  # a replaced engine's handle is not kept
        seconds, what = self.timeouts.engine_call_s, f"push of version {version}"
        sync = WeightSync(engines, self.shared_push, check_coverage=self.weight_sync.check_coverage,
                          timeout_s=seconds, version=version - 1)
        try:
            return await deadline(sync.sync([], version), seconds, "weight sync", what)
        except (RoleStalled, RunFailed):
            raise
        except TimeoutError as error:  # one engine's call (WeightSync's own deadline)
            raise RoleStalled("weight sync", what, seconds) from error
        except Exception as error:
            raise RunFailed("weight sync", f"{what} failed: {describe(error)}") from error

    # --- colocated engines (parallelism.colocate): asleep while the trainer steps, woken by the weight push ---

    async def sleep_engines(self) -> None:
        """Every engine sleeps (GPU: its weights' and KV cache's memory released; CPU: paused) before the trainer
        steps; the next weight push wakes it (rollout/engine.py). A replaced engine is put to sleep with the others."""
        await self._replacing_dead(lambda: self._on_engines("sleep", "sleep"), None)

    async def release_trainer_memory(self) -> dict[str, float]:
        """Every trainer rank hands the memory its allocator cached (activations, grads) back to the GPU, so the
        engines beside it can wake into it. Returns what stays allocated on the fullest rank: the plan's "trainer
        resident" (runtime/plan.py) measured, so a split that is too tight shows before it runs out."""
        named = [(f"{role} rank {i}", w) for role, g in _trainer_groups(self.roles) for i, w in enumerate(g.workers)]
        ranks = [w for _, w in named]
        # the single pass's rank makes its offer in the same call: the push after it is one call per engine
        offering = self.roles.actor.workers[0] if self._single_rank_ipc() else None
        known = self.shared_push and self.shared_push.token
        # each rank named (was: any group's stall told as the actor's, a rank's death as Ray's raw error)
        answers = await _every([w.__ray_call__.remote(_release_cuda_cache, (self.engine_dtype, known)
                                                      if w is offering else None) for w in ranks],
                               self.timeouts.trainer_call_s, "trainer", "release cached GPU memory",
                               lambda i, _: named[i][0], peers_s=PEERS_S)
        if offering is not None:
            self.offer = (answers[ranks.index(offering)][1],)
        return {"memory/trainer_resident_gib": max((kept for kept, _ in answers), default=0.0)}

    async def engine_phase_metrics(self, version: int) -> dict[str, float]:
        """The engines' last sleep and wake: seconds (mean over the engines that report them) and GiB freed (sum).
        `version`: the one just pushed (an engine replaced here gets it). An engine started since the sleep (replaced)
        reports none: before, it counted as a 0 s sleep, which halved the step's mean with two engines."""
        per_engine = await self._replacing_dead(lambda: self._on_engines("sleep_metrics", "read sleep metrics"),
                                                version)
        keys = sorted({k for m in per_engine for k in m})
        return {k: (sum if k.endswith("gib") else fmean)([m[k] for m in per_engine if k in m]) for k in keys}

    async def _on_engines(self, method: str, what: str) -> list:
        return await _every([getattr(e, method).remote() for e in self.roles.engines], self.timeouts.engine_call_s,
                            "rollout engine", what)

    async def trainer_probe_view(self) -> tuple:
        """The trainer's side of the sync probe (weight_sync/probe.py): the probe sequence, the weights' per-layer
        sums and its log-probs of it. Taken before the push, from the weights it pushes: colocated, the engines still
        sleep, so this forward has the train phase's room, not what a woken engine leaves (on the H200 a 4B model's
        gathered weights beside a 91 GiB engine ran out of memory)."""
        from molt_hydra.weight_sync.probe import probe_tokens

        tokens = probe_tokens(len(self.roles.tokenizer), self.max_model_len)
        (sums, *_) = await self.ranks(self.roles.actor, "sync_probe_sums", self.engine_dtype)
        (logprobs, *_) = await self.ranks(self.roles.actor, "sync_probe_logprobs", tokens)
        return tokens, sums, logprobs

    async def sync_probe(self, version: int, trainer_view: tuple) -> dict[str, float]:
        """After the push of `version`: every engine's per-layer weight sums and its log-probs of the probe sequence
        against the trainer's (`trainer_probe_view`); a disagreement ends the run naming the layers."""
        from molt_hydra.weight_sync.probe import comparable_groups, differing_groups, logprob_gap, verdict

        tokens, sums, logprobs = trainer_view

        async def probe():  # (an engine replaced here is given `version`, then probed as the others)
            engines = self.roles.engines
            return engines, await deadline(asyncio.gather(*(e.weight_checksums.remote() for e in engines),
                                                          *(e.score.remote(tokens) for e in engines)),
                                           self.timeouts.engine_call_s, "rollout engine", "sync probe")

        engines, seen = await self._replacing_dead(probe, version)
        gaps, compared = [], []
        for i, (engine_sums, engine_logprobs) in enumerate(zip(seen[:len(engines)], seen[len(engines):])):
            gaps.append(logprob_gap(logprobs, engine_logprobs))
            compared.append(len(comparable_groups(sums, engine_sums)))
            failure = verdict(version, i, self.engine_dtype, gaps[-1], differing_groups(sums, engine_sums))
            if failure is not None:
                raise RunFailed("weight sync", failure)
        return {"weight_sync/probe_logprob_gap": max(gaps), "weight_sync/probe_groups": float(min(compared))}

    async def example_errors(self) -> dict[str, str]:
        """One example error message per drop reason, from every runner that still answers."""
        answers = asyncio.gather(*(r.example_errors.remote() for r in self.roles.runners), return_exceptions=True)
        per_runner = [errors for errors in await asyncio.wait_for(answers, 30) if isinstance(errors, dict)]
        # the first runner's example of a reason wins
        return {reason: error for errors in reversed(per_runner) for reason, error in errors.items()}

    async def probe_rollout(self, seconds: float = 10.0) -> list[str]:
        """Which engines fail a 1-token request and which agent runners do not answer: names the stalled role when
        a rollout batch never completes (before: a stopped agent runner was never named, only 'rollout')."""
        from molt_hydra.rollout.generation import GenerationRequest, Sampling

        probe = GenerationRequest("watchdog-probe", [self.roles.pad_token_id], Sampling(max_tokens=1))
        calls = {**{f"rollout engine {i}": e.generate.remote(probe) for i, e in enumerate(self.roles.engines)},
                 **{f"agent runner {i}": r.__ray_call__.remote(_answer) for i, r in enumerate(self.roles.runners)}}
        answers = await asyncio.gather(*(asyncio.wait_for(c, seconds) for c in calls.values()), return_exceptions=True)
        # a timeout or a dead actor: either way it is the one that stalled
        return [name for name, answer in zip(calls, answers) if isinstance(answer, BaseException)]

    async def shutdown(self) -> None:
        roles = self.roles
        await roles.generator.close()
        for r in roles.runners:
            with suppress(Exception):  # shutting down: a runner that cannot close is killed below anyway
                await asyncio.wait_for(r.close.remote(), 10)
        for w in (w for _, g in _trainer_groups(roles) for w in g.workers):
            ray.kill(w)
        for e in roles.engines:
            with suppress(Exception):
                await asyncio.wait_for(e.shutdown.remote(), 20)
            ray.kill(e)


def _answer(_actor) -> bool:
    """The probe of an agent runner: answered by its own event loop, free while the agent code runs (in its thread)."""
    return True


def _trainer_groups(roles) -> list[tuple[str, object]]:
    """(role, group) of each trainer group the run has (actor, reference, critic)."""
    return [(role, g) for role, g in (("actor", roles.actor), ("reference", roles.ref), ("critic", roles.critic))
            if g is not None]


# a trainer call failed on a rank: how long the others get to end (see `_every`); above Ray's node health check
# (~15-30 s), so on a node's death the dead ranks' error comes in before the survivors' ('closed by peer') are told
PEERS_S = 60.0


async def _every(calls: list, seconds: float, role: str, what: str, who=None, peers_s: float | None = None) -> list:
    """Every call's result, in order, under one deadline; the first failure (the first process that died, if any)
    ends the run, naming `who(index, error)` (default: `role index`). `peers_s` (trainer ranks' calls): once one
    failed, the others get that long, not the deadline: they may wait on it in a collective until its timeout (an
    out-of-memory on one rank; before: the run waited trainer_call_s, 30 min, then told it as a stall); the death of
    a rank still comes first (its peers' errors follow from it). None: every call ends or the deadline passes (a
    push retried after a failure must not start while a rank is still in the failed one)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.ALL_COMPLETED
                                           if peers_s is None else asyncio.FIRST_EXCEPTION)
        errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
        if pending and peers_s is not None and errors:  # (a dead rank's error: the cause is known, no grace)
            if not any(isinstance(e, ray.exceptions.RayActorError) for e in errors):
                await asyncio.wait(pending, timeout=peers_s)
        elif pending:  # the ranks still running named (was: the call's role for any of them, e.g. the reference's)
            raise RoleStalled(", ".join(dict.fromkeys(who(i, None) if who else role for i, t in enumerate(tasks)
                                                      if t in pending)), what, seconds)
    finally:
        for task in tasks:
            task.cancel()  # (those still running; the run's teardown ends their processes)
    results = [t.exception() or t.result() if t.done() and not t.cancelled() else None for t in tasks]
    failed = [(i, result) for i, result in enumerate(results) if isinstance(result, Exception)]
    if failed:  # a process that died is the cause; the others' errors follow from it (gloo: 'closed by peer')
        i, error = min(failed, key=lambda f: not isinstance(f[1], ray.exceptions.RayActorError))
        raise RunFailed(who(i, error) if who else f"{role} {i}", f"{what} failed: {describe(error)}") from error
    return results


def _release_cuda_cache(worker, offer_for: tuple | None) -> tuple[float, object]:
    """On a trainer rank: its cached blocks back to the GPU; what stays allocated (GiB); with `offer_for` (the engine
    dtype, the token the driver's push holds), also the rank's single-pass offer (`offer_shared_params`)."""
    import torch

    from molt_hydra.weight_sync.shared_params import offer_shared_params

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
    offer = offer_shared_params(worker, "cuda_ipc", *offer_for) if offer_for is not None else None
    return (torch.cuda.memory_allocated() / 2**30 if cuda else 0.0), offer

