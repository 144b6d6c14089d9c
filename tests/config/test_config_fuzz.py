"""Fuzz of the config front door: a few hundred seeded override sets drawn from the schema's own types and declared
ranges, run through what `molt-run ... dry_run=true` runs (override check, compose, typed conversion, validation,
plan), in this process for speed; a handful through the real `molt-run`.

Bad sets must end in a config error (exit 2) that names every bad key and no traceback; valid-but-unusual sets (every
value on an edge of its range) must plan. Generation follows the schema, so a field added later is fuzzed too.
"""

from __future__ import annotations

import dataclasses
import random
import typing
from enum import Enum
from pathlib import Path

import pytest

from _config_helpers import PLAN_HEADER, run_cli_many
from molt_hydra.cli import EXIT_CONFIG_ERROR, point_problems
from molt_hydra.config.bounds import BOUNDS, Bounds
from molt_hydra.config.schema import OptimizerConfig, RunConfig
from molt_hydra.config.validate import MUON_FIELDS, NOT_IMPLEMENTED

SEED = 1717
N_BAD = 240
N_VALID = 30


@dataclasses.dataclass(frozen=True)
class Leaf:
    key: str
    kind: type  # int, float, bool, str, an Enum, or list (of floats)
    optional: bool
    bounds: Bounds | None


def leaves() -> list[Leaf]:
    out, todo = [], [("", RunConfig)]
    while todo:
        prefix, cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                todo.append((f"{prefix}{f.name}.", tp))
                continue
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            optional = typing.get_origin(tp) is typing.Union
            base = args[0] if optional else tp
            kind = list if typing.get_origin(base) is list else base
            if kind in (int, float, bool, str, list) or (isinstance(kind, type) and issubclass(kind, Enum)):
                out.append(Leaf(prefix + f.name, kind, optional, f.metadata.get(BOUNDS)))
    return sorted(out, key=lambda leaf: leaf.key)


LEAVES = leaves()
NUMERIC = [leaf for leaf in LEAVES if leaf.kind in (int, float) and leaf.bounds is not None]


def _fmt(kind: type, v: float) -> str:
    return str(int(v)) if kind is int else repr(float(v))


def outside(leaf: Leaf, rng: random.Random) -> str | None:
    """A value of the field's own type outside its declared range (None if the range is unbounded)."""
    b, step = leaf.bounds, (1 if leaf.kind is int else 0.5)
    low = b.ge - step if b.ge is not None else b.gt if b.gt is not None else None
    high = b.le + step if b.le is not None else b.lt if b.lt is not None else None
    choices = [v for v in (low, high, None if low is None else low - rng.randint(1, 100) * step) if v is not None]
    choices = [v for v in choices if v not in b.also]
    if leaf.kind is float and rng.random() < 0.1:
        return rng.choice(["inf", "-inf", "nan"])  # never in any range
    return _fmt(leaf.kind, rng.choice(choices)) if choices else None


def on_edge(leaf: Leaf, rng: random.Random) -> str:
    """A valid value on an edge of the declared range (a sentinel, a limit, or just inside an open limit)."""
    b = leaf.bounds
    tiny = 1 if leaf.kind is int else 1e-6
    edges = [*b.also]
    far = 1e6 if leaf.kind is float else 10**6  # an unbounded side: a far value
    edges += [b.ge] if b.ge is not None else [b.gt + tiny] if b.gt is not None else [-far]
    edges += [b.le] if b.le is not None else [b.lt - tiny] if b.lt is not None else [far]
    return _fmt(leaf.kind, rng.choice(edges))


def bad_type(leaf: Leaf, rng: random.Random) -> str | None:
    """A value of another type, or ??? (a value left missing: was a traceback for a key molt-run reads early)."""
    if leaf.kind is int:
        return rng.choice(["1.5", "abc", "[1]", "???"])
    if leaf.kind is float:
        return rng.choice(["abc", "'1,5'", "{a: 1}", "???"])
    if leaf.kind is bool:
        return rng.choice(["maybe", "yes_please", "???"])
    if isinstance(leaf.kind, type) and issubclass(leaf.kind, Enum):
        return rng.choice(["not_a_choice", "1", "???"])
    return None


