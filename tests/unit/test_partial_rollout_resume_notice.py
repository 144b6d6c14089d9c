"""A resume under train.partial_rollout says it is not exact (runtime/controller.py `restore`). The groups in flight at
the save are vLLM requests, not saved: they start over under the resumed weights, where the uninterrupted run finished
them from the tokens they had, some of older policy versions. Before, the run said nothing, and docs/molt_options.md
promised that a resumed async run trains exactly what the uninterrupted run would have. Without partial rollout the
groups in flight at a save run under the version they are rerun under, and the resume is exact: no notice."""

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.rollout.generation import Sampling  # noqa: E402
from molt_hydra.rollout.generator import SamplesGenerator  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402

BATCH, INFLIGHT = 2, 5


class Runner:
    async def run_group(self, row, n, sampling):
        return [(SimpleNamespace(reward=1.0, rollout_id=f"{row['prompt']}/{i}"), None) for i in range(n)]


def controller(partial: bool) -> RLController:
    """The generator as the run builds it: it carries groups over a batch only under partial rollout."""
    cfg = to_run_config(compose_config([f"train.partial_rollout={str(partial).lower()}", f"rollout.batch_size={BATCH}",
                                        f"rollout.max_inflight_groups={INFLIGHT}", "seed=3"]))
    generator = SamplesGenerator([{"prompt": f"p{i}"} for i in range(16)], runner=Runner(), batch_size=BATCH,
                                 n_samples_per_prompt=1, sampling=Sampling(max_tokens=1), seed=3,
                                 max_inflight_groups=INFLIGHT, carry_over=partial)
    roles = SimpleNamespace(calls=None, generator=generator, eval_rows=None, role_pids={})
    return RLController(cfg, roles, log=SimpleNamespace(sinks=SimpleNamespace(wandb_id=None)))


def saved(partial: bool) -> dict:
    """The loop's state saved after step 2 (policy version 2), with one batch made since."""

    async def run():
        ctl = controller(partial)
        ctl.step = ctl.version = 2
        ctl.queue.put_nowait((await ctl.roles.generator.generate_batch(), {}))
        state = ctl.client_state()
        await ctl.roles.generator.close()
        return state

    return asyncio.run(run())


@pytest.mark.parametrize("partial", [True, False])
def test_a_resume_under_partial_rollout_names_the_groups_that_start_over(partial, capsys):
    state = saved(partial)
    # under partial rollout the pool is refilled after each batch: INFLIGHT groups were in flight at the save
    assert len(state["generator"]["pending"]) == (INFLIGHT if partial else 0)
    controller(partial).restore(state)
    out = capsys.readouterr().out
    if not partial:
        assert out == ""
        return
    assert out == (f"Resuming under train.partial_rollout: the {INFLIGHT} prompt groups in flight at the save start "
                   "over under the resumed weights (policy version 2), where the uninterrupted run finished them from "
                   "the tokens they had, some of older versions, so the steps that train them can differ from that "
                   "run's (a resume is exact with train.partial_rollout=false)\n")


def test_a_mid_batch_save_without_partial_rollout_resumes_silently(capsys):
    """An async save while a batch is generated (its groups in flight, all under the saved version): exact."""
    state = saved(False)
    state["generator"]["pending"] = [(0, 7), (0, 9)]
    controller(False).restore(state)
    assert capsys.readouterr().out == ""
