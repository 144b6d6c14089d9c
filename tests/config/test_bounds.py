"""Declared ranges (config/bounds.py) and names of external things (config/validate.py): every numeric field of the
schema states its range where it is declared; a value outside it, an unknown scheduler, a model or data location that
cannot exist, or an agent that cannot be imported fails validation with the full key, all problems at once."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from test_validation import assert_fires, config_errors
from molt_hydra.config.bounds import BOUNDS, Bounds, declared_bounds
from molt_hydra.config.schema import RunConfig
from molt_hydra.data.prompts import BUILTIN_TASKS




def _numeric(tp) -> bool:
    """int, float, Optional of them, or a list of them (bool is not numeric here)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:
        return len(args) == 1 and _numeric(args[0])
    if typing.get_origin(tp) is list:
        return _numeric(args[0])
    return tp in (int, float)


def test_every_numeric_field_declares_its_range():
    """A field added without `ranged(...)` fails here by name (fix: declare its range where it is declared)."""
    missing = []
    todo = [("", RunConfig)]
    while todo:
        prefix, cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                todo.append((f"{prefix}{f.name}.", hints[f.name]))
            elif _numeric(hints[f.name]) and BOUNDS not in f.metadata:
                missing.append(f"{prefix}{f.name}")
    assert not missing, f"numeric schema fields without a declared range (use ranged(...) in schema.py): {missing}"


def test_every_default_lies_in_its_range():
    bad = [f"{k}={d}" for k, (b, d) in declared_bounds(RunConfig).items() if b is not None and d is not None
           and not all(b.holds(v) for v in (d if isinstance(d, list) else [d]))]
    assert not bad, f"schema defaults outside their own declared ranges: {bad}"


def test_bounds_describe_and_hold():
    b = Bounds(gt=0, le=1)
    assert b.describe() == "in (0, 1]" and b.holds(1) and not b.holds(0) and not b.holds(1.5)
    sentinel = Bounds(ge=1, also=(-1,))
    assert sentinel.describe() == "-1 or >= 1" and sentinel.holds(-1) and not sentinel.holds(0)


