"""The agent contract: `Result`, `Env`, `Episode`, `Trajectory`, and the `Runner` base that runs a group of episodes,
catching every agent failure per rollout and counting it by reason (never fatal, never a hang).

Authoring styles match Molt (reference/molt_inventory.md §3): `Env` + `StepEnvRunner` (framework owns the token
loop) and `ChatAgent` + `ChatAgentRunner` (agent owns the loop through a stock SDK). A Molt agent file ports by
changing its imports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import inspect
import logging
import math
import numbers
import operator
import random
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from molt_hydra.models.vlm import NOT_GENERATED  # noqa: F401 -- re-exported: the version of prompt / feedback tokens
from molt_hydra.rollout.generation import EngineFailure, Generation, Sampling, TokenGenerator
from molt_hydra.rollout.router import EPISODE_DEADLINE

log = logging.getLogger(__name__)

# Why a rollout produced no trajectory; the samples generator logs them as rollout/dropped/<reason>.
AGENT_EXCEPTION = "agent_exception"
AGENT_TIMEOUT = "agent_timeout"
EMPTY_SESSION = "empty_session"
# the engines failed the rollout's generation (rollout/generation.py EngineFailure): not the agent's fault
ENGINE_ABORTED = "engine_aborted"
# a NaN / inf reward or score: the driver drops the trajectory (rollout/generator.py `usable`); named here
NONFINITE = {"reward": "nonfinite_reward", "score": "nonfinite_score"}


class GenerationAborted(EngineFailure):
    """`Trajectory.append_action` refused a generation the engine cut short; its rollout is dropped as engine_aborted
    (was: agent_exception, blaming the agent for the engine stopping or failing)."""


@dataclass
class Result:
    """What `Env.step` and `ChatAgent.run` return (same fields and defaults as Molt's)."""

    reward: Any = 0.0  # float, or a 1-element tensor / list (its element; more elements are an error)
    observation: str = ""  # step runner: next-turn feedback text, appended as tokens
    terminated: bool = True  # episode ended naturally (default: single turn)
    truncated: bool = False  # cut off externally
    info: dict = field(default_factory=dict)  # numeric scalars become logged metrics
    score: Any = None  # dynamic-filter / dashboard score; defaults to reward
    images: list | None = None  # step: next-turn images; chat: replaces the trajectory images (PIL, paths, bytes)
    sampling_params: Sampling | dict | None = None  # step: override sampling for the following turns


def scalar(value: Any, what: str) -> float:
    """A reward/score as float: a number (a bool, a numpy scalar), a one-element tensor / array or list / tuple (its
    element). Anything else (None, a string, a dict, an empty sequence, or one of several elements: was, its first
    taken without a word, so rewards per turn or per sample trained on the first alone) is an error naming `what`
    and the value."""
    if value is None:
        raise ValueError(f"{what} is None; return a number")
    _not_awaited(value, f"{what} is")
    if hasattr(value, "flatten") and not isinstance(value, (str, bytes)):  # torch / numpy, 0-d included
        value = value.flatten()
    if hasattr(value, "flatten") or isinstance(value, (list, tuple)):
        if len(value) == 0:
            raise ValueError(f"{what} is an empty {type(value).__name__}; return a number")
        if len(value) > 1:
            raise ValueError(f"{what} is a {type(value).__name__} of {len(value)} elements; return one number for the "
                             "rollout (a float, or a one-element list or tensor)")
        value = value[0]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # a tensor / numpy element
        value = value.item()
    if not isinstance(value, numbers.Real):  # a string, a dict, a nested list, a complex number...
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise TypeError(f"{what} is {type(value).__name__} {shown}; return a number (a float, a bool, a numpy "
                        "scalar, a one-element tensor or list)")
    try:
        return float(value)
    except OverflowError:  # an int past a float's range (was: "int too large to convert to float", naming nothing)
        raise ValueError(f"{what} is {type(value).__name__} beyond a float's range (its magnitude over 1.8e308); "
                         "return a number within it") from None


def _not_awaited(value: Any, said: str) -> None:
    """An async function's result that was never awaited (`reward=grade(...)` with an `async def grade`): an error
    saying so (was: "is coroutine <coroutine object grade ...>; return a number", and Python's "never awaited")."""
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # it will never run: no "coroutine ... was never awaited" warning on top
        name = getattr(value, "__qualname__", "")
        raise TypeError(f"{said} {type(value).__name__}{f' {name}' if name else ''}, an async function's result that "
                        "was not awaited; `await` it")


# What the runners read from the other `Result` fields (a truthy string "no" would end an episode, info=None or an
# observation that is no string failed deep inside a runner with a message naming neither the agent nor the field).
RESULT_FIELDS = {
    "observation": (lambda v: isinstance(v, str), "a string"),
    "terminated": (lambda v: not isinstance(v, (str, bytes)) and v in (True, False), "a bool"),
    "truncated": (lambda v: not isinstance(v, (str, bytes)) and v in (True, False), "a bool"),
    # its numbers are logged as metrics named by their keys (was: an int key failed the trainer's step on sorting
    # the metric names, "'<' not supported between instances of 'int' and 'str'", naming neither agent nor key)
    "info": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
             "a dict with string keys (each number in it is logged as the metric its key names)"),
    "images": (lambda v: v is None or isinstance(v, (list, tuple)), "None or a list of images"),
}


