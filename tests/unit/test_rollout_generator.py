"""The samples generator with a scripted group runner (no engine): order, resume, filtering, drops, eval."""

import asyncio
from dataclasses import dataclass, field

import pytest

from molt_hydra.rollout.generation import Sampling
from molt_hydra.rollout.generator import DROP_REASONS, SamplesGenerator, prompt_order, refuse_other_prompts

SAMPLING = Sampling(max_tokens=4)


@dataclass
class Traj:
    reward: float
    score: float | None = None
    rollout_id: str = ""
    truncated: bool = False
    action_ranges: list = field(default_factory=lambda: [(0, 3)])


class ScriptedRunner:
    """row["script"][i]: a reward, "raise" (the rollout's agent failed) or "hang" (the whole group hangs)."""

    def __init__(self):
        self.dispatched: list[int] = []

    async def run_group(self, row, n, sampling):
        self.dispatched.append(row["id"])
        await asyncio.sleep(0.001 * (row["id"] % 3))  # groups finish out of dispatch order
        script = row.get("script", [1.0] * n)
        if "hang" in script:
            await asyncio.sleep(60)
        if "boom" in script:
            raise RuntimeError("runner crashed")
        return [(None, "agent_exception") if s == "raise" else (Traj(*_reward_score(s), rollout_id=f"{row['id']}-{i}"),
                                                                None)
                for i, s in enumerate(script)]


def _reward_score(entry) -> tuple:
    """A script entry: a reward, or (reward, score)."""
    return tuple(entry) if isinstance(entry, tuple) else (entry, None)


def rows(n):
    return [{"id": i} for i in range(n)]


async def drain(gen):
    out = []
    while True:
        b = await gen.generate_batch()
        out += [g.prompt_index for g in b.groups]
        if b.exhausted:
            return out


def test_prompt_order_is_a_function_of_seed_and_epoch():
    assert prompt_order(50, 1, 0) == prompt_order(50, 1, 0)
    assert sorted(prompt_order(50, 1, 0)) == list(range(50))
    assert prompt_order(50, 1, 0) != prompt_order(50, 1, 1)
    assert prompt_order(50, 1, 0) != prompt_order(50, 2, 0)


def test_same_seed_same_order_across_runs_and_epochs():
    def run(seed):
        runner = ScriptedRunner()
        gen = SamplesGenerator(rows(10), runner, batch_size=3, n_samples_per_prompt=2, sampling=SAMPLING,
                               seed=seed, num_epochs=2)
        groups = asyncio.run(drain(gen))
        return runner.dispatched, groups

    d1, g1 = run(7)
    d2, g2 = run(7)
    assert d1 == d2 == prompt_order(10, 7, 0) + prompt_order(10, 7, 1)
    # the seed fixes the dispatch order; groups come back as they finish (timers: the machine's load may swap two)
    assert sorted(g1) == sorted(g2) == sorted(list(range(10)) * 2)
    assert run(8)[0] != d1


def test_resume_continues_the_same_order_without_losing_or_repeating_prompts():
    def make(runner):
        return SamplesGenerator(rows(12), runner, batch_size=2, n_samples_per_prompt=2, sampling=SAMPLING,
                                seed=3, max_inflight_groups=4)

    full_runner = ScriptedRunner()
    asyncio.run(drain(make(full_runner)))
    assert full_runner.dispatched == prompt_order(12, 3, 0)

    async def first_half():
        gen = make(ScriptedRunner())
        got = [g.prompt_index for _ in range(2) for g in (await gen.generate_batch()).groups]
        state = gen.state_dict()
        await gen.close()
        return got, state

    got, state = asyncio.run(first_half())
    in_flight = [i for _, i in state["pending"]]
    assert len(in_flight) == 4  # groups in flight at the checkpoint are re-dispatched on resume, not lost
    resumed_runner = ScriptedRunner()
    resumed = make(resumed_runner)
    resumed.load_state_dict(state)
    rest = asyncio.run(drain(resumed))
    order = prompt_order(12, 3, 0)
    surplus = [i for i, _, _ in state["finished"]]
    assert sorted(got + surplus + in_flight) == sorted(order[: state["cursor"]])
    assert resumed_runner.dispatched == in_flight + order[state["cursor"] :]
    assert sorted(got + rest) == list(range(12))


