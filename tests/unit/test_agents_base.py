import asyncio
import math
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from molt_hydra.agents import Episode, Runner, Trajectory, load_runner
from molt_hydra.agents.base import Result, apply_sampling_override, failed_on, reward_and_score, scalar
from molt_hydra.agents.chat_agent import ChatAgentRunner
from molt_hydra.agents.loading import resolve_target
from molt_hydra.agents.math_grading import _WORKERS, grade_math, last_boxed
from molt_hydra.agents.step_runner import StepEnvRunner
from molt_hydra.rollout.generation import Generation, Sampling


def test_trajectory_keeps_tokens_logprobs_versions_aligned():
    t = Trajectory()
    t.append_feedback([1, 2, 3])
    t.append_action(Generation([4, 5], [-0.1, -0.2], [7, 8], "stop"))
    t.append_feedback([6])
    t.append_action(Generation([9], [-0.3], [8], "length"))
    assert t.token_ids == [1, 2, 3, 4, 5, 6, 9]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert t.versions == [-1, -1, -1, 7, 8, -1, 8]
    assert t.action_ranges == [(3, 5), (6, 7)] and t.generated_ids == [4, 5, 9] and t.num_generated == 3
    assert t.finish_reasons == ["stop", "length"]


def test_an_aborted_generation_fails_its_rollout_naming_the_abort_never_trained_as_an_action(tiny_model):
    """Before: a generation vLLM ended with finish reason "abort" was appended as a finished action and trained on.
    The rollout is dropped as engine_aborted, its own reason (was: agent_exception, blaming the agent for the engine
    stopping), and the samples generator logs it as rollout/dropped/engine_aborted."""
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env

    class Aborting:
        async def generate(self, request):
            return [Generation([7, 8], [-0.5, -0.5], [0, 0], "abort")]

    class Once(Env):
        async def step(self, state):
            return Result(reward=1.0, terminated=True)

    eps = [Episode(prompt="hi", sampling=Sampling(max_tokens=4), max_length=64) for _ in range(2)]
    outcome = asyncio.run(StepEnvRunner(Once).run_group(eps, Aborting(), AutoTokenizer.from_pretrained(tiny_model)))
    assert outcome.trajectories == [] and dict(outcome.failures) == {"engine_aborted": 2}
    assert "finish reason 'abort' after 2 tokens" in outcome.errors["engine_aborted"]


def test_an_engine_abort_is_logged_as_its_own_drop_reason_not_as_the_agents(tiny_model):
    """Before: a rollout whose generation vLLM aborted counted in rollout/dropped/agent_exception, as if the Env had
    raised; now in rollout/dropped/engine_aborted, and agent_exception stays 0."""
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env
    from molt_hydra.rollout.generator import SamplesGenerator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    class AbortsTheFirst:  # a stand-in engine: vLLM aborts sample 0's request, finishes sample 1's
        async def generate(self, request):
            return [Generation([7, 8], [-0.5, -0.5], [0, 0], "abort" if request.session_id.endswith("-0") else "stop")]

    class Once(Env):
        async def step(self, state):
            return Result(reward=1.0)

    class Group:  # hands a group back as runtime/agent_runner.py does: (None, reason) per failure, then trajectories
        async def run_group(self, row, n, sampling):
            eps = [Episode(prompt=row["prompt"], sampling=sampling, max_length=64, rollout_id=f"g-{i}")
                   for i in range(n)]
            outcome = await StepEnvRunner(Once).run_group(eps, AbortsTheFirst(), tokenizer)
            return [(None, r) for r, k in outcome.failures.items() for _ in range(k)] + [
                (t, None) for t in outcome.trajectories]

    gen = SamplesGenerator([{"prompt": "hi"}], Group(), batch_size=1, n_samples_per_prompt=2,
                           sampling=Sampling(max_tokens=4))
    batch = asyncio.run(gen.generate_batch())
    assert [len(g.trajectories) for g in batch.groups] == [1]  # sample 1, kept (incomplete_groups=keep)
    m = batch.metrics
    assert (m["rollout/dropped/engine_aborted"], m["rollout/dropped/agent_exception"]) == (1.0, 0.0)
    assert m["rollout/dropped/total"] == 1.0


def test_routed_experts_laid_per_token_first_writer_wins():
    t = Trajectory()
    t.append_feedback([1, 2])
    t.append_action(Generation([3], [-1.0], [0], "stop", routed_experts=[[0, 1], [2, 3], [4, 5]]))  # prompt + gen
    t.append_feedback([4])
    t.append_action(Generation([5], [-1.0], [0], "stop", routed_experts=[[6, 7]]))  # generated only
    assert t.routed_experts == [[0, 1], [2, 3], [4, 5], None, [6, 7]]


def test_scalar_and_sampling_override():
    assert scalar([0.5], "r") == 0.5 and scalar(1, "r") == 1.0
    with pytest.raises(ValueError, match="Result.reward is None"):
        scalar(None, "Result.reward")
    s = Sampling(max_tokens=8)
    assert apply_sampling_override(s, {"max_tokens": 3}).max_tokens == 3
    assert apply_sampling_override(s, None) is s
    with pytest.raises(ValueError, match=r"unknown keys \['max_new'\]"):
        apply_sampling_override(s, {"max_new": 3})


@pytest.mark.parametrize("override, said", [
    ({"max_tokens": -5}, "['max_tokens'] is -5; it must be an int >= 1"), ({"max_tokens": 2.5}, "an int >= 1"),
    ({"temperature": "hot"}, "['temperature'] is 'hot'; it must be a number >= 0"),
    ({"temperature": math.nan}, "a number >= 0"), ({"top_p": 0}, "a number in (0, 1]"),
    ({"top_k": 0}, "-1 (off) or an int >= 1"), ({"min_tokens": True}, "an int >= 0"),
    ({"stop": ""}, "a non-empty string or a list of them"), ({"stop": [1]}, "a non-empty string or a list of them"),
    ({"stop_token_ids": [-1]}, "a list of token ids"), ({"seed": "42"}, "None or an int64"),
    ({"seed": 2**63}, "None or an int64 (in [-2**63, 2**63 - 1])"), ({"seed": -(2**63) - 1}, "None or an int64"),
    ({"ignore_eos": "yes"}, "a bool"), ({"structured": "json"}, "None or a dict"),
    ({"n": 4}, "['n']=4: the step runner samples one completion per turn"),
    ({"top_logprobs": 5}, "['top_logprobs']=5"), (Sampling(max_tokens=0), "['max_tokens'] is 0")],
    ids=lambda v: str(v)[:30])
def test_a_sampling_override_the_engine_cannot_honour_is_an_error_naming_the_key(override, said):
    """Before: only unknown keys were refused. A bad value went to the engine (vLLM's error, naming no agent), n /
    top_logprobs were silently ignored, and max_tokens <= 0 ended the episode as "truncated" with its reward kept."""
    with pytest.raises(ValueError) as err:
        apply_sampling_override(Sampling(max_tokens=8), override)
    assert said in str(err.value) and "sampling_params" in str(err.value)


@pytest.mark.parametrize("override, key, recipe", [
    ({"temperature": 0}, "temperature", "rollout.temperature=0.7"), ({"top_p": 0.9}, "top_p", "rollout.top_p=1.0"),
    ({"top_k": 20}, "top_k", "rollout.top_k=-1"), (Sampling(max_tokens=4), "temperature", "rollout.temperature=0.7")])
def test_an_env_changing_the_recipes_sampling_is_an_error_naming_the_key(override, key, recipe):
    """The trainer recomputes every turn's log-probs at the recipe's temperature / top_p / top_k, so a turn sampled
    at others is trained off-policy (the chat server refuses the same change with a 400). Before: applied, without a
    word (a whole Sampling of defaults too: the turn sampled at temperature 1.0)."""
    with pytest.raises(ValueError) as err:
        apply_sampling_override(Sampling(max_tokens=8, temperature=0.7), override)
    assert str(err.value).startswith(f"Result.sampling_params[{key!r}]=")
    assert f"differs from this rollout's {recipe}: the trainer recomputes" in str(err.value)


def test_a_sampling_override_of_good_values_is_applied():
    s = Sampling(max_tokens=8, seed=3, temperature=0.5)
    assert apply_sampling_override(s, {"stop": "</answer>", "stop_token_ids": [2], "temperature": 0.5, "n": 1}) == \
        Sampling(max_tokens=8, seed=3, stop=("</answer>",), stop_token_ids=(2,), temperature=0.5)
    s = Sampling(max_tokens=8, seed=3)
    assert apply_sampling_override(s, Sampling(max_tokens=4)) == Sampling(max_tokens=4)
    # numpy numbers (an Env drawing a seed with numpy) as Python's: a numpy int seed passed, then overflowed the
    # engine's seed + choice index mod 2**63 (OverflowError in the engine, naming nothing)
    from molt_hydra.rollout.engine import VLLMEngine

    got = apply_sampling_override(s, {"seed": np.int64(2**63 - 1), "max_tokens": np.int32(4),
                                      "temperature": np.float32(1.0), "stop_token_ids": [np.int64(2)]})
    assert [type(v) for v in (got.seed, got.max_tokens, got.temperature, *got.stop_token_ids)] == [int, int, float, int]
    assert (got.seed, got.max_tokens, got.temperature, got.stop_token_ids) == (2**63 - 1, 4, 1.0, (2,))
    assert VLLMEngine._sampling_params(got, 1, False).seed == 0  # (2**63 - 1 + 1) mod 2**63
    # a negative seed, as the chat server takes one (was: "None or an int >= 0")
    assert apply_sampling_override(s, {"seed": -5}).seed == -5
    assert apply_sampling_override(s, {"seed": -(2**63)}).seed == -(2**63)