def bad_sets(seed: int = SEED, n: int = N_BAD) -> list[tuple[list[str], list[str]]]:
    """(overrides, keys the error must name). A set is either one override composition rejects (type, choice,
    unknown key, grammar) or one to three values outside their ranges, which are all reported together."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        style = rng.choice(["range", "range", "range", "type", "unknown_key", "grammar"])
        if style == "range":
            picked = rng.sample(NUMERIC, rng.randint(1, 3))
            overrides = [f"{leaf.key}={v}" for leaf in picked if (v := outside(leaf, rng)) is not None]
            if overrides:
                out.append((overrides, [o.split("=", 1)[0] for o in overrides]))
        elif style == "type":
            leaf = rng.choice(LEAVES)
            value = bad_type(leaf, rng)
            if value is not None:
                out.append(([f"{leaf.key}={value}"], [leaf.key]))
        elif style == "unknown_key":
            leaf = rng.choice(LEAVES)
            key = leaf.key + rng.choice(["x", "_typo", "s"])
            out.append(([f"{key}=1"], [key]))
        else:
            leaf = rng.choice(LEAVES)
            text = f"{leaf.key}={rng.choice(['[1', '${oops', 'a,b', '{x', '1]'])}"
            out.append(([text], [text]))
    return out


# Fields that cross-group rules tie to others (batch arithmetic, resource fit, estimator needs, schedules): an edge
# value of one of them alone is a legitimate cross-group error, so the must-plan sets leave them at their values.
TIED = {"rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.num_engines", "rollout.tensor_parallel_size",
        "rollout.data_parallel_size", "rollout.pipeline_parallel_size", "rollout.max_new_tokens", "rollout.top_p",
        "rollout.mtp_num_speculative_tokens", "train.batch_size", "train.micro_batch_size", "train.queue_depth",
        "train.max_staleness", "train.critic.actor_freezing_steps", "data.max_len", "data.train_probs",
        "algorithm.kl.coef", "algorithm.clip_eps_high", "eval.every_steps", "cluster.nodes",
        "cluster.devices_per_node", "algorithm.is_correction.low", "algorithm.is_correction.high",
        "algorithm.dynamic_filtering.low", "algorithm.dynamic_filtering.high", "algorithm.reward_clip",
        "algorithm.dynamic_filtering.max_gen_batches",  # refused while the filter is off (the default)
        "data.max_images_per_prompt",  # > 0: images, refused for the default text-only model (docs/vlm.md)
        "rollout.max_num_batched_tokens",  # on CPU (no chunked prefill) at least rollout.max_model_len
        "rollout.max_model_len", "eval.max_new_tokens", "train.max_tokens_per_micro_batch",  # vs data.max_len
        "model.aux_loss_coef",  # > 0 acts on MoE routers: refused for the default dense model
        "data.max_samples",  # at least rollout.batch_size prompts
        "rollout.block_size",  # on CPU a multiple of 32
        "rollout.kv_cache_gb",  # on CPU whole GiB
        "rollout.gpu_memory_utilization",  # GPU engines only: refused on the default CPU run
        "logger.every_steps", "logger.sample_table_every",  # at most train.max_steps (30)
        # settings of a switch that is off by default (Muon, grad-norm debugging, log-prob dumps) are refused alone
        *(f"{block}.{name}" for block in ("train.optimizer", "train.critic.optimizer") for name in MUON_FIELDS),
        "logger.debug_grad_norms_topk", "logger.dump_logprobs_steps",
        "agent.max_choices", "agent.tool_parser",  # ChatAgent knobs: refused for the default agent (an Env)
        # LoRA: its knobs are refused while model.lora.rank is null; the rank is bounded by the model's hidden size
        "model.lora.rank", "model.lora.alpha", "model.lora.dropout",
        "checkpoint.save_steps",  # 0 (never) refuses the knobs that shape checkpoints
        # knobs of a mechanism the default run does not use (tests/config/test_inert_knobs.py): grpo reads no discount,
        # lambda or value clip and trains no critic; no KL is computed; no eval data; the constant scheduler
        "algorithm.gamma", "algorithm.lam", "algorithm.value_clip", "algorithm.kl.target", "algorithm.kl.horizon",
        "train.critic.epochs", *(f"train.critic.optimizer.{f.name}" for f in dataclasses.fields(OptimizerConfig)),
        "train.optimizer.weight_decay",  # lr x weight_decay below 1 (decoupled decay)
        "train.optimizer.min_lr_ratio", "train.optimizer.warmup_ratio",
        *(f"eval.{name}" for name in ("batch_size", "n_samples_per_prompt", "temperature", "top_p")),
        "rollout.decode_context_parallel_size",  # must divide rollout.tensor_parallel_size (1)
        "rollout.num_runners",  # at most the prompt groups in flight (rollout.max_inflight_groups, 8)
        "rollout.max_inflight_groups",  # above rollout.batch_size (8) only with train.partial_rollout
        "checkpoint.max_disk_gb"}  # at least one checkpoint's size
FREE = [leaf for leaf in NUMERIC if leaf.key not in TIED and not leaf.key.startswith("parallelism.")
        and leaf.key not in NOT_IMPLEMENTED]


def valid_sets(seed: int = SEED, n: int = N_VALID) -> list[list[str]]:
    rng = random.Random(seed + 1)
    return [[f"{leaf.key}={on_edge(leaf, rng)}" for leaf in rng.sample(FREE, rng.randint(2, 6))] for _ in range(n)]


def dry_run_in_process(overrides: list[str]) -> tuple[int, str]:
    """What `molt-run OVERRIDES dry_run=true` does, minus Hydra's run directory: (exit code, message or plan), through
    the CLI's own check of one run (`point_problems`). Anything but a ConfigError propagates, so a traceback fails the
    test that calls this."""
    problems, result = point_problems([*overrides, "dry_run=true"], Path("/nonexistent/molt_fuzz"), None)
    return (EXIT_CONFIG_ERROR, "\n".join(problems)) if problems else (0, result[1].render())


def test_generation_covers_the_schema():
    sets = bad_sets()
    keys = {k for _, ks in sets for k in ks}
    assert len(sets) == N_BAD and len({tuple(o) for o, _ in sets}) > N_BAD * 0.9  # few repeats
    assert len({leaf.key for leaf in NUMERIC} & keys) > len(NUMERIC) * 0.8, "most ranged fields are fuzzed"
    assert bad_sets() == sets, "seeded: the same sets every run"


def test_bad_override_sets_fail_with_the_keys_named():
    """The first half of the sets (make test's budget: ~0.15 s a set); the rest below, behind `slow`."""
    _reject_cleanly(bad_sets()[:N_BAD // 2])


@pytest.mark.slow
def test_the_other_bad_override_sets_fail_with_the_keys_named():
    _reject_cleanly(bad_sets()[N_BAD // 2:])


def _reject_cleanly(sets: list) -> None:
    failures = []
    for overrides, keys in sets:
        code, text = dry_run_in_process(overrides)
        lines = text.splitlines()
        missed = [k for k in keys if not any(line.startswith(f"- {k}") for line in lines)]
        if code != EXIT_CONFIG_ERROR or missed or any("Fix: " not in line for line in lines if line.startswith("- ")):
            failures.append(f"{overrides}: exit {code}, keys not named {missed}\n{text[:600]}")
    assert not failures, f"{len(failures)} bad sets not rejected cleanly:\n" + "\n\n".join(failures[:10])


def test_valid_unusual_sets_plan():
    failures = []
    for overrides in valid_sets():
        code, text = dry_run_in_process(overrides)
        if code != 0 or PLAN_HEADER not in text:
            failures.append(f"{overrides}: exit {code}\n{text[:600]}")
    assert not failures, f"{len(failures)} valid sets did not plan:\n" + "\n\n".join(failures[:10])


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """A few sets of each kind through the real `molt-run`, all started together."""
    base = tmp_path_factory.mktemp("fuzz_cli")
    sets = bad_sets()
    picked = [next(s for s in sets if s[0][0].startswith(s[1][0]) and "=" in s[1][0]),  # grammar
              next(s for s in sets if len(s[0]) >= 2)] + sets[:2]  # several ranges at once, then the first two
    valid = valid_sets()[:1]
    calls = [[*o, "dry_run=true", f"hydra.run.dir={base / str(i)}"] for i, (o, _) in enumerate(picked)]
    calls += [[*o, "dry_run=true", f"hydra.run.dir={base / 'valid'}"] for o in valid]
    results = run_cli_many(calls)
    return list(zip(picked, results[:len(picked)])), results[len(picked):]


def test_bad_sets_through_the_real_cli(cli_runs):
    bad, _ = cli_runs
    for (overrides, keys), res in bad:
        assert res.returncode == EXIT_CONFIG_ERROR, res.describe()
        assert "Traceback" not in res.output, res.describe()
        assert PLAN_HEADER not in res.stdout, res.describe()
        for k in keys:
            assert f"- {k}" in res.stderr, f"{k} not named\n{res.describe()}"


def test_valid_set_through_the_real_cli(cli_runs):
    _, valid = cli_runs
    for res in valid:
        assert res.returncode == 0, res.describe()
        assert PLAN_HEADER in res.stdout, res.describe()


HUGE = 2**31  # past any count a run holds; a check that counts up to such a value by ones never ends


def _fail_on_alarm(signum, frame):
    raise TimeoutError(f"the check did not end within {CHECK_LIMIT_S} s")


CHECK_LIMIT_S = 60  # a termination bound, not a speed target: one check takes about a second


# (make test's budget: its rl point bounds the same plan and checks; eval's in make test-full)
@pytest.mark.parametrize("job", ["rl", pytest.param("eval", marks=pytest.mark.slow)])
def test_a_huge_count_ends_in_a_plan_or_an_error(job):
    """Every int knob of the schema at 2**31 ends, in a plan or in errors naming key, reason and fix. Before,
    rollout.n_samples_per_prompt=2147483648 (or rollout.batch_size) hung `molt-run ... dry_run=true` under any job:
    the batch rule's suggested fix searched down from the step's sample count by ones, built even when it passed."""
    import signal

    extra = ["eval.data_path=builtin://toy_eval"] if job == "eval" else []
    previous = signal.signal(signal.SIGALRM, _fail_on_alarm)
    try:
        for leaf in (leaf for leaf in LEAVES if leaf.kind is int):
            signal.alarm(CHECK_LIMIT_S)
            code, text = dry_run_in_process([f"job={job}", *extra, f"{leaf.key}={HUGE}"])
            signal.alarm(0)
            lines = text.splitlines() if code else []
            assert all(" Fix: " in line for line in lines if line.startswith("- ")), (leaf.key, text)
            assert code == 0 or any(line.startswith("- ") for line in lines), (leaf.key, text)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
