"""A save while the producer holds a generated batch (runtime/controller.py `produce`): in sync mode it awaits the
trainer ranks' answer to the engines-idle hint before it queues the batch. Before, a save in that window had the
generator past the batch's prompts and no batch of them (neither queued nor in flight): the resumed run skipped those
prompts without a word. Now the held batch is saved as queued, and a resumed sync run trains it first, with the
engines-idle hint answered first as the uninterrupted run had it."""

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.rollout.generation import Sampling  # noqa: E402
from molt_hydra.rollout.generator import SamplesGenerator, prompt_order  # noqa: E402
from molt_hydra.runtime import controller as controller_module  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402

PROMPTS = 8


class Runner:
    """Every rollout scores 1 at once."""

    async def run_group(self, row, n, sampling):
        return [(SimpleNamespace(reward=1.0, rollout_id=f"{row['prompt']}/{i}"), None) for i in range(n)]


class Calls:
    """The trainer ranks' engines hints, recorded; the idle one a sync step awaits is answered once `answer` is set."""

    def __init__(self):
        self.answer, self.hints = asyncio.Event(), []

    async def engines_busy(self, busy: bool, wait: bool) -> None:
        self.hints.append((busy, wait))
        if not busy and wait:
            await self.answer.wait()


def sync_controller() -> RLController:
    """A sync-mode controller over 8 prompts, 2 per batch (the generator as the run builds it: no carry-over)."""
    cfg = to_run_config(compose_config(["train.mode=sync", "rollout.batch_size=2", "seed=3"]))
    generator = SamplesGenerator([{"prompt": f"p{i}"} for i in range(PROMPTS)], runner=Runner(), batch_size=2,
                                 n_samples_per_prompt=1, sampling=Sampling(max_tokens=1), seed=3, carry_over=False)
    roles = SimpleNamespace(calls=Calls(), generator=generator, eval_rows=None, role_pids={})
    return RLController(cfg, roles, log=SimpleNamespace(sinks=SimpleNamespace(wandb_id=None)))


def prompts_of(batch) -> list[int]:
    return [g.prompt_index for g in batch.groups]


async def _saved_while_the_hint_is_answered() -> dict:
    ctl = sync_controller()
    producer = asyncio.ensure_future(ctl.produce())
    while not ctl.roles.calls.hints[1:]:  # batch 0 generated; the idle hint sent, not yet answered
        await asyncio.sleep(0)
    state = ctl.client_state()  # the save's snapshot (RLController.save)
    producer.cancel()
    return state


def test_a_batch_held_at_a_save_is_saved_queued_and_trained_first_after_the_resume():
    order = prompt_order(PROMPTS, 3, 0)
    state = asyncio.run(_saved_while_the_hint_is_answered())
    assert state["batches_made"] == 1 and [prompts_of(b) for b, _ in state["queued"]] == [sorted(order[:2])]

    async def resumed():
        ctl = sync_controller()
        ctl.restore(state)
        first, timing = ctl.queue.get_nowait()
        return prompts_of(first), timing, prompts_of(await ctl.roles.generator.generate_batch()), ctl.batches_made

    first, timing, second, made = asyncio.run(resumed())
    # the uninterrupted run's batches 0 and 1 (a batch is in prompt order: `produce` sorts it)
    assert (first, sorted(second), made) == (sorted(order[:2]), sorted(order[2:4]), 1)
    assert sorted(timing) == ["timing/generation", "timing/vllm_idle_wait"]  # the step's metrics read both


def test_a_resumed_sync_run_answers_the_idle_hint_before_it_trains_a_queued_batch(monkeypatch):
    """Its thread count: the trainer ranks count the engines as busy until told otherwise."""
    state = asyncio.run(_saved_while_the_hint_is_answered())
    monkeypatch.setattr(controller_module.ray_head, "watchers", lambda *a: [])
    seen = []

    async def resumed():
        ctl = sync_controller()
        ctl.restore(state)
        calls = ctl.calls = ctl.roles.calls
        calls.answer.set()
        calls.keeper = SimpleNamespace(watch=lambda version: asyncio.sleep(0))
        calls.freeze_heaps = lambda: asyncio.sleep(0)

        async def steps():
            seen.extend(calls.hints)
            return {}

        ctl._steps, ctl.produce = steps, lambda: asyncio.sleep(0)
        await ctl.run()

    asyncio.run(resumed())
    assert seen == [(False, True)]