@pytest.mark.parametrize("value, expected", [
    (np.float32(0.25), 0.25), (np.int64(3), 3.0), (np.bool_(True), 1.0), (True, 1.0), (torch.tensor(0.5), 0.5),
    (torch.tensor(True), 1.0), (torch.tensor([[0.75]]), 0.75), (np.array([0.5]), 0.5), ((0.5,), 0.5),
    (math.inf, math.inf)], ids=lambda v: type(v).__name__)
def test_a_reward_of_any_numeric_kind_is_honoured(value, expected):
    """Numbers of every kind become floats (inf too: the samples generator drops it as nonfinite_reward)."""
    assert reward_and_score(Result(reward=value), "Env.step") == (expected, expected)


@pytest.mark.parametrize("value, said", [
    ("0.5", "Result.reward of GraderEnv.step is str '0.5'; return a number"),
    (b"1", "is bytes b'1'"), ({"reward": 1.0}, "is dict {'reward': 1.0}"), ([[0.5]], "is list [0.5]"),
    (1 + 2j, "is complex (1+2j)"), (None, "Result.reward of GraderEnv.step is None"),
    ([], "is an empty list"), (torch.tensor([]), "is an empty Tensor"), (np.array([]), "is an empty ndarray"),
    # (was: the first element taken, the others dropped without a word)
    ([0.5, 1.0], "Result.reward of GraderEnv.step is a list of 2 elements; return one number for the rollout"),
    (torch.tensor([1.0, 0.0, 1.0]), "is a Tensor of 3 elements"), (np.ones((2, 2)), "is a ndarray of 4 elements"),
    (10**400, "Result.reward of GraderEnv.step is int beyond a float's range (its magnitude over 1.8e308); return "
              "a number within it"), (-(10**5000), "is int beyond a float's range")],
    ids=lambda v: type(v).__name__)
def test_a_reward_that_is_no_number_is_an_error_naming_the_agent_and_the_value(value, said):
    """Before: a string reward was float()-ed silently ('0.5' -> 0.5), a dict or nested list raised float()'s
    message naming neither the agent nor Result.reward, an empty tensor raised IndexError."""
    with pytest.raises((TypeError, ValueError)) as err:
        reward_and_score(Result(reward=value), "GraderEnv.step")
    assert said in str(err.value) and "GraderEnv.step" in str(err.value)


@pytest.mark.parametrize("field, value, said", [
    ("observation", None, "Result.observation of GraderEnv.step is NoneType None; it must be a string"),
    ("observation", ["look"], "is list ['look']; it must be a string"),
    ("info", None, "Result.info of GraderEnv.step is NoneType None; it must be a dict"),
    ("info", {"ok": 1.0, 3: 0.5}, "Result.info of GraderEnv.step is dict {'ok': 1.0, 3: 0.5}; it must be a dict with "
     "string keys"),
    ("terminated", "no", "Result.terminated of GraderEnv.step is str 'no'; it must be a bool"),
    ("truncated", np.array([True, False]), "Result.truncated of GraderEnv.step is ndarray"),
    ("images", "cat.png", "Result.images of GraderEnv.step is str 'cat.png'; it must be None or a list")],
    ids=lambda v: str(v)[:20])
def test_a_result_field_of_the_wrong_type_is_an_error_naming_it(field, value, said):
    """Before: terminated="no" (truthy) ended the episode; info=None or an observation of None failed inside the
    runner ("'NoneType' object is not iterable", "You need to specify either `text`..."), naming no field; an info
    key that is no string ({3: 0.5}) failed the trainer's step ("'<' not supported between instances of 'int' and
    'str'", sorting the step's metric names), naming neither the agent nor the key."""
    with pytest.raises(TypeError) as err:
        reward_and_score(Result(reward=1.0, **{field: value}), "GraderEnv.step")
    assert said in str(err.value)


def test_an_async_functions_result_not_awaited_is_named_as_such():
    """`reward=grade(...)` with an `async def grade`, or a step returning its result unawaited. Before: "is coroutine
    <coroutine object ...>; return a number" (or "must return Result, got coroutine"), and Python's "coroutine was
    never awaited" warning on top; now the message says to await it, and the coroutine is closed (no warning)."""
    async def grade():
        return 1.0

    for make, said in ((lambda c: Result(reward=c), "Result.reward of GraderEnv.step is coroutine"),
                       (lambda c: Result(reward=1.0, score=c), "Result.score of GraderEnv.step is coroutine"),
                       (lambda c: c, "GraderEnv.step returned coroutine")):
        coroutine = grade()
        with pytest.raises(TypeError) as err:
            reward_and_score(make(coroutine), "GraderEnv.step")
        assert str(err.value) == (f"{said} test_an_async_functions_result_not_awaited_is_named_as_such.<locals>.grade,"
                                  " an async function's result that was not awaited; `await` it")
        assert coroutine.cr_frame is None  # closed


def test_an_info_value_that_cannot_leave_the_runner_process_fails_its_rollout_naming_the_key():
    """Result.info travels to the driver as Ray pickles it. Before: a lock (or client, generator) there failed the
    reply that carried it, losing its whole group with no message naming the value. What Ray's pickler ships (a
    lambda, a string, a tensor) passes."""
    import threading

    from molt_hydra.agents.base import shippable

    shippable({"digits": 0.5, "pred": "42", "fn": lambda x: x, "t": torch.ones(2)}, "GraderEnv.step")
    with pytest.raises(TypeError) as err:
        shippable({"digits": 0.5, "guard": threading.Lock()}, "GraderEnv.step")
    assert str(err.value) == ("Result.info['guard'] of GraderEnv.step is lock, which cannot be sent from the agent "
                              "runner to the trainer (TypeError: cannot pickle '_thread.lock' object); keep numbers "
                              "(logged as metrics) and plain data in info")


def test_info_is_checked_for_shipping_once_per_trajectory_not_every_turn(tiny_model, monkeypatch):
    """The step runner keeps the last turn's info, so that one alone is pickled to check it (was: every turn's, a
    pickle per turn of an info that often grows with the episode: 13% of the runner loop's time at 32 turns, 22% at
    128 in a stand-in-engine bench). An earlier turn's info, which nothing ships, no longer fails the rollout; the
    kept one still does, naming its key."""
    import threading

    from ray import cloudpickle
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env

    class Echo:  # stand-in for the engine: one token a turn
        async def generate(self, request):
            return [Generation([7], [-0.5], [0], "stop")]

    class FiveTurns(Env):
        def __init__(self, lock_last: bool = False):
            self.lock_last = lock_last

        async def step(self, state):
            last = state["turn"] == 4
            held = threading.Lock() if last == self.lock_last else 0  # unpicklable on turns 0-3, or on the last
            return Result(reward=1.0, observation=" more", terminated=last, info={"turn": state["turn"], "h": held})

    pickled = []
    dumps = cloudpickle.dumps
    monkeypatch.setattr(cloudpickle, "dumps", lambda obj, *a, **k: pickled.append(obj) or dumps(obj, *a, **k))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ep = Episode(prompt="hi", sampling=Sampling(max_tokens=1), max_length=64)
    outcome = asyncio.run(StepEnvRunner(FiveTurns).run_group([ep], Echo(), tok))
    (traj,) = outcome.trajectories
    assert (traj.reward, traj.info, pickled) == (5.0, {"turn": 4, "h": 0}, [{"turn": 4, "h": 0}])
    ep = Episode(prompt="hi", sampling=Sampling(max_tokens=1), max_length=64)
    outcome = asyncio.run(StepEnvRunner(FiveTurns, {"lock_last": True}).run_group([ep], Echo(), tok))
    assert outcome.trajectories == [] and dict(outcome.failures) == {"agent_exception": 1}
    assert outcome.errors["agent_exception"].startswith(
        "FiveTurns on prompt 'hi', label None: TypeError: Result.info['h'] of FiveTurns.step is lock, ")


@pytest.mark.parametrize("value", [True, False, np.bool_(True), torch.tensor(False), 1, 0])
def test_a_bool_of_any_kind_ends_an_episode(value):
    assert reward_and_score(Result(reward=0.5, terminated=value, truncated=value), "Env.step") == (0.5, 0.5)


def test_a_score_that_is_no_number_is_named_as_the_score():
    with pytest.raises(TypeError, match=r"Result.score of GraderEnv.step is str 'high'"):
        reward_and_score(Result(reward=1.0, score="high"), "GraderEnv.step")


