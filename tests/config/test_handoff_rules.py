"""Values that used to pass `dry_run=true` and then fail at run time (or do nothing) are refused at validation
(config/handoff_rules.py): one table row per class and knob, each asserting the full key and the reason; one CLI
call with one bad value of every class asserts exit 2, every key, and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from _config_helpers import PLAN_HEADER, compose_config, run_cli
from molt_hydra.cli import EXIT_CONFIG_ERROR, to_run_config
from molt_hydra.config.schema import ConfigError
from test_validation import assert_fires, config_errors

FAULTS = Path(__file__).resolve().parents[1] / "integration" / "fault_agents.py"
MOE = "model.path=tiny://qwen3_moe_tiny"
AUTOMODEL = ["cluster=local_gpus", "model.backend=automodel"]
BAD = [
    # lengths that cannot work together (conf default data.max_len=256)
    ("engine_shorter_than_context", ["rollout.max_model_len=4"], "rollout.max_model_len",
     "4 is below data.max_len=256"),
    ("engine_below_prompt_plus_turn", ["rollout.max_model_len=200", "rollout.max_new_tokens=128"],
     "rollout.max_model_len", "200 is below data.max_len=256"),
    ("eval_turn_cap", ["eval.max_new_tokens=256"], "eval.max_new_tokens",
     "256 leaves no room for the prompt within data.max_len=256"),
    ("gpu_step_budget_no_chunking", ["cluster=local_gpus", "rollout.enable_chunked_prefill=false",
                                     "rollout.max_num_batched_tokens=64"], "rollout.max_num_batched_tokens",
     "64 is below rollout.max_model_len 256 with chunked prefill off"),
    ("dynamic_batch_budget", ["train.dynamic_batch=true", "train.max_tokens_per_micro_batch=100"],
     "train.max_tokens_per_micro_batch", "100 is below data.max_len=256"),
    # names vLLM looks up when an engine or a chat runner starts
    ("attention_backend", ["rollout.attention_backend=FLASH_ATN"], "rollout.attention_backend",
     "'FLASH_ATN' is not a vLLM attention backend (did you mean 'FLASH_ATTN'?)"),
    ("mm_encoder_attn_backend", ["rollout.mm_encoder_attn_backend=SDPA"], "rollout.mm_encoder_attn_backend",
     "'SDPA' is not a vLLM attention backend"),
    ("mamba_dtype", ["rollout.mamba_ssm_cache_dtype=fp7"], "rollout.mamba_ssm_cache_dtype",
     "'fp7' is not a value vLLM's EngineArgs.mamba_ssm_cache_dtype takes"),
    ("gdn_backend", ["rollout.gdn_prefill_backend=tritonn"], "rollout.gdn_prefill_backend",
     "'tritonn' is not a value vLLM's EngineArgs.gdn_prefill_backend takes (did you mean 'triton'?)"),
    ("tool_parser", ["agent.tool_parser=hermez"], "agent.tool_parser", "'hermez' is not a vLLM tool parser"),
    ("reasoning_parser", ["agent.reasoning_parser=qwen4"], "agent.reasoning_parser",
     "'qwen4' is not a vLLM reasoning parser"),
    # agent kwargs bound to the constructors they reach
    ("env_kwarg_unknown", ["+agent.runner.bogus_kwarg=1"], "agent.runner.bogus_kwarg",
     "ToyEnv() takes no argument 'bogus_kwarg'"),
    ("env_kwarg_misspelled", ["agent=math", "+agent.runner.require_boxd=false"], "agent.runner.require_boxd",
     "MathEnv(require_boxed) takes no argument 'require_boxd' (did you mean 'require_boxed'?)"),
    ("runner_wrapped_env_kwarg", ["agent.runner._target_=${molt:recipes}/agents/toy.py",
                                  "+agent.runner.bogus_kwarg=1"], "agent.runner.bogus_kwarg",
     "ToyEnv() takes no argument 'bogus_kwarg'"),
    ("env_constructor_refuses", ["agent.runner._target_=${molt:recipes}/agents/python_tool_env.py:PythonToolEnv",
                                 "+agent.runner.exec_timout_s=5"], "agent.runner.exec_timout_s",
     "PythonToolEnv(**agent.runner kwargs) raised ValueError: not a python-tool kwarg"),
    ("chat_agent_kwarg", ["agent=geo3k_python", "model.path=tiny://idefics3_tiny", "+agent.runner.bogus=1"],
     "agent.runner.bogus", "Geo3kPythonAgent(**agent.runner kwargs) raised ValueError: not a python-tool kwarg"),
    # empty names and unparsable addresses
    *[(f"empty_{key}", [f"{key}="], key, "is '', which names nothing")
      for key in ("data.input_key", "data.label_key", "data.split", "eval.split", "name", "logger.wandb.project",
                  "checkpoint.dir", "data.tools_key", "logger.wandb.entity")],
    # a plain `def` where the runner awaits (before: every rollout failed "object Result can't be used in 'await'")
    *[(f"sync_{name}", [f"agent.runner._target_={FAULTS}:{cls}"], "agent.runner._target_",
       f"{cls}.{name} is a plain function, but the runner awaits it")
      for cls, name in (("SyncStepEnv", "step"), ("SyncRunAgent", "run"), ("SyncExecuteRunner", "execute"))],
    # one that yields its Result (before: "is a plain function ... declare it `async def`", which it was)
    *[(f"yields_{name}", [f"agent.runner._target_={FAULTS}:{cls}"], "agent.runner._target_",
       f"{cls}.{name} yields (a generator), but the runner awaits one Result from it. Fix: `return` it from `async def "
       f"{name}(...)` instead of yielding")
      for cls, name in (("YieldingStepEnv", "step"), ("YieldingRunAgent", "run"))],
    # before: "takes no argument 'target'. Fix: remove +agent.runner.target", never naming _target_
    ("runner_target_misspelled", ["+agent.runner.target=${molt:recipes}/agents/math.py:MathEnv"],
     "agent.runner.target", "ToyEnv() takes no argument 'target' (did you mean '_target_'?)"),
    # an agent method that cannot take the runner's arguments (before: every rollout failed "takes 1 positional
    # argument but 2 were given")
    *[(f"arity_{name}", [f"agent.runner._target_={FAULTS}:{cls}"], "agent.runner._target_",
       f"{cls}.{name}(self) cannot take the runner's call {name}({arg}): too many positional arguments")
      for cls, name, arg in (("NoStateStepEnv", "step", "state"), ("NoCtxRunAgent", "run", "ctx"))],
    # (before: a TypeError traceback out of validation)
    ("property_step", [f"agent.runner._target_={FAULTS}:PropertyStepEnv"], "agent.runner._target_",
     "PropertyStepEnv.step is a property, not a method, but the runner calls it (the Env contract)."),
    # a class that does not define the method its runner calls
    *[(f"undefined_{name}", [f"agent.runner._target_={FAULTS}:{cls}"], "agent.runner._target_",
       f"{cls} does not define {name}, which the runner calls (the {base} contract). Fix: define `async def "
       f"{name}(self, {args})` in {cls}")
      for cls, name, base, args in (("NoStepEnv", "step", "Env", "state"), ("NoRunAgent", "run", "ChatAgent", "ctx"),
                                    ("NoExecuteRunner", "execute", "Runner", "episode, generator, tokenizer"))],
    ("none_step", [f"agent.runner._target_={FAULTS}:NoneStepEnv"], "agent.runner._target_",
     "NoneStepEnv.step is a NoneType, not a method, but the runner calls it (the Env contract)."),
    # a StepEnvRunner / ChatAgentRunner (subclass) that refuses its arguments (before: a traceback out of validation)
    ("runner_constructor_refuses", [f"agent.runner._target_={FAULTS}:RefusingRunner"], "agent.runner",
     "RefusingRunner(**agent.runner kwargs) raised ValueError: the grader is unreachable."),
    ("runner_env_file_missing", ["agent.runner._target_=molt_hydra.agents.step_runner.StepEnvRunner",
                                 "+agent.runner.env=no/such/agent.py:MyEnv"], "agent.runner",
     "StepEnvRunner(**agent.runner kwargs) raised FileNotFoundError: agent file "),
    # a name longer than a file name may be (255 bytes: 128 two-byte letters are 256): before, Hydra failed to make
    # outputs/<name>/<time> with an OSError traceback, after every check had passed
    ("name_too_long", ["name='" + "é" * 128 + "'"], "name", "is 256 bytes long, but it names the run's directory"),
    # ... and one directory: before, name=.. wrote the run to outputs/../<time>, outside outputs/
    *[(f"name_{label}", [f"name={value}"], "name", "which a / or a name of . or .. would move elsewhere")
      for label, value in (("slash", "a/b"), ("dotdot", ".."), ("climbs", "a/../../b"))],
    # an empty entry of a list of names: before, accepted; an empty fnmatch pattern matches no parameter name, so the
    # grad-norm debug logged no norm at all
    ("blank_grad_norm_filter", ["logger.debug_grad_norms=true", "logger.debug_grad_norms_filter=['*q_proj*',' ']"],
     "logger.debug_grad_norms_filter", "['*q_proj*', ' '] holds an empty entry, which names nothing."),
    ("blank_setup_line", ["cluster.setup=['']"], "cluster.setup", "[''] holds an empty entry"),
    # W&B's own project-name check (wandb.init's, once every role had started): before, accepted
    ("wandb_project_with_entity", ["logger.wandb.project='team/proj'"], "logger.wandb.project",
     "W&B refuses it: Invalid project name 'team/proj'"),
    ("wandb_project_too_long", ["logger.wandb.project=" + "p" * 129], "logger.wandb.project",
     "exceeded 128 characters"),
    ("ray_address_garbage", ["cluster.ray_address=not-an-address"], "cluster.ray_address",
     "'not-an-address' is not an address Ray can join"),
    ("ray_address_bad_port", ["cluster.ray_address=10.0.0.1:99999"], "cluster.ray_address",
     "'10.0.0.1:99999' is not an address Ray can join"),
    # MoE-only knobs on a dense model
    *[(f"dense_{key}", [*extra, f"{key}={value}"], key, "acts on MoE routers or experts, but "
       "model.path=tiny://qwen3_tiny is a dense") for extra, key, value in (
        ([], "model.freeze_moe_router", "true"), ([], "rollout.routing_replay", "true"),
        ([], "model.gate_precision", "bfloat16"), ([], "model.aux_loss_coef", "0.01"),
        ([], "rollout.enable_expert_parallel", "true"), ([], "parallelism.moe_reshard_after_forward", "true"),
        ([], "model.moe_experts_impl", "loop"),
        # before, accepted: a dense model has no grouped expert weight for it to move off Muon
        (["train.optimizer.name=muon"], "train.optimizer.muon_experts_adamw", "true"),
        (["algorithm=ppo_gae", "train.critic.optimizer.name=muon"], "train.critic.optimizer.muon_experts_adamw",
         "true"),
        # before, accepted for AutoModel (the HF path refuses them as AutoModel-only): no experts to dispatch to
        *((AUTOMODEL, key, value) for key, value in (("model.moe_dispatcher", "deepep"),
                                                     ("model.experts_backend", "te"), ("parallelism.ep", "2"))))],
    # engine knobs of a layer kind on a model without it: before, accepted, then ignored by vLLM (MTP: no engine)
    *[(f"no_layers_{key}", [f"rollout.{key}={value}"], f"rollout.{key}",
       f"acts on {what}, but model.path=tiny://qwen3_tiny (qwen3) has none")
      for key, value, what in (("mm_encoder_attn_backend", "TORCH_SDPA", "a multimodal (vision / audio) encoder"),
                               ("gdn_prefill_backend", "triton", "Gated-DeltaNet layers"),
                               ("mamba_ssm_cache_dtype", "float32", "state-space (Mamba / linear-attention) layers"),
                               ("mtp_num_speculative_tokens", "1", "multi-token-prediction (MTP) layers"))],
]


@pytest.mark.parametrize("overrides,key,fragment", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_handoff_rule_fires(overrides, key, fragment):
    assert_fires(overrides, key, fragment)


GOOD = [
    ["rollout.max_model_len=512"],
    # without eval data (or an evaluation scheduled) it changes nothing (refused)
    ["eval.max_new_tokens=64", "eval.data_path=builtin://toy", "eval.every_steps=10"],
    ["rollout.attention_backend=CPU_ATTN"],
    ["model.path=tiny://idefics3_tiny", "rollout.mm_encoder_attn_backend=TORCH_SDPA"],
    ["agent=geo3k_python", "model.path=tiny://idefics3_tiny", "agent.tool_parser=qwen3_coder",
     "agent.reasoning_parser=qwen3"],  # a chat agent (an Env reads no parser)
    ["agent=math", "+agent.runner.require_boxed=false"],
    ["agent.runner._target_=${molt:recipes}/agents/python_tool_env.py:PythonToolEnv", "+agent.runner.exec_timeout_s=5"],
    # an `async def step` under a plain (functools.wraps) decorator: before, refused as "a plain function"
    [f"agent.runner._target_={FAULTS}:DecoratedStepEnv"],
    [f"agent.runner._target_={FAULTS}:ThreadedStepEnv"],
    ["checkpoint.best_metric_key="],  # '' is its documented default ("first key ending in _pass1")
    ["logger.debug_grad_norms=true", "logger.debug_grad_norms_filter=['*q_proj*']"],
    ["logger.wandb.project=my-project_2", "logger.wandb.entity=team"],
    ["cluster.ray_address=10.0.0.1:6379"], ["cluster.ray_address=ray://head:10001"], ["cluster.ray_address=auto"],
    [MOE, "model.freeze_moe_router=true", "rollout.routing_replay=true", "model.gate_precision=bfloat16"],
    [MOE, "train.optimizer.name=muon", "train.optimizer.muon_experts_adamw=true"],
]


@pytest.mark.parametrize("overrides", GOOD, ids=[" ".join(g) for g in GOOD])
def test_working_values_still_pass(overrides):
    assert config_errors(overrides) == []


def test_cli_refuses_one_of_each_class_with_exit_2(tmp_path):
    rows = [BAD[0], BAD[5], BAD[11], BAD[16], BAD[-6]]
    overrides = [o for row in rows for o in row[1]] + ["cluster.ray_address=not-an-address"]
    res = run_cli([*overrides, "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"])
    assert res.returncode == EXIT_CONFIG_ERROR, res.describe()
    assert "Traceback" not in res.output and PLAN_HEADER not in res.stdout, res.describe()
    keys = {l[2:].split(":", 1)[0] for l in res.stderr.splitlines() if l.startswith("- ")}
    assert keys >= {row[2] for row in rows} | {"cluster.ray_address"}, res.describe()


# config.json keys that carry each layer kind, as the HF configs of models vLLM serves with them name them
LAYER_CONFIGS = {
    "gdn_prefill_backend=triton": {"model_type": "qwen3_next", "linear_num_value_heads": 32},  # Qwen3-Next
    "mamba_ssm_cache_dtype=float32": {"model_type": "nemotron_h", "ssm_state_size": 128},  # Nemotron-H
    "mtp_num_speculative_tokens=1": {"model_type": "deepseek_v3", "num_nextn_predict_layers": 1},  # DeepSeek-V3
}


@pytest.mark.parametrize("knob", LAYER_CONFIGS)
def test_a_layer_kinds_engine_knob_is_taken_for_a_model_with_those_layers(knob, tmp_path):
    """The layer-kind rule reads the model's config.json: a model with the layers passes, its dense twin (the same
    config without the key) is refused."""
    import json

    from molt_hydra.models.tiny import tiny_config_dict

    key, twin = knob.split("=")[0], dict(LAYER_CONFIGS[knob])
    twin.pop(next(k for k in twin if k != "model_type"))
    for name, extra in (("with", LAYER_CONFIGS[knob]), ("without", twin)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**tiny_config_dict("qwen3_tiny"), **extra}))
    on = [f"model.path={tmp_path / 'with'}", "model.tokenizer_path=tiny://qwen3_tiny", f"rollout.{knob}"]
    assert [line for line in config_errors(on) if line.startswith(f"rollout.{key}")] == []
    assert_fires([f"model.path={tmp_path / 'without'}", *on[1:]], f"rollout.{key}", "has none (its config.json)")


def test_a_file_where_a_directory_goes_or_an_empty_file_is_refused(tmp_path):
    """Before: model.path naming a regular file or a directory without config.json, and data.train_path an empty
    file or directory, passed a dry run (each exists) and failed only when the run loaded them."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "weights.bin").write_text("x")
    assert_fires([f"data.train_path={tmp_path / 'empty.jsonl'}"], "data.train_path", "is an empty file")
    assert_fires([f"model.path={tmp_path / 'weights.bin'}", "model.tokenizer_path=tiny://qwen3_tiny"], "model.path",
                 "is a file, not a directory")
    (tmp_path / "empty").mkdir()
    assert_fires([f"data.train_path={tmp_path / 'empty'}"], "data.train_path", "is an empty directory")
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_config" / "model.safetensors").write_text("x")
    assert_fires([f"model.path={tmp_path / 'no_config'}", "model.tokenizer_path=tiny://qwen3_tiny"], "model.path",
                 "holds no config.json, so it is no HF model directory")