@pytest.mark.parametrize("other", ["fewer", "edited"])
def test_a_resume_on_other_prompts_is_refused_naming_both(other):
    """Before: a resume after the data file was cut short failed mid-run with 'Run failed: driver: IndexError: list
    index out of range' (advising the same resume again); one after rows were edited went on over other prompts."""
    data = [{"id": i, "prompt": f"q{i}", "label": str(i)} for i in range(8)]
    gen = SamplesGenerator(data, ScriptedRunner(), batch_size=2, n_samples_per_prompt=1, sampling=SAMPLING)
    state = gen.state_dict()
    assert state["prompts"] == gen.fingerprint() and gen.fingerprint().startswith("8 rows, sha256 ")
    changed = data[:5] if other == "fewer" else [*data[:7], {**data[7], "label": "8"}]
    resumed = SamplesGenerator(changed, ScriptedRunner(), batch_size=2, n_samples_per_prompt=1, sampling=SAMPLING)
    with pytest.raises(ValueError) as e:
        resumed.load_state_dict(state)
    assert str(e.value).startswith(f"the checkpoint was trained on other prompts ({gen.fingerprint()}) than this "
                                   f"run's ({resumed.fingerprint()}); ")
    with pytest.raises(ValueError) as same_text:  # the resume check's refusal before Ray (runtime/entrypoint.py)
        refuse_other_prompts(gen.fingerprint(), resumed.fingerprint())
    assert str(same_text.value) == str(e.value)
    assert resumed.fingerprint() != gen.fingerprint()
    same = SamplesGenerator([dict(r) for r in data], ScriptedRunner(), batch_size=2, n_samples_per_prompt=1,
                            sampling=SAMPLING)
    same.load_state_dict(state)  # the same data, reloaded: resumes
    del state["prompts"]  # a checkpoint older than the record: resumes as before
    resumed.load_state_dict(state)


def test_surplus_finished_groups_go_into_the_state():
    async def go():
        gen = SamplesGenerator(rows(6), ScriptedRunner(), batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING,
                               max_inflight_groups=6)
        gen._refill()
        await asyncio.wait(list(gen._inflight))  # every group finishes; one is returned, the rest is surplus
        batch = await gen.generate_batch()
        await gen.generate_batch()
        return batch, gen.state_dict()

    batch, state = asyncio.run(go())
    assert len(batch.groups) == 1
    assert len(state["finished"]) == 4 and state["pending"] == []


def test_a_save_mid_batch_keeps_the_counts_of_the_groups_already_filtered():
    """A save while a batch is half made (async mode, partial rollout): its groups already filtered out are not
    re-run on resume (their prompts are used), so their counts must go into the state. Before, the resumed batch
    reported no dynamic_filter drop and a pass rate of 100% for a batch that filtered one group of four."""
    scripts = {0: [1.0, 1.0], 1: [0.0, 1.0], 2: ["hang"], 3: [1.0, 0.0]}  # 0 all pass: filtered; 2 hangs
    data = [{"id": i, "script": s} for i, s in scripts.items()]

    def make(data):
        return SamplesGenerator(data, ScriptedRunner(), batch_size=3, n_samples_per_prompt=2, sampling=SAMPLING,
                                max_inflight_groups=4, dynamic_filtering=(0.0, 1.0))

    async def half():
        gen = make(data)
        making = asyncio.ensure_future(gen.generate_batch())
        while [index for _, index, _ in gen._inflight.values()] != [2]:  # groups 0, 1, 3 are done and filtered
            await asyncio.sleep(0)
        state = gen.state_dict()
        making.cancel()
        await gen.close()
        return state

    state = asyncio.run(half())
    resumed = make([*data[:2], {"id": 2, "script": [0.0, 1.0]}, data[3]])  # group 2 reruns (and now finishes)
    resumed.load_state_dict(state)
    batch = asyncio.run(resumed.generate_batch())
    assert sorted(g.prompt_index for g in batch.groups) == [1, 2, 3]
    m = batch.metrics
    assert m["rollout/dropped/dynamic_filter"] == 2 and m["rollout/dropped/total"] == 2  # group 0's two rollouts
    assert m["dynamic_filtering_pass_rate"] == 100.0 * 3 / 4 and m["rollout/group_all_pass_rate"] == 100.0 / 4