def test_math_grading():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert grade_math(r"The answer is \boxed{\frac{1}{2}}.", "0.5") == 1.0
    assert grade_math(r"\boxed{43}", 42) == 0.0
    assert grade_math("43", 43) == 0.0  # no box, no credit
    # unboxed grading takes the response's last answer, so a wrong intermediate number does not count
    assert grade_math("12 + 7 = 19", "19", require_boxed=False) == 1.0
    assert grade_math("19? No: 12 + 7 = 8", "19", require_boxed=False) == 0.0
    # a list label is the answer tuple (was: graded against the text "['2', '3']", so never correct)
    assert grade_math(r"\boxed{3, 2}", ["2", "3"]) == 1.0 and grade_math(r"\boxed{2}", ["2", "3"]) == 0.0
    # a dict label holds the answer as Molt's grader unwraps it (before: graded as its text, never correct)
    assert grade_math(r"\boxed{3}", {"ground_truth": "3", "style": "rule"}) == 1.0
    assert grade_math(r"\boxed{3}", {"reward_model": {"ground_truth": 3}, "extra_info": {"answer": 4}}) == 1.0
    assert grade_math(r"\boxed{5}", {"solution": {"extracted": "5", "answer": "x = 5"}}) == 1.0
    assert grade_math(r"so \fbox{7}", "7") == 1.0 and last_boxed(r"\boxed{1} then \fbox{2}") == "2"
    with pytest.raises(ValueError, match=r"no label to grade against \(\{'style': 'rule'\}\)"):
        grade_math(r"\boxed{3}", {"style": "rule"})
    # no label is an error, not a grade (was: \boxed{} scored 1.0 against "", \boxed{None} 1.0 against None)
    for response, label in ((r"\boxed{}", ""), (r"\boxed{None}", None), (r"\boxed{ }", " ")):
        with pytest.raises(ValueError, match="no label to grade against.*Fix: point data.label_key"):
            grade_math(response, label)


def test_a_response_of_none_is_graded_as_no_answer_and_one_of_another_type_is_named():
    """An OpenAI message's content is None when the reply was tool calls alone (an agent's last turn). Before:
    "expected string or bytes-like object, got 'NoneType'" out of the regex, dropping each such rollout as
    agent_exception instead of scoring it 0.0; any other type raised the same message, naming nothing."""
    assert grade_math(None, "5") == 0.0 and grade_math(None, "5", require_boxed=False) == 0.0
    with pytest.raises(TypeError, match=r"grade_math: the response is dict \{'content': '5'\}, not text"):
        grade_math({"content": "5"}, "5")
    with pytest.raises(ValueError, match="no label to grade against"):  # (the label is still checked)
        grade_math(None, None)


def test_a_math_worker_that_dies_grading_is_replaced_and_the_answer_graded_again(monkeypatch, tmp_path, caplog):
    """A worker that dies mid-grade (the OOM killer, a crash). Before: graded 0.0 as a timed-out comparison is,
    without a word: a right answer scored as wrong. Now the answer is graded again in a fresh worker; one that kills
    its worker twice is graded 0.0 with a warning naming it."""
    from molt_hydra.agents import math_grading

    died = tmp_path / "died"  # (a stand-in worker: the first one dies on its answer, later ones say "equal")
    monkeypatch.setattr(math_grading, "_WORKER", f"import json, os, sys\nprint('ready', flush=True)\n"
                        f"for line in sys.stdin:\n    if not os.path.exists({str(died)!r}):\n"
                        f"        open({str(died)!r}, 'w').close()\n        sys.exit(3)\n"
                        "    print(json.dumps([True, True, True]), flush=True)\n")
    monkeypatch.setattr(math_grading, "_WORKERS", math_grading._Workers())
    with caplog.at_level("WARNING", logger=math_grading.__name__):
        assert grade_math(r"\boxed{5}", "5") == 1.0
    assert caplog.messages == ["grade_math: the math-verify worker died (exit code 3) grading '$5$' against '$5$'; "
                               "grading it again"]
    monkeypatch.setattr(math_grading, "_WORKER", "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
                                                 "sys.exit(3)\n")  # (every worker dies on it)
    monkeypatch.setattr(math_grading, "_WORKERS", math_grading._Workers())
    caplog.clear()
    with caplog.at_level("WARNING", logger=math_grading.__name__):
        assert grade_math(r"\boxed{5}", "5") == 0.0
    assert caplog.messages[-1] == ("grade_math: the math-verify worker died (exit code 3) grading '$5$' against "
                                   "'$5$' a second time: graded 0.0, as a comparison past its deadline is")


def test_a_box_written_with_a_space_is_graded_as_a_box():
    """LaTeX takes `\\boxed {5}`, and math-verify and the MATH benchmark's grader read `$\\boxed 5$`. Before: neither
    was found (last_boxed None), so a right answer in either form was graded 0.0, as if unboxed."""
    assert grade_math(r"The answer is \boxed {\frac{1}{2}}.", "0.5") == 1.0
    assert grade_math(r"The answer is $\boxed 5$.", "5") == 1.0 and grade_math(r"so \fbox 7", "7") == 1.0
    assert last_boxed("\\boxed\n{12}") == "12" and last_boxed("\\boxed 42\nthat is all") == "42"
    # a word that only starts with boxed, or a bare mention of the box, is not one
    assert last_boxed(r"\boxedsymbol{3}") is None and last_boxed(r"\boxed{5}. It goes in \boxed.") == "5"
    # a prose mention after a braced box is no answer (the braced one is)
    assert last_boxed(r"The answer is \boxed{42}. (I wrote it in \boxed as asked.)") == "42"


@pytest.mark.timeout(60)  # before: never returned
def test_an_answer_sympy_cannot_evaluate_is_graded_0_by_its_deadline():
    """\\boxed{9^{9^{9^{9}}}} is one big-integer power that holds the GIL until done (never): graded in-process it froze
    every thread of the agent runner, so neither the agent's timeout nor any other could fire. Now its worker process
    is killed at the deadline, the answer graded 0.0 (math-verify's verdict for a timed-out comparison), and the next
    grade runs in a fresh worker."""
    assert grade_math(r"\boxed{4}", "4") == 1.0  # a worker started (its start is not the deadline's)
    assert grade_math(r"\boxed{9^{9^{9^{9}}}}", "1", timeout_s=2) == 0.0  # (graded, it would never return)
    assert grade_math(r"\boxed{\frac{6}{4}}", "1.5") == 1.0
    for worker in list(_WORKERS.idle):  # an idle worker that died (e.g. the OOM killer) is replaced, not written to
        worker.kill()
        worker.wait()
    assert grade_math(r"\boxed{2}", "2") == 1.0


def test_toy_reward_is_the_digit_fraction():
    digit_fraction = resolve_target("recipes/agents/toy.py:digit_fraction")
    assert digit_fraction("12ab") == 0.5 and digit_fraction("") == 0.0 and digit_fraction("007") == 1.0
    assert digit_fraction("1<|im_end|>") == 1 / 11


def test_a_misspelled_target_name_is_named_in_its_file_with_the_nearest_name():
    """Before: 'molt_agent_toy_e3bcf20b has no attribute 'ToyEvn'' (the loader's internal module name, no hint)."""
    toy = Path("recipes/agents/toy.py").resolve()
    with pytest.raises(ValueError) as err:
        resolve_target("recipes/agents/toy.py:ToyEvn")
    assert str(err.value) == (f"agent target 'recipes/agents/toy.py:ToyEvn': agent file {toy} has no attribute "
                              "'ToyEvn' (did you mean 'ToyEnv'?)")
    with pytest.raises(ValueError, match=r"molt_hydra.recipes.agents.toy has no attribute 'ToyEvn' \(did you mean "):
        resolve_target("molt_hydra.recipes.agents.toy.ToyEvn")


def test_an_agent_file_imports_the_module_beside_it(tmp_path, monkeypatch):
    """As `python agent.py` would (its directory first on the path while it runs). Before: "No module named
    'sibling_grading'", a config error for any agent split over two files. An import inside a function, at a step,
    finds them too (before: "No module named 'lazy_grading'", every rollout): the directory stays on the path after
    every other entry, so a module beside it shadows nothing installed."""
    import sys

    (tmp_path / "sibling_grading.py").write_text("def grade(text):\n    return 0.25\n")
    (tmp_path / "lazy_grading.py").write_text("def grade(text):\n    return 0.5\n")
    (tmp_path / "agent.py").write_text(
        "from sibling_grading import grade\nfrom molt_hydra.agents import Env, Result\n"
        "class MyEnv(Env):\n    async def step(self, state):\n        return Result(reward=grade(''))\n"
        "class LazyEnv(Env):\n    async def step(self, state):\n        from lazy_grading import grade as g\n"
        "        return Result(reward=g(''))\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the test's own copy: put back after it)
    path_before = list(sys.path)
    env = load_runner(f"{tmp_path / 'agent.py'}:MyEnv").env_cls()
    assert asyncio.run(env.step({})).reward == 0.25 and sys.path == path_before + [str(tmp_path)]
    assert asyncio.run(load_runner(f"{tmp_path / 'agent.py'}:LazyEnv").env_cls().step({})).reward == 0.5
    assert sys.path == path_before + [str(tmp_path)]


@pytest.mark.parametrize("top_level, code", [
    ("import sys\nsys.exit('no grader')\n", "'no grader'"),
    ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--url', required=True)\np.parse_args([])\n",
     "2")], ids=["sys.exit", "argparse"])
