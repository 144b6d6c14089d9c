"""parallelism.colocate: engines and trainer share devices; engines sleep while the trainer steps. Validation refuses
what cannot run colocated, each with key, reason and fix; the plan derives the engines' share of each GPU from the
trainer's resident memory and refuses a split that cannot fit, with the numbers of every phase."""

from __future__ import annotations

import pytest

from _config_helpers import compose_config
from molt_hydra.cli import to_run_config
from molt_hydra.config.schema import ConfigError
from molt_hydra.runtime.validate import validate
from molt_hydra.runtime.plan import CUDA_CONTEXT_GIB, FRAGMENTATION, GIB, KNOWN_SHAPES, make_plan, model_shape

GPU = ["cluster.device=cuda", "cluster.devices_per_node=1", "cluster.memory_gb_per_device=139",
       "parallelism.colocate=true", "train.mode=sync"]


def errors(overrides: list[str]) -> list[str]:
    try:
        make_plan(validate(to_run_config(compose_config(overrides))))
    except ConfigError as e:
        return [line.removeprefix("- ") for line in str(e).splitlines()]
    return []


@pytest.mark.parametrize("overrides,key,fragment", [
    (["parallelism.colocate=true"], "train.mode", "generation cannot run ahead of training"),  # async by default
    ([*GPU, "rollout.weight_sync.transport=nccl"], "rollout.weight_sync.transport", "NCCL cannot connect"),
    ([*GPU, "rollout.tensor_parallel_size=2", "cluster.devices_per_node=2"], "rollout.tensor_parallel_size",
     "this engine spans 2 GPUs"),
    ([*GPU, "rollout.num_engines=2", "cluster.devices_per_node=2", "parallelism.trainer_devices=1"],
     "rollout.num_engines", "2 engine device(s) but 1 trainer device(s)"),
    ([*GPU, "cluster.memory_gb_per_device=0"], "cluster.memory_gb_per_device", "its size is unknown here"),
    (["rollout.weight_sync.transport=cuda_ipc", "cluster.device=cuda"], "rollout.weight_sync.transport",
     "cuda_ipc maps the trainer's GPU memory"),
    ([*GPU, "model.path=Qwen/Qwen3-4B", "rollout.gpu_memory_utilization=0.9"], "parallelism.colocate",
     "the generate phase needs"),
    ([*GPU, "model.path=Qwen/Qwen3-4B", "cluster.memory_gb_per_device=60"], "rollout.gpu_memory_utilization",
     "colocated, the engine gets"),
])
def test_what_cannot_run_colocated_is_refused(overrides, key, fragment):
    lines = errors(overrides)
    assert any(line.startswith(f"{key}: ") and fragment in line and " Fix: " in line for line in lines), lines


# Qwen3-4B (bf16, its published shape): K and V of every layer's KV heads per token, and its parameters
QWEN3_4B = KNOWN_SHAPES["Qwen/Qwen3-4B"]
QWEN3_4B_KV = 2 * QWEN3_4B["num_hidden_layers"] * QWEN3_4B["num_key_value_heads"] * QWEN3_4B["head_dim"] * 2
QWEN3_4B_PARAMS = model_shape("Qwen/Qwen3-4B").params


# Not colocated, the same estimate: a trainer rank or an engine past the device's memory is refused before it starts
# (were: "DOES NOT FIT" in the plan, then the run started and failed out of memory, or vLLM refused its engine)
@pytest.mark.parametrize("overrides,key,fragment", [
    (["+recipe=qwen3_4b_math", "train.micro_batch_size=64", "train.batch_size=512"], "cluster.memory_gb_per_device",
     "above the 80 GiB of a device"),
    (["+recipe=qwen3_4b_math", "rollout.gpu_memory_utilization=0.05"], "rollout.gpu_memory_utilization",
     "0.05 of the 80 GiB device is 4 GiB, not enough for the engine's"),
    # the device's size is a key too (before: not named, for cluster.memory_gb_per_device=0.1 given by mistake)
    (["+recipe=qwen3_4b_math", "cluster.memory_gb_per_device=0.1"], "rollout.gpu_memory_utilization",
     "(vLLM would not start it; the device's size: cluster.memory_gb_per_device=0.1)"),
    (["+recipe=qwen3_4b_math", "rollout.gpu_memory_utilization=0.1"], "rollout.gpu_memory_utilization",
     "fewer than one sequence of rollout.max_model_len=8192"),
    (["+recipe=qwen3_4b_math", "rollout.gpu_memory_utilization=0.0945"], "rollout.gpu_memory_utilization",
     f"holds {int((0.0945 * 80 - 2 * QWEN3_4B_PARAMS / GIB) * GIB / QWEN3_4B_KV)} tokens"),
])
def test_what_cannot_fit_a_device_is_refused(overrides, key, fragment):
    lines = errors(overrides)
    assert any(line.startswith(f"{key}: ") and fragment in line and " Fix: " in line for line in lines), lines
    assert errors(overrides[:1]) == []  # the recipe as written fits