def test_the_engine_gets_the_agents_reasoning_parser():
    """vLLM's structured outputs honour the reasoning end only when the engine knows the parser."""
    from molt_hydra.runtime.roles import extra_engine_args

    assert "reasoning_parser" not in extra_engine_args(to_run_config(compose_config([])))
    cfg = to_run_config(compose_config(["agent.reasoning_parser=deepseek_r1"]))
    assert extra_engine_args(cfg)["reasoning_parser"] == "deepseek_r1"


def test_an_empty_key_without_a_default_is_not_told_to_fall_back_to_one():
    """output_dir (MISSING: Hydra sets it) set to '': before, the fix said "or leave it out (default '???')"."""
    from molt_hydra.runtime.validate import validate

    with pytest.raises(ConfigError) as info:
        validate(to_run_config(compose_config([], output_dir="")))
    assert "- output_dir: is '', which names nothing. Fix: set output_dir to a name" in str(info.value).splitlines()


@pytest.mark.parametrize("key", ["output_dir", "checkpoint.dir", "checkpoint.export_dir", "train.rollout_dump_dir"])
def test_a_run_directory_the_file_system_cannot_name_is_refused(key):
    """Before: a directory of the run with a name past 255 bytes (or a path past 4096) passed validation, then the
    plan's checkpoint disk check (a dry run's too) or the first write ended in `OSError: File name too long`."""
    from molt_hydra.runtime.validate import validate

    NAME_MAX, PATH_MAX = 255, 4096  # Linux's: bytes per name, and per path with its NUL

    long, deep = "x" * (NAME_MAX + 1), "/tmp/" + "/".join(["y" * 200] * (PATH_MAX // 200 + 1))
    for path, reason in ((f"/tmp/{long}/a", f"has a name of {NAME_MAX + 1} bytes ('{'x' * 40}'...), and a file "
                          f"system takes at most {NAME_MAX} bytes per name."),
                         (deep, f"is {len(deep)} bytes long as an absolute path, and Linux takes paths below "
                          f"{PATH_MAX} bytes.")):
        cfg = compose_config([] if key == "output_dir" else [f"{key}={path}"],
                             **({"output_dir": path} if key == "output_dir" else {}))
        with pytest.raises(ConfigError) as info:
            validate(to_run_config(cfg))
        # (output_dir's: one line, not one more for each directory under it)
        assert str(info.value).splitlines() == [f"- {key}: {reason} Fix: shorten {key}" + (
            " (hydra.run.dir sets it where the command line does not)" if key == "output_dir" else "")]


def test_an_overlong_replay_directory_is_not_a_directory():
    """Before: `Path.is_dir` raised `OSError: File name too long` from config/validate.py's train rule."""
    assert_fires([f"train.rollout_replay_dir=/tmp/{'x' * 300}"], "train.rollout_replay_dir",
                 "is not a directory of rollout_step{N}.pt files")