def test_an_agent_file_that_exits_when_imported_is_a_config_error_naming_the_target(tmp_path, top_level, code):
    """A script's top-level code in an agent file. Before: its SystemExit left validation and ended molt-run with the
    file's own message or argparse's usage (which reads as molt-run's), no key named."""
    from molt_hydra.agents.rules import _target
    from molt_hydra.config.validate import Problems

    (tmp_path / "script_agent.py").write_text(top_level)
    problems, target = Problems(), f"{tmp_path / 'script_agent.py'}:MyEnv"
    assert _target(problems, {"_target_": target}) is None
    assert problems.lines == [
        f"- agent.runner._target_: importing {target!r} called sys.exit({code}): the file runs code meant for a "
        "script when imported. Fix: put that code (argparse, sys.exit) under `if __name__ == '__main__':`, and pass "
        "settings as agent.runner.* kwargs"]


def test_a_dotted_target_naming_a_file_of_the_working_directory_is_told_to_name_the_file(tmp_path, monkeypatch):
    """`my_agents.MyEnv` beside my_agents.py: `molt-run` (a console script) has not the working directory on its
    import path. Before: the generic fix alone ("set agent.runner._target_ to pkg.module.Name or ..."), the user left
    to guess why a file they can see was not found."""
    from molt_hydra.agents.rules import TARGET_FIX, _target
    from molt_hydra.config.validate import Problems

    (tmp_path / "pkg").mkdir()
    for name in ("my_agents.py", "pkg/agent.py"):
        (tmp_path / name).write_text("from molt_hydra.agents import Env\nclass MyEnv(Env):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for target, missing, file in (("my_agents.MyEnv", "my_agents", "my_agents.py"),
                                  ("pkg.agent.MyEnv", "pkg", "pkg/agent.py")):
        problems = Problems()
        assert _target(problems, {"_target_": target}) is None
        assert problems.lines == [f"- agent.runner._target_: cannot import {target!r} (ModuleNotFoundError: No module "
                                  f"named {missing!r}). Fix: name it by its file, agent.runner._target_={file}:MyEnv "
                                  f"({missing} is not on the import path here), or install its package"]
    problems = Problems()  # no such file here: the generic fix
    _target(problems, {"_target_": "nothere.MyEnv"})
    assert problems.lines[0].endswith(f"Fix: {TARGET_FIX}")


def test_a_kwarg_holding_its_own_target_is_refused_naming_it(tmp_path):
    """Hydra's nested instantiation (`agent.runner.grader={_target_: ..., scale: 2}`) is not what the agent loader
    does: the Env got the dict. Before: validation passed and every rollout failed inside the Env ("'dict' object
    has no attribute 'grade'")."""
    from omegaconf import OmegaConf

    from molt_hydra.agents.rules import check_agent
    from molt_hydra.config.schema import RunConfig
    from molt_hydra.config.validate import Problems

    (tmp_path / "graded.py").write_text(
        "from molt_hydra.agents import Env, Result\nclass Grader:\n    def __init__(self, scale=1.0):\n"
        "        self.scale = scale\nclass GradedEnv(Env):\n    def __init__(self, grader=None, graders=()):\n"
        "        self.grader = grader\n    async def step(self, state):\n"
        "        return Result(reward=self.grader.scale)\n")
    grader = {"_target_": f"{tmp_path / 'graded.py'}:Grader", "scale": 2.0}
    for kwargs, key in (({"grader": grader}, "agent.runner.grader"),
                        ({"graders": OmegaConf.create([{"scale": 1}, grader])}, "agent.runner.graders[1]")):
        cfg, problems = RunConfig(), Problems()
        cfg.agent.runner = {"_target_": f"{tmp_path / 'graded.py'}:GradedEnv", **kwargs}
        check_agent(cfg, problems)
        assert problems.lines == [
            f"- {key}: holds a '_target_' ({grader['_target_']!r}), but the agent's kwargs reach GradedEnv as they "
            "are: it would get this dict, not the object it names (only agent.runner._target_ is built). Fix: give "
            "GradedEnv the class as a string kwarg and its settings as plain kwargs, and build the object in its "
            "constructor (molt_hydra.agents.targets.resolve_target resolves the string); or, where the agent builds "
            "it from the dict itself (hydra.utils.instantiate), set agent.runner._recursive_=false, Hydra's switch "
            "for passing it as it is"]
    cfg, problems = RunConfig(), Problems()  # plain dicts and lists of them pass
    cfg.agent.runner = {"_target_": f"{tmp_path / 'graded.py'}:GradedEnv", "grader": {"scale": 2.0}}
    check_agent(cfg, problems)
    assert problems.lines == []
    # Hydra's own switch: the agent gets the dict and builds it itself (the loader passes no _recursive_ kwarg)
    cfg, problems = RunConfig(), Problems()
    cfg.agent.runner = {"_target_": f"{tmp_path / 'graded.py'}:GradedEnv", "grader": grader, "_recursive_": False}
    check_agent(cfg, problems)
    assert problems.lines == []
    runner = load_runner(cfg.agent.runner)
    assert runner.env_kwargs == {"grader": grader}
    cfg.agent.runner["_recursive_"] = "no"
    check_agent(cfg, problems)
    assert problems.lines == ["- agent.runner._recursive_: is 'no', not a boolean. Fix: set it to false (nested "
                              "_target_ dicts reach the agent as they are) or leave it out"]


def test_an_env_file_a_runner_imports_that_exits_is_a_config_error_naming_the_target(tmp_path):
    """The same through a StepEnvRunner that imports its `env=` file as it is built (agents/rules.py `_built`). Before:
    molt-run ended without a word (exit 2, the file's own code)."""
    from molt_hydra.agents.rules import check_agent
    from molt_hydra.config.schema import RunConfig
    from molt_hydra.config.validate import Problems

    (tmp_path / "exit_env.py").write_text("import sys\nsys.exit(2)\n")
    cfg, problems = RunConfig(), Problems()
    cfg.agent.runner = {"_target_": "molt_hydra.agents.step_runner.StepEnvRunner",
                        "env": f"{tmp_path / 'exit_env.py'}:E"}
    check_agent(cfg, problems)
    assert problems.lines == [
        "- agent.runner._target_: building StepEnvRunner called sys.exit(2): a file it imports runs code meant for a "
        "script. Fix: put that code (argparse, sys.exit) under `if __name__ == '__main__':`, and pass settings as "
        "agent.runner.* kwargs"]


def test_load_runner_forms(tmp_path):
    assert isinstance(load_runner({"_target_": "recipes/agents/toy.py:ToyEnv"}), StepEnvRunner)
    runner = load_runner({"_target_": "recipes/agents/python_tool_chat.py", "max_turns": 2})
    assert isinstance(runner, ChatAgentRunner) and runner.agent_kwargs == {"max_turns": 2}
    env_runner = load_runner("recipes/agents/python_tool_env.py:PythonToolEnv", exec_timeout_s=3)
    assert env_runner.env_kwargs == {"exec_timeout_s": 3}
    # the same file loads once: classes compare by identity
    assert resolve_target("recipes/agents/toy.py:ToyEnv") is load_runner("recipes/agents/toy.py").env_cls
    assert isinstance(load_runner({"_target_": "molt_hydra.agents.step_runner.StepEnvRunner",
                                   "env": "recipes/agents/math.py:MathEnv"}), StepEnvRunner)
    (tmp_path / "bad.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="has no attribute 'AgentRunner'"):
        load_runner(str(tmp_path / "bad.py"))
    with pytest.raises(TypeError, match="expected a Runner, Env or ChatAgent subclass"):
        load_runner(str(tmp_path / "bad.py") + ":x")
    with pytest.raises(FileNotFoundError):
        load_runner("nope/missing.py")
    with pytest.raises(ValueError, match="needs a '_target_' key"):
        load_runner({"max_turns": 2})
    # two classes of the name asked for: before, the later one loaded silently
    (tmp_path / "twice.py").write_text("from molt_hydra.recipes.agents.toy import AgentRunner as Base\n"
                                       "class AgentRunner(Base):\n    pass\n\n"
                                       "class AgentRunner(Base):\n    x = 1\n")
    with pytest.raises(ValueError, match=r"defines AgentRunner 2 times \(lines 2, 5\); the last would run"):
        load_runner(str(tmp_path / "twice.py"))


def test_fresh_env_per_episode_and_empty_rollouts_counted():
    made = []

    class Counting(Runner):
        async def execute(self, episode, generator, tokenizer):
            made.append(object())
            return []  # generated nothing

    eps = [Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8) for _ in range(3)]
    outcome = asyncio.run(Counting().run_group(eps, None, None))
    assert dict(outcome.failures) == {"empty_session": 3} and outcome.trajectories == [] and len(made) == 3


@pytest.mark.parametrize("returned, got", [
    (None, "got NoneType"), (Trajectory(), "got Trajectory"), ([{"token_ids": [1]}], "got a list holding dict")],
    ids=str)
