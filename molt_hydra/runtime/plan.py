"""The plan of a run, computed from the validated config alone (no Ray, no torch, no model download):
which roles exist and where they go, the batch arithmetic of one step, and a per-device memory estimate.

`dry_run=true` prints it and stops; a real run prints it first and places roles by it.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from molt_hydra.algorithm.advantage import ADVANTAGE_ESTIMATORS
from molt_hydra.config.schema import ConfigError, RunConfig
from molt_hydra.config.validate import rollout_devices, trainer_backend, trainer_roles
from molt_hydra.models.logprobs import LOGPROB_CHUNK_TOKENS
from molt_hydra.models.rules import model_fields

GIB = 1024**3
# Colocated on one GPU (parallelism.colocate): each process's CUDA context, what a sleeping vLLM engine keeps (its
# context, CUDA graphs and allocations outside its sleep pool), and a margin for the allocators' fragmentation.
CUDA_CONTEXT_GIB = 0.75
ENGINE_ASLEEP_GIB = 2.0
FRAGMENTATION = 0.05
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Shapes of the models the shipped recipes name, from their published config.json, so a dry run on a machine that
# never downloaded them still estimates memory. A local directory's own config.json always wins.
KNOWN_SHAPES = {
    "Qwen/Qwen3-4B": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        tie_word_embeddings=False, vision_params=0.6e9),
    "smollm2://SmolLM2-135M-Instruct": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                            head_dim=64, tie_word_embeddings=True),
}


@dataclass
class ModelShape:
    params: float  # total parameters
    active_params: float  # parameters touched per token (MoE: routed experts only)
    layers: int
    hidden: int
    vocab: int
    kv_bytes_per_token_per_byte: int  # 2 (K and V) x layers x kv_heads x head_dim: multiply by dtype bytes
    vision: bool = False  # a vision-language model (its trainer takes log-probs from full logits)
    # (in, out) of each decoder block's linear modules a LoRA may adapt (models/lora.py), and of the lm_head
    linears: dict = field(default_factory=dict)

    def trained_params(self, lora) -> float:
        """Parameters the optimizer steps (grads and AdamW moments): every one, or under LoRA the adapter's: rank x
        (in + out) per adapted module on `model.lora.target_modules` (None: the family's default, here every listed
        linear but the lm_head)."""
        targets = lora.target_modules
        per_layer = sum(i + o for name, (i, o) in self.linears.items()
                        if name != "lm_head" and (targets is None or name in targets))
        head = sum(self.linears.get("lm_head", (0, 0))) if targets and "lm_head" in targets else 0
        return lora.rank * (self.layers * per_layer + head) if lora.rank else self.params

    @classmethod
    def from_hf_config(cls, c: dict) -> "ModelShape":
        vlm = "vision_config" in c or c.get("vision_params", 0) > 0
        outer, c = c, c.get("text_config", c) | {k: v for k, v in c.items() if k == "vision_params"}
        h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        hd = c.get("head_dim") or h // heads
        attn = h * hd * (heads + 2 * kv) + heads * hd * h
        experts = c.get("num_experts") or c.get("num_local_experts") or 0  # transformers >= 5.18 saves the latter
        if experts:
            expert = 3 * h * c["moe_intermediate_size"]
            mlp_total, mlp_active = experts * expert + h * experts, c["num_experts_per_tok"] * expert + h * experts
        else:
            mlp_total = mlp_active = 3 * h * c["intermediate_size"]
        embed = V * h * (1 if c.get("tie_word_embeddings", False) else 2)
        vision = c.get("vision_params") or _vision_params(outer.get("vision_config"))
        ffn = c.get("intermediate_size", 0)
        linears = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd),
                   "o_proj": (heads * hd, h), "lm_head": (h, V),
                   **({} if experts else {"gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)})}
        return cls(params=L * (attn + mlp_total) + embed + vision,
                   active_params=L * (attn + mlp_active) + embed + vision, layers=L, hidden=h, vocab=V,
                   kv_bytes_per_token_per_byte=2 * L * kv * hd, vision=vlm, linears=linears)


def _vision_params(vision: dict | None) -> float:
    """A vision tower's rough size from its config (12 x depth x width^2, as tiny_vlm.py's estimate): a real VLM's
    config.json (a local directory, a cached hub snapshot) has no `vision_params` (was: its tower counted as 0)."""
    if not isinstance(vision, dict):
        return 0
    depth = vision.get("depth") or vision.get("num_hidden_layers") or 0
    return 12 * depth * (vision.get("hidden_size") or vision.get("embed_dim") or 0) ** 2


def model_shape(path: str) -> ModelShape | None:
    """From model.path's config.json where it can be read here, else the shapes known above by name; a known VLM's
    tower size (`vision_params`) beside a read config, which has none."""
    known, config = KNOWN_SHAPES.get(path, {}), model_fields(path)
    if config is not None and "vision_params" in known:
        config = {**config, "vision_params": known["vision_params"]}
    config = config or known
    return ModelShape.from_hf_config(config) if config else None


@dataclass
class Role:
    name: str
    count: int
    devices_each: float
    cpus_each: float
    note: str = ""


@dataclass
class Plan:
    roles: list[Role]
    batch: dict[str, int | str]
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # colocated: one GPU's memory per phase
    assumptions: list[str] = field(default_factory=list)
    device: str = "cpu"
    batch_title: str = "Batch arithmetic (one RL step):"

    def render(self) -> str:
        unit = "GPU" if self.device == "cuda" else "CPU slot"
        lines = ["== Plan ==", "Roles:"]
        for r in self.roles:
            lines.append(f"  {r.name:<16} x{r.count:<3} {r.devices_each:g} {unit} + {r.cpus_each:g} CPU each"
                         + (f"   ({r.note})" if r.note else ""))
        lines += [self.batch_title] + [f"  {k:<32} {v}" for k, v in self.batch.items()]
        for title, table in (("Memory estimate per device (GiB):", self.memory),
                             ("Memory by phase, one colocated GPU (GiB):", self.phases)):
            lines += [title] if table else []
            for name, parts in table.items():
                detail = ", ".join(f"{k} {v:.3g}" for k, v in parts.items())
                lines.append(f"  {name:<16} {sum(parts.values()):8.3g}   = {detail}")
        lines += ["Assumptions:"] + [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)


def fsdp_roles(cfg: RunConfig) -> tuple[str, ...]:
    """The trainer roles (FSDP groups) this run builds: the actor, and the reference / critic its estimator needs."""
    return trainer_roles(cfg, frozenset(ADVANTAGE_ESTIMATORS[cfg.algorithm.estimator].needs))


def make_plan(cfg: RunConfig) -> Plan:
    r, p = cfg.rollout, cfg.parallelism
    fsdp, dp = fsdp_roles(cfg), max(p.trainer_devices // (p.tp * p.cp), 1)
    trainer_share = round(1.0 / len(fsdp), 2) if p.colocate_models and len(fsdp) > 1 else 1.0
    roles: list[Role] = []
    if cfg.job.value in ("rl", "eval"):
        engine_devices = r.tensor_parallel_size * r.data_parallel_size * r.pipeline_parallel_size
        roles.append(Role("rollout engine", r.num_engines, engine_devices, 0,
                          f"vLLM TP={r.tensor_parallel_size} DP={r.data_parallel_size}"
                          + (", sleeps while the trainer steps" if p.colocate and cfg.job.value == "rl" else "")))
        roles.append(Role("agent runner", r.num_runners, 0, 1, "agents + reward, loopback chat server"))
    if cfg.job.value in ("rl", "sft"):
        roles.append(Role("actor", p.trainer_devices, trainer_share, 1, f"FSDP2 dp={dp} tp={p.tp} cp={p.cp} ep={p.ep}"))
        roles += [Role(name, p.trainer_devices, trainer_share, 1, note) for name, note in (
            ("reference", "frozen, logprobs only"), ("critic", "value head, own optimizer"))
            if name in fsdp and cfg.job.value == "rl"]

    title, batch = _batch(cfg, dp)
    plan = Plan(roles=roles, batch=batch, device=cfg.cluster.device.value, batch_title=title)
    engines = 0 if cfg.job.value == "sft" else rollout_devices(cfg)
    trainers = 0 if cfg.job.value == "eval" else p.trainer_devices
    plan.assumptions.append(
        f"{engines} rollout + {trainers} trainer device(s) of "
        f"{cfg.cluster.nodes} x {cfg.cluster.devices_per_node} ({cfg.cluster.device.value})"
        + (", colocated" if p.colocate and cfg.job.value == "rl" else ""))

    shape = model_shape(cfg.model.path)
    if shape is None:
        plan.assumptions.append(f"no memory estimate: {cfg.model.path} has no local config.json and no known shape")
        return plan
    _estimate_memory(cfg, plan, shape, dp)
    _checkpoint_disk(cfg, plan, shape)
    return plan


def _batch(cfg: RunConfig, dp: int) -> tuple[str, dict[str, int | str]]:
    """The batch arithmetic of the job's step: an RL step (a rollout batch, the optimizer steps over it), an SFT
    optimizer step (no rollout), or an eval job's one pass (no trainer)."""
    r, t, e, job = cfg.rollout, cfg.train, cfg.eval, cfg.job.value
    if job == "eval":
        return "Evaluation (one pass over eval.data_path):", {
            "samples per prompt": e.n_samples_per_prompt, "prompt groups in flight": e.batch_size}
    samples = t.batch_size if job == "sft" else r.batch_size * r.n_samples_per_prompt
    per_rank = samples // dp
    micro = (f"token budget {t.max_tokens_per_micro_batch}" if t.dynamic_batch
             else f"{math.ceil(per_rank / t.micro_batch_size)} of {t.micro_batch_size}")
    if job == "sft":
        return "Batch arithmetic (one SFT optimizer step):", {
            "samples per optimizer step": samples, "data-parallel ranks": dp, "samples per rank": per_rank,
            "micro-batches per rank": micro, "epochs over the data": t.epochs}
    steps = 1 if t.force_on_policy else samples // t.batch_size
    return "Batch arithmetic (one RL step):", {
        "prompt groups x samples": f"{r.batch_size} x {r.n_samples_per_prompt} = {samples}",
        "data-parallel ranks": dp,
        "samples per rank": per_rank,
        "micro-batches per rank": micro,
        "optimizer steps per rollout batch": f"{steps} x {t.epochs} epoch(s) = {steps * t.epochs}",
        "accumulation per optimizer step": ("dynamic" if t.dynamic_batch
                                            else t.batch_size // (t.micro_batch_size * dp)),
        "mode": f"{t.mode.value}, queue_depth={t.queue_depth}, max_staleness={t.max_staleness}"
                + (", partial rollout" if t.partial_rollout else ""),
    }


def _checkpoint_disk(cfg: RunConfig, plan: Plan, shape: ModelShape) -> None:
    """A resumable checkpoint holds the trainer's fp32 weights and AdamW's two fp32 moments (masters too under
    model.master_weights=optimizer): ~12-14 bytes a parameter, tens of GB for a few billion. A disk that cannot take
    one fails the run at its first save, after the GPU time is spent; so the plan checks it before anything starts."""
    c = cfg.checkpoint
    if cfg.job.value == "eval" or c.save_steps == 0:
        return
    weights = DTYPE_BYTES[cfg.model.param_dtype.value] + 4 if cfg.model.master_weights.value == "optimizer" else 4
    critic = cfg.job.value == "rl" and "critic" in fsdp_roles(cfg)
    one = (weights * shape.params + 8 * shape.trained_params(cfg.model.lora)) * (1 + critic) / 1e9
    at = Path(c.dir).absolute()
    while not at.exists():
        at = at.parent
    free = shutil.disk_usage(at).free / 1e9
    kept = c.max_num + 1 if c.max_num > 0 else 0  # the newest is written before the oldest is pruned
    line = f"checkpoints: ~{one:.3g} GB each in {c.dir} ({free:.3g} GB free there)"
    if kept:
        line += f", up to {kept} on disk at once: {kept * one:.3g} GB"
    if one > free:
        line += " -- NOT ONE FITS: a run started here fails before its first step"
    elif kept * one > free:
        line += " -- DOES NOT FIT: lower checkpoint.max_num or set checkpoint.max_disk_gb"
    plan.assumptions.append(line)
    if c.max_disk_gb is not None and one / (1 + critic) > c.max_disk_gb:  # (a budget per root: actor's, critic's)
        raise ConfigError(f"- checkpoint.max_disk_gb: one resumable checkpoint of this run is ~{one / (1 + critic):.3g}"
                          f" GB ({weights} + 8 bytes per parameter), over the budget of {c.max_disk_gb} GB: its first "
                          f"save would fail the run, after its steps. Fix: raise checkpoint.max_disk_gb above "
                          f"{one / (1 + critic):.3g}, or unset it")
    if one > free and not cfg.dry_run:  # a dry run may plan for another machine's disk: it shows, a run refuses
        raise ConfigError(f"- checkpoint.dir: one resumable checkpoint of this run is ~{one:.3g} GB ({weights} + 8 "
                          f"bytes per parameter: weights and AdamW state, {shape.params / 1e9:.3g} B parameters"
                          + (", actor and critic" if critic else "") + f"), but {at} has {free:.3g} GB free. "
                          "Fix: checkpoint.dir on a disk with room, or checkpoint.save_steps=0 (no resumable "
                          "checkpoint)")


def _trainer_memory(cfg: RunConfig, shape: ModelShape, dp: int) -> tuple[dict[str, float], list[str]]:
    """One trainer rank's peak memory by part (GiB), and the assumptions behind it."""
    p, t, m = cfg.parallelism, cfg.train, cfg.model
    P, shard, compute_bytes = shape.params, max(p.trainer_devices, 1), DTYPE_BYTES[m.param_dtype.value]
    tokens = t.max_tokens_per_micro_batch if t.dynamic_batch else t.micro_batch_size * cfg.data.max_len
    tokens_per_rank = tokens // (p.cp * p.tp) or 1
    ac = m.gradient_checkpointing.value
    # Full AC keeps each block's input (h per token) plus one block's working set (~34 h bytes/token at 16-bit,
    # Korthikanti et al. 2022); no AC keeps every block's working set.
    act_per_token = (shape.layers * shape.hidden * compute_bytes + 34 * shape.hidden) if ac != "none" else (
        34 * shape.hidden * shape.layers)
    if m.master_weights.value == "optimizer":  # param_dtype params, fp32 masters in AdamW (parallel/optim.py)
        # several micro-batches per optimizer step: grads sum into fp32 buffers, each micro-batch's param_dtype grad
        # freed as it is added (one FSDP unit's at a time); one micro-batch: the param_dtype grads themselves
        accumulates = t.dynamic_batch or t.batch_size // (t.micro_batch_size * dp) > 1
        grad_bytes = 4 if accumulates else compute_bytes
        state = {f"weights {m.param_dtype.value}": compute_bytes * P / shard / GIB,
                 f"grads {'fp32 (accumulated)' if accumulates else m.param_dtype.value}": grad_bytes * P / shard / GIB,
                 "fp32 master weights": 0.0 if p.offload.value != "none" else 4 * P / shard / GIB}
    else:
        state = {"weights fp32": 4 * P / shard / GIB, "grads fp32": 4 * P / shard / GIB}
    trained = shape.trained_params(m.lora)
    if m.lora.rank:
        state["grads fp32"] = 4 * trained / shard / GIB
    # the HF backend's text actor takes log-probs through the lm_head a chunk of tokens at a time (models/logprobs.py):
    # forward and backward hold ~3 fp32 [chunk x vocab] arrays and the fp32 lm_head grad, whatever the micro-batch
    fused_head = trainer_backend(cfg) == "hf" and not shape.vision
    chunk = min(LOGPROB_CHUNK_TOKENS, tokens_per_rank)
    logits = ({f"logits fp32, {chunk} tokens at a time": 4 * shape.vocab * (3 * chunk + shape.hidden) / GIB}
              if fused_head else {"logits fp32": 4 * shape.vocab * tokens_per_rank / GIB})
    # FSDP2's unsharded compute-dtype params: one block at a time over several ranks (resharded after forward); one
    # rank keeps them all from forward to backward, or runs without FSDP2 when its params are already in the compute
    # dtype (optimizer masters, fp32 compute), VLMs aside (parallel/trainer.py _build_hf)
    plain = m.master_weights.value == "optimizer" or (m.param_dtype.value == "float32" and trainer_backend(cfg) == "hf")
    gathered = ({"gathered layer": compute_bytes * (P - shape.vocab * shape.hidden) / shape.layers / GIB} if shard > 1
                else {"gathered model": 0.0 if plain and not shape.vision else compute_bytes * P / GIB})
    trainer = {**state, "adamw moments": 0.0 if p.offload.value != "none" else 8 * trained / shard / GIB, **gathered,
               "activations": act_per_token * tokens_per_rank / GIB, **logits}
    return trainer, [
        f"model: {P / 1e6:,.1f} M params ({shape.active_params / 1e6:,.1f} M active per token), {shape.layers} layers"
        + (f"; LoRA rank {m.lora.rank}: {trained / 1e6:,.2f} M trained (grads, AdamW moments)" if m.lora.rank else ""),
        f"trainer: {' + '.join(state)} + AdamW moments sharded over {shard} rank(s); {compute_bytes}-byte compute; "
        f"activation checkpointing {ac}; {tokens_per_rank} tokens per micro-batch per rank; "
        + ("log-probs through the lm_head, fp32 logits of a chunk of tokens at a time" if fused_head
           else "fp32 logits of the whole micro-batch"),
    ]


def _engine_memory(cfg: RunConfig, plan: Plan, shape: ModelShape, engine_weights: float) -> str:
    """As the engine sizes it (rollout/engine.py): on GPU vLLM's KV cache takes what gpu_memory_utilization leaves
    after the weights (activations ignored here); CPU engines take exactly kv_cache_gb."""
    r, mem = cfg.rollout, cfg.cluster.memory_gb_per_device
    if cfg.cluster.device.value == "cuda":
        kv = max(r.gpu_memory_utilization * mem - engine_weights, 0.0) if mem else None
        if kv == 0.0 and not cfg.parallelism.colocate:  # (colocated: _colocated_split checks the engine's share)
            raise ConfigError(f"- rollout.gpu_memory_utilization: {r.gpu_memory_utilization} of the {mem:g} GiB "
                              f"device is {r.gpu_memory_utilization * mem:.3g} GiB, not enough for the engine's "
                              f"{engine_weights:.3g} GiB of weights (vLLM would not start it; the device's size: "
                              f"cluster.memory_gb_per_device={mem:g}). Fix: raise rollout.gpu_memory_utilization "
                              "(default 0.9), or rollout.tensor_parallel_size to split the weights, or "
                              "cluster.memory_gb_per_device if the devices have more")
        kv_source = (f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} of {mem} GiB minus weights" if mem
                     else f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} of the device (size unknown: "
                     f"set cluster.memory_gb_per_device)")
    else:
        kv, kv_source = r.kv_cache_gb, f"rollout.kv_cache_gb={r.kv_cache_gb}"
    plan.memory["rollout engine"] = {"weights": engine_weights, **({"kv cache": kv} if kv is not None else {})}
    kv_token = shape.kv_bytes_per_token_per_byte * DTYPE_BYTES[r.dtype.value] / r.tensor_parallel_size
    # vLLM refuses to start a GPU engine whose KV cache cannot hold one sequence of max_model_len tokens
    if cfg.cluster.device.value == "cuda" and kv and kv_token and kv * GIB < kv_token * r.max_model_len:
        raise ConfigError(f"- rollout.gpu_memory_utilization: the engine's {kv:.3g} GiB KV cache holds "
                          f"{int(kv * GIB / kv_token)} tokens, fewer than one sequence of rollout.max_model_len="
                          f"{r.max_model_len} ({kv_token * r.max_model_len / GIB:.3g} GiB; vLLM would not start the "
                          "engine). Fix: raise rollout.gpu_memory_utilization, or lower data.max_len")
    return (f"engine: {DTYPE_BYTES[r.dtype.value]}-byte weights / TP {r.tensor_parallel_size}; KV cache from "
            f"{kv_source}" + (f", holds {int(kv * GIB / kv_token) if kv_token else 0} tokens" if kv is not None else "")
            + f" ({kv_token / 1024:.1f} KiB/token)")


