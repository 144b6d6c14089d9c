"""The agent-runner process: runs the configured agent over prompt groups against the engines (through the router)
and hands back the finished trajectories, with failures counted by reason (Molt §3.8); the controller turns them into
training rows (algorithm/experience.py).

One `AgentRunnerActor` per `rollout.num_runners`, each a Ray actor with its own event loop (and, for chat agents,
its own loopback chat server). The samples generator in the driver reaches them through `RemoteGroupRunner`.

What agent code prints or logs (an Env's, a ChatAgent's, a reward function's; and each failed rollout's traceback)
goes where Ray sends the runner process's stdout / stderr: its session log files, kept off the terminal
(log_to_driver=False). `link_output` names them in output_dir, so they are found (was: only in /tmp/ray/session_*).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import socket
import threading
import uuid
from pathlib import Path

from molt_hydra.rollout.batched_calls import BatchedCallee, BatchedCalls
from molt_hydra.rollout.generation import Sampling


def request_seed(base: int, *parts) -> int:
    """A stable 31-bit seed from the run seed and the sample's identity: a resumed run samples the same tokens."""
    return int.from_bytes(hashlib.sha256(repr((base, *parts)).encode()).digest()[:4], "little") & 0x7FFFFFFF


class AgentRunnerActor(BatchedCallee):
    """Hosts one agent runner. Returns trajectories (not tensors) so the generator can filter on their scores."""

    BATCHED = ("run_group",)  # the driver's groups arrive in batches (rollout/batched_calls.py)

    def __init__(self, runner_spec: dict, engines: list, *, tokenizer_path: str, max_len: int, timeout_s: float,
                 engine_timeout_s: float, seed: int, max_turns: int, apply_chat_template: bool = False,
                 chat_options: dict | None = None):
        from transformers import AutoTokenizer

        from molt_hydra.agents.loading import load_runner
        from molt_hydra.agents.step_runner import StepEnvRunner
        from molt_hydra.rollout.router import Router

        from molt_hydra.models.vlm import TrajectoryImages

        self.runner = load_runner(dict(runner_spec))
        if chat_options and hasattr(self.runner, "configure_chat"):  # agent.tool_parser, max_choices, ...
            self.runner.configure_chat(**chat_options)
        elif chat_options and isinstance(self.runner, StepEnvRunner):  # the engines' image limit, as a chat runner's
            self.runner.max_images = chat_options.get("max_images") or 0  # (None: data.max_images_per_prompt=0)
        self.apply_chat_template = apply_chat_template
        images = TrajectoryImages.for_model(tokenizer_path)
        text_only = images is None and (Path(tokenizer_path) / "config.json").is_file()
        if text_only and getattr(self.runner, "accepts_images", False):
            self.runner.accepts_images = False  # image parts / Result.images for a text-only model are refused
        if images is not None and getattr(self.runner, "image_tokens_per_image", None) == 0:
            # each image takes engine tokens beyond its placeholder, as many as the processor gives its size: the
            # length budget, usage and the overflow 400 count them, so a rollout stays within max_len once expanded
            # (else algorithm/experience.py drops it as image_truncated)
            self.runner.image_tokens_per_image = images.added_tokens
        self.router = Router(engines, timeout_s=engine_timeout_s)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.max_len, self.timeout_s, self.seed, self.max_turns = max_len, timeout_s, seed, max_turns
        # Agent code is user code and may block (time.sleep, a synchronous HTTP call): it runs on its own event loop
        # in its own thread, so this actor's loop stays free to enforce agent.timeout_s and to answer the driver.
        self.agent_loop = asyncio.new_event_loop()
        self.errors: dict[str, str] = {}  # an example message per failure reason, for the run's failure summary
        self.closing = False  # set by `close`: the agent loop is not restarted after it
        threading.Thread(target=self._agent_loop_forever, name="agent-loop", daemon=True).start()

    def _agent_loop_forever(self) -> None:
        """The agent loop until `close` stops it. A SystemExit / KeyboardInterrupt raised in a task agent code made
        (a coroutine under asyncio.gather) is set on that task, whose awaiter fails its rollout with it, and is also
        raised out of run_forever by asyncio: the loop goes on. Before, it ended the loop's thread without a word:
        every later group of this runner timed out, told as 'agent code blocked its event loop'."""
        while True:
            try:
                return self.agent_loop.run_forever()
            except (SystemExit, KeyboardInterrupt):
                if self.closing:  # close()'s stop may have run in the same pass: restarting would lose it
                    return

    async def _on_agent_loop(self, coro, timeout_s: float):
        """`coro`'s result from the agent loop, or TimeoutError after `timeout_s` plus any time the router waited for
        a replacement engine meanwhile."""
        work = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.agent_loop))
        start, outage = asyncio.get_running_loop().time(), self.router.outage_s()
        while True:
            left = start + timeout_s + (self.router.outage_s() - outage) - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait({work}, timeout=max(left, 0.0))
            if done:
                return work.result()
            if left <= 0:
                work.cancel()
                raise asyncio.TimeoutError

    async def run_group(self, row: dict, n_samples: int, sampling: Sampling) -> list[tuple[object, str | None]]:
        from molt_hydra.agents.base import AGENT_EXCEPTION, AGENT_TIMEOUT, Episode, Runner, failed_on

        group_id = uuid.uuid4().hex
        # Seeds derive from the group's base seed (set by the generator from the run seed, epoch and prompt), so
        # the same prompt at the same point of the run samples the same tokens, also after a resume.
        base = sampling.seed if sampling.seed is not None else request_seed(self.seed, group_id)
        episodes = [
            Episode(prompt=row["prompt"], sampling=dataclasses.replace(sampling, seed=request_seed(base, i)),
                    max_length=self.max_len, label=row.get("label"), images=list(row.get("images") or []),
                    tools=row.get("tools"), group_id=group_id, rollout_id=f"{group_id}-{i}", max_turns=self.max_turns,
                    apply_chat_template=self.apply_chat_template)
            for i in range(n_samples)
        ]
        try:  # the agent loop's own per-rollout timeout fires first unless agent code blocks that loop
            outcome = await self._on_agent_loop(self.runner.run_group(episodes, self.router, self.tokenizer,
                                                                      self.timeout_s), self.timeout_s * 1.1 + 5)
        except asyncio.TimeoutError:
            if AGENT_TIMEOUT not in self.errors:  # told once: a blocked loop holds the probe below 1 s
                # Why: agent code blocking the agent loop (it answers no probe), a Runner's own run_group not ending
                # its rollouts at timeout_s (it cancels nothing), or a rollout going on after the cancellation at its
                # timeout. Each is told as itself: the user is not sent looking for a blocking call that is not there.
                probe = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.agent_loop))
                answered, _ = await asyncio.wait({probe}, timeout=1.0)
                if not answered:
                    why = ("agent code blocked its event loop past agent.timeout_s={} (a blocking call inside async "
                           "code?)")
                elif type(self.runner).run_group is not Runner.run_group:
                    why = (type(self.runner).__name__ + ".run_group went on past agent.timeout_s={}: a Runner's own "
                           "run_group must end its rollouts at agent.timeout_s (the timeout_s it is passed), as "
                           "Runner.run_group does")
                else:
                    why = ("agent code went on past agent.timeout_s={}, through the cancellation that ends a rollout "
                           "at its timeout (an `except BaseException:` or `except asyncio.CancelledError:` that does "
                           "not re-raise, or a `finally:` that awaits?)")
                # (the group's agent and row first, as a rollout's failure names them: base.py failed_on)
                self.errors[AGENT_TIMEOUT] = f"{failed_on(self.runner, episodes[0])}: {why.format(self.timeout_s)}"
            return [(None, AGENT_TIMEOUT)] * n_samples
        except BaseException as e:  # a Runner's own run_group is user code: its group fails, counted (any error, as
            # a rollout's in Runner._run_one: a BaseException past here failed the run in a traceback, not torn down)
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):  # this call's own
                raise
            self.errors.setdefault(AGENT_EXCEPTION, f"{failed_on(self.runner, episodes[0])}: "
                                                    f"{type(self.runner).__name__}.run_group raised "
                                                    f"{type(e).__name__}: {e}")
            return [(None, AGENT_EXCEPTION)] * n_samples
        return self._results(outcome, episodes)

    def _results(self, outcome, episodes: list) -> list[tuple[object, str | None]]:
        """The group's (trajectory, None) and (None, failure reason) pairs. A Runner's own run_group is user code: what
        it returns is checked as Runner.run_group checks each rollout's (agents/base.py check_built), else its group,
        or the segment, fails as agent_exception naming it. Before, a list for a RolloutOutcome failed as "'list'
        object has no attribute 'errors'", and a segment without its episode's rollout id, or with a reward of None,
        failed the whole run in the driver, as the driver's."""
        from molt_hydra.agents.base import AGENT_EXCEPTION, RolloutOutcome, Runner, Trajectory, check_built, failed_on

        name = f"{type(self.runner).__name__}.run_group"
        who = failed_on(self.runner, episodes[0])  # (a group's rollouts share its prompt and label)
        if not isinstance(outcome, RolloutOutcome):
            self.errors.setdefault(AGENT_EXCEPTION, f"{who}: TypeError: {name} must return a RolloutOutcome, got "
                                                    f"{type(outcome).__name__}")
            return [(None, AGENT_EXCEPTION)] * len(episodes)
        for reason, error in outcome.errors.items():
            self.errors.setdefault(reason, error)
        results = [(None, reason) for reason, count in outcome.failures.items() for _ in range(count)]
        if type(self.runner).run_group is Runner.run_group:
            return results + [(t, None) for t in outcome.trajectories]
        ids = {ep.rollout_id: ep.group_id for ep in episodes}
        for t in outcome.trajectories:
            try:
                if not isinstance(t, Trajectory):
                    raise TypeError(f"{name} returned a {type(t).__name__} among its trajectories")
                if ids.get(t.rollout_id, object()) != t.group_id:
                    raise ValueError(f"{name} returned a Trajectory with rollout_id={t.rollout_id!r}, "
                                     f"group_id={t.group_id!r}: each must carry its Episode's (Runner.run_group "
                                     "stamps them)")
                check_built(t, name)
            except (TypeError, ValueError) as e:
                self.errors.setdefault(AGENT_EXCEPTION, f"{who}: {type(e).__name__}: {e}")
                results.append((None, AGENT_EXCEPTION))
            else:
                results.append((t, None))
        return results

    def router_metrics(self) -> dict[str, float]:
        from molt_hydra.agents.tool_parser import parse_failures

        return {**self.router.metrics(), "agent/tool_parse_failures": float(parse_failures())}

    def example_errors(self) -> dict[str, str]:
        return self.errors

    def output_files(self) -> tuple[str, list[str]]:
        """(this node's name, the files Ray writes this process's stdout and stderr to)."""
        return socket.gethostname(), [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)]

    def replace_engine(self, index: int, engine) -> int:
        return self.router.replace_engine(index, engine)

    async def close(self) -> None:
        try:
            await self._on_agent_loop(self.runner.close(), 10)
        finally:
            self.closing = True  # (before the stop is queued: the agent loop's thread reads it after the stop ran)
            self.agent_loop.call_soon_threadsafe(self.agent_loop.stop)