def test_dynamic_filtering_and_drop_accounting():
    scripts = {0: [1.0, 1.0, 1.0, 1.0], 1: [0.0, 0.0, 0.0, 0.0], 2: [1.0, 0.0, 1.0, 0.0],
               3: [1.0, 0.0, "raise", 1.0], 4: ["hang"] * 4, 5: ["boom"] * 4}
    gen = SamplesGenerator([{"id": i, "script": s} for i, s in scripts.items()], ScriptedRunner(), batch_size=4,
                           n_samples_per_prompt=4, sampling=SAMPLING, dynamic_filtering=(0.0, 1.0),
                           group_timeout_s=0.5)
    batch = asyncio.run(gen.generate_batch())
    assert [g.prompt_index for g in batch.groups] == [2] and batch.exhausted
    m = batch.metrics
    assert m["rollout/dropped/dynamic_filter"] == 8  # all-pass group 0 + all-fail group 1
    assert m["rollout/dropped/incomplete_group"] == 3  # group 3's three usable rollouts
    assert m["rollout/dropped/agent_exception"] == 1 + 4
    assert m["rollout/dropped/agent_timeout"] == 4
    assert m["rollout/dropped/total"] == 8 + 3 + 5 + 4
    assert set(DROP_REASONS) <= {k.removeprefix("rollout/dropped/") for k in m}
    assert m["dynamic_filtering_pass_rate"] == pytest.approx(100 / 6)
    assert m["rollout/group_all_pass_rate"] == pytest.approx(100 / 6)
    assert m["rollout/group_all_fail_rate"] == pytest.approx(100 / 6)
    # scores seen before filtering: 4 + 0 + 2 + 2 over 4 + 4 + 4 + 3 rollouts
    assert m["rollout/pre_filter_mean_score"] == pytest.approx(8 / 15)


@pytest.mark.parametrize("policy,kept", [("keep", [0, 1]), ("drop", [1])])
def test_incomplete_groups_keep_or_drop(policy, kept):
    scripts = {0: [1.0, "raise"], 1: [1.0, 0.0]}
    gen = SamplesGenerator([{"id": i, "script": s} for i, s in scripts.items()], ScriptedRunner(), batch_size=2,
                           n_samples_per_prompt=2, sampling=SAMPLING, incomplete_groups=policy)
    batch = asyncio.run(gen.generate_batch())
    assert sorted(g.prompt_index for g in batch.groups) == kept
    assert batch.metrics["rollout/dropped/incomplete_group"] == (1 if policy == "drop" else 0)


def test_eval_pass_at_1_and_pass_at_k_per_datasource():
    eval_rows = [{"id": 0, "script": [1.0, 0.0, 0.0, 0.0], "datasource": "a"},
                 {"id": 1, "script": [0.0, 0.0, 0.0, 0.0], "datasource": "a"},
                 {"id": 2, "script": [1.0, 1.0, 0.5, 0.5], "datasource": "b"}]
    gen = SamplesGenerator(rows(1), ScriptedRunner(), batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING)
    m = asyncio.run(gen.evaluate(eval_rows, 4, SAMPLING))
    assert m["eval_a_pass4"] == pytest.approx((1 + 0) / 2)
    assert m["eval_a_pass1"] == pytest.approx((0.25 + 0) / 2)
    assert m["eval_b_pass4"] == pytest.approx(1.0)
    assert m["eval_b_pass1"] == pytest.approx(0.75)
    assert m["eval_num_samples"] == 12 and m["eval_response_length_mean"] == 3


class SegmentedRunner(ScriptedRunner):
    """row["segments"][i]: how many segments rollout i returns, each with its reward (a chat agent's branches)."""

    async def run_group(self, row, n, sampling):
        return [(Traj(reward, rollout_id=f"{row['id']}-{i}"), None)
                for i, (reward, segments) in enumerate(zip(row["script"], row["segments"])) for _ in range(segments)]


