"""The samples generator: a streaming pool of prompt groups in flight (Molt §4.5).

It dispatches prompt rows to a group runner (the agent runners), keeps up to `max_inflight_groups` groups running,
and returns exactly `batch_size` finished, filtered groups per `generate_batch` call; surplus finished groups and the
groups still in flight carry over to the next call, so generation of batch k+1 overlaps training on batch k and some
rollouts straddle a weight sync (partial rollout: the engines pause/resume mid-request, every token keeps its version).

It sees trajectories only through `reward`, `score` (None → reward), `rollout_id`, `truncated` and `action_ranges`.
Prompt order is a function of (seed, epoch); `state_dict` holds the position, the prompts still in flight (they are
re-dispatched on resume, so none is lost or repeated; under partial rollout they start over under the resumed
weights, where the uninterrupted run finished them across the weight sync), the surplus finished groups and the
counts of the groups filtered since the last batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

from molt_hydra.config.schema import WEIGHTS_ALONE
from molt_hydra.rollout.generation import Sampling

# Molt's seven reasons, then the agent-side failures molt_hydra counts too (Molt prints and forgets them).
DROP_REASONS = (
    "empty_tokens", "vlm_media_unresolved", "vlm_truncation", "logprob_misalign", "no_action_tokens",
    "incomplete_group", "dynamic_filter", "agent_exception", "agent_timeout", "empty_session", "engine_aborted",
    "nonfinite_reward", "nonfinite_score")


class RunFailed(RuntimeError):
    """A failure the run cannot survive (a role died, an I/O error, nothing left to train on): the run ends with one
    message naming the role and the cause (runtime/watchdog.py re-exports it)."""

    def __init__(self, role: str, cause: str, drops: dict[str, int] | None = None,
                 examples: dict[str, str] | None = None):
        super().__init__(f"{role}: {cause}")
        self.role, self.cause, self.drops = role, cause, drops or {}
        self.examples = examples or {}  # an error message per drop reason, of failures the runners never saw


def usable(results: list[tuple[Any, str | None]], dropped: Counter) -> list:
    """The trajectories of a group's results that can be scored; each other result is counted in `dropped` by its
    reason (a NaN / inf reward as nonfinite_reward: it would poison its group's advantages, or an eval's mean; a
    NaN / inf `Result.score` as nonfinite_score: the dynamic filter would drop its group as if out of range, and the
    score metrics would be NaN)."""
    kept = []
    for trajectory, reason in results:
        if reason is not None or trajectory is None:
            dropped[reason or "empty_session"] += 1
        elif not math.isfinite(float(trajectory.reward)):
            dropped["nonfinite_reward"] += 1
        elif getattr(trajectory, "score", None) is not None and not math.isfinite(float(trajectory.score)):
            dropped["nonfinite_score"] += 1
        else:
            kept.append(trajectory)
    return kept


class GroupRunner(Protocol):
    async def run_group(self, prompt_row: dict, n_samples: int, sampling: Sampling) -> list[tuple[Any, str | None]]:
        """One (trajectory, None) per usable rollout/segment, (None, reason) per dropped one."""
        ...


def prompt_order(num_prompts: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num_prompts))
    random.Random(f"molt_hydra/{seed}/{epoch}").shuffle(order)  # str seeds hash deterministically across processes
    return order


@dataclass
class FinishedGroup:
    prompt_index: int
    epoch: int
    trajectories: list


@dataclass
class RolloutBatch:
    groups: list[FinishedGroup]
    metrics: dict[str, float]
    exhausted: bool  # no prompt left, nothing in flight or buffered


def prompts_fingerprint(prompts: list[dict]) -> str:
    """The prompts' count and a digest of their prompt and label, told apart by a resume: indices into other data pick
    other prompts (or none: an IndexError) from then on. Images are not hashed (their PIL objects' repr is not their
    content). Also the resume check's, before any role starts (runtime/entrypoint.py)."""
    digest = hashlib.sha256()
    for row in prompts:
        digest.update(repr((row.get("prompt"), row.get("label"))).encode())
    return f"{len(prompts)} rows, sha256 {digest.hexdigest()[:16]}"