def test_a_runner_returning_no_list_of_trajectories_fails_its_rollout_naming_execute(returned, got):
    """Before: "'NoneType' object is not iterable", "'Trajectory' object is not iterable", "'dict' object has no
    attribute 'num_generated'"."""

    class Custom(Runner):
        async def execute(self, episode, generator, tokenizer):
            return returned

    ep = Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8)
    outcome = asyncio.run(Custom().run_group([ep], None, None))
    assert dict(outcome.failures) == {"agent_exception": 1}
    assert outcome.errors["agent_exception"] == (f"Custom on prompt 'p', label None: TypeError: Custom.execute must "
                                                 f"return a list of Trajectory, {got}")


def _built(**fields) -> Trajectory:
    """A one-action segment of 4 tokens (the last 2 generated) as a Runner's own `execute` may build it."""
    return Trajectory(**{"token_ids": [5, 6, 7, 8], "logprobs": [0.0, 0.0, -0.5, -0.5], "versions": [-1, -1, 0, 0],
                         "action_ranges": [(2, 4)], "reward": 1.0, **fields})


@pytest.mark.parametrize("fields, said", [
    ({"reward": None}, "ValueError: Trajectory.reward of Custom.execute is None; return a number"),
    ({"reward": "0.5"}, "TypeError: Trajectory.reward of Custom.execute is str '0.5'; return a number"),
    ({"score": "high"}, "TypeError: Trajectory.score of Custom.execute is str 'high'; return a number"),
    ({"action_ranges": [(2, 9)]}, "ValueError: Trajectory.action_ranges of Custom.execute holds (2, 9): each must "
                                  "be a [start, end) span of its 4 tokens, 0 < start <= end <= 4"),
    ({"action_ranges": [(0, 2)]}, "ValueError: Trajectory.action_ranges of Custom.execute holds (0, 2): each must "
                                  "be a [start, end) span of its 4 tokens, 0 < start <= end <= 4"),
    ({"action_ranges": [(3, 2)]}, "ValueError: Trajectory.action_ranges of Custom.execute holds (3, 2): each must "
                                  "be a [start, end) span of its 4 tokens, 0 < start <= end <= 4"),
], ids=str)
def test_a_trajectory_a_runner_built_wrong_fails_its_rollout_naming_the_field(fields, said):
    """A Runner's own `execute` builds its Trajectory itself. Before: a reward of None, or an action range beyond its
    tokens, failed the whole run in the driver, as the driver's ('Run failed: driver: TypeError: float() argument
    must be a string or a real number, not 'NoneType'', '... driver: ValueError: invalid action range (16, 29) for
    24 tokens'), and a string reward '0.5' was float()-ed there and trained on without a word."""

    class Custom(Runner):
        async def execute(self, episode, generator, tokenizer):
            return [_built(**fields)]

    ep = Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8)
    outcome = asyncio.run(Custom().run_group([ep], None, None))
    assert dict(outcome.failures) == {"agent_exception": 1} and outcome.trajectories == []
    assert outcome.errors["agent_exception"].startswith(f"Custom on prompt 'p', label None: {said}"), outcome.errors


@pytest.mark.parametrize("reward, score", [(np.float32(0.5), None), (torch.tensor([0.5]), 1), (True, np.int64(1))],
                         ids=str)
def test_a_trajectory_a_runner_built_with_numbers_of_any_kind_keeps_them_as_floats(reward, score):
    """Any number `Result.reward` takes is taken on a Trajectory too, sent on as a float."""

    class Custom(Runner):
        async def execute(self, episode, generator, tokenizer):
            return [_built(reward=reward, score=score)]

    ep = Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8)
    (seg,) = asyncio.run(Custom().run_group([ep], None, None)).trajectories
    assert type(seg.reward) is float and seg.reward == float(np.asarray(reward).flatten()[0])
    assert seg.score is None if score is None else (type(seg.score) is float and seg.score == 1.0)


def test_a_failed_rollouts_message_names_the_agent_and_its_sample():
    """Before: the run's failure summary showed the cause alone ("KeyError: 'answer'", "the rollout ran past
    agent.timeout_s=..."), naming neither the agent nor the row it failed on."""
    from molt_hydra.agents.base import Env

    class Grader(Env):
        async def step(self, state):
            return Result()

    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2+2?"}]}]
    assert failed_on(StepEnvRunner(Grader), Episode(prompt=chat, sampling=Sampling(1), max_length=8, label={
        "answer": "4"})) == "Grader on prompt 'What is 2+2?', label {'answer': '4'}"
    long = Episode(prompt="Count:\n" + "1 " * 100, sampling=Sampling(1), max_length=8, label="x" * 100)
    assert failed_on(StepEnvRunner(Grader), long) == (f"Grader on prompt {repr(long.prompt)[:57]}..., "
                                                      f"label {repr('x' * 100)[:37]}...")  # (one line, cut short)

    class Sleeper(Runner):
        async def execute(self, episode, generator, tokenizer):
            if episode.label == 3:
                await asyncio.sleep(3600)
            raise KeyError("answer")

    eps = [Episode(prompt=f"p{i}", sampling=Sampling(max_tokens=1), max_length=8, label=i) for i in (3, 4)]
    outcome = asyncio.run(Sleeper().run_group(eps, None, None, 0.2))
    assert outcome.errors == {"agent_timeout": "Sleeper on prompt 'p3', label 3: the rollout ran past "
                                               "agent.timeout_s=0.2",
                              "agent_exception": "Sleeper on prompt 'p4', label 4: KeyError: 'answer'"}


@pytest.mark.parametrize("field", ["reward", "score"])
def test_a_nonfinite_reward_or_score_has_an_example_naming_the_agent_and_sample(field):
    """The driver drops such a trajectory (rollout/generator.py `usable`). Before: counted as nonfinite_reward /
    nonfinite_score, with no example error in the run's failure summary to say which agent, row or value."""

    class Custom(Runner):
        async def execute(self, episode, generator, tokenizer):
            return [_built(**{field: math.nan if episode.label == "bad" else 1.0})]

    eps = [Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8, label=label) for label in ("ok", "bad")]
    outcome = asyncio.run(Custom().run_group(eps, None, None))
    assert len(outcome.trajectories) == 2 and not outcome.failures  # (the driver drops it, counted there)
    assert outcome.errors == {f"nonfinite_{field}": f"Custom on prompt 'p', label 'bad': its {field} is nan; return "
                                                    "a finite number"}


def test_an_agent_calling_sys_exit_fails_its_rollout_only():
    """Before: SystemExit passed `except Exception`, left the group's gather and ended the runner's agent loop (its
    thread's run_forever re-raises it): that group and every later one failed as agent_timeout after agent.timeout_s,
    'agent code blocked its event loop'."""
    import sys

    class Exiting(Runner):
        async def execute(self, episode, generator, tokenizer):
            if episode.label == "exit":
                sys.exit("the grader gave up")
            return []

    async def group_then_another():
        eps = [Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8, label=label)
               for label in ("exit", "ok")]
        return await Exiting().run_group(eps, None, None), await Exiting().run_group(eps[1:], None, None)

    first, second = asyncio.run(group_then_another())
    assert dict(first.failures) == {"agent_exception": 1, "empty_session": 1}
    assert first.errors["agent_exception"] == "Exiting on prompt 'p', label 'exit': SystemExit: the grader gave up"
    assert dict(second.failures) == {"empty_session": 1}


class FunctionTimedOut(BaseException):
    """As func_timeout's (a grader's time limit): a BaseException, so that `except Exception` does not swallow it."""


def test_an_agent_raising_any_base_exception_fails_its_rollout_only():
    """Before: it left the group's gather, crossed Ray to the driver past every `except Exception` and ended the run
    in a traceback (exit 1), its roles not torn down."""

    class Grading(Runner):
        async def execute(self, episode, generator, tokenizer):
            if episode.label == "slow":
                raise FunctionTimedOut("grading ran past 5 s")
            return []

    eps = [Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8, label=label) for label in ("slow", "ok")]
    outcome = asyncio.run(Grading().run_group(eps, None, None, 5))
    assert dict(outcome.failures) == {"agent_exception": 1, "empty_session": 1}
    assert outcome.errors["agent_exception"] == ("Grading on prompt 'p', label 'slow': FunctionTimedOut: grading ran "
                                                 "past 5 s")


def test_an_agent_raising_cancelled_error_fails_its_rollout_only_and_a_real_cancel_still_cancels():
    """Before: a CancelledError the agent raised itself (an inner task's, re-raised) left the gather and ended the
    whole group's run_group, every rollout lost and the runner's call failed."""

    class Cancelling(Runner):
        async def execute(self, episode, generator, tokenizer):
            if episode.label == "cancel":
                raise asyncio.CancelledError("an inner task was cancelled")
            if episode.label == "hang":
                await asyncio.sleep(3600)
            return []

    eps = [Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8, label=label)
           for label in ("cancel", "ok")]
    outcome = asyncio.run(Cancelling().run_group(eps, None, None, 5))
    assert dict(outcome.failures) == {"agent_exception": 1, "empty_session": 1}
    assert outcome.errors["agent_exception"] == (
        "Cancelling on prompt 'p', label 'cancel': CancelledError: an inner task was cancelled")

    async def cancelled_from_outside():
        hang = Episode(prompt="p", sampling=Sampling(max_tokens=1), max_length=8, label="hang")
        group = asyncio.ensure_future(Cancelling().run_group([hang], None, None, 60))
        await asyncio.sleep(0.1)
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group

    asyncio.run(cancelled_from_outside())