def _estimate_memory(cfg: RunConfig, plan: Plan, shape: ModelShape, dp: int) -> None:
    r, job, mem = cfg.rollout, cfg.job.value, cfg.cluster.memory_gb_per_device
    trainer, notes = _trainer_memory(cfg, shape, dp)
    if job != "eval":
        plan.memory["actor"] = trainer
    engine_weights = DTYPE_BYTES[r.dtype.value] * shape.params / r.tensor_parallel_size / GIB
    if cfg.parallelism.colocate and cfg.cluster.device.value == "cuda" and job == "rl":
        _colocated_split(cfg, plan, trainer, engine_weights)  # derives rollout.gpu_memory_utilization first
    engine = _engine_memory(cfg, plan, shape, engine_weights) if job != "sft" else None
    plan.assumptions += [*(notes if job != "eval" else notes[:1]), *([engine] if engine else [])]  # eval: no trainer
    if mem and job != "eval":  # (eval starts no trainer)
        need = sum(trainer.values())
        plan.assumptions.append(f"fit: trainer needs {need:.1f} of {mem} GiB per device"
                                + (" -- DOES NOT FIT" if need > mem else ""))
        # the same estimate refuses a colocated split (_colocated_split): a trainer alone past the device's memory
        # would otherwise start, and fail with an out-of-memory error at its first step
        if need > mem:
            raise ConfigError(
                f"- cluster.memory_gb_per_device: one trainer rank needs ~{need:.3g} GiB "
                f"({', '.join(f'{k} {v:.3g}' for k, v in trainer.items() if v >= 0.05)}), above the {mem:g} GiB of "
                "a device. Fix: more trainer ranks (parallelism.trainer_devices) to shard its state, a smaller "
                "micro-batch (train.micro_batch_size or train.max_tokens_per_micro_batch), "
                "model.gradient_checkpointing=full, parallelism.offload=optimizer, or cluster.memory_gb_per_device "
                "if the devices have more (0 skips this estimate)")