def refuse_other_prompts(saved: str | None, now: str, checkpoint: str = "the checkpoint") -> None:
    """ValueError naming both fingerprints and the fix where `checkpoint` was trained on other prompts (`saved`, its
    fingerprint; None: a checkpoint older than the record) than this run's (`now`). Raised by `load_state_dict`, and
    by the resume check before any role starts (runtime/entrypoint.py `_resumed_rows`)."""
    if saved is not None and saved != now:
        raise ValueError(f"{checkpoint} was trained on other prompts ({saved}) than this run's ({now}); its place in "
                         "them cannot be resumed. Fix: resume with the data it was trained on, or start on this data "
                         f"from its weights alone: {WEIGHTS_ALONE}")


@dataclass(eq=False)
class SamplesGenerator:
    """`carry_over`: keep `max_inflight_groups` running at all times, so groups of the next batch start while this one
    finishes and straddle the weight sync that follows (Molt's streaming pool). Off, only as many groups run as the
    batch still needs: every group of a batch starts under one policy version and nothing carries over.
    `group_seed(epoch, prompt index)`: the base sampling seed of a group, so a resumed run samples the same."""

    prompts: Sequence[dict]
    runner: GroupRunner
    _: KW_ONLY
    batch_size: int
    n_samples_per_prompt: int
    sampling: Sampling
    max_inflight_groups: int | None = None  # None: batch_size
    seed: int = 0
    num_epochs: int = 1
    dynamic_filtering: tuple[float, float] | None = None
    # batches' worth of groups one batch may filter out before the run fails (the run passes
    # algorithm.dynamic_filtering.max_gen_batches); None: no cap (in-process tests)
    max_gen_batches: int | None = None
    incomplete_groups: str = "keep"
    # In-process runners only (tests); the run leaves it None on purpose: every rollout already has its own deadline
    # inside the agent runner (agent.timeout_s, moved on by engine outages), a stalled runner is named by
    # train.timeouts.step_s, and a fixed group deadline would cut groups waiting out an engine replacement.
    group_timeout_s: float | None = None
    carry_over: bool = True
    group_seed: Callable[[int, int], int] | None = None

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("SamplesGenerator needs at least one prompt")
        if self.batch_size < 1 or self.n_samples_per_prompt < 1 or self.num_epochs < 1:
            raise ValueError(f"batch_size, n_samples_per_prompt, num_epochs must be >= 1, got "
                             f"{self.batch_size}, {self.n_samples_per_prompt}, {self.num_epochs}")
        if self.incomplete_groups not in ("keep", "drop"):
            raise ValueError(f"incomplete_groups must be 'keep' or 'drop', got {self.incomplete_groups!r}")
        if self.dynamic_filtering is not None and not self.dynamic_filtering[0] < self.dynamic_filtering[1]:
            raise ValueError(f"dynamic_filtering needs low < high, got {self.dynamic_filtering}")
        self.max_inflight_groups = self.max_inflight_groups or self.batch_size
        self.epoch = 0
        self.cursor = 0  # next position in prompt_order(seed, epoch)
        self._order = prompt_order(len(self.prompts), self.seed, 0)
        self._pending: list[tuple[int, int]] = []  # (epoch, prompt index) to dispatch before the order (resume)
        self._inflight: dict[asyncio.Task, tuple[int, int, int]] = {}  # task -> (epoch, prompt index, dispatch seq)
        self._dispatched = 0
        self._finished: list[FinishedGroup] = []
        self._dropped: Counter = Counter()  # rollouts dropped, by reason (since the last batch)
        self._groups: Counter = Counter()  # groups seen / kept / all pass / all fail, scores (`_filter`)
        self._failed_in_a_row = 0  # groups in a row without one usable rollout: a batch's worth ends the run
        self._errors: dict[str, str] = {}  # an example per reason of the groups that failed here (`_group`)
        self._fingerprint: str | None = None  # `fingerprint`, made at the first save

    # --- dispatch ---

    def _next_prompt(self) -> tuple[int, int] | None:
        if self._pending:
            return self._pending.pop(0)
        if self.cursor == len(self._order):
            if self.epoch + 1 >= self.num_epochs:
                return None
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = prompt_order(len(self.prompts), self.seed, self.epoch)
        self.cursor += 1
        return self.epoch, self._order[self.cursor - 1]

    async def _run(self, epoch: int, index: int) -> list[tuple[Any, str | None]]:
        sampling = self.sampling
        if self.group_seed is not None:
            sampling = dataclasses.replace(sampling, seed=self.group_seed(epoch, index))
        return await self._group(self.prompts[index], self.n_samples_per_prompt, sampling, self.group_timeout_s)

    async def _group(self, row: dict, n: int, sampling: Sampling, timeout_s: float | None) -> list:
        """The runner's results for one group; a failure of the whole group counts each rollout by reason, its message
        kept for the run's failure summary (was: counted only, so a run that ended 'every rollout failed' on it
        could show no cause)."""
        try:
            return await asyncio.wait_for(self.runner.run_group(row, n, sampling), timeout_s)
        except asyncio.TimeoutError:
            self._errors.setdefault("agent_timeout", f"a prompt group ran past {timeout_s}s")
            return [(None, "agent_timeout")] * n
        except RunFailed:  # the runner itself is gone: no later group can run either
            raise
        except Exception as e:  # the runner's own failure (a result it could not send back): the group is lost
            self._errors.setdefault("agent_exception", f"{type(e).__name__}: {e}")
            return [(None, "agent_exception")] * n

    def _refill(self) -> None:
        limit = self.max_inflight_groups
        if not self.carry_over:
            limit = min(limit, self.batch_size - len(self._finished))
        while len(self._inflight) < limit:
            nxt = self._next_prompt()
            if nxt is None:
                return
            self._inflight[asyncio.ensure_future(self._run(*nxt))] = (*nxt, self._dispatched)
            self._dispatched += 1

    # --- filtering (Molt `_filter_group`) ---

    def _filter(self, epoch: int, index: int, results: list[tuple[Any, str | None]]) -> FinishedGroup | None:
        dropped, groups = self._dropped, self._groups
        groups["groups_seen"] += 1
        kept = usable(results, dropped)
        failed = self._failed_in_a_row = 0 if kept else self._failed_in_a_row + 1
        if failed >= self.batch_size:
            raise RunFailed("agent runner", f"every rollout of the last {failed} prompt groups "
                            f"({failed * self.n_samples_per_prompt} rollouts) failed; nothing can be trained",
                            drops=dict(dropped), examples=dict(self._errors))
        # A chat rollout may return several segments; the group's score counts each rollout once.
        per_rollout = {getattr(t, "rollout_id", None) or id(t): t for t in kept}
        scores = [float(t.reward if getattr(t, "score", None) is None else t.score) for t in per_rollout.values()]
        incomplete = len(per_rollout) < self.n_samples_per_prompt
        if self.dynamic_filtering is not None:
            low, high = self.dynamic_filtering
            groups["score_sum"] += sum(scores)
            groups["score_count"] += len(scores)
            groups["all_pass"] += bool(scores) and all(s >= high for s in scores)
            groups["all_fail"] += bool(scores) and all(s <= low for s in scores)
            groups["incomplete"] += incomplete
            if incomplete or not low < sum(scores) / len(scores) < high:  # incomplete: always dropped here
                dropped["incomplete_group" if incomplete else "dynamic_filter"] += len(kept)
                return None
        elif not kept or (incomplete and self.incomplete_groups == "drop"):
            dropped["incomplete_group"] += len(kept)
            return None
        groups["groups_kept"] += 1
        return FinishedGroup(index, epoch, kept)

    def _refuse_endless_filtering(self) -> None:
        """`max_gen_batches` batches' worth of groups generated for this batch without filling it: a task the policy
        always (or never) solves, whose groups the filter drops one and all. Before, the run generated on without a
        step until the data ran out (epochs of it) or train.timeouts.step_s told a stall, naming neither."""
        g, cap = self._groups, self.max_gen_batches
        if self.dynamic_filtering is None or cap is None or g["groups_seen"] < cap * self.batch_size:
            return
        low, high = self.dynamic_filtering
        mean = f"{g['score_sum'] / g['score_count']:.4g}" if g["score_count"] else "none (no usable rollout)"
        # a group with a failed rollout is dropped whatever its scores: then the failures are the cause, not the band
        failing = ("make the rollouts complete (the failures below); " if 2 * g["incomplete"] >= g["groups_seen"]
                   else "")
        raise RunFailed("rollout", f"dynamic filtering kept {g['groups_kept']} of the {g['groups_seen']} prompt groups "
                        f"generated for a batch of {self.batch_size} (algorithm.dynamic_filtering.max_gen_batches="
                        f"{cap} batches' worth); a group is kept only when all its rollouts completed and its mean "
                        f"score lies strictly between low={low} and high={high}: {g['incomplete']} groups had a failed "
                        f"rollout, their mean score is {mean}, {g['all_pass']} groups with every score >= high, "
                        f"{g['all_fail']} with every score <= low. Fix: {failing}train on prompts the policy solves "
                        "sometimes, not always or never; or widen algorithm.dynamic_filtering.low / high; or raise "
                        "algorithm.dynamic_filtering.max_gen_batches; or set algorithm.dynamic_filtering.enable=false",
                        drops=dict(self._dropped), examples=dict(self._errors))

    def _metrics(self) -> dict[str, float]:
        dropped, g = self._dropped, self._groups
        self._dropped, self._groups = Counter(), Counter()
        metrics = {f"rollout/dropped/{r}": float(dropped[r]) for r in DROP_REASONS}
        metrics["rollout/dropped/total"] = float(sum(dropped.values()))
        if self.dynamic_filtering is not None and g["groups_seen"]:
            metrics["dynamic_filtering_pass_rate"] = 100.0 * g["groups_kept"] / g["groups_seen"]
            metrics["rollout/group_all_pass_rate"] = 100.0 * g["all_pass"] / g["groups_seen"]
            metrics["rollout/group_all_fail_rate"] = 100.0 * g["all_fail"] / g["groups_seen"]
            if g["score_count"]:
                metrics["rollout/pre_filter_mean_score"] = g["score_sum"] / g["score_count"]
        return metrics

    # --- the streaming pool ---

    async def generate_batch(self) -> RolloutBatch:
        """Exactly `batch_size` kept groups (fewer only when the prompts run out)."""
        while len(self._finished) < self.batch_size:
            self._refuse_endless_filtering()
            self._refill()
            if not self._inflight:
                break
            done, _ = await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: self._inflight[t][2]):  # dispatch order: deterministic batches
                epoch, index, _ = self._inflight.pop(task)
                group = self._filter(epoch, index, task.result())
                if group is not None:
                    self._finished.append(group)
        if self.carry_over:
            self._refill()  # keep the pool busy while the trainer works on this batch
        batch, self._finished = self._finished[: self.batch_size], self._finished[self.batch_size :]
        exhausted = not (self._finished or self._inflight or self._pending or self.cursor < len(self._order)
                         or self.epoch + 1 < self.num_epochs)
        return RolloutBatch(batch, self._metrics(), exhausted)

    # --- checkpoint client state ---

    def state_dict(self) -> dict:
        inflight = [(e, i) for e, i, _ in sorted(self._inflight.values(), key=lambda v: v[2])]
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor, "prompts": self.fingerprint(),
                "pending": list(self._pending) + inflight,  # in-flight groups are rerun after a resume
                "finished": [(g.prompt_index, g.epoch, g.trajectories) for g in self._finished],
                # a save mid-batch (async, partial rollout): the counts of the groups already filtered go into it
                "counts": (dict(self._dropped), dict(self._groups), self._failed_in_a_row)}

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = prompts_fingerprint(self.prompts)
        return self._fingerprint

    def load_state_dict(self, state: dict) -> None:
        if self._inflight:
            raise RuntimeError("load_state_dict on a generator with groups in flight")
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint prompt order was seeded with {state['seed']}, this run uses {self.seed}")
        refuse_other_prompts(state.get("prompts"), self.fingerprint())
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = prompt_order(len(self.prompts), self.seed, self.epoch)
        self._pending = [tuple(p) for p in state["pending"]]
        self._finished = [FinishedGroup(i, e, t) for i, e, t in state["finished"]]
        dropped, groups, self._failed_in_a_row = state.get("counts", ({}, {}, 0))  # (older checkpoints: none)
        self._dropped, self._groups = Counter(dropped), Counter(groups)

    async def close(self) -> None:
        for task in self._inflight:
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        self._inflight.clear()

    # --- eval over a whole set (Molt §4.11) ---

    async def evaluate(self, rows: Sequence[dict], n_samples: int, sampling: Sampling,
                       max_inflight: int | None = None) -> dict[str, float]:
        """pass{n} = mean over groups of max reward (n > 1), pass1 = mean over groups of mean reward, per datasource,
        over the rollouts that can be scored; the others are counted (eval_dropped_<reason>), and none at all fails
        the run with the drops.
        `max_inflight` (eval.batch_size): prompt groups evaluated concurrently; None = the training pool's limit."""
        semaphore = asyncio.Semaphore(max_inflight or self.max_inflight_groups)

        async def one(k: int, row):
            # each prompt's group a base seed of its own (was: the eval's seed for every group, so sample i of every
            # prompt drew the same noise); the same at every eval, so evals compare on common random numbers
            own = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=(sampling.seed + k) % 2**63)
            async with semaphore:
                return row.get("datasource", "default"), await self._group(row, n_samples, own, None)

        per_ds: dict[str, list[list]] = {}
        dropped: Counter = Counter()
        for ds, results in await asyncio.gather(*(one(k, r) for k, r in enumerate(rows))):
            per_ds.setdefault(ds, []).append(usable(results, dropped))
        if not any(g for groups in per_ds.values() for g in groups):  # (was: exit 0 with a pass@1 of 0.0)
            raise RunFailed("agent runner", f"every eval rollout ({len(rows)} prompts x {n_samples}) failed; the "
                            "eval has no score", drops=dict(dropped), examples=dict(self._errors))
        metrics = {f"eval_dropped_{reason}": float(n) for reason, n in sorted(dropped.items())}
        for ds, groups in per_ds.items():
            # each rollout once: a chat rollout's segments each carry its reward (was: a 3-segment rollout counted 3x)
            rewards = [[float(t.reward) for t in {getattr(t, "rollout_id", None) or id(t): t for t in g}.values()]
                       for g in groups if g]
            if not rewards:  # every rollout of this datasource failed: counted above, not scored 0
                continue
            if n_samples > 1:
                metrics[f"eval_{ds}_pass{n_samples}"] = sum(max(r) for r in rewards) / len(rewards)
            metrics[f"eval_{ds}_pass1"] = sum(sum(r) / len(r) for r in rewards) / len(rewards)
        # response length and truncation per datasource, then over every sample
        scopes = {f"eval_{ds}_": [t for g in groups for t in g] for ds, groups in per_ds.items()}
        scopes["eval_"] = [t for done in scopes.values() for t in done]
        for prefix, done in ((p, done) for p, done in scopes.items() if done):
            lengths = [sum(e - s for s, e in t.action_ranges) for t in done]
            metrics[f"{prefix}response_length_mean"] = sum(lengths) / max(len(done), 1)
            metrics[f"{prefix}truncated_rate"] = sum(bool(t.truncated) for t in done) / max(len(done), 1)
        # rollouts, as pass@k counts them (lengths and truncation above: per segment, as the training's rollout/*)
        metrics["eval_num_samples"] = float(len({getattr(t, "rollout_id", None) or id(t) for t in scopes["eval_"]}))
        return metrics
