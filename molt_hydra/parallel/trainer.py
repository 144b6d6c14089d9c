"""One FSDP2 trainer rank (actor, reference or critic): forward passes, the training step, weights, checkpoints.

Built from one `TrainerSpec` (parallel/trainer_spec.py). Usable as a Ray actor per rank (parallel/group.py) or
directly in a torchrun / multiprocessing process (tests, bench, SFT). No Ray, vLLM or Hydra import on this path.

Samples are dicts of 1-D token-aligned tensors (see models/logprobs.py): `input_ids` plus whatever the objective
needs (`action_mask`, `advantages`, `old_logprobs`, `ref_logprobs`, `rollout_logprobs`, `returns`, `values`, or
`loss_mask` for SFT; `routed_experts` [T, moe layers, topk] for R3 on AutoModel). Micro-batches are right-padded
[S, L] rows, or packed [1, T] streams with `packing` (parallel/batching.py); the objective (parallel/objectives.py)
receives [S, L] rows together with the window denominators of Molt's global token mean (inventory
§2.7): N = mask tokens of the optimizer-step window summed over micro-batches and DP ranks, G = its sequences, and
dp_size to cancel FSDP2's gradient mean over DP. Metrics are token-weighted over the window and the DP ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from molt_hydra.algorithm.experience import NumpyPickled
from molt_hydra.compat.torch import compiled_graphs
from molt_hydra.compat.transformers import expert_widths, install_experts
from molt_hydra.models import lora, moe_experts, moe_routing, vlm
from molt_hydra.models.automodel import build_automodel, clip_grad_norm, hf_name_mapper, replay_routed_experts
from molt_hydra.models.build import DTYPES, build_model, decoder_layers, resolve_backend, resolve_path
from molt_hydra.models.logprobs import (LOGPROB_CHUNK_TOKENS, entropy_from_logits, linear_logprobs_entropy,
                                       logprobs_from_logits)
from molt_hydra.parallel import checkpoint as ckpt
from molt_hydra.parallel.batching import (count_micro_batches, pack, pad_rows, partition_balanced, partition_padded,
                                          prompt_groups, shared_prompt_rows, shared_prompt_tokens, unpack)
from molt_hydra.parallel.objectives import SFTObjective
from molt_hydra.parallel.distributed import build_device_mesh, init_distributed
from molt_hydra.parallel.fsdp import compile_block, shard_model, to_compute_dtype
from molt_hydra.parallel.grad_debug import grad_norm_metrics
from molt_hydra.parallel.launch import store_port
from molt_hydra.parallel.optim import MasterWeightAdamW, build_optimizer, build_scheduler, fused_add_graphs
from molt_hydra.parallel.perf import flops_per_token, mfu
from molt_hydra.parallel.trainer_spec import TrainerSpec
from molt_hydra.weight_sync.buckets import iter_weight_buckets, local_full_weights

log = logging.getLogger(__name__)


class FusedLogprobHead:
    """Replaces the lm_head's forward: from the final hidden states straight to the log-probs (and entropy) of the
    targets set before the model call, chunk by chunk (models/logprobs.py), so [tokens x vocab] logits never exist.
    Runs inside the model's forward, where FSDP has the head's weight gathered (and the backward reaches it)."""

    def __init__(self, head: torch.nn.Linear):
        self.weight_of = lambda: head.weight  # the gathered (unsharded) weight while the root unit is forward
        # the next model call's (targets, temperature, chunk, with entropy, needed tokens, sources), in the order
        # linear_logprobs_entropy takes them
        self.call = None
        head.forward = self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        lp, ent = linear_logprobs_entropy(hidden, self.weight_of(), *self.call)
        return torch.stack([lp, ent], -1) if self.call[3] else lp[..., None]  # [3]: with entropy


def _nonfinite(debug: dict) -> str:
    """The parameters logger.debug_grad_norms found non-finite before clipping, for the failure's message (the step's
    metrics, where they would go, are never logged)."""
    names = [k.split("/", 1)[1] for k, v in debug.items() if "_grad_norm/" in k and not math.isfinite(v)]
    count = next(int(v) for k, v in debug.items() if k.endswith("_grad_nonfinite_params"))
    return f" ({count} parameter(s) with non-finite gradients before clipping, e.g. {names})"


class TrainerWorker:
    def __init__(self, spec: TrainerSpec):
        self.spec, self.rank, self.world_size, self.role = spec, spec.rank, spec.world_size, spec.role
        if spec.full_determinism:  # train.full_determinism, as Molt: transformers' seeds + deterministic kernels
            from transformers import enable_full_determinism
            enable_full_determinism(spec.seed)
        port = spec.master_port if spec.shared_port is None else store_port(spec.rank, spec.shared_port)
        self.device = init_distributed(spec.rank, spec.world_size, spec.master_addr, port, timeout_s=spec.timeout_s)
        self._init_cpu_threads(spec)
        # None: bf16 on a GPU, fp32 on CPU (bf16 matmuls are slow there); an explicit dtype is honoured on both
        self.param_dtype = spec.param_dtype or ("bf16" if self.device.type == "cuda" else "fp32")
        self.master_weights = spec.master_weights == "optimizer"  # params and grads in param_dtype, fp32 masters
        self.dp_size = spec.dp_size or spec.world_size
        # the critic (value head on a backbone) is always built with HF transformers
        self.backend = resolve_backend(spec.backend) if spec.role != "critic" else "hf"
        torch.manual_seed(spec.seed)  # same init (e.g. value head) on every rank
        self.model_path = resolve_path(spec.model_path)
        # model.lora (models/lora.py): the actor trains a PEFT adapter on its frozen base; the reference is the base
        self.lora = spec.lora if spec.role == "actor" else None
        (self._build_automodel if self.backend == "automodel" else self._build_hf)(spec)
        if self.idle_cpu_threads != self.cpu_threads:
            self._follow_hints_per_block()
        self.head = self._fused_head(spec)
        # a prompt group's prompt computed once per micro-batch row (parallel/batching.py `shared_prompt_rows`); the
        # critic's values are read on every token, so it keeps plain rows
        self.share_prompts = spec.share_prompts and spec.role != "critic"
        if self.share_prompts and (self.head is None or self.spec.packing or self.moe
                                   or self.model.config._attn_implementation != "sdpa"):
            raise ValueError("parallelism.share_prompts needs the fused log-prob head (HF text model), sdpa attention, "
                             "no packing and a dense model; set parallelism.share_prompts=false")
        self._routing_stats = None
        self.temperature, self.chunk = spec.temperature, spec.logprob_chunk_size or LOGPROB_CHUNK_TOKENS
        self._build_optimizer(spec)
        self.global_step = 0
        self.told_no_graphs = False  # compiled blocks that built no graph: said once
        # every FSDP2 unit, whoever wrapped the model (HF path or AutoModel); none on one unsharded rank
        self.fsdp_units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        # parallelism.defer_grad_sync (several ranks, validated): reduce-scatter on a window's last micro-batch only
        self.defer_grad_sync = self.fsdp_units if spec.defer_grad_sync else []

    def _init_cpu_threads(self, spec: TrainerSpec) -> None:
        """CPU threads: `cpu_threads` (the CPUs Ray reserved for this rank; a Ray worker started before it was placed
        need not carry Ray's OMP_NUM_THREADS for them) while the rollout engines generate beside it; with
        `node_ranks` (trainer ranks on this node), this node's cores split among them while the engines are idle
        (told through `engines_busy`; until then they count as busy). Set before every forward, in the calling
        thread: OpenMP's thread count is per thread, and a Ray actor with a control thread runs calls elsewhere."""
        self.cpu_threads = spec.cpu_threads if self.device.type == "cpu" else None
        self.idle_cpu_threads = max(self.cpu_threads, len(os.sched_getaffinity(0)) // spec.node_ranks) \
            if self.cpu_threads and spec.node_ranks else self.cpu_threads
        self._engines_busy = (0, True)  # (hint number, busy): the latest hint wins, whatever order they arrive in
        self._threads_used: list[int] = []  # at each point the threads were set during the current call
        self._use_cpu_threads()

    def _build_automodel(self, spec: TrainerSpec) -> None:
        self.compile_blocks = bool(spec.compile_blocks)  # auto: eager (compiled AutoModel not yet run in the loop)
        self.model = build_automodel(
            self.model_path, role=spec.role, dp_size=self.dp_size, tp_size=spec.tp_size, ep_size=spec.ep_size,
            cp_size=spec.cp_size, param_dtype=self.param_dtype, gradient_checkpointing=spec.gradient_checkpointing,
            random_init=spec.random_init, config_overrides=spec.config_overrides,
            attn_implementation=spec.attn_implementation, compile_blocks=self.compile_blocks,
            gate_precision=spec.gate_precision, master_weights=spec.master_weights,
            freeze_moe_router=spec.freeze_moe_router, freeze_visual_encoder=spec.freeze_visual_encoder,
            **(spec.automodel_options or {}))
        # AutoModel's gates replay and freeze (its RouterReplay: `_replay`); its experts are model.experts_backend's
        self.moe, self.frozen_names, self.moe_experts_impl = moe_routing.is_moe_config(self.model.config), set(), None
        self.hf_balancing = False  # its load-balancing loss is refused (config/validate.py)

    def _build_hf(self, spec: TrainerSpec) -> None:
        mesh = build_device_mesh(self.dp_size)
        model = build_model(self.model_path, role=spec.role, attn_implementation=spec.attn_implementation,
                            gradient_checkpointing=spec.gradient_checkpointing == "full", random_init=spec.random_init,
                            config_overrides=spec.config_overrides,
                            init_device=self.device if spec.random_init else "cpu")
        # None (auto): compiled where it measured faster and ran stable in the loop (bench/RESULTS.md): the HF dense
        # text trainer on a GPU, with or without activation checkpointing; MoE (its routing statistics and replay not
        # yet run compiled in the GPU loop), LoRA and VLMs stay eager unless asked
        self.compile_blocks = spec.compile_blocks if spec.compile_blocks is not None else (
            self.device.type == "cuda" and not self.lora and not vlm.is_vlm(model.config)
            and not moe_routing.is_moe_config(model.config))
        if spec.compile_blocks is None and self.compile_blocks:
            log.info("model.compile_blocks unset: %s's decoder blocks compile on the GPU (false: eager)",
                     type(model).__name__)
        if self.lora:  # before sharding: FSDP2 shards base and adapter alike, the optimizer takes the adapter
            # target_modules None: the family's default; the config refuses a family without one when it can read
            # the model's config.json, a hub id it cannot read is refused here
            if (targets := lora.resolve_targets(model.config.model_type, self.lora["target_modules"])) is None:
                raise ValueError(f"model.lora.target_modules: model family {model.config.model_type!r} has no "
                                 "default targets; set them (e.g. [q_proj,v_proj])")
            self.lora = {**self.lora, "target_modules": targets}
            model = lora.add_adapter(model, self.lora)
        self._install_moe(model, spec)
        if spec.freeze_visual_encoder:
            vlm.freeze_visual_encoder(model)  # before the optimizer, which takes only requires_grad params
        stored_as_computed = self.master_weights or all(p.dtype == DTYPES.get(self.param_dtype)
                                                        for p in model.parameters())
        if stored_as_computed and spec.world_size == 1 and not spec.offload and not vlm.is_vlm(model.config):
            # one rank, params already in the compute dtype: FSDP2 would only copy them into a second buffer (its
            # one-rank all-gather) and the grads through a reduce buffer, every micro-batch (a SmolLM2 step on CPU:
            # ~0.3 s each); VLMs keep its input cast
            for layer in decoder_layers(model) if self.compile_blocks else ():
                compile_block(layer)
            self.model = model.to(self.device)
        else:  # one rank: nothing to save by freeing gathered params after forward, and backward skips a re-gather
            self.model = shard_model(model, mesh, param_dtype=self.param_dtype, offload=spec.offload,
                                     reshard_after_forward=spec.world_size > 1, compile_blocks=self.compile_blocks)
        if vlm.is_vlm(model.config) and spec.role != "ref" and not spec.freeze_visual_encoder:
            vlm.keep_visual_encoder_in_every_backward(self.model)  # text-only micro-batches on some DP ranks

    def _install_moe(self, model, spec: TrainerSpec) -> None:
        """MoE (models/moe_routing.py): gate precision, R3 replay, routing statistics, frozen routers, and the
        load-balancing loss counted on the experts used; HF's own (router logits' top-k) for other MoE models."""
        routers = moe_routing.install(model, spec.gate_precision, replay=spec.routing_replay)
        # other HF MoE models: transformers' own loss, which skips padding only given the attention mask (_forward)
        self.hf_balancing = spec.aux_loss_coef > 0 and not routers
        if self.hf_balancing:
            model.config.output_router_logits = True
        if (spec.routing_replay or spec.freeze_moe_router) and not routers:
            raise NotImplementedError(f"rollout.routing_replay / model.freeze_moe_router: {type(model).__name__} "
                                      "has no MoE router this trainer supports (HF path: Qwen3-MoE); turn them off")
        self.moe, self.moe_experts_impl = bool(routers), None  # HF MoE models: "grouped" | "loop" (moe_experts.py)
        if routers:
            self.moe_experts_impl = moe_experts.choose(spec.moe_experts_impl, self.device, DTYPES[self.param_dtype],
                                                       expert_widths(model), self.compile_blocks)
            install_experts(model, self.moe_experts_impl, moe_experts.grouped_experts_forward)
        self.frozen_names = set(moe_routing.freeze(model)) if spec.freeze_moe_router else set()

    def _fused_head(self, spec: TrainerSpec) -> FusedLogprobHead | None:
        """The causal LM hands out its final hidden states and the log-probs are taken through the lm_head chunk by
        chunk, never materialising [tokens x vocab] logits (HF text models; models/logprobs.py)."""
        if not spec.fused_head or spec.role == "critic":  # the critic's value head has no vocabulary
            return None
        if self.backend != "hf" or vlm.is_vlm(self.model.config):  # off by design: AutoModel, VLMs
            return None
        head = self.model.get_output_embeddings()
        if isinstance(head, torch.nn.Linear) and head.bias is None:
            return FusedLogprobHead(head)
        log.warning("fused log-prob head off (the lm_head is a %s.%s or has a bias, not a bias-free torch.nn.Linear "
                    "(a LoRA-adapted lm_head, say)): log-probs go through the full [tokens x vocab] logits",
                    type(head).__module__, type(head).__name__)
        return None

    def _build_optimizer(self, spec: TrainerSpec) -> None:
        self.optimizer = self.scheduler = None
        masters = None
        if self.master_weights:  # before the first forward, where FSDP2 reads the params' dtypes
            value_head = getattr(self.model, "value_head", None)  # a Linear, kept fp32
            masters = to_compute_dtype(self.model, DTYPES[self.param_dtype], keep=[value_head] if value_head else [])
        if spec.role == "ref":
            return
        if spec.optimizer_offload and masters is None:  # params stay as they are; fp32 masters go to the host
            masters = {p: p.detach() for p in self.model.parameters()}
        self.optimizer = build_optimizer(self.model, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                         weight_decay=spec.weight_decay, masters=masters, muon=spec.muon,
                                         on_host=spec.optimizer_offload)
        self.scheduler = build_scheduler(self.optimizer, name=spec.lr_scheduler, total_steps=spec.total_steps,
                                         warmup_ratio=spec.lr_warmup_ratio, min_lr_ratio=spec.min_lr_ratio)

    # ---------------------------------------------------------------- CPU threads
    def engines_busy(self, busy: bool, hint: int) -> None:
        """Whether the rollout engines are generating (hint number `hint`, increasing): a CPU rank then keeps to
        its reserved threads, otherwise it takes its share of the node's cores from the next decoder block on. Called on
        the actor's control thread (parallel/group.py), so it is answered while a training step runs."""
        if hint > self._engines_busy[0]:
            self._engines_busy = (hint, busy)

    def _use_cpu_threads(self) -> None:
        """Sets this thread's torch threads from the latest engines hint."""
        if not self.cpu_threads:
            return
        want = self.cpu_threads if self._engines_busy[1] else self.idle_cpu_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        self._threads_used.append(want)

    def _follow_hints_per_block(self):
        """A hint takes effect at the next decoder block, forward or backward, not only at the next micro-batch
        (one can be half of a step's work): a pre-hook sets the threads before each block's forward, and a hook on
        the block's output before its backward (which runs on this thread: CPU autograd)."""
        def use_threads(*hook_args):  # a forward pre-hook (module, args) or a grad hook (grad)
            self._use_cpu_threads()

        def after_forward(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(out) and out.requires_grad:
                out.register_hook(use_threads)

        for layer in decoder_layers(self.model):
            layer.register_forward_pre_hook(use_threads)
            layer.register_forward_hook(after_forward)

    # ---------------------------------------------------------------- forward
    def _forward(self, mb: dict, need_entropy: bool, needed: torch.Tensor | None = None):
        """Token-aligned log-probs (critic: values), entropy or None, MoE aux loss or None. `needed` (a mask): the
        fused head computes only those tokens and gives 0 elsewhere; the logits path computes every token."""
        ids, pos = mb["input_ids"], mb["position_ids"]
        first = pos == 0  # token 0 of every packed sample has no prediction (and never a mask)
        shared = mb.get("shared")  # the model's rows when prompts are shared; ids / pos stay the samples' own
        if self.role == "critic":
            v = self.model(input_ids=ids, position_ids=pos)
            out = torch.nn.functional.pad(v[:, :-1].float(), (1, 0))  # V(state before token t), token-aligned
            return out.masked_fill(first, 0.0), None, None
        mm = {k: mb[k] for k in vlm.MULTIMODAL_KEYS if k in mb}
        # VLM: the model derives its M-RoPE positions from ids + image grid (one sample per micro-batch)
        if self.head is not None:  # the lm_head returns [B, T, 1 or 2]: log p (and entropy)
            self.head.call = (ids, self.temperature, self.chunk, need_entropy,
                              None if needed is None else needed.bool(), None if shared is None else shared["sources"])
        balancing = self.moe and self.spec.aux_loss_coef > 0
        with moe_routing.load_balancing(self.model) if balancing else contextlib.nullcontext() as balance:
            inputs = dict(input_ids=ids, position_ids=None if mm else pos) if shared is None else {
                k: shared[k] for k in ("input_ids", "position_ids", "attention_mask")}
            if self.hf_balancing and "real_tokens" in mb:  # right-padded rows (packed ones have no padding)
                inputs["attention_mask"] = mb["real_tokens"].long()
            res = self.model(**inputs, **mm)
        aux = balance.value() if balancing else getattr(res, "aux_loss", None)
        if self.head is not None:
            out = res.logits.masked_fill(first[..., None], 0.0)
            return out[..., 0], (out[..., 1] if need_entropy else None), aux
        # tensor parallel: vocab-sharded DTensor logits
        logits = res.logits.full_tensor() if hasattr(res.logits, "full_tensor") else res.logits
        lp = logprobs_from_logits(logits, ids, self.temperature, self.chunk).masked_fill(first, 0.0)
        ent = (entropy_from_logits(logits, ids, self.temperature, self.chunk).masked_fill(first, 0.0) if need_entropy
               else None)
        return lp, ent, aux

    def _replay(self, mb: dict, routing_stats=None):
        """R3: the micro-batch's `routed_experts` ([B, L, moe layers, topk], recorded by the rollout engine) replace
        the gates' own top-k for the forward and the backward (checkpoint recompute) inside; on the HF path the
        routers also count trainer-vs-engine agreement into `routing_stats` (models/moe_routing.py)."""
        if self.backend == "automodel":  # its gates compare with (R3: use) the engine's experts; nothing else
            return contextlib.nullcontext() if "routed_experts" not in mb else replay_routed_experts(
                mb["routed_experts"], replay=self.spec.routing_replay, stats=routing_stats,
                real_tokens=mb.get("real_tokens"))
        if self.moe:
            return moe_routing.engine_routing(self.model, mb.get("routed_experts"), routing_stats,
                                              mb.get("mm_token_type_ids"), mb.get("real_tokens"))
        return contextlib.nullcontext()

    def _micro_batches(self, samples: list[dict], mask_key: str | None = None) -> list[list[int]]:
        lengths, budget = [len(s["input_ids"]) for s in samples], self.spec.max_tokens_per_micro_batch
        if any(s.get("pixel_values") is not None for s in samples):  # VLM: one sample per micro-batch (vlm.py)
            bins = [[i] for i in range(len(samples))]
        elif self.share_prompts and mask_key:  # a prompt group stays in one micro-batch, as one row
            groups = prompt_groups(samples, mask_key)
            bins = [sorted(i for g in b for i in groups[g])
                    for b in partition_padded(shared_prompt_tokens(samples, mask_key), budget)]
        else:
            bins = None if self.spec.packing else partition_padded(lengths, budget)
        k = torch.tensor(count_micro_batches(lengths, budget) if bins is None else len(bins))
        dist.all_reduce(k, op=dist.ReduceOp.MAX)  # every rank runs the same number of FSDP forwards
        # packed: balanced over k bins; rows: empty bins added, which run a dummy forward
        return partition_balanced(lengths, int(k)) if bins is None else bins + [[] for _ in range(int(k) - len(bins))]

    def _batch(self, rows: list[dict], mask_key: str | None = None) -> dict:
        """One micro-batch on the device: a packed [1, T] stream or right-padded [B, L] rows (see batching.py), plus
        a VLM sample's image inputs, which are per sample and never packed; with shared prompts (and the mask that
        tells prompts from responses), the model's rows under "shared", the samples' own rows as they are."""
        mm = vlm.multimodal_kwargs(rows)
        rows = [{k: v for k, v in r.items() if k not in vlm.MULTIMODAL_KEYS} for r in rows]
        if self.spec.packing:  # needs a varlen attention kernel (validated); rows need no mask (causal attention)
            return self._to_device(pack(rows) | mm)
        mb = pad_rows(rows)
        if self.share_prompts and mask_key:
            mb["shared"] = shared_prompt_rows(rows, mask_key)
        return self._to_device(mb | mm)

    def _to_device(self, mb: dict) -> dict:
        return {k: self._to_device(v) if isinstance(v, dict) else v.to(self.device, non_blocking=True)
                for k, v in mb.items()}

    @torch.no_grad()
    def compute_logprobs(self, samples: list[dict], with_entropy: bool = False, mask_key: str | None = None) -> list:
        """Per-sample token-aligned log-probs at the temperature (critic: values), fp32 on CPU; collective over DP.
        `mask_key`: only the tokens where the samples' mask of that name is set are needed (0 elsewhere). Dropout
        (LoRA's, and the checkpoint's own, e.g. a config.json attention_dropout) is off here: these are the policy's
        log-probs (critic: its values), which the engine samples from without dropout; the model's mode is restored."""
        training = self.model.training
        self.model.eval()
        try:
            return self._compute_logprobs(samples, with_entropy, mask_key)
        finally:
            self.model.train(training)

    def _compute_logprobs(self, samples: list[dict], with_entropy: bool, mask_key: str | None) -> list:
        if not samples:
            raise ValueError("compute_logprobs got no samples on this rank")
        out: list = [None] * len(samples)
        self._threads_used = []
        if self.moe and self.role == "actor":  # trainer-vs-engine routing of this recompute, reported by train_step
            self._routing_stats = moe_routing.routing_stats(self.model.config)
        for part in self._micro_batches(samples, mask_key):
            self._use_cpu_threads()
            idx = part or [0]  # an empty bin still runs a forward so the FSDP collectives line up
            keys = ("input_ids", "routed_experts", *vlm.MULTIMODAL_KEYS, *((mask_key,) if mask_key else ()))
            mb = self._batch([{k: samples[i][k] for k in keys if k in samples[i]} for i in idx], mask_key)
            with self._replay(mb, self._routing_stats if part else None):
                val, ent, _ = self._forward(mb, with_entropy, mb[mask_key] if mask_key else None)
            if not part:
                continue
            lens = [len(samples[i]["input_ids"]) for i in part]
            # values (and entropy) as right-padded rows, one per sample (a packed row is split)
            rows = [(unpack(x, lens) if self.spec.packing else x).float().cpu() for x in (val, ent) if x is not None]
            for j, (i, n) in enumerate(zip(part, lens)):
                out[i] = tuple(r[j, :n] for r in rows) if with_entropy else rows[0][j, :n]
        # One rank keeps its gathered (compute-dtype) params after forward, for the backward; a forward-only pass has
        # no backward to free them, so they would stay allocated: colocated, 6.8 GiB of a 4B model under the engine's
        # KV cache (an OOM on the H200).
        for module in self.fsdp_units if self.world_size == 1 else ():
            module.reshard()
        return NumpyPickled(out)

    # ---------------------------------------------------------------- training
    def train_step(self, samples: list[dict], loss_fn=None, num_optimizer_steps: int = 1,
                   return_logprobs: bool = False, epochs: int = 1) -> dict:
        """Forward/backward over this rank's samples in `num_optimizer_steps` windows, `epochs` times over (PPO
        epochs); one optimizer step per window. Collective: every DP rank calls it with its own shard. Returns
        DP-reduced metrics (same on every rank) over every epoch's windows (was: the controller called once per epoch
        and logged the last epoch's). `return_logprobs` (one window, one epoch only): this rank's per-sample
        log-probs from the training forward, i.e. at the parameters before the step, under "logprobs" (what
        compute_logprobs with the loss's mask_key would give, 0 off the mask; MoE routing statistics are counted in
        this forward), so one forward serves as the old-logprob pass and the loss's."""
        loss_fn = loss_fn or SFTObjective()
        if len(samples) < num_optimizer_steps:
            raise ValueError(f"{len(samples)} samples on rank {self.rank} < num_optimizer_steps={num_optimizer_steps}")
        if return_logprobs and num_optimizer_steps * epochs != 1:
            raise ValueError(f"return_logprobs needs one optimizer step (got {num_optimizer_steps} x {epochs} "
                             "epochs): later windows' forwards run after the first step changed the parameters")
        logprobs = [None] * len(samples) if return_logprobs else None
        if return_logprobs and self.moe and self.role == "actor":
            self._routing_stats = moe_routing.routing_stats(self.model.config)
        t0 = time.perf_counter()
        sums: dict[str, torch.Tensor] = {}
        grad_norms, self._threads_used = [], []
        for window in np.array_split(np.arange(len(samples)), num_optimizer_steps) * epochs:
            n_tok = self._backward_window([samples[i] for i in window], window, loss_fn, sums, logprobs)
            sums["_tokens"] = sums.get("_tokens", 0.0) + n_tok / self.world_size
            if self.spec.debug_grad_norms:  # before clipping; the last window's are reported
                grads = ((n, self.optimizer.grad(p) if self.master_weights else p.grad)
                         for n, p in self.model.named_parameters())
                debug = grad_norm_metrics(grads, *self.spec.debug_grad_norms,
                                          "critic" if self.role == "critic" else "actor")
            grad_norms.append(gn := self._clip_grads())
            if not torch.isfinite(gn):  # (every rank: the norm is reduced) was: the update wrote NaN into every weight
                raise FloatingPointError(
                    f"the gradient norm is {float(gn)} at optimizer step {self.global_step + 1}: a NaN or inf in the "
                    f"loss or its gradients{_nonfinite(debug) if self.spec.debug_grad_norms else ''}; this step was "
                    "not applied (the last checkpoint is kept). Fix: lower train.optimizer.lr, or look for an inf in "
                    "the rewards or a custom loss; logger.debug_grad_norms=true names the parameters in this message")
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        # every epoch's pass over the samples counts in the throughput (tokens / s, MFU)
        metrics = self._step_metrics(samples * epochs, sums, grad_norms, time.perf_counter() - t0, self._threads_used)
        metrics.update(debug if self.spec.debug_grad_norms else {})
        return metrics if logprobs is None else {**metrics, "logprobs": NumpyPickled(logprobs)}

    def _backward_window(self, win: list[dict], window, loss_fn, sums: dict, logprobs: list | None) -> torch.Tensor:
        """Forward and backward over the micro-batches of one optimizer step's samples `win` (indices `window` of the
        step's): token-weighted metric sums add into `sums`, and the training forward's log-probs land in
        `logprobs` (when given). Returns the window's action tokens N over all DP ranks."""
        mask_key = loss_fn.mask_key
        replicas = self.world_size // self.dp_size  # tp / cp ranks of one DP group hold the same samples
        counts = torch.tensor([float(sum(s[mask_key].sum().item() for s in win)),
                               float(sum(bool(s[mask_key].any()) for s in win))])
        dist.all_reduce(counts)  # the window's action tokens N and sequences G over all DP ranks
        n_tok, n_seq = (counts / replicas).to(self.device)
        parts = self._micro_batches(win, mask_key)
        if self.master_weights:  # several micro-batches: their grads sum in fp32 (parallel/optim.py)
            self.optimizer.accumulate_fp32 = len(parts) > 1
        for j, part in enumerate(parts):
            self._use_cpu_threads()
            for unit in self.defer_grad_sync:  # reduce-scatter on the window's last micro-batch only
                unit.set_requires_gradient_sync(j == len(parts) - 1, recurse=False)
            rows = [win[i] for i in part] or [  # dummy: 2 tokens, nothing masked, keeps collectives aligned
                {k: (v[:2].clone() if k != mask_key else torch.zeros_like(v[:2])) for k, v in win[0].items()
                 if torch.is_tensor(v) and v.dim() >= 1 and k not in vlm.MULTIMODAL_KEYS}]
            mb = self._batch(rows, mask_key)
            # backward inside: checkpoint recompute replays the same experts (and counts them again, which leaves
            # the routing ratios as they are)
            with self._replay(mb, self._routing_stats if logprobs is not None and part else None):
                # every objective reads log-probs and entropy on its mask only (parallel/objectives.py)
                out, ent, aux = self._forward(mb, bool(loss_fn.entropy_coef), mb[mask_key])
                if self.spec.packing:  # losses see one right-padded row per sample (exact per-sequence aggregation)
                    lengths = [len(r["input_ids"]) for r in rows]
                    mb = {k: unpack(v, lengths) for k, v in mb.items() if v.dim() == 2}
                    out, ent = unpack(out, lengths), None if ent is None else unpack(ent, lengths)
                loss, mets = loss_fn(out, mb, ent, num_tokens=n_tok, global_batch_size=n_seq, dp_size=self.dp_size)
                if aux is not None and self.spec.aux_loss_coef > 0 and part:  # (a dummy's 2 tokens route nothing
                    # trained: was a router gradient of its own, and a share of the mean)
                    loss = loss + self.spec.aux_loss_coef * aux / sum(map(bool, parts))
                loss.backward()
            if logprobs is not None and part:  # one device->host copy per micro-batch
                lp = out.detach().float().cpu()
                for r, i in enumerate(part):
                    logprobs[window[i]] = lp[r, :len(win[i]["input_ids"])]
            # scalar metrics are micro-batch means: weight by tokens; kept on device (no sync per micro-batch); the
            # replicas of one DP group each count 1 / replicas of them
            w = mb[mask_key].sum().float() / replicas
            for k, v in mets.items():
                sums[k] = sums.get(k, 0.0) + v.detach().float() * w
        return n_tok

    def _clip_grads(self) -> torch.Tensor:
        """Clips the window's gradients to max_norm (none at 0); returns their norm before clipping."""
        if self.backend == "automodel" and self.world_size > 1:
            if self.master_weights:  # AutoModel's EP-aware clip scales param grads in place: the fp32 sums
                self.optimizer.round_into_grads()  # are rounded to bf16 once, after accumulating
            gn = torch.as_tensor(clip_grad_norm(self.model, self.spec.max_norm, self.dp_size), device=self.device)
        elif self.master_weights:  # measured here, applied inside the fused update (parallel/optim.py)
            gn = self.optimizer.clip_grad_norm_(self.spec.max_norm)
        else:
            params = [p for p in self.model.parameters() if p.grad is not None]
            gn = torch.nn.utils.clip_grad_norm_(params, self.spec.max_norm if self.spec.max_norm > 0 else math.inf)
        return gn.full_tensor() if hasattr(gn, "full_tensor") else gn

    def _step_metrics(self, samples, sums, grad_norms, seconds, threads) -> dict:
        dt = torch.tensor(seconds)
        keys = sorted(k for k in sums if k != "_tokens")
        sums["_all"] = float(sum(len(s["input_ids"]) for s in samples)) / (self.world_size // self.dp_size)
        red = torch.stack([torch.as_tensor(sums[k], device=self.device) for k in [*keys, "_tokens", "_all"]]).cpu()
        dist.all_reduce(red)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time, as Molt reports
        n_mask, tokens = float(red[-2]), float(red[-1])
        prefix, perf = ("critic", "perf/critic_") if self.role == "critic" else ("actor", "perf/")
        metrics = {k: float(red[i]) / max(n_mask, 1.0) for i, k in enumerate(keys)}
        if self.moe and self.role == "actor":  # every rank: the reduction is a collective
            stats = self._routing_stats or moe_routing.routing_stats(self.model.config)
            summed = stats.as_tensor()
            dist.all_reduce(summed)
            metrics.update(stats.metrics(summed))
            self._routing_stats = None
        metrics.update({f"{prefix}_lr": self.scheduler.get_last_lr()[0],
                        f"{prefix}_grad_norm": float(torch.stack(grad_norms).float().mean()),
                        f"{perf}train_tokens_per_sec": tokens / float(dt),
                        f"{perf}step_time_s": float(dt),
                        f"{perf}torch_threads": float(np.mean(threads) if threads else torch.get_num_threads())})
        if self.spec.peak_tflops:
            seq = tokens / (len(samples) * self.dp_size)  # the batch's mean length (tp / cp ranks share samples)
            metrics[f"{perf}mfu"] = mfu(int(tokens), float(dt), flops_per_token(self.model.config, int(seq)),
                                        self.spec.peak_tflops * 1e12, self.world_size)
        if self.compile_blocks:  # rising after the first steps: torch.compile recompiles (shapes, guards)
            metrics[f"{perf}compiled_graphs"] = graphs = float(compiled_graphs())
            # the blocks' own: the fp32 grad sums' fused add (one graph, on a GPU) says nothing of theirs
            if not graphs - fused_add_graphs() and not self.told_no_graphs:  # e.g. a data-dependent op inside AC
                self.told_no_graphs = True
                log.warning("model.compile_blocks: torch.compile built no graph in the first step; the blocks run "
                            "eager (TORCH_LOGS=graph_breaks says why)")
        if self.device.type == "cuda":
            metrics[f"{perf}gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            metrics[f"{perf}gpu_mem_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        return metrics

    # ---------------------------------------------------------------- weights & checkpoints
    def weight_buckets(self, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None, device="cpu"):
        """Generator: every rank iterates, rank 0 receives lists of (hf_name, full tensor)."""
        if self.lora:  # the adapter alone, under PEFT's names (what vLLM's LoRA loader reads)
            return iter_weight_buckets(self.model, bucket_bytes, dtype, device,
                                       to_hf=lambda n, t: [(lora.peft_name(n), t)], keep=lora.is_adapter_param)
        # frozen routers never change: they stay out of the sync (the engine keeps the checkpoint's)
        return iter_weight_buckets(self.model, bucket_bytes, dtype, device, to_hf=self._to_hf(views=True),
                                   keep=lambda name: name not in self.frozen_names)

    def local_weights(self):
        """The single-pass GPU weight sync's tensors: views of this rank's own full parameters on its GPU, or None."""
        weights = None if self.lora else local_full_weights(self.model, to_hf=self._to_hf(views=True))
        if weights is None or not all(t.is_cuda for _, t in weights):
            return None  # a gather or a copy is needed, or the parameters are offloaded: the bucketed path
        return [(n, t) for n, t in weights if n not in self.frozen_names]  # frozen routers stay out (weight_buckets)

    def _to_hf(self, views: bool = False):
        """AutoModel keeps its own names and grouped experts: its state-dict adapter maps them back to the
        checkpoint's HF names with one tensor per expert, which is what vLLM and transformers load (`views`: views of
        the grouped tensors, for the weight sync); transformers-5 MoE models fuse their experts, given back per expert
        too (`moe_routing.checkpoint_expert_tensors`)."""
        if self.backend != "automodel":
            return moe_routing.checkpoint_expert_tensors if self.moe else None
        return hf_name_mapper(self.model, views=views)

    def save_checkpoint(self, root: str, client_state: dict | None = None, keep: int = 3,
                        max_disk_gb: float | None = None, tag: int | None = None, hold: int | None = None) -> str:
        """Saved as step_<tag> (the RL loop's step: every role of a run saves that step under one name), else
        step_<optimizer steps>. `hold`: a step retention keeps besides (parallel/retention.py)."""
        cs = {"global_step": self.global_step, "master_weights": self.spec.master_weights, **(client_state or {})}
        step = self.global_step if tag is None else tag
        return str(ckpt.save_checkpoint(root, step, self.model, self.optimizer, self.scheduler, cs, keep, max_disk_gb,
                                        hold))

    def load_checkpoint(self, root: str, model_only: bool = False, step: str | None = None) -> dict | None:
        """`model_only` (checkpoint.load_model_only): the weights alone; optimizer, scheduler and step stay fresh.
        `step`: that step_<N> under `root` (every role of a run resumes the same one), else the newest loadable."""
        # a warm start under optimizer masters loads into the masters (else its first step would go on from the
        # model as built, and an fp32 checkpoint would reach them rounded to the params' bf16)
        masters = model_only and isinstance(self.optimizer, MasterWeightAdamW)
        cs = ckpt.load_checkpoint(root, self.model, self.optimizer, self.scheduler, model_only=model_only,
                                  master_weights=self.spec.master_weights, step=step, seed=self.spec.seed,
                                  into=self.optimizer.masters_by_name(self.model) if masters else None)
        if cs is not None and masters:
            self.optimizer.params_from_masters()
        if cs is not None and not model_only:
            self.global_step = int(cs.get("global_step", 0))
        return cs

    def adapter_config(self) -> dict:
        """adapter_config.json of this actor's adapter (PEFT's format; what the engines' LoRA loader validates)."""
        return lora.adapter_config(self.lora, self.model_path)

    def export_hf(self, out_dir: str, dtype: str = "bf16", merged: bool = False) -> str | None:
        """The final / best / per-checkpoint HF export. LoRA: the adapter in PEFT's format in `out_dir`, and with
        `merged` (checkpoint.export_merged) the base with the adapter merged in, a full HF model in out_dir/merged."""
        if self.role == "critic":
            raise ValueError("export_hf exports causal LMs; the critic has no lm_head")
        # the tokenizer the run's token ids are of (model.tokenizer_path): was model.path's, another vocabulary's
        tokenizer = (resolve_path(self.spec.tokenizer_path, weights=False) if self.spec.tokenizer_path
                     else self.model_path)
        out = ckpt.export_hf(out_dir, self.model, tokenizer_path=tokenizer, base_path=self.model_path,
                             dtype=DTYPES[dtype], to_hf=self._to_hf(), adapter=self.lora, merged=merged)
        return str(out) if out else None

    def shutdown(self):
        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while a peer is still talking to it
            dist.destroy_process_group()
