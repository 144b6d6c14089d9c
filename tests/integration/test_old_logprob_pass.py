"""The old-logprob pass is skipped exactly when it cannot differ from the training forward (one optimizer step per
batch): the controller's step then makes one trainer call, and its loss, gradient (through the weights after the
step), IS correction, entropy, drift and R3 routing metrics equal the two-pass computation's. With two optimizer
steps per batch the separate pass still runs. Real FSDP2 trainer rank over gloo, driven by the real controller."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from molt_hydra.parallel.launch import run_ranks

import _old_logprob_jobs as jobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

pytestmark = pytest.mark.timeout(600)

DENSE = ["algorithm.is_correction.level=token", "algorithm.is_correction.mode=mask", "algorithm.entropy_coef=0.01"]
MOE = ["model.path=tiny://qwen3_moe_tiny", "rollout.routing_replay=true"]


def run_config(extra: list[str]):
    from molt_hydra.cli import to_run_config
    return to_run_config(compose_config(["rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
                                         "train.max_staleness=1", *extra]))


def step(tmp_path, name: str, extra: list[str], force_two_pass: bool) -> dict:
    cfg = run_config(extra)
    run_ranks(jobs.controller_step, 1, tmp_path / f"{name}.pt", cfg, cfg.model.path, force_two_pass, timeout_s=300)
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def same_step(one: dict, two: dict, keys: set[str]) -> None:
    """Every logged metric but wall-clock ones, and every weight after the optimizer step, agree."""
    clock = ("timing/", "perf/")
    assert keys <= set(one["metrics"]), sorted(keys - set(one["metrics"]))
    assert set(one["metrics"]) == set(two["metrics"])
    for k, v in one["metrics"].items():
        if not k.startswith(clock):
            assert v == (pytest.approx(two["metrics"][k], rel=1e-5, abs=1e-6) if isinstance(v, float)
                         else two["metrics"][k]), k
    diffs = {k: (one["model"][k] - two["model"][k]).abs().max().item() for k in one["model"]}
    assert max(diffs.values()) < 1e-6, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]


def test_one_optimizer_step_skips_the_pass_and_matches_two_passes(tmp_path):
    one, two = (step(tmp_path, f"dense_{n}", DENSE + ["train.batch_size=8"], n == "two") for n in ("one", "two"))
    assert [m for m, _ in one["called"]] == ["train_step"]
    assert one["called"][0][1]["return_logprobs"] is True
    assert [m for m, _ in two["called"]] == ["compute_logprobs", "train_step"]
    # the loss, its IS weights and entropy term, the step's gradient, and the drift metrics from the old log-probs
    same_step(one, two, {"policy_loss", "policy_clip_ratio", "policy_kl", "is_filter_ratio", "entropy_loss",
                         "actor_grad_norm", "vllm_kl", "drift/k3_kl", "drift/abs_logp_diff_p99",
                         "drift/is_filtered_token_frac", "drift/is_ratio_max"})
    # the IS filter and the drift metrics saw real engine-vs-trainer differences, not a trivial batch
    assert 0 < one["metrics"]["is_filter_ratio"] < 1
    assert one["metrics"]["drift/abs_logp_diff_max"] > 0.1
    assert one["metrics"]["actor_grad_norm"] > 0


def test_moe_routing_replay_metrics_match_two_passes(tmp_path):
    one, two = (step(tmp_path, f"moe_{n}", MOE + ["train.batch_size=8"], n == "two") for n in ("one", "two"))
    assert [m for m, _ in one["called"]] == ["train_step"]
    same_step(one, two, {"routing/agreement", "routing/aux_loss", "routing/expert_load_entropy", "policy_loss",
                         "actor_grad_norm"})
    assert 0 < one["metrics"]["routing/agreement"] < 1  # the random engine experts agree with the trainer's sometimes


def test_two_optimizer_steps_keep_the_pass(tmp_path):
    res = step(tmp_path, "two_steps", DENSE + ["train.batch_size=4"], False)
    assert [m for m, _ in res["called"]] == ["compute_logprobs", "train_step"]
    assert res["called"][1][1] == {"num_optimizer_steps": 2, "return_logprobs": False, "epochs": 1}


@pytest.mark.parametrize("extra, steps, frozen, one_pass", [
    ([], 1, False, True),
    (["train.force_on_policy=true"], 1, False, True),
    ([], 2, False, False),                       # two windows: the second one's forward sees stepped weights
    (["train.epochs=2"], 1, False, False),       # the second epoch's forward sees stepped weights
    ([], 1, True, False),                        # critic warm-up: the actor does not train this step
    (["model.lora.rank=8"], 1, False, True),
    (["model.lora.rank=8", "model.lora.dropout=0.1"], 1, False, False),  # the training forward drops out
])
def test_when_the_training_forward_gives_the_old_logprobs(extra, steps, frozen, one_pass):
    from molt_hydra.runtime.controller import RLController
    ctl = RLController(run_config(extra), SimpleNamespace(calls=None, ref=None), log=None)
    assert ctl.old_logprobs_from_training(steps, frozen) is one_pass


@pytest.mark.parametrize("fields, one_pass", [
    ({"attention_dropout": 0.1}, False), ({"vision_config": {"attention_dropout": 0.1}}, False),
    ({"resid_pdrop": 0.1}, False),
    ({"attention_dropout": 0.0, "classifier_dropout": 0.1}, True),  # a head the causal LM never uses
], ids=str)
def test_a_checkpoints_own_dropout_needs_the_pass(tmp_path, fields, one_pass):
    """Its training forward drops out (the recompute does not: parallel/trainer.py compute_logprobs), so its log-probs
    are not the sampling policy's: as the IS numerator they would weigh (mask mode: drop) tokens by dropout noise.
    Before: only LoRA dropout kept the pass."""
    from molt_hydra.runtime.controller import RLController
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **fields}))
    ctl = RLController(run_config([f"model.path={tmp_path}"]), SimpleNamespace(calls=None, ref=None), log=None)
    assert ctl.old_logprobs_from_training(1, False) is one_pass


@pytest.mark.parametrize("use_loss, one_pass", [(False, False), (True, True)])
def test_kl_penalty_in_the_reward_needs_the_pass(use_loss, one_pass):
    """KL to the reference as a reward penalty enters the advantages, which the loss needs before any forward."""
    from molt_hydra.runtime.controller import RLController
    cfg = run_config(["algorithm.kl.coef=0.1", f"algorithm.kl.use_loss={str(use_loss).lower()}"])
    ctl = RLController(cfg, SimpleNamespace(calls=None, ref=object()), log=None)
    assert ctl.old_logprobs_from_training(1, False) is one_pass