OUTPUT = "agent_runner_{}.{}"  # in output_dir: a link to Ray's file of runner i's stdout ("out") / stderr ("err")


async def link_output(runners: list, output_dir: str) -> str:
    """Links in `output_dir` to the runners' stdout / stderr files (replacing a resumed run's); a line naming them
    for the console (a runner on another node: its node and files)."""
    here, found, elsewhere = socket.gethostname(), [], []
    for i, (node, files) in enumerate(await asyncio.gather(*(r.output_files.remote() for r in runners))):
        if node != here or not all(os.path.exists(f) for f in files):  # not on this node: named where it is
            elsewhere.append(f"runner {i} on {node}: {', '.join(files)}")
            continue
        try:
            for file, kind in zip(files, ("out", "err")):
                link = Path(output_dir) / OUTPUT.format(i, kind)
                link.unlink(missing_ok=True)
                link.symlink_to(file)
            found.append(i)
        except OSError:  # (a file system without links)
            elsewhere.append(f"runner {i}: {', '.join(files)}")
    named = [str(Path(output_dir) / OUTPUT.format("*" if len(found) > 1 else found[0], "{out,err}"))] if found else []
    return "agent code's print / logging output: " + "; ".join(named + elsewhere)


class RemoteGroupRunner:
    """The generator's `GroupRunner`: spreads groups round-robin over the runner actors. A stalled runner is caught by
    the controller's step deadline, which names it."""

    def __init__(self, actors: list):
        self.actors, self._next = actors, 0
        self._calls = [BatchedCalls(a, "run_group") for a in actors]

    async def run_group(self, row: dict, n_samples: int, sampling: Sampling):
        import ray

        from molt_hydra.runtime.watchdog import RunFailed, describe

        i, self._next = self._next, (self._next + 1) % len(self.actors)
        try:
            return await self._calls[i].call(row, n_samples, sampling)
        except ray.exceptions.RayActorError as e:  # the runner process is gone: the run cannot go on without it
            raise RunFailed(f"agent runner {i}", describe(e)) from e

