"""The dry-run plan tells each job's own step: an RL step (rollout batch, optimizer steps over it), an SFT optimizer
step (no rollout engine), an eval job's one pass (no trainer). Before, job=sft and job=eval printed the RL batch
arithmetic (prompt groups x samples, async mode, staleness) and counted devices they never start."""

from __future__ import annotations

from _config_helpers import compose_config
from molt_hydra.cli import to_run_config
from molt_hydra.runtime.plan import make_plan
from molt_hydra.runtime.validate import validate


def plan_of(overrides: list[str]):
    cfg = validate(to_run_config(compose_config(overrides)))
    return cfg, make_plan(cfg)


def test_an_sft_plan_shows_its_optimizer_step_and_no_engine():
    cfg, plan = plan_of(["+recipe=tiny_vlm_colors_warm"])
    t, ranks = cfg.train, cfg.parallelism.trainer_devices
    assert plan.batch_title == "Batch arithmetic (one SFT optimizer step):"
    assert plan.batch == {"samples per optimizer step": t.batch_size, "data-parallel ranks": ranks,
                          "samples per rank": t.batch_size // ranks,
                          "micro-batches per rank": f"{-(-t.batch_size // ranks // t.micro_batch_size)} of "
                                                    f"{t.micro_batch_size}",
                          "epochs over the data": t.epochs}
    assert plan.assumptions[0].startswith(f"0 rollout + {ranks} trainer device(s)"), plan.assumptions


def test_an_eval_plan_shows_its_one_pass_and_no_trainer():
    cfg, plan = plan_of(["job=eval", "eval.data_path=builtin://toy_eval", "eval.n_samples_per_prompt=3",
                         "rollout.batch_size=5"])
    assert plan.batch_title == "Evaluation (one pass over eval.data_path):"
    assert plan.batch == {"samples per prompt": 3, "prompt groups in flight": 5}  # eval.batch_size: the rollout's
    assert plan.assumptions[0].startswith(f"{cfg.rollout.num_engines} rollout + 0 trainer device(s)")
    assert not any(a.startswith("trainer:") for a in plan.assumptions), plan.assumptions
    assert "actor" not in plan.memory and [r.name for r in plan.roles] == ["rollout engine", "agent runner"]


def test_an_rl_plan_keeps_its_step():
    cfg, plan = plan_of([])
    r = cfg.rollout
    assert plan.batch_title == "Batch arithmetic (one RL step):"
    assert plan.batch["prompt groups x samples"] == f"{r.batch_size} x {r.n_samples_per_prompt} = " \
                                                    f"{r.batch_size * r.n_samples_per_prompt}"
    assert plan.render().splitlines()[1 + 1 + len(plan.roles)] == "Batch arithmetic (one RL step):"


def test_an_eval_on_more_devices_is_not_held_to_the_trainers_arithmetic():
    """Before: job=eval on a 4-device node was refused for train.batch_size (64 not a multiple of 16 x 3 trainer
    ranks) and a recipe's parallelism.ep for the trainer mesh, though an eval job starts no trainer (and refuses
    train.* on its command line)."""
    cfg, plan = plan_of(["job=eval", "eval.data_path=builtin://toy_eval", "cluster.devices_per_node=4",
                         "cluster.cpus_per_node=4"])
    assert cfg.parallelism.trainer_devices == 3 and cfg.train.batch_size % (cfg.train.micro_batch_size * 3) != 0
    assert plan.batch_title.startswith("Evaluation")
    cfg, _ = plan_of(["+recipe=qwen3_moe_geo3k", "job=eval", "eval.data_path=builtin://geo_triangles_eval",
                      "cluster.devices_per_node=6"])
    assert cfg.parallelism.ep == 4 and cfg.parallelism.trainer_devices % 4 != 0