# The values the issue found accepted, one per rule; each must now be refused with the key named.
OUT_OF_RANGE = [
    ("train.max_steps=0", "train.max_steps", "must be >= 1, got 0"),
    ("agent.max_turns=0", "agent.max_turns", "must be >= 1, got 0"),
    ("agent.timeout_s=-1", "agent.timeout_s", "must be in (0, 10000000.0], got -1.0"),
    ("rollout.max_new_tokens=-4", "rollout.max_new_tokens", "must be >= 1, got -4"),
    ("rollout.max_num_seqs=0", "rollout.max_num_seqs", "must be >= 1, got 0"),
    ("rollout.block_size=0", "rollout.block_size", "must be >= 1, got 0"),
    ("rollout.weight_sync.bucket_mb=0", "rollout.weight_sync.bucket_mb", "must be >= 1, got 0"),
    ("logger.every_steps=0", "logger.every_steps", "must be >= 1, got 0"),
    ("checkpoint.save_steps=-2", "checkpoint.save_steps", "must be -1 or >= 0, got -2"),
    ("train.timeouts.step_s=0", "train.timeouts.step_s", "must be in (0, 10000000.0], got 0.0"),
    ("train.timeouts.startup_s=-5", "train.timeouts.startup_s", "must be in (0, 10000000.0], got -5.0"),
    ("cluster.time_min=0", "cluster.time_min", "must be >= 1, got 0"),
    ("cluster.memory_gb_per_device=-1", "cluster.memory_gb_per_device", "must be >= 0, got -1.0"),
    ("eval.top_p=2", "eval.top_p", "must be in (0, 1], got 2.0"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization", "must be in (0, 1], got 1.5"),
    ("rollout.kv_cache_gb=0", "rollout.kv_cache_gb", "must be in (0, 1000000.0], got 0.0"),
    ("algorithm.clip_eps_low=-0.1", "algorithm.clip_eps_low", "must be in [0, 1), got -0.1"),
    ("algorithm.clip_eps_high=-0.1", "algorithm.clip_eps_high", "must be >= 0, got -0.1"),
    ("algorithm.kl.coef=-1", "algorithm.kl.coef", "must be >= 0, got -1.0"),
    ("algorithm.kl.horizon=0", "algorithm.kl.horizon", "must be >= 1, got 0"),
    ("algorithm.value_clip=0", "algorithm.value_clip", "must be > 0, got 0"),
    ("train.optimizer.betas=[0.9,1.0]", "train.optimizer.betas", "each value must be in [0, 1), got [0.9, 1.0]"),
    ("train.critic.optimizer.betas=[-0.1,0.9]", "train.critic.optimizer.betas", "each value must be in [0, 1)"),
    ("train.optimizer.eps=0", "train.optimizer.eps", "must be in (0, 1] ("),
    ("train.optimizer.weight_decay=-0.01", "train.optimizer.weight_decay", "must be >= 0, got -0.01"),
    ("seed=-1", "seed", "must be in [0, 4294967296), got -1"),
]


@pytest.mark.parametrize("override,key,fragment", OUT_OF_RANGE, ids=[c[1] for c in OUT_OF_RANGE])
def test_out_of_range_value_is_refused(override, key, fragment):
    assert_fires([override], key, fragment)


@pytest.mark.parametrize("override,key", [("rollout.temperature=inf", "rollout.temperature"),
                                          ("train.optimizer.lr=nan", "train.optimizer.lr"),
                                          ("rollout.kv_cache_gb=1e300", "rollout.kv_cache_gb"),
                                          ("train.timeouts.collective_s=1e300", "train.timeouts.collective_s")])
def test_non_finite_and_overflowing_values_are_refused(override, key):
    assert_fires([override], key, "must be ")


@pytest.mark.parametrize("override,key,range_,default", [
    ("algorithm.entropy_coef=1e39", "algorithm.entropy_coef", ">= 0", "0.0"),
    ("rollout.temperature=1e39", "rollout.temperature", ">= 1e-05", "1.0"),
    ("algorithm.kl.coef=1e39", "algorithm.kl.coef", ">= 0", "null"),
    ("model.lora.alpha=1e39", "model.lora.alpha", "> 0", "null"),
    ("algorithm.dynamic_filtering.high=-1e39", "algorithm.dynamic_filtering.high", "a finite number", "1.0")])
def test_a_float_past_float32_is_refused(override, key, range_, default):
    """Before: a finite Python float past 3.4e38 was accepted, then inf in the trainer's or vLLM's float32 tensors
    (an inf entropy or KL coefficient, LoRA scale or temperature: a NaN loss or NaN sampling probabilities)."""
    from _config_helpers import compose_config
    from molt_hydra.config.bounds import out_of_range

    assert out_of_range(compose_config([override]), RunConfig) == [
        f"- {key}: must be {range_} and within float32 (|x| <= 3.4e38): past it a value is inf in the trainer's and "
        f"vLLM's float32 math, got {float(override.split('=')[1])}. Fix: set {key} within that range (default "
        f"{default})"]
    assert out_of_range(compose_config([f"{key}=3.4e38"]), RunConfig) == []  # (float32's largest is 3.4028e38)


@pytest.mark.parametrize("override,key", [("train.optimizer.eps=1e-300", "train.optimizer.eps"),
                                          ("train.optimizer.max_grad_norm=1e-300", "train.optimizer.max_grad_norm"),
                                          ("train.optimizer.lr=1e-39", "train.optimizer.lr"),
                                          ("algorithm.reward_clip=[-1e-300,1.0]", "algorithm.reward_clip")])
def test_a_non_zero_float_below_float32_is_refused(override, key):
    """Before: accepted, then 0 in float32: AdamW's eps=1e-300 divided 0 by 0 (NaN weights wherever a gradient was
    0), max_grad_norm=1e-300 scaled every gradient to 0 (a run that learns nothing, without a word)."""
    import torch

    assert torch.tensor(1e-300).item() == 0.0  # (why: float32 has no such number)
    assert_fires([override], key, "unless 0, at least 1.2e-38 in magnitude")


@pytest.mark.parametrize("override", ["train.optimizer.max_grad_norm=0.0", "train.optimizer.weight_decay=-0.0",
                                      "train.optimizer.lr=1.2e-38"])
def test_zero_and_float32_normals_pass(override):
    from _config_helpers import compose_config
    from molt_hydra.config.bounds import out_of_range

    assert out_of_range(compose_config([override]), RunConfig) == []


def test_a_non_finite_value_names_the_limit_it_fails():
    """Before: `must be >= 1e-05, got inf`, a range inf seems to be in."""
    assert_fires(["rollout.temperature=inf"], "rollout.temperature", "must be >= 1e-05 and finite, got inf.")


@pytest.mark.parametrize("override,key", [("rollout.num_runners=99999999999999999999", "rollout.num_runners"),
                                          ("cluster.cpus_per_node=9223372036854775808", "cluster.cpus_per_node"),
                                          ("rollout.top_k=-9223372036854775809", "rollout.top_k")])
def test_an_integer_past_64_bits_is_refused(override, key):
    """Before: accepted, then an overflow where Ray, torch or vLLM took it (ray.init(num_cpus=...), a top-k tensor)."""
    assert_fires([override], key, f"and a 64-bit integer (below 2**63), got {override.split('=')[1]}.")


def test_the_largest_64_bit_integer_is_in_range():
    from _config_helpers import compose_config
    from molt_hydra.config.bounds import out_of_range

    assert out_of_range(compose_config([f"train.max_steps={2**63 - 1}"]), RunConfig) == []
    assert out_of_range(compose_config([f"train.max_steps={2**63}"]), RunConfig)[0].startswith("- train.max_steps:")


def test_range_errors_come_with_single_group_errors_at_once():
    """Ranges (bounds.py) and __post_init__ rules of other groups are reported together, one line each."""
    lines = config_errors(["train.max_steps=0", "rollout.top_p=7", "algorithm.reward_clip=[5,-5]",
                           "cluster.nodes=0"])
    keys = sorted(line.split(":", 1)[0] for line in lines)
    assert keys == ["algorithm.reward_clip", "cluster.nodes", "rollout.top_p", "train.max_steps"], lines


def test_train_probs_must_sum_to_one():
    assert_fires(["data.train_path='builtin://toy,builtin://arithmetic'", "data.train_probs=[0.5,0.6]"],
                 "data.train_probs", "must sum to 1, got [0.5, 0.6]")
    assert_fires(["data.train_probs=[1.5]"], "data.train_probs", "each value must be in [0, 1]")
    assert_fires(["data.train_probs=[0.5,0.5]"], "data.train_probs", "2 probabilities for 1 dataset(s)")
    assert config_errors(["data.train_path='builtin://toy,builtin://arithmetic'", "data.train_probs=[0.25,0.75]"]) == []
    # before: accepted, and loading the prompts looped forever (the dataset of probability 0 is never exhausted)
    assert_fires(["data.train_path='builtin://toy,builtin://arithmetic'", "data.train_probs=[1.0,0.0]"],
                 "data.train_probs", "[1.0, 0.0] gives a dataset probability 0")


# ---------------------------------------------------------------------------------- names of external things
def test_unknown_scheduler_lists_the_transformers_ones():
    from transformers import SchedulerType

    lines = config_errors(["train.optimizer.scheduler=cosine_typo"])
    line = next(l for l in lines if l.startswith("train.optimizer.scheduler: "))
    assert "'cosine_typo' is not a transformers scheduler" in line
    assert all(s.value in line for s in SchedulerType)


def test_default_scheduler_is_a_transformers_one():
    """validate.py skips the (slow) scheduler-list import for the default name; that default must be valid."""
    from transformers import SchedulerType

    from molt_hydra.config.schema import OptimizerConfig

    assert OptimizerConfig().scheduler in {s.value for s in SchedulerType}
    assert RunConfig().train.critic.optimizer.scheduler in {s.value for s in SchedulerType}


def test_overlong_model_path_is_a_config_error_not_an_oserror():
    lines = config_errors(["model.path=" + "x" * 300])
    assert any(l.startswith("model.path: ") and "is not a usable path (File name too long)" in l for l in lines), lines


@pytest.mark.parametrize("overrides", [["data.train_path=" + "x" * 300], ["eval.data_path=" + "x" * 300],
                                       ["job=sft", "data.train_path=" + "x" * 300]])
def test_overlong_data_path_is_a_config_error_not_an_oserror(overrides):
    """Before: data/rules.py's and agents/rules.py's looks at the local dataset (Path.is_file / is_dir) raised
    OSError: [Errno 36] File name too long, a traceback in place of validation's report."""
    key = overrides[-1].split("=")[0]
    lines = config_errors(overrides)
    assert (f"{key}: {'x' * 60!r}... is not a usable path (File name too long). Fix: give files, directories, hub "
            f"dataset ids or one of {['builtin://' + n for n in sorted(BUILTIN_TASKS)]}") in lines, lines


@pytest.mark.parametrize("override,key,fragment", [
    ("model.path=/no/such/model/dir", "model.path", "is neither an existing directory nor a hub id"),
    ("model.ref_path=tiny://nope", "model.ref_path", "'tiny://nope' is not a tiny model"),
    ("checkpoint.path=/no/such/ckpt", "checkpoint.path", "is neither an existing directory nor a hub id"),
    ("data.train_path='builtin://toy,builtin://nope'", "data.train_path", "'builtin://nope' is not a builtin task"),
    ("data.train_path=/no/such/file.jsonl", "data.train_path", "is neither an existing file or directory"),
    ("eval.data_path=builtin://nope", "eval.data_path", "'builtin://nope' is not a builtin task"),
], ids=lambda v: v if isinstance(v, str) and "=" in v else "")
def test_locations_that_cannot_exist_are_refused(override, key, fragment):
    assert_fires([override], key, fragment)


def test_existing_local_paths_and_hub_ids_pass(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n' * 8)  # rollout.batch_size=8 prompts a step
    assert config_errors([f"data.train_path={data}", f"model.tokenizer_path={tmp_path}",
                          "model.critic_path=Qwen/Qwen3-4B", "algorithm=ppo_gae",  # a critic reads it
                          "parallelism.colocate_models=true"]) == []


@pytest.mark.parametrize("override", ["~agent.runner._target_", "agent.runner._target_=null"])
def test_agent_without_target_is_refused(override):
    assert_fires([override], "agent.runner._target_", "the agent has no _target_")


def test_agent_target_must_be_an_agent_class():
    assert_fires(["agent.runner._target_=os.path"], "agent.runner._target_",
                 "'os.path' is <module 'posixpath'")


@pytest.mark.parametrize("job", ["sft", "eval"])
def test_a_resumable_checkpoint_as_checkpoint_path_is_refused_naming_the_exports(tmp_path, job):
    """checkpoint.path ("a checkpoint or HF directory to load instead of model.path") given a run's step_N: before,
    job=sft failed once its rank started, on the tokenizer ('You need to have sentencepiece or tiktoken installed
    ...'), job=eval when its engine started; neither said the directory is a DCP checkpoint, nor what to give."""
    import torch

    from molt_hydra.config.schema import WEIGHTS_ALONE
    from molt_hydra.parallel.checkpoint import save_checkpoint

    step = save_checkpoint(tmp_path / "ckpt", 4, torch.nn.Linear(2, 2))
    lines = config_errors([f"job={job}", f"checkpoint.path={step}", "eval.data_path=builtin://toy_eval"])
    (line,) = [line for line in lines if line.startswith("checkpoint.path: ")]
    assert line == (f"checkpoint.path: {str(step)!r} is a resumable checkpoint (DCP shards), not an HF model "
                    "directory (the trainer and vLLM load the model from one). Fix: set it to an HF export (an RL "
                    "run's <output_dir>/hf_final, <checkpoint.dir>/best or <checkpoint.dir>/hf/step_N; an SFT run's "
                    "<output_dir>/hf); for job=sft to start from this checkpoint's weights, unset it, "
                    f"{WEIGHTS_ALONE} and checkpoint.resume=must")


@pytest.mark.parametrize("resume", ["auto", "must", "never"])
def test_a_step_directory_as_checkpoint_dir_is_refused_naming_its_parent(tmp_path, resume):
    """checkpoint.dir ("root of resumable checkpoints") given one saved step: before, accepted; a resume found no
    checkpoint in it (auto started from step 0, must failed at start-up) and the run saved its own steps inside that
    earlier run's step (step_4/step_1, ...)."""
    import torch

    from molt_hydra.config.schema import WEIGHTS_ALONE
    from molt_hydra.parallel.checkpoint import resolve_checkpoint, save_checkpoint

    step = save_checkpoint(tmp_path / "ckpt", 4, torch.nn.Linear(2, 2))
    assert resolve_checkpoint(step) is None and resolve_checkpoint(tmp_path / "ckpt") == step
    lines = config_errors([f"checkpoint.dir={step}", f"checkpoint.resume={resume}"])
    assert [line for line in lines if line.startswith("checkpoint.dir: ")] == [
        f"checkpoint.dir: {str(step)!r} is one saved checkpoint (a step's DCP shards), not the directory of a run's "
        "checkpoints: the run would find no checkpoint in it to resume, and save its own inside it (step_4/step_1, "
        f"...). Fix: set checkpoint.dir to {str(tmp_path / 'ckpt')!r} (checkpoint.resume=auto goes on from its newest "
        f"step); for this step's weights alone, {WEIGHTS_ALONE}"]
    assert config_errors([f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.resume={resume}"]) == []


def test_an_over_long_checkpoint_dir_under_resume_must_is_told_not_a_traceback():
    """Before: `checkpoint.resume=must` checked that checkpoint.dir exists with an OSError traceback (File name too
    long) instead of the name's own rule."""
    assert config_errors([f"checkpoint.dir=/tmp/{'a' * 300}", "checkpoint.resume=must"]) == [
        f"checkpoint.dir: has a name of 300 bytes ('{'a' * 40}'...), and a file system takes at most 255 bytes per "
        "name. Fix: shorten checkpoint.dir"]


@pytest.mark.parametrize("override,key", [("model.path=''", "model.path"), ("checkpoint.path=''", "checkpoint.path"),
                                          ("data.train_path=','", "data.train_path")])
def test_empty_locations_are_refused(override, key):
    assert_fires([override], key, "")


def test_agent_target_that_cannot_be_imported_is_refused():
    assert_fires(["agent.runner._target_=no_such_pkg_for_molt.Agent"], "agent.runner._target_",
                 "cannot import 'no_such_pkg_for_molt.Agent' (ModuleNotFoundError")
    assert_fires(["agent.runner._target_=/no/such/agent.py:Env"], "agent.runner._target_", "FileNotFoundError")


def test_an_agent_file_whose_import_fails_runs_once_in_validation(tmp_path):
    """Validation resolves agent.runner._target_ once. Before: twice (the prompt rows' rule asked whether it is a chat
    agent, then the agent's rule), and a file whose import fails is not kept by Python: its top-level code (prints, a
    slow import, a server it starts) ran twice."""
    runs = tmp_path / "runs.txt"
    agent = tmp_path / "agent.py"
    agent.write_text(f"open({str(runs)!r}, 'a').write('ran\\n')\nimport no_such_module_for_molt\n")
    lines = [line for line in config_errors([f"agent.runner._target_={agent}:MyEnv"]) if "agent.runner" in line]
    assert lines == [f"agent.runner._target_: cannot import '{agent}:MyEnv' (ModuleNotFoundError: No module named "
                     "'no_such_module_for_molt'). Fix: set agent.runner._target_ to pkg.module.Name or "
                     "path/to/file.py:Name (an Env, ChatAgent or Runner)"]
    assert runs.read_text() == "ran\n"


# ---------------------------------------------------------------------------------------- refused knobs
@pytest.mark.parametrize("override,key", [
    ("parallelism.pp=2", "parallelism.pp"),
])
def test_knob_without_a_mechanism_is_refused_when_set(override, key):
    assert_fires([override], key, "not available: ")


@pytest.mark.parametrize("override,key", [
    ("data.split=test", "data.split"), ("data.train_probs=[1.0]", "data.train_probs"),
    ("data.blank_images=true", "data.blank_images"), ("eval.split=test", "eval.split"),
    ("logger.tensorboard=true", "logger.tensorboard"), ("logger.wandb.project=p", "logger.wandb.project"),
])
def test_sft_refuses_what_it_ignores(override, key):
    assert_fires(["+recipe=qwen3_4b_sft", "cluster=local_gpus", override], key, f"so it changes nothing. Fix: unset "
                 f"{key} for job=sft")


def test_sft_takes_an_image_column():
    # job=sft trains on image rows (runtime/sft_job.py passes data.image_key on): not refused as ignored
    lines = config_errors(["+recipe=tiny_vlm_colors_warm"])
    assert lines == [], lines


def test_sft_recipe_itself_is_valid():
    assert config_errors(["+recipe=qwen3_4b_sft", "cluster=local_gpus"]) == []


def test_replay_dir_must_exist():
    assert_fires(["train.rollout_replay_dir=/no/such/dump"], "train.rollout_replay_dir", "is not a directory")


def test_gpu_transport_refused_on_cpu():
    assert_fires(["rollout.weight_sync.transport=nccl"], "rollout.weight_sync.transport", "this run is on CPU")


def test_a_value_clip_of_zero_is_refused_and_null_turns_clipping_off():
    """max((V - R)^2, (V_old + clip(V - V_old, 0) - R)^2) never falls below the old value's loss, so with a clip of 0
    the critic can only learn to be worse (was: accepted). null is how clipping is turned off."""
    import torch

    from molt_hydra.algorithm.value_loss import value_loss

    old, ret = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    better = torch.tensor([[0.5]], requires_grad=True)  # halfway to the return: a lower unclipped loss
    loss, _ = value_loss(better, old, ret, torch.ones(1, 1), value_clip=0.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 1.0 ** 2) and better.grad.item() == 0.0  # the old value's loss, no grad
    assert_fires(["algorithm=ppo_gae", "parallelism.colocate_models=true", "algorithm.value_clip=0"],
                 "algorithm.value_clip", "must be > 0")
    assert config_errors(["algorithm=ppo_gae", "parallelism.colocate_models=true", "algorithm.value_clip=null"]) == []