def test_a_groups_shared_prompt_is_rendered_and_tokenized_once(tiny_model):
    """Eight samples of one chat prompt and one sample of another: two renders, two tokenizations, and every sample
    still starts from its own prompt's exact ids."""
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env, Result

    tok = AutoTokenizer.from_pretrained(tiny_model)
    calls = {"render": 0, "tokenize": 0}

    class Counted:  # the real tokenizer, its render and tokenize calls counted
        def apply_chat_template(self, *a, **kw):
            calls["render"] += 1
            return tok.apply_chat_template(*a, **kw)

        def __call__(self, *a, **kw):
            calls["tokenize"] += 1
            return tok(*a, **kw)

        def decode(self, *a, **kw):
            return tok.decode(*a, **kw)

    class Echo:
        async def generate(self, request):
            return [Generation([7], [-0.5], [0], "stop")]

    class OneTurn(Env):
        async def step(self, state):
            return Result(reward=1.0)

    chats = [[{"role": "user", "content": "What is 2+2?"}]] * 8 + [[{"role": "user", "content": "And 3+3?"}]]
    eps = [Episode(prompt=c, sampling=Sampling(max_tokens=1), max_length=64) for c in chats]
    outcome = asyncio.run(StepEnvRunner(OneTurn).run_group(eps, Echo(), Counted()))
    assert calls == {"render": 2, "tokenize": 2}
    for traj, chat in zip(outcome.trajectories, chats):
        expected = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
        assert traj.token_ids == expected + [7]


def test_an_empty_text_prompt_fails_its_rollout_naming_the_env_and_the_fix(tiny_model):
    """An empty prompt row with data.apply_chat_template=false (or a reset observation of ''): no token to generate
    from. Before: the engine's "session ...: empty prompt_ids", naming neither the row nor the env."""
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env

    class Engine:  # (the real engine refuses empty prompt ids: rollout/engine.py)
        async def generate(self, request):
            assert request.prompt_ids, "empty prompt_ids"
            return [Generation([7], [-0.5], [0], "stop")]

    class OneTurn(Env):
        async def step(self, state):
            return Result(reward=1.0)

    eps = [Episode(prompt=p, sampling=Sampling(max_tokens=4), max_length=64) for p in ("", "hi")]
    outcome = asyncio.run(StepEnvRunner(OneTurn).run_group(eps, Engine(), AutoTokenizer.from_pretrained(tiny_model)))
    assert len(outcome.trajectories) == 1 and dict(outcome.failures) == {"agent_exception": 1}
    assert outcome.errors["agent_exception"] == (
        "OneTurn on prompt '', label None: ValueError: the first prompt of OneTurn is empty text (the row's prompt, "
        "or what reset returned as "
        "'observation'): nothing to generate from. Fix: give the row a prompt, or set data.apply_chat_template=true "
        "to render it as a user message")


def test_an_env_asking_for_no_tokens_fails_its_rollout_instead_of_a_silent_truncation(tiny_model):
    """Before: `sampling_params={"max_tokens": 0}` ended the episode as truncated after one turn, reward kept."""
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env

    class Echo:
        async def generate(self, request):
            return [Generation([7], [-0.5], [0], "stop")]

    class NoBudget(Env):
        async def step(self, state):
            return Result(reward=1.0, observation=" again", terminated=False, sampling_params={"max_tokens": 0})

    eps = [Episode(prompt="hi", sampling=Sampling(max_tokens=4), max_length=64) for _ in range(2)]
    outcome = asyncio.run(StepEnvRunner(NoBudget).run_group(eps, Echo(), AutoTokenizer.from_pretrained(tiny_model)))
    assert outcome.trajectories == [] and dict(outcome.failures) == {"agent_exception": 2}
    assert "Result.sampling_params['max_tokens'] is 0; it must be an int >= 1" in outcome.errors["agent_exception"]


def test_an_env_handing_back_its_turns_sampling_params_leaves_the_later_turns_seeds_moving(tiny_model):
    """An Env that returns its state's sampling_params with another field changed hands back the turn's own seed
    (the rollout's + the turn): it chose no seed, so each later turn still samples with a seed of its own (was: that
    seed for every later turn, the repeated noise per-turn seeds are for). A seed the Env sets itself is kept."""
    import dataclasses

    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env

    class Recording:
        def __init__(self):
            self.seeds = []

        async def generate(self, request):
            self.seeds.append(request.sampling.seed)
            return [Generation([7], [-0.5], [0], "stop")]

    def env(chosen_seed):
        class Handing(Env):
            async def step(self, state):
                given = state["sampling_params"]
                back = dataclasses.replace(given, max_tokens=3, seed=given.seed if chosen_seed is None else chosen_seed)
                return Result(reward=1.0, observation=" more", terminated=state["turn"] == 3, sampling_params=back)
        return Handing

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for chosen, wanted in ((None, [100, 101, 102, 103]), (7, [100, 7, 7, 7])):
        engine = Recording()
        ep = Episode(prompt="hi", sampling=Sampling(max_tokens=4, seed=100), max_length=256)
        asyncio.run(StepEnvRunner(env(chosen)).run_group([ep], engine, tok))
        assert engine.seeds == wanted, (chosen, engine.seeds)


@pytest.mark.parametrize("returned, said", [
    (None, "got NoneType"), ({"label": 1}, "got a dict whose 'observation' is NoneType"),
    ({"observation": 5}, "got a dict whose 'observation' is int")], ids=str)
def test_a_reset_returning_no_observation_fails_its_rollout_naming_reset(tiny_model, returned, said):
    """Before: "'NoneType' object is not subscriptable", "KeyError: 'observation'", a jinja UndefinedError."""
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env

    class BadReset(Env):
        def reset(self, state):
            return returned

        async def step(self, state):
            return Result(reward=1.0)

    ep = Episode(prompt="hi", sampling=Sampling(max_tokens=4), max_length=64)
    outcome = asyncio.run(StepEnvRunner(BadReset).run_group([ep], None, AutoTokenizer.from_pretrained(tiny_model)))
    assert dict(outcome.failures) == {"agent_exception": 1}
    assert "BadReset.reset must return a dict with 'observation'" in outcome.errors["agent_exception"]
    assert said in outcome.errors["agent_exception"]


def test_an_env_editing_its_prompt_or_label_in_place_leaves_its_groups_other_rollouts_alone(tiny_model):
    """Before: reset got the group's shared chat messages and label; an env inserting a system message in place gave
    the second rollout two system messages, and one popping its label list graded the next rollout against []."""
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env

    tok = AutoTokenizer.from_pretrained(tiny_model)
    seen = []

    class Echo:
        async def generate(self, request):
            return [Generation([7], [-0.5], [0], "stop")]

    class InPlace(Env):
        def reset(self, state):
            state["observation"].insert(0, {"role": "system", "content": "Be brief."})
            return state

        async def step(self, state):
            seen.append(list(state["label"]))
            return Result(reward=float(state["label"].pop() == "4"))

    chat, label = [{"role": "user", "content": "2+2?"}], ["4"]
    eps = [Episode(prompt=chat, sampling=Sampling(max_tokens=1), max_length=64, label=label) for _ in range(3)]
    outcome = asyncio.run(StepEnvRunner(InPlace).run_group(eps, Echo(), tok))
    expected = tok([tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *chat], tokenize=False,
                                            add_generation_prompt=True)], add_special_tokens=False)["input_ids"][0]
    assert [t.token_ids for t in outcome.trajectories] == [expected + [7]] * 3
    assert seen == [["4"]] * 3 and [t.reward for t in outcome.trajectories] == [1.0] * 3
    assert chat == [{"role": "user", "content": "2+2?"}] and label == ["4"]


def test_a_chat_agent_drawing_on_its_images_leaves_the_rows_image_alone(tiny_model):
    """Before: ctx.images were the row's own images (decoded once at load): a box an agent drew on one was in every
    later rollout's prompt image of that row, every epoch."""
    from openai import AsyncOpenAI
    from PIL import Image, ImageDraw
    from transformers import AutoTokenizer

    from molt_hydra.agents.chat_agent import ChatAgent
    from molt_hydra.agents.wire.images import load_image
    from molt_hydra.models.build import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("tiny://qwen25_vl_tiny"))  # (a VLM's: image parts are taken)
    seen = []

    class Engine:
        async def generate(self, request):
            return [Generation([7, tok.eos_token_id], [-0.5, -0.5], [0, 0], "stop")]

    class Drawing(ChatAgent):
        async def run(self, ctx):
            seen.append(load_image(ctx.messages[0]["content"][0]["image_url"]["url"]).getpixel((1, 1)))
            ImageDraw.Draw(ctx.images[0]).rectangle([0, 0, 3, 3], fill=(0, 0, 0))
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=1.0)

    row_image, runner = Image.new("RGB", (28, 28), (255, 0, 0)), ChatAgentRunner(Drawing)

    async def two_rollouts():
        try:
            for _ in range(2):
                ep = Episode(prompt="<image>colour?", images=[row_image], sampling=Sampling(max_tokens=4),
                             max_length=512)
                assert (await runner.run_group([ep], Engine(), tok)).trajectories
        finally:
            await runner.close()

    asyncio.run(two_rollouts())
    assert seen == [(255, 0, 0)] * 2 and row_image.getpixel((1, 1)) == (255, 0, 0)


