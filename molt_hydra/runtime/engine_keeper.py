"""A dead rollout engine is replaced, not fatal: the driver checks every engine's health every few seconds (the actor
gone, or alive with its vLLM engine core dead); a dead one is killed, a new one is built as at start
(`Roles.new_engine`), given the trainer's current weights and policy version, and handed to every runner's router,
whose requests wait for it and are retried with their own seeds. Each restart prints one console line (which
engine, why, how many requests were retried) and is counted (`engine/restarts`, also `rollout/engine_restarts`);
restarts are bounded by `rollout.max_engine_restarts`; one more death ends the run, naming the engine."""

from __future__ import annotations

import asyncio
import os
import sys
from contextlib import suppress

import ray

from molt_hydra.runtime.watchdog import RunFailed, deadline, descendants, describe, kill, with_logged_error

POLL_S = 2.0  # how often the driver asks every engine whether it is alive


class EngineKeeper:
    def __init__(self, roles, *, max_restarts: int, startup_s: float):
        """`roles`: the built handles (runtime/roles.py), reached through `roles.calls`."""
        self.roles, self.max_restarts, self.startup_s = roles, max_restarts, startup_s
        self.restarts = 0
        self.why: dict[int, str] = {}  # engine index -> how its death was seen, for the restart line
        self.retries_seen = 0.0  # the runners' cumulative router retries at the last restart
        self.processes: dict[int, list[int]] = {}  # engine index -> its processes (its vLLM engine core included)

    async def watch(self, weights_version) -> None:
        """Forever: replace dead engines. `weights_version()`: the policy version of the trainer's weights now."""
        self.processes = {i: await self._local_processes(engine) for i, engine in enumerate(self.roles.engines)}
        while True:
            await asyncio.sleep(POLL_S)
            # Polled outside the lock, so a health check waiting on a busy engine never holds up a weight push;
            # re-checked under it, as a failed push may have replaced the engine meanwhile.
            if not await self.dead_engines():
                continue
            async with self.roles.calls.engines_lock:
                for index in await self.dead_engines():
                    await self.replace(index, weights_version())

    async def dead_engines(self) -> list[int]:
        async def dead(engine) -> str | None:
            try:
                return None if await asyncio.wait_for(engine.healthy.remote(), 10) else "its vLLM engine core died"
            except ray.exceptions.RayActorError as e:
                return f"its actor {describe(e).removeprefix('the process ')}"
            except Exception:  # not answering in time: the stall watchdog's case, not a death
                return None

        states = await asyncio.gather(*(dead(e) for e in self.roles.engines))
        self.why.update({i: why for i, why in enumerate(states) if why})
        return [i for i, why in enumerate(states) if why]

    async def replace(self, index: int, version: int | None) -> None:
        """A new engine `index`; with `version`, it receives the trainer's weights stamped so (None: the caller's
        weight push that follows gives them)."""
        role = f"rollout engine {index}"
        if self.restarts >= self.max_restarts:
            raise RunFailed(role, f"died after {self.restarts} restart(s); rollout.max_engine_restarts="
                                  f"{self.max_restarts} allows no more")
        if self.roles.transport == "nccl":  # the broadcast group is opened once, with every engine, at start
            raise RunFailed(role, "died; a replacement cannot join the NCCL weight-broadcast group opened at start "
                                  "(resume from the last checkpoint, as the run's last line says)")
        self.restarts += 1
        roles, old = self.roles, self.roles.engines[index]
        # an actor that outlived its engine core: let vLLM clean up what is left of it (already dead or not
        # answering: killed below either way)
        with suppress(Exception):
            await asyncio.wait_for(old.shutdown.remote(), 10)
        ray.kill(old)
        kill(self.processes.pop(index, []))  # an engine core whose actor was killed is left an orphan
        engine = roles.new_engine(index)
        try:
            await deadline(engine.start.remote(), self.startup_s, role, "restart")
        except ray.exceptions.RayError as e:  # named by its index (before: 'rollout engine', whichever it was)
            cause = f"its restart failed: {describe(e).removeprefix('its start failed: ')}"
            raise RunFailed(role, await with_logged_error(engine, cause)) from e
        # version 0 before any push: the model path's weights, which the new engine loaded itself. A warm start's
        # version 0 is its checkpoint's, pushed at its start (before: a replacement before the first sync served the
        # model path's weights as version 0, and the steps trained on them were off-policy without a word)
        if version or version == 0 and roles.calls.pushed:
            await roles.calls.push_to(version, [engine])
        roles.engines[index] = engine
        stranded = sum(n or 0 for n in await deadline(asyncio.gather(
            *(r.replace_engine.remote(index, engine) for r in roles.runners)), 30, "agent runner",
            "replace a rollout engine"))
        roles.role_pids[role] = await deadline(engine.__ray_call__.remote(lambda e: os.getpid()), 30, role, "pid")
        self.processes[index] = await self._local_processes(engine)
        # One console line per restart: the engine, why, and the requests retried on the new engine: those that met
        # the dead one and already went back to wait (counted by the runners' routers since the previous restart), and
        # those still in flight on it when it was replaced (`stranded`: they fail now and retry).
        retries = (await roles.calls.router_metrics()).get("rollout/router/retries", 0.0)
        retried = int(retries - self.retries_seen) + stranded
        self.retries_seen = retries + stranded  # the stranded ones are counted by their routers as they retry
        print(f"rollout engine {index} restarted ({self.restarts} of rollout.max_engine_restarts="
              f"{self.max_restarts}): {self.why.pop(index, 'it died')}; {retried} request(s) retried on the new "
              "engine", file=sys.stderr, flush=True)

    @staticmethod
    async def _local_processes(engine) -> list[int]:
        """The engine actor's process and its children, when it runs on this node (a pid means nothing elsewhere)."""
        def probe(_engine):
            return ray.get_runtime_context().get_node_id(), [os.getpid(), *descendants(os.getpid())]

        try:
            node, pids = await asyncio.wait_for(engine.__ray_call__.remote(probe), 30)
        except Exception:  # an engine dying or busy right now: its replacement is cleaned by Ray alone
            return []
        return pids if node == ray.get_runtime_context().get_node_id() else []

    def metrics(self) -> dict[str, float]:
        return {"engine/restarts": float(self.restarts), "rollout/engine_restarts": float(self.restarts)}