def test_eval_counts_a_chat_rollouts_reward_once_however_many_segments_it_has():
    """pass@k is over rollouts; before, a rollout of 3 segments weighed 3x in pass@1 (0.75 here, not 0.5)."""
    gen = SamplesGenerator(rows(1), SegmentedRunner(), batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING)
    m = asyncio.run(gen.evaluate([{"id": 0, "script": [1.0, 0.0], "segments": [3, 1]}], 2, SAMPLING))
    assert m["eval_default_pass1"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval_default_pass2"] == pytest.approx(1.0)
    assert m["eval_num_samples"] == 2  # rollouts (its 4 segments: the response lengths' count)


class SeedRecordingRunner(ScriptedRunner):
    def __init__(self):
        super().__init__()
        self.seeds = {}

    async def run_group(self, row, n, sampling):
        self.seeds[row["id"]] = sampling.seed
        return await super().run_group(row, n, sampling)


def test_each_eval_prompt_samples_from_a_base_seed_of_its_own_the_same_at_every_eval():
    """Before: every eval group got the eval's one seed, so sample i of every prompt drew the same noise."""
    runner = SeedRecordingRunner()
    gen = SamplesGenerator(rows(1), runner, batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING)
    eval_rows = [{"id": i, "script": [1.0, 0.0]} for i in range(3)]
    asyncio.run(gen.evaluate(eval_rows, 2, Sampling(max_tokens=4, seed=1000)))
    first = dict(runner.seeds)
    assert first == {0: 1000, 1: 1001, 2: 1002}  # the row's position moves the eval's seed
    asyncio.run(gen.evaluate(eval_rows, 2, Sampling(max_tokens=4, seed=1000)))
    assert runner.seeds == first  # the next eval: the same seeds (common random numbers across evals)


def test_eval_scores_only_what_can_be_scored_and_counts_the_rest():
    """Before: a failed rollout was left out uncounted, a NaN reward made pass@1 NaN, and a datasource whose every
    rollout failed was scored 0.0."""
    nan = float("nan")
    eval_rows = [{"id": 0, "script": [1.0, "raise"], "datasource": "a"},
                 {"id": 1, "script": [nan, 0.0], "datasource": "a"},
                 {"id": 2, "script": ["raise", "raise"], "datasource": "b"}]
    gen = SamplesGenerator(rows(1), ScriptedRunner(), batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING)
    m = asyncio.run(gen.evaluate(eval_rows, 2, SAMPLING))
    assert m["eval_a_pass1"] == pytest.approx((1.0 + 0.0) / 2) and m["eval_a_pass2"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval_dropped_agent_exception"] == 3 and m["eval_dropped_nonfinite_reward"] == 1
    assert m["eval_num_samples"] == 2 and not any(k.startswith("eval_b_") for k in m)


def test_an_eval_whose_every_rollout_failed_fails_with_the_drops():
    """Before: job=eval with an agent that raised on every rollout exited 0, printing eval_toy_pass1 0.0."""
    from molt_hydra.rollout.generator import RunFailed

    gen = SamplesGenerator(rows(1), ScriptedRunner(), batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING)
    with pytest.raises(RunFailed) as e:
        asyncio.run(gen.evaluate([{"id": i, "script": ["raise", float("nan")]} for i in range(3)], 2, SAMPLING))
    assert (e.value.role, e.value.cause) == ("agent runner", "every eval rollout (3 prompts x 2) failed; the eval "
                                                             "has no score")
    assert e.value.drops == {"agent_exception": 3, "nonfinite_reward": 3}


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="low < high"):
        SamplesGenerator(rows(1), ScriptedRunner(), batch_size=1, n_samples_per_prompt=2, sampling=SAMPLING,
                         dynamic_filtering=(1.0, 0.0))
    with pytest.raises(ValueError, match="incomplete_groups"):
        SamplesGenerator(rows(1), ScriptedRunner(), batch_size=1, n_samples_per_prompt=2, sampling=SAMPLING,
                         incomplete_groups="maybe")


def test_nonfinite_rewards_are_dropped_and_counted_not_trained():
    nan, inf = float("nan"), float("inf")
    gen = SamplesGenerator([{"id": 0, "script": [1.0, nan, 0.0, inf]}, {"id": 1, "script": [0.5] * 4}],
                           ScriptedRunner(), batch_size=2, n_samples_per_prompt=4, sampling=SAMPLING)
    batch = asyncio.run(gen.generate_batch())
    kept = {g.prompt_index: [t.reward for t in g.trajectories] for g in batch.groups}
    assert kept == {0: [1.0, 0.0], 1: [0.5] * 4}  # incomplete groups are kept by default, without the bad samples
    assert batch.metrics["rollout/dropped/nonfinite_reward"] == 2
    assert batch.metrics["rollout/dropped/total"] == 2


def test_nonfinite_scores_are_dropped_and_counted_not_filtered_as_out_of_range():
    nan, inf = float("nan"), float("inf")
    gen = SamplesGenerator([{"id": 0, "script": [(1.0, nan), 0.0, 1.0, (0.0, inf)]}], ScriptedRunner(), batch_size=1,
                           n_samples_per_prompt=4, sampling=SAMPLING)
    batch = asyncio.run(gen.generate_batch())
    assert [t.reward for g in batch.groups for t in g.trajectories] == [0.0, 1.0]
    assert batch.metrics["rollout/dropped/nonfinite_score"] == 2
    assert batch.metrics["rollout/dropped/total"] == 2


def in_dispatch_order(scripts):
    """Rows whose k-th dispatched one (prompt order of seed 0, epoch 0) runs scripts[k]."""
    rows = [{"id": i} for i in range(len(scripts))]
    for k, index in enumerate(prompt_order(len(scripts), 0, 0)):
        rows[index]["script"] = scripts[k]
    return rows


def test_a_batch_worth_of_failed_groups_in_a_row_fails_with_the_drops():
    from molt_hydra.rollout.generator import RunFailed

    scripts = [[1.0] * 2, ["raise"] * 2, [float("nan"), "raise"], ["raise"] * 2, [1.0] * 2]
    gen = SamplesGenerator(in_dispatch_order(scripts), ScriptedRunner(), batch_size=3,
                           n_samples_per_prompt=2, sampling=SAMPLING, max_inflight_groups=1)
    with pytest.raises(RunFailed) as err:
        asyncio.run(drain(gen))
    # groups 1, 2, 3 (in that order: one in flight at a time) left nothing usable: 3 = batch_size in a row
    assert err.value.role == "agent runner"
    assert {k: v for k, v in err.value.drops.items() if v} == {"agent_exception": 2 + 1 + 2, "nonfinite_reward": 1}


def test_a_usable_group_resets_the_failure_count():
    scripts = [["raise"] * 2, ["raise"] * 2, [1.0] * 2, ["raise"] * 2, ["raise"] * 2, [1.0] * 2]
    rows = in_dispatch_order(scripts)
    gen = SamplesGenerator(rows, ScriptedRunner(), batch_size=3, n_samples_per_prompt=2, sampling=SAMPLING,
                           max_inflight_groups=1)
    assert sorted(asyncio.run(drain(gen))) == sorted(r["id"] for r in rows if r["script"] == [1.0] * 2)


def test_a_whole_groups_failure_reaches_the_failure_summary_with_its_message():
    """The runner's own failure (here "runner crashed"; in a run, a result the runner process could not send back)
    loses the whole group on the driver, where the runners' example errors never see it. Before: counted as
    agent_exception with no message anywhere, so a run ending 'every rollout failed' on it showed no cause."""
    from molt_hydra.rollout.generator import RunFailed

    gen = SamplesGenerator([{"id": i, "script": ["boom"] * 2} for i in range(2)], ScriptedRunner(), batch_size=2,
                           n_samples_per_prompt=2, sampling=SAMPLING)
    with pytest.raises(RunFailed) as err:
        asyncio.run(drain(gen))
    assert {k: v for k, v in err.value.drops.items() if v} == {"agent_exception": 4}
    assert err.value.examples == {"agent_exception": "RuntimeError: runner crashed"}


def test_an_eval_groups_failure_is_counted_with_its_message_not_raised():
    """Before: a runner failure in eval escaped evaluate() as the raw error (in training the same failure is one
    group's agent_exception); now counted the same way, and named when nothing could be scored."""
    from molt_hydra.rollout.generator import RunFailed

    gen = SamplesGenerator(rows(1), ScriptedRunner(), batch_size=1, n_samples_per_prompt=1, sampling=SAMPLING)
    m = asyncio.run(gen.evaluate([{"id": 0, "script": ["boom"] * 2}, {"id": 1, "script": [1.0, 0.0]}], 2, SAMPLING))
    assert m["eval_dropped_agent_exception"] == 2 and m["eval_default_pass1"] == 0.5
    with pytest.raises(RunFailed) as err:
        asyncio.run(gen.evaluate([{"id": 0, "script": ["boom"] * 2}], 2, SAMPLING))
    assert err.value.examples == {"agent_exception": "RuntimeError: runner crashed"}