def test_a_chat_agent_editing_its_label_leaves_its_groups_other_rollouts_alone(tiny_model):
    """Before: ctx.label was the group's shared label: one rollout's edit was the next one's label."""
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from molt_hydra.agents.chat_agent import ChatAgent

    tok = AutoTokenizer.from_pretrained(tiny_model)
    sent, labels = [], []

    class Recording:
        async def generate(self, request):
            sent.append(request.sampling.temperature)
            return [Generation([7, tok.eos_token_id], [-0.5, -0.5], [0, 0], "stop")]

    class Appending(ChatAgent):
        async def run(self, ctx):
            labels.append(list(ctx.label))
            ctx.label.append("extra")
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=1.0, truncated=True)  # e.g. it stopped at its own turn limit

    runner = ChatAgentRunner(Appending)

    async def group():
        eps = [Episode(prompt="hi", sampling=Sampling(max_tokens=4, temperature=0.7), max_length=128, label=["4"])
               for _ in range(2)]
        eps[1].label = eps[0].label  # one row's label, shared by its group
        try:
            return await runner.run_group(eps, Recording(), tok)
        finally:
            await runner.close()

    outcome = asyncio.run(group())
    assert len(outcome.trajectories) == 2 and sent == [0.7, 0.7] and labels == [["4"], ["4"]]
    # and Result.truncated reaches every segment (before: ignored on the chat path, truncated_rate 0)
    assert [t.truncated for t in outcome.trajectories] == [True, True]


def test_an_engine_timeout_or_death_drops_the_rollout_as_the_engines_on_both_agent_paths(tiny_model):
    """The router's failures (an engine that did not answer within its timeout, every engine dead, a death past its
    retries) were counted as agent_exception, as if the agent had failed: an Env's rollout through the step runner,
    and a chat agent that raised on the 500 its client got. Both are the engines' now (engine_aborted); a chat agent
    that raises with no engine failure in its session stays the agent's."""
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from molt_hydra.agents.base import Env
    from molt_hydra.agents.chat_agent import ChatAgent
    from molt_hydra.rollout.generation import EngineFailure, EngineTimeout

    tok = AutoTokenizer.from_pretrained(tiny_model)

    class Failing:
        def __init__(self, error):
            self.error = error

        async def generate(self, request):
            raise self.error

    class Once(Env):
        async def step(self, state):
            return Result(reward=1.0, terminated=True)

    class Asking(ChatAgent):
        async def run(self, ctx):
            async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=1.0)

    async def group(runner, error):
        eps = [Episode(prompt="hi", sampling=Sampling(max_tokens=4), max_length=128)]
        try:
            return await runner.run_group(eps, Failing(error), tok)
        finally:
            await runner.close()

    timeout = EngineTimeout("engine 0 did not answer session 's' within 900 s")
    for runner, error in ((StepEnvRunner(Once), timeout), (StepEnvRunner(Once), EngineFailure("every rollout "
                          "engine is dead")), (ChatAgentRunner(Asking), timeout)):
        outcome = asyncio.run(group(runner, error))
        assert dict(outcome.failures) == {"engine_aborted": 1}, (runner, outcome.errors)
        assert str(error) in outcome.errors["engine_aborted"]
    outcome = asyncio.run(group(ChatAgentRunner(Asking), ValueError("a bad request of the agent's own")))
    assert dict(outcome.failures) == {"agent_exception": 1}


@pytest.mark.parametrize("error", ["RuntimeError", "FunctionTimedOut"])
def test_the_runner_process_counts_a_runner_whose_own_run_group_raises_and_marks_text_models(tiny_model, tmp_path,
                                                                                              error):
    """Before: a Runner overriding run_group that raised failed the runner actor's call (a traceback through Ray);
    now its group's rollouts fail, counted as agent_exception with the message (a BaseException too: before, it
    ended the run in a traceback). A step runner on a text model is told it takes no images (Result.images then fail
    the rollout, test_agents_images.py)."""
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    (tmp_path / "custom.py").write_text(
        "from molt_hydra.agents.base import Runner\n"
        "class FunctionTimedOut(BaseException):\n    pass\n"
        "class AgentRunner(Runner):\n"
        "    async def execute(self, episode, generator, tokenizer):\n        return []\n"
        "    async def run_group(self, episodes, generator, tokenizer, timeout_s=None):\n"
        f"        raise {error}('my batching broke')\n")
    kw = dict(tokenizer_path=tiny_model, max_len=64, timeout_s=5, engine_timeout_s=5, seed=0, max_turns=2)
    actor = AgentRunnerActor({"_target_": str(tmp_path / "custom.py")}, [object()], **kw)
    try:
        assert asyncio.run(actor.run_group({"prompt": "p"}, 2, Sampling(max_tokens=4))) == [
            (None, "agent_exception")] * 2
        assert actor.example_errors() == {"agent_exception": "AgentRunner on prompt 'p', label None: "
                                                              f"AgentRunner.run_group raised {error}: my "
                                                              "batching broke"}
    finally:
        actor.agent_loop.call_soon_threadsafe(actor.agent_loop.stop)
    toy = AgentRunnerActor({"_target_": "recipes/agents/toy.py:ToyEnv"}, [object()], **kw)
    toy.agent_loop.call_soon_threadsafe(toy.agent_loop.stop)
    assert toy.runner.accepts_images is False


@pytest.mark.parametrize("agent_code, cause", [
    ("        while True:\n            try:\n                await asyncio.sleep(0.2)\n"
     "            except asyncio.CancelledError:\n                pass\n",
     "agent code went on past agent.timeout_s=1, through the cancellation that ends a rollout at its timeout (an "
     "`except BaseException:` or `except asyncio.CancelledError:` that does not re-raise, or a `finally:` that "
     "awaits?)"),
    ("        time.sleep(12)\n        return []\n",
     "agent code blocked its event loop past agent.timeout_s=1 (a blocking call inside async code?)"),
    ("        return []\n    async def run_group(self, episodes, generator, tokenizer, timeout_s=None):\n"
     "        await asyncio.sleep(10)\n",
     "AgentRunner.run_group went on past agent.timeout_s=1: a Runner's own run_group must end its rollouts at "
     "agent.timeout_s (the timeout_s it is passed), as Runner.run_group does")],
    ids=["ignores its cancellation", "blocks its loop", "own run_group ignores timeout_s"])
def test_a_group_past_its_timeout_is_told_as_a_blocked_loop_only_where_the_loop_is_blocked(tiny_model, tmp_path,
                                                                                            agent_code, cause):
    """An agent swallowing the CancelledError of its timeout (a retry loop under `except BaseException`) keeps its
    group past agent.timeout_s while the agent loop stays free. Before: told as 'agent code blocked its event loop
    past agent.timeout_s (a blocking call inside async code?)', as a time.sleep in async code is. A Runner whose
    own run_group does not end its rollouts at timeout_s cancels nothing. Before: told as a swallowed cancellation."""
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    (tmp_path / "custom.py").write_text(
        "import asyncio, time\nfrom molt_hydra.agents.base import Runner\n"
        "class AgentRunner(Runner):\n    async def execute(self, episode, generator, tokenizer):\n" + agent_code)
    kw = dict(tokenizer_path=tiny_model, max_len=64, timeout_s=1, engine_timeout_s=5, seed=0, max_turns=2)
    actor = AgentRunnerActor({"_target_": str(tmp_path / "custom.py")}, [object()], **kw)
    try:
        assert asyncio.run(actor.run_group({"prompt": "p"}, 2, Sampling(max_tokens=4))) == [
            (None, "agent_timeout")] * 2
        assert actor.example_errors() == {"agent_timeout": f"AgentRunner on prompt 'p', label None: {cause}"}
    finally:
        actor.agent_loop.call_soon_threadsafe(actor.agent_loop.stop)


def test_why_groups_outlived_agent_timeout_s_is_probed_once_per_runner(tiny_model, monkeypatch):
    """Before: every timed-out group probed the agent loop again (up to 1 s of a blocked loop each) for a message
    already recorded."""
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    kw = dict(tokenizer_path=tiny_model, max_len=64, timeout_s=1, engine_timeout_s=5, seed=0, max_turns=2)
    actor = AgentRunnerActor({"_target_": "recipes/agents/toy.py:ToyEnv"}, [object()], **kw)

    async def past_its_deadline(coro, timeout_s):  # stand-in for a group kept past its deadline (6.1 s here)
        coro.close()
        raise asyncio.TimeoutError

    actor._on_agent_loop, submitted = past_its_deadline, []
    submit = asyncio.run_coroutine_threadsafe
    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", lambda coro, loop: submitted.append(coro) or submit(
        coro, loop))
    try:
        for _ in range(3):
            assert asyncio.run(actor.run_group({"prompt": "p"}, 2, Sampling(max_tokens=4))) == [
                (None, "agent_timeout")] * 2
        assert len(submitted) == 1  # the first group's probe only
        assert actor.example_errors()["agent_timeout"].startswith(
            "ToyEnv on prompt 'p', label None: agent code went on past agent.timeout_s=1, ")
    finally:
        actor.agent_loop.call_soon_threadsafe(actor.agent_loop.stop)