def _colocated_split(cfg: RunConfig, plan: Plan, trainer: dict[str, float], engine_weights: float) -> None:
    """One GPU shared by an engine and the trainer ranks on it: while the engine generates, the trainer keeps only its
    resident state (weights, masters, AdamW moments; activations and grads freed, its cache emptied); while the trainer
    steps, the engine sleeps (weights and KV cache released). The engine's `gpu_memory_utilization` is what the
    generate phase leaves; a user's value, or a step that does not fit beside a sleeping engine, is checked here."""
    r, p, mem = cfg.rollout, cfg.parallelism, cfg.cluster.memory_gb_per_device
    resident = sum(v for k, v in trainer.items() if k.startswith(("weights", "fp32 master", "adamw")))
    weights = sum(v for k, v in trainer.items() if k.startswith("weights"))
    ref = p.colocate_models and "reference" in fsdp_roles(cfg)  # on these GPUs too
    critic = p.colocate_models and "critic" in fsdp_roles(cfg)
    others = ref * weights + critic * resident
    contexts = CUDA_CONTEXT_GIB * (2 + ref + critic)  # the engine's and each trainer role's
    leaves = mem * (1 - FRAGMENTATION) - contexts - resident - others
    if r.gpu_memory_utilization is None:
        r.gpu_memory_utilization = max(round(leaves / mem, 3), 0.001)
    engine = r.gpu_memory_utilization * mem
    beside = {"other roles resident": others, "CUDA contexts": contexts}
    plan.phases["generate"] = {"engine (gpu_memory_utilization)": engine, "trainer resident": resident, **beside}
    plan.phases["train"] = {"engine asleep": ENGINE_ASLEEP_GIB, "trainer step peak": sum(trainer.values()), **beside}
    plan.phases["wake + sync"] = {"engine weights": engine_weights, "trainer resident": resident, **beside}
    plan.assumptions.append(
        f"colocated: rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} of {mem:g} GiB (the generate phase's "
        f"room after {resident:.3g} GiB of trainer state, {contexts:g} GiB of CUDA contexts and "
        f"{FRAGMENTATION:.0%} for fragmentation); a sleeping engine keeps ~{ENGINE_ASLEEP_GIB:g} GiB")
    # what shrinks the trainer's resident state (the generate and wake phases), and its step peak (the train phase)
    less_resident = ("more trainer ranks (parallelism.trainer_devices) to shard its state, parallelism.offload="
                     "optimizer (its fp32 masters and AdamW moments on the host; HF backend), "
                     + ("model.master_weights=fsdp (2 bytes a parameter less: no bf16 copy beside the masters), "
                        if cfg.model.master_weights.value == "optimizer" else ""))
    fixes = {"generate": f"a lower rollout.gpu_memory_utilization, {less_resident}",
             "train": f"a smaller micro-batch, activation checkpointing, {less_resident}",
             "wake + sync": less_resident}
    problems = []
    if engine < engine_weights + 1.0:
        problems.append(f"- rollout.gpu_memory_utilization: colocated, the engine gets {engine:.3g} GiB of the GPU's "
                        f"{mem:g} but needs {engine_weights:.3g} GiB of weights plus >= 1 GiB for activations and KV "
                        f"cache (the trainer keeps {resident:.3g} GiB resident). Fix: {less_resident}or "
                        "parallelism.colocate=false")
    for phase, parts in plan.phases.items():
        if sum(parts.values()) > mem:
            problems.append(f"- parallelism.colocate: the {phase} phase needs {sum(parts.values()):.3g} GiB of a "
                            f"{mem:g} GiB GPU ({', '.join(f'{k} {v:.3g}' for k, v in parts.items())}). Fix: "
                            f"{fixes[phase]}or parallelism.colocate=false")
    if problems:
        raise ConfigError("\n".join(problems))