def reward_and_score(result: Any, returned_by: str) -> tuple[float, float]:
    """A `Result`'s reward and score (the score defaults to the reward) as floats; anything else, or another field
    of a type the runners cannot read, is an error naming the field."""
    if not isinstance(result, Result):
        _not_awaited(result, f"{returned_by} returned")
        raise TypeError(f"{returned_by} must return Result, got {type(result).__name__}")
    for name, (ok, must) in RESULT_FIELDS.items():
        value = getattr(result, name)
        if not _safe(ok, value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise TypeError(f"Result.{name} of {returned_by} is {type(value).__name__} {shown}; it must be {must}")
    reward = scalar(result.reward, f"Result.reward of {returned_by}")
    return reward, reward if result.score is None else scalar(result.score, f"Result.score of {returned_by}")


def shippable(info: dict, returned_by: str) -> None:
    """`info` travels with the trajectory from the runner process to the driver, as Ray pickles it. A value it cannot
    pickle (a lock, a client, a generator) failed its whole group's reply (rollout/batched_calls.py) with no message
    naming the value: an error naming the key instead, failing this rollout alone. Checked once per finished
    trajectory, on the info it keeps (was: every step-runner turn, a pickle of a growing info each turn)."""
    from ray import cloudpickle  # (deferred: heavy)

    try:
        cloudpickle.dumps(info)
    except Exception:  # noqa: BLE001 -- whatever pickling raises: find the value and name it
        for key, value in info.items():
            try:
                cloudpickle.dumps(value)
            except Exception as e:  # noqa: BLE001
                raise TypeError(f"Result.info[{key!r}] of {returned_by} is {type(value).__name__}, which cannot be "
                                f"sent from the agent runner to the trainer ({type(e).__name__}: {e}); keep numbers "
                                "(logged as metrics) and plain data in info") from None
        raise


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v  # not NaN


def _strings(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v)


# What each Sampling field may be set to from an Env's `Result.sampling_params` (the engine would otherwise refuse the
# request with vLLM's message, or max_tokens <= 0 would end the episode as silently "truncated"). `n` and
# `top_logprobs` stay as the runner sets them: the step runner samples one completion per turn and hands no
# alternatives to `Env.step`, so another value would change nothing.
# Sampling values the recipe fixes for training (the trainer recomputes log-probs at them): neither an Env
# (`Result.sampling_params`) nor a chat client (agents/wire/session.py) may change them.
RECIPE_SAMPLING = {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k"}
OVERRIDE_RULES = {
    "max_tokens": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "min_tokens": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "temperature": (lambda v: _real(v) and 0 <= v < math.inf, "a number >= 0"),
    "top_p": (lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _int(v) and (v == -1 or v >= 1), "-1 (off) or an int >= 1"),
    "stop": (lambda v: isinstance(v, str) and v or _strings(v), "a non-empty string or a list of them"),
    "stop_token_ids": (lambda v: isinstance(v, (list, tuple)) and all(_int(x) and x >= 0 for x in v),
                       "a list of token ids (ints >= 0)"),
    # any int64, as the chat server takes a client's seed: the engine seeds vLLM with seed + choice index mod 2**63
    "seed": (lambda v: v is None or _int(v) and -(2**63) <= v < 2**63, "None or an int64 (in [-2**63, 2**63 - 1])"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool"),
    "structured": (lambda v: v is None or isinstance(v, dict), "None or a dict of vLLM StructuredOutputsParams fields"),
}


def _safe(ok, value) -> bool:
    try:
        return bool(ok(value))
    except Exception:  # noqa: BLE001 -- a value whose == raises (a many-element array) is not the type asked for
        return False


def apply_sampling_override(sampling: Sampling, override: Sampling | dict | None) -> Sampling:
    """`sampling` with an Env's `Result.sampling_params` applied (a Sampling replaces it whole); a key or value the
    engine could not honour, or a recipe-fixed value changed (RECIPE_SAMPLING), is an error naming it and what it may
    be."""
    if override is None:
        return sampling
    if isinstance(override, Sampling):
        override = {f.name: getattr(override, f.name) for f in dataclasses.fields(Sampling)}
    if not isinstance(override, dict):
        raise TypeError(f"sampling_params must be a Sampling or dict, got {type(override).__name__}")
    unknown = set(override) - {f.name for f in dataclasses.fields(Sampling)}
    if unknown:
        raise ValueError(f"sampling_params override has unknown keys {sorted(unknown)}")
    for key, value in override.items():
        if key in ("n", "top_logprobs"):
            if value not in (getattr(sampling, key), {"n": 1, "top_logprobs": 0}[key]):
                raise ValueError(f"Result.sampling_params[{key!r}]={value!r}: the step runner samples one "
                                 "completion per turn and hands no alternatives to Env.step; leave it out")
        elif not OVERRIDE_RULES[key][0](value):
            raise ValueError(f"Result.sampling_params[{key!r}] is {value!r}; it must be {OVERRIDE_RULES[key][1]}")
        elif key in RECIPE_SAMPLING and not math.isclose(value, ours := getattr(sampling, key), abs_tol=1e-6):
            # (was: applied, so the turn was sampled at one value and trained at the recipe's: off-policy unseen)
            raise ValueError(f"Result.sampling_params[{key!r}]={value!r} differs from this rollout's "
                             f"{RECIPE_SAMPLING[key]}={ours}: the trainer recomputes log-probs at the recipe's "
                             "sampling, so an Env may not change it; leave it out")
    # numpy scalars as Python numbers (was: a numpy int seed passed, then overflowed the engine's seed + choice index
    # mod 2**63, and numpy ints in stop_token_ids reached vLLM's request)
    def plain(v):
        return int(v) if _int(v) else float(v) if _real(v) else v

    stops = {k: (override[k],) if isinstance(override[k], str) else tuple(map(plain, override[k]))
             for k in ("stop", "stop_token_ids") if k in override}
    return dataclasses.replace(sampling, **{**{k: plain(v) for k, v in override.items()}, **stops})


def seed_agent_rngs(seed: int | None, *where) -> None:
    """Seed Python's `random` and numpy's global RNG from the rollout's seed (derived from train.seed, the epoch, the
    prompt and the sample) and `where` in the rollout, right before the runner calls agent code: its draws are then a
    function of the run's seed, the same after a resume and whatever rollouts run beside it (was: the runner
    process's RNGs, seeded from os.urandom at its start, so the same seed drew other observations and rewards). Draws
    after an `await` inside agent code interleave with other rollouts' (seed a `random.Random` of your own from
    `sampling_params.seed` for those). No seed (a runner used directly, unseeded): left as they are."""
    if seed is not None:
        value = int.from_bytes(hashlib.sha256(repr((seed, *where)).encode()).digest()[:4], "little")
        random.seed(value)
        np.random.seed(value)


def image_tokens(per_image: int | Callable[[Any], int], images: list) -> int:
    """The tokens `images` add to a prompt beyond their placeholders (among its ids already), as the engine expands
    them: a runner's `image_tokens_per_image`, a count for every image (the user's) or a function of the image (the
    model's processor count, `TrajectoryImages.added_tokens`, which the runner process sets when it is 0)."""
    return sum(per_image(im) for im in images) if callable(per_image) else per_image * len(images)


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    """A prompt given as text, sent without a chat template (/v1/completions, an Env's text prompt), as the model's
    input ids: with the BOS token in front where the tokenizer adds one (Llama, Gemma, Mistral), as vLLM's
    /v1/completions and `LLM.generate` tokenize a text prompt (was: without, so a BOS model read a prompt unlike any
    it was trained on), unless the text starts with it already (text rendered by a chat template: one BOS, not two).
    A chat template's render writes its own BOS, and an observation continues a sequence: both go without."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if ids and bos is not None and ids[0] != bos and tokenizer("x")["input_ids"][:1] == [bos]:  # (its post-processor)
        return [bos, *ids]
    return ids


@functools.cache
def model_images(model_dir: str) -> tuple[bool, int | None]:
    """(whether the tokenizer's model takes images, its image placeholder's token id), from its config: a text-only
    model's image parts, and a placeholder written into a text, are then the client's 400 (or an Env observation's
    refusal, step_runner.py) instead of an engine error, or a text read as an image's place without an image.
    Unknown (no readable config): (True, None), the engine decides."""
    from transformers import AutoConfig

    from molt_hydra.models.vlm import is_vlm

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return True, None
    return (True, getattr(config, "image_token_id", None)) if is_vlm(config) else (False, None)


@dataclass
class Episode:
    """One rollout to run: the prompt row plus the sampling budget."""

    prompt: str | list[dict]  # pre-rendered text (step) or chat messages (chat; step renders them itself)
    sampling: Sampling
    max_length: int  # prompt + all generated and feedback tokens of one segment
    label: Any = None
    images: list = field(default_factory=list)
    tools: list[dict] | None = None
    group_id: Any = None
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    max_turns: int | None = None  # generating turns allowed (agent.max_turns); None = unlimited
    apply_chat_template: bool = False  # data.apply_chat_template: a string prompt is one user message, rendered


@dataclass
class Trajectory:
    """One training segment, token-first. `logprobs[i]` and `versions[i]` belong to `token_ids[i]` (0.0 / -1 where
    the token was not generated); `action_ranges` are half-open spans of generated tokens."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    action_ranges: list[tuple[int, int]] = field(default_factory=list)
    routed_experts: list | None = None  # MoE: per token, per layer, expert ids (None where unknown)
    images: list = field(default_factory=list)
    prompt: Any = None
    label: Any = None
    reward: float = 0.0
    score: float | None = None
    info: dict = field(default_factory=dict)
    truncated: bool = False
    finish_reasons: list[str] = field(default_factory=list)  # one per action
    group_id: Any = None
    rollout_id: str | None = None
    segment_index: int = 0  # chat path: position of this segment in its session

    def append_feedback(self, token_ids: list[int]) -> None:
        """Prompt or feedback tokens: trained on as context only."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([NOT_GENERATED] * len(token_ids))
        if self.routed_experts is not None:
            self.routed_experts.extend([None] * len(token_ids))

    def append_action(self, gen: Generation) -> None:
        if gen.finish_reason not in ("stop", "length"):  # (was: a cut-short generation trained as a finished action)
            raise GenerationAborted(f"the engine ended a generation with finish reason {gen.finish_reason!r} after "
                               f"{len(gen.token_ids)} tokens (vLLM aborted or failed the request: the engine stopping "
                               "or an engine error): a cut-short action is not trained on, the rollout is dropped")
        start = len(self.token_ids)
        self.token_ids.extend(gen.token_ids)
        self.logprobs.extend(gen.logprobs)
        self.versions.extend(gen.versions)
        self.action_ranges.append((start, len(self.token_ids)))
        self.finish_reasons.append(gen.finish_reason)
        if gen.routed_experts is not None or self.routed_experts is not None:
            self._lay_routing(gen, start)

    def _lay_routing(self, gen: Generation, start: int) -> None:
        # vLLM returns routing either for the generated tokens only or for prompt + generated (from position 0);
        # earlier rows win so a prompt's routing is the one recorded when its tokens were first processed. Rows from
        # position 0 are in the engine's positions, where each image placeholder is its whole span of image tokens:
        # they are kept in full, so the list lines up with the expanded trajectory the trainer sees (to_experience).
        experts = self.routed_experts = self.routed_experts or []
        rows = gen.routed_experts or []
        offset = start if len(rows) == len(gen.token_ids) else 0
        # an entry per token (None where unknown), and every row of those that start at position 0
        experts.extend([None] * (max(len(self.token_ids), len(rows) if offset == 0 else 0) - len(experts)))
        for i, row in enumerate(rows[: len(experts) - offset]):
            if experts[offset + i] is None:
                experts[offset + i] = list(row)

    @property
    def generated_ids(self) -> list[int]:
        return [t for s, e in self.action_ranges for t in self.token_ids[s:e]]

    @property
    def num_generated(self) -> int:
        return sum(e - s for s, e in self.action_ranges)


class Env(ABC):
    """Framework-owned loop: `reset` once (optional), then `step` after every generation. Fresh instance per episode."""

    def reset(self, state: dict) -> dict:
        """`state = {"observation": prompt, "label": label}`; the returned `"observation"` is the first model input."""
        return state

    @abstractmethod
    async def step(self, state: dict) -> Result:
        """`state` keys: observation_text, action_text, action_ids, label, sampling_params, turn, tokenizer."""


def check_built(seg: Trajectory, returned_by: str) -> None:
    """What the driver reads of a segment a Runner's own `execute` (or `run_group`) built: its reward and score as
    floats, its action ranges within its tokens; else an error naming the field, failing that rollout. Before, the
    driver's float() took a string reward silently, and a reward of None or a range past the tokens failed the whole
    run there, named as the driver's."""
    seg.reward = scalar(seg.reward, f"Trajectory.reward of {returned_by}")
    if seg.score is not None:
        seg.score = scalar(seg.score, f"Trajectory.score of {returned_by}")
    n, spans = len(seg.token_ids), []
    for span in seg.action_ranges:
        try:  # ints of any kind (a numpy int, a 0-d tensor: what __index__ takes), not bools
            start, end = (operator.index(x) for x in span)
            ok = 0 < start <= end <= n and not any(isinstance(x, bool) for x in span)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"Trajectory.action_ranges of {returned_by} holds {span!r}: each must be a [start, end) "
                             f"span of its {n} tokens, 0 < start <= end <= {n} (token 0 has no context to be "
                             "generated from)")
        spans.append((start, end))
    seg.action_ranges = spans


@dataclass
class RolloutOutcome:
    """A group's trajectories (every segment stamped with group_id and its rollout_id) and failures by reason."""

    trajectories: list[Trajectory]
    failures: Counter
    errors: dict[str, str] = field(default_factory=dict)  # one example message per failure reason


class Runner(ABC):
    @abstractmethod
    async def execute(self, episode: Episode, generator: TokenGenerator, tokenizer) -> list[Trajectory]:
        """Run one rollout; the segments it produced (may be empty)."""

    async def run_group(
        self, episodes: list[Episode], generator: TokenGenerator, tokenizer, timeout_s: float | None = None
    ) -> RolloutOutcome:
        """Run episodes concurrently. A raising, hanging (past `timeout_s`) or empty rollout is counted, not fatal."""
        runs = await asyncio.gather(*(self._run_one(ep, generator, tokenizer, timeout_s) for ep in episodes))
        outcome = RolloutOutcome([], Counter())
        for episode, (segments, reason, error) in zip(episodes, runs):
            if reason is not None:  # (a failed rollout has no segments)
                outcome.failures[reason] += 1
                outcome.errors.setdefault(reason, error)
            for seg in segments:
                seg.group_id, seg.rollout_id = episode.group_id, episode.rollout_id
                for name, reason in NONFINITE.items():  # (was: dropped by the driver with no example message)
                    if (value := getattr(seg, name)) is not None and not math.isfinite(value):
                        outcome.errors.setdefault(reason, f"{failed_on(self, episode)}: its {name} is {value}; "
                                                          "return a finite number")
            outcome.trajectories.extend(segments)
        return outcome

    async def _run_one(self, episode, generator, tokenizer, timeout_s) -> tuple[list[Trajectory], str | None, str]:
        """(segments, None, "") or ([], failure reason, an error message for the run's failure summary)."""
        deadline = asyncio.timeout(timeout_s)
        EPISODE_DEADLINE.set(deadline)  # the router extends it while the rollout waits for a replacement engine
        try:
            async with deadline:
                segments = await self.execute(episode, generator, tokenizer)
            if not isinstance(segments, list) or not all(isinstance(s, Trajectory) for s in segments):
                got = type(segments).__name__ if not isinstance(segments, list) else "a list holding " + ", ".join(
                    sorted({type(s).__name__ for s in segments if not isinstance(s, Trajectory)}))
                raise TypeError(f"{type(self).__name__}.execute must return a list of Trajectory, got {got}")
            for seg in segments:
                check_built(seg, f"{type(self).__name__}.execute")
        except BaseException as e:  # the agent is user code: any error ends this rollout only; a sys.exit() escaping
            # would end the runner's agent loop, and every later rollout would time out. A CancelledError the agent
            # raised itself (nobody cancelled this task) would end its whole group. Another BaseException (a grader's
            # func_timeout.FunctionTimedOut) crossed Ray to the driver past every `except Exception`: the run ended
            # in a traceback (exit 1), its roles not torn down.
            if isinstance(e, GeneratorExit) or isinstance(e, asyncio.CancelledError) and \
                    asyncio.current_task().cancelling():
                raise  # this rollout really is being cancelled (or its coroutine closed)
            who = failed_on(self, episode)
            if isinstance(e, TimeoutError) and deadline.expired():  # ours, not a TimeoutError the agent raised
                log.warning("rollout %s (%s): agent exceeded timeout_s=%s", episode.rollout_id, who, timeout_s)
                return [], AGENT_TIMEOUT, f"{who}: the rollout ran past agent.timeout_s={timeout_s}"
            if isinstance(e, EngineFailure):  # the engines', raised through the agent's generation calls
                log.warning("rollout %s (%s): %s", episode.rollout_id, who, e)
                return [], ENGINE_ABORTED, f"{who}: {e}"
            log.exception("rollout %s (%s): agent raised", episode.rollout_id, who)
            return [], AGENT_EXCEPTION, f"{who}: {type(e).__name__}: {e}"
        if not any(seg.num_generated for seg in segments):
            return [], EMPTY_SESSION, f"{failed_on(self, episode)}: the agent returned no generated token"
        return segments, None, ""

    async def close(self) -> None:
        """Release per-process resources (the chat server)."""


def failed_on(runner: Runner, episode: Episode) -> str:
    """The agent and the sample a failed rollout ran, as its failure message starts: the Env / ChatAgent class (a
    Runner's own: the Runner), the prompt (of chat messages, the last user text) and the label, each cut short. Was:
    the cause alone ("KeyError: 'answer'"), naming neither the agent nor the row it failed on."""
    agent = getattr(runner, "env_cls", None) or getattr(runner, "agent_cls", None) or type(runner)
    prompt = episode.prompt
    if isinstance(prompt, list):  # chat messages: the last user turn's text
        last = next((m.get("content") for m in reversed(prompt) if isinstance(m, dict) and m.get("role") == "user"),
                    "")
        prompt = last if not isinstance(last, list) else " ".join(
            p["text"] for p in last if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"])
    return f"{getattr(agent, '__name__', agent)} on prompt {_cut(prompt)}, label {_cut(episode.label, 40)}"


def _cut(value: Any, most: int = 60) -> str:
    """`value`'s repr on one line, at most `most` characters."""
    shown = " ".join(repr(value).split())
    return shown if len(shown) <= most else shown[: most - 3] + "..."