def test_a_sys_exit_in_the_agent_loops_pass_that_runs_closes_stop_ends_the_loop(tiny_model):
    """A SystemExit of agent code raised in the pass of the agent loop that ran close()'s stop leaves run_forever
    with the stop spent (run_forever clears it). Before: the loop was restarted and ran on after close()."""
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    before = set(threading.enumerate())
    kw = dict(tokenizer_path=tiny_model, max_len=64, timeout_s=5, engine_timeout_s=5, seed=0, max_turns=2)
    actor = AgentRunnerActor({"_target_": "recipes/agents/toy.py:ToyEnv"}, [object()], **kw)
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "agent-loop"]
    loop, queue = actor.agent_loop, actor.agent_loop.call_soon_threadsafe
    held, go = threading.Event(), threading.Event()

    def stop_then_exit(callback, *args, **kwargs):  # close()'s stop, then a sys.exit: both run in one pass
        if callback != loop.stop:
            return queue(callback, *args, **kwargs)
        queue(lambda: (held.set(), go.wait()))  # the loop is held while both are queued
        held.wait()
        queue(callback)
        queue(sys.exit, "agent code's exit")
        go.set()

    loop.call_soon_threadsafe = stop_then_exit
    try:
        asyncio.run(actor.close())
        thread.join(5)
        assert not thread.is_alive()
    finally:
        queue(loop.stop)


def test_sys_exit_in_a_task_of_agent_code_fails_its_rollouts_and_the_runner_goes_on(tiny_model, tmp_path):
    """sys.exit() in a coroutine the agent gathers: asyncio sets it on that task (its awaiter fails the rollout with
    it) and raises it out of the agent loop's run_forever too. Before: the agent loop's thread ended; this group and
    every later one timed out after agent.timeout_s x 1.1 + 5 s, 'agent code blocked its event loop'."""
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    (tmp_path / "custom.py").write_text(
        "import asyncio, sys\nfrom molt_hydra.agents.base import Runner\n"
        "async def grade(label):\n    if label == 'exit':\n        sys.exit('the grader gave up')\n"
        "class AgentRunner(Runner):\n    async def execute(self, episode, generator, tokenizer):\n"
        "        await asyncio.gather(grade(episode.label))\n        return []\n")
    kw = dict(tokenizer_path=tiny_model, max_len=64, timeout_s=30, engine_timeout_s=5, seed=0, max_turns=2)
    actor = AgentRunnerActor({"_target_": str(tmp_path / "custom.py")}, [object()], **kw)
    try:
        for label, expected in (("exit", "agent_exception"), ("exit", "agent_exception"), ("ok", "empty_session")):
            group = actor.run_group({"prompt": "p", "label": label}, 2, Sampling(max_tokens=4))
            assert asyncio.run(asyncio.wait_for(group, 10)) == [(None, expected)] * 2, label
        assert actor.example_errors() == {
            "agent_exception": "AgentRunner on prompt 'p', label 'exit': SystemExit: the grader gave up",
            "empty_session": "AgentRunner on prompt 'p', label 'ok': the agent returned no generated token"}
    finally:
        actor.agent_loop.call_soon_threadsafe(actor.agent_loop.stop)


def test_a_relative_agent_file_reaches_the_runners_as_an_absolute_path(tmp_path, monkeypatch):
    """The runners import the file in Ray workers, whose working directory differs on a remote cluster (before: the
    relative path was sent as it was)."""
    from molt_hydra.agents.targets import absolute_target

    monkeypatch.chdir(tmp_path)
    assert absolute_target("agents/my_env.py:MyEnv") == f"{tmp_path}/agents/my_env.py:MyEnv"
    assert absolute_target("agents/my_env.py") == f"{tmp_path}/agents/my_env.py"
    assert absolute_target("/abs/agent.py:X") == "/abs/agent.py:X"
    assert absolute_target("pkg.module.Name") == "pkg.module.Name"
    # under home, as validation imports it (before: '<cwd>/~/agents/a.py:X', a file the runners could not find)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert absolute_target("~/agents/a.py:X") == f"{tmp_path}/home/agents/a.py:X"


@pytest.mark.parametrize("body, said", [
    ("        return out.trajectories\n",
     ["TypeError: AgentRunner.run_group must return a RolloutOutcome, got list"] * 2),
    ("        out.trajectories[0].reward = None\n        return out\n",
     ["ValueError: Trajectory.reward of AgentRunner.run_group is None; return a number", None]),
    ("        out.trajectories[1].action_ranges = [(0, 3)]\n        return out\n",
     [None, "ValueError: Trajectory.action_ranges of AgentRunner.run_group holds (0, 3): each must be a [start, "
            "end) span of its 4 tokens"]),
    ("        out.trajectories[0].rollout_id = None\n        return out\n",
     ["ValueError: AgentRunner.run_group returned a Trajectory with rollout_id=None, group_id=", None]),
    ("        out.trajectories[1] = {'token_ids': [1]}\n        return out\n",
     [None, "TypeError: AgentRunner.run_group returned a dict among its trajectories"]),
], ids=["a list", "reward None", "action range", "no rollout id", "a dict"])
def test_the_runner_process_checks_what_a_runners_own_run_group_returns(tiny_model, tmp_path, body, said):
    """A Runner's own run_group returns a RolloutOutcome of its episodes' segments, each as Runner.run_group checks
    an execute's. Before: a list failed as "AttributeError: 'list' object has no attribute 'errors'"; a segment with
    a reward of None, an action range from token 0 or no rollout id failed the whole run in the driver, as the
    driver's ('Run failed: driver: TypeError: float() argument must be ...')."""
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    (tmp_path / "custom.py").write_text(
        "from molt_hydra.agents.base import Runner, Trajectory\n"
        "class AgentRunner(Runner):\n"
        "    async def execute(self, episode, generator, tokenizer):\n"
        "        return [Trajectory(token_ids=[5, 6, 7, 8], logprobs=[0, 0, -.5, -.5], versions=[-1, -1, 0, 0],\n"
        "                           action_ranges=[(2, 4)], reward=1.0)]\n"
        "    async def run_group(self, episodes, generator, tokenizer, timeout_s=None):\n"
        "        out = await super().run_group(episodes, generator, tokenizer, timeout_s)\n" + body)
    kw = dict(tokenizer_path=tiny_model, max_len=64, timeout_s=5, engine_timeout_s=5, seed=0, max_turns=2)
    actor = AgentRunnerActor({"_target_": str(tmp_path / "custom.py")}, [object()], **kw)
    try:
        results = asyncio.run(actor.run_group({"prompt": "p"}, 2, Sampling(max_tokens=4)))
    finally:
        actor.agent_loop.call_soon_threadsafe(actor.agent_loop.stop)
    bad = [s for s in said if s is not None]
    assert sorted(r for t, r in results if t is None) == ["agent_exception"] * len(bad), results
    assert [t.reward for t, r in results if t is not None] == [1.0] * (2 - len(bad))
    # (named by the runner, the group's prompt and label first, as a rollout's failure is: base.py failed_on)
    assert actor.example_errors()["agent_exception"].startswith("AgentRunner on prompt 'p', label None: " + bad[0]), \
        actor.example_errors()


def test_action_ranges_of_any_int_kind_are_taken_as_ints():
    """A hand-written Runner may compute its spans with numpy or torch: ints of any kind (what __index__ takes) are
    taken, as plain ints; a bool or a float is not an index."""
    import torch

    from molt_hydra.agents.base import Trajectory, check_built

    seg = Trajectory(token_ids=[1, 2, 3, 4], reward=1.0, action_ranges=[(np.int64(1), torch.tensor(3))])
    check_built(seg, "R.execute")
    assert seg.action_ranges == [(1, 3)] and all(type(x) is int for x in seg.action_ranges[0])
    for bad in [(True, 3), (1.0, 3)]:
        with pytest.raises(ValueError, match=r"Trajectory.action_ranges of R.execute holds"):
            check_built(Trajectory(token_ids=[1, 2, 3, 4], reward=1.0, action_ranges=[bad]), "R.execute")


def test_a_worker_whose_pipe_broke_before_the_write_is_replaced(monkeypatch, caplog):
    """A worker that died between the idle check and the write (a broken pipe) is a death grading: the answer goes
    to a fresh worker (was: BrokenPipeError out of grade_math, the rollout failed)."""
    from molt_hydra.agents import math_grading

    class BrokenWorker:
        returncode = -9

        def poll(self):
            return None  # still alive at the check

        @property
        def stdin(self):
            raise BrokenPipeError(32, "Broken pipe")

        def kill(self):
            pass

        def wait(self):
            return self.returncode

    monkeypatch.setattr(math_grading, "_WORKERS", math_grading._Workers())
    math_grading._WORKERS.idle.append(BrokenWorker())
    with caplog.at_level("WARNING", logger=math_grading.__name__):
        assert grade_math(r"\boxed{5}", "5") == 1.0
    assert "the math-verify worker died (exit code -9)" in caplog.text