def test_one_gpu_recipe_plans_as_written_with_the_engine_share_derived():
    cfg = validate(to_run_config(compose_config(["+recipe=qwen3_toy_gpu", "cluster.memory_gb_per_device=139",
                                                 "rollout.gpu_memory_utilization=null"])))
    plan = make_plan(cfg)
    params = model_shape(cfg.model.path).params
    # one GPU rank: master_weights auto -> optimizer; bf16 weights, their fp32 masters and the AdamW moments stay
    # while the engine generates (grads and activations are freed)
    assert cfg.model.master_weights.value == "optimizer"
    resident = (2 + 4 + 8) * params / GIB
    want = round((139 * (1 - FRAGMENTATION) - 2 * CUDA_CONTEXT_GIB - resident) / 139, 3)
    assert cfg.rollout.gpu_memory_utilization == want
    assert set(plan.phases) == {"generate", "train", "wake + sync"}
    assert plan.phases["generate"]["engine (gpu_memory_utilization)"] == pytest.approx(want * 139)
    assert "Memory by phase, one colocated GPU (GiB):" in plan.render()
    engine, actor = [r for r in plan.roles if r.name in ("rollout engine", "actor")]
    assert engine.count == actor.count == 1 and "sleeps while the trainer steps" in engine.note


def test_a_recipe_value_under_the_ceiling_is_kept():
    cfg = validate(to_run_config(compose_config(["+recipe=qwen3_toy_gpu", "cluster.memory_gb_per_device=139"])))
    make_plan(cfg)
    assert cfg.rollout.gpu_memory_utilization == 0.3


def test_colocated_on_cpu_shares_the_slots():
    cfg = validate(to_run_config(compose_config(["parallelism.colocate=true", "train.mode=sync"])))
    assert cfg.parallelism.trainer_devices == cfg.cluster.devices_per_node  # no slot set aside for the engine
    assert make_plan(cfg).phases == {}  # host memory: no split to derive


@pytest.mark.parametrize("overrides,level", [
    ([], 2),  # every sync rewrites every weight: weights and KV cache are released
    (["model.lora.rank=8"], 1),  # only the adapter travels: the base must survive the sleep
    (["model.freeze_moe_router=true"], 1),  # frozen routers never travel: a released copy would wake as garbage
])
def test_a_colocated_engine_keeps_its_weights_asleep_where_syncs_leave_some_out(overrides, level):
    from molt_hydra.runtime.roles import engine_args

    cfg = validate(to_run_config(compose_config(["+recipe=qwen3_moe_r3_gpu", "cluster.memory_gb_per_device=139",
                                                 *overrides])))
    assert engine_args(cfg, cfg.model.path, True, 0)["sleep_level"] == level
    cpu = validate(to_run_config(compose_config(["parallelism.colocate=true", "train.mode=sync"])))
    assert engine_args(cpu, cpu.model.path, False, 0)["sleep_level"] == 0  # no sleep mode on CPU: paused


def test_a_phase_that_cannot_fit_offers_the_fixes_that_shrink_what_it_holds():
    """The 8-layer MoE recipe on an 80 GB card (run on an H100, session 17): the trainer's resident state overflows
    the generate phase, so its fix names what shrinks that state (offload, fsdp masters under the resolved optimizer
    masters), not the micro-batch or activation checkpointing, which only the train phase's peak holds."""
    lines = errors(["+recipe=qwen3_moe_r3_gpu", "cluster.memory_gb_per_device=79.6"])
    generate = next(line for line in lines if line.startswith("parallelism.colocate: the generate phase"))
    fix = generate.split(" Fix: ")[1]
    assert "parallelism.offload=optimizer" in fix and "model.master_weights=fsdp" in fix
    assert "micro-batch" not in fix and "activation checkpointing" not in fix
    train = next(line for line in lines if line.startswith("parallelism.colocate: the train phase"))
    assert "a smaller micro-batch, activation checkpointing" in train.split(" Fix: ")[1]
