"""KL estimators k1/k2/k3 with Molt's clamps, and the fixed / adaptive KL controllers (Molt §2.4)."""

import math

import pytest
import torch

from molt_hydra.algorithm.kl import KLController, approx_kl

NAN, INF = float("nan"), float("inf")


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=1e-6)


# log r = logp - logp_base = 0.5, -1, -99 (a -100 log-prob), +99 (a -100 base log-prob)
LOGP = torch.tensor([-1.0, -2.0, -100.0, -1.0])
BASE = torch.tensor([-1.5, -1.0, -1.0, -100.0])


def test_k1_is_the_unclamped_log_ratio():
    close(approx_kl(LOGP, BASE, "k1"), [0.5, -1.0, -99.0, 99.0])


def test_k2_is_half_the_squared_log_ratio_clamped_to_10():
    close(approx_kl(LOGP, BASE, "k2"), [0.5 ** 2 / 2, 1 / 2, 10.0, 10.0])  # 99^2 / 2 = 4900.5 -> 10


def test_k3_is_exp_minus_one_plus_log_ratio_clamped_to_10():
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 10.0, 10.0]  # e^99 - 100 and 98 -> 10
    close(approx_kl(LOGP, BASE, "k3"), k3)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_inf_and_nan_log_probs_are_replaced_as_molt_does(estimator):
    logp = torch.tensor([-INF, -1.0, -INF, NAN])
    base = torch.tensor([-1.0, -INF, -INF, -1.0])
    log_ratio = [-30.0, 30.0, 0.0, 0.0]  # -inf -> -30, +inf -> +30, -inf - -inf = NaN -> 0, NaN -> 0
    expected = {
        "k1": log_ratio,
        "k2": [10.0, 10.0, 0.0, 0.0],
        "k3": [10.0, 10.0, 0.0, 0.0],  # e^30 - 31 and 29, both -> 10
    }[estimator]
    close(approx_kl(logp, base, estimator), expected)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_gradients_stay_finite_at_a_minus_100_log_prob(estimator):
    logp = LOGP.clone().requires_grad_()
    approx_kl(logp, BASE, estimator).sum().backward()
    assert torch.isfinite(logp.grad).all()
    if estimator == "k3":  # d k3 / d log r = 1 - exp(-log r) inside the clamp, 0 where it saturates
        close(logp.grad, [1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0, 0.0])


def test_unknown_estimator_names_the_key():
    with pytest.raises(ValueError, match="algorithm.kl.estimator='k4'"):
        approx_kl(LOGP, BASE, "k4")


def test_fixed_controller_never_moves():
    controller = KLController(0.05)
    controller.update(current_kl=10.0, n_steps=1000)
    assert controller.value == 0.05


def test_adaptive_controller_proportional_update_and_clamp():
    controller = KLController(0.1, target=0.05, horizon=1000)
    controller.update(current_kl=0.055, n_steps=100)  # e = 0.055 / 0.05 - 1 = 0.1
    assert controller.value == pytest.approx(0.1 * (1 + 0.1 * 100 / 1000))
    before = controller.value
    controller.update(current_kl=5.0, n_steps=100)  # e = 99, clamped to +0.2
    assert controller.value == pytest.approx(before * (1 + 0.2 * 100 / 1000))
    before = controller.value
    controller.update(current_kl=0.0, n_steps=500)  # e = -1, clamped to -0.2
    assert controller.value == pytest.approx(before * (1 - 0.2 * 500 / 1000))


def test_controller_choice_follows_target():
    for target in (None, 0.0):  # falsy target: fixed, as in Molt
        fixed = KLController(0.01, target=target)
        fixed.update(current_kl=10.0, n_steps=1000)
        assert fixed.value == 0.01
    adaptive = KLController(0.01, target=0.1, horizon=500)
    assert adaptive.horizon == 500 and adaptive.value == 0.01
    adaptive.update(current_kl=0.2, n_steps=100)  # e = 1, clamped to +0.2
    assert adaptive.value == pytest.approx(0.01 * (1 + 0.2 * 100 / 500))


def test_k1_as_a_loss_ignores_the_reference_so_the_config_refuses_it():
    """d k1 / d logp = 1 whatever the reference: the KL loss's gradient is coef / N per token for any reference."""
    import sys
    from pathlib import Path

    from molt_hydra.algorithm.loss import PolicyLoss
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from test_validation import assert_fires, config_errors

    mask = torch.ones(1, 3, dtype=torch.bool)
    for ref in (torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-9.0, -0.1, -5.0]])):
        logp = torch.tensor([[-1.2, -0.7, -2.0]], requires_grad=True)
        loss, _ = PolicyLoss("ppo", kl_use_loss=True, kl_estimator="k1")(
            logp, logp.detach(), torch.zeros(1, 3), mask, ref_log_probs=ref, kl_coef=0.5)
        loss.backward()
        close(logp.grad, [[0.5 / 3] * 3])
    base = ["algorithm.kl.use_loss=true", "parallelism.colocate_models=true"]
    assert_fires(base, "algorithm.kl.estimator", "k1 as a loss has the gradient grad log pi whatever the reference")
    for ok in (["algorithm.kl.estimator=k3"], ["algorithm.kl.estimator=k2"]):
        assert not [e for e in config_errors(base + ok) if e.startswith("algorithm.kl.estimator")]


def test_a_frozen_actor_step_measures_no_kl_and_leaves_the_adaptive_coefficient():
    """kl.use_loss: the KL is measured by the actor's training step; during the critic's warm-up the actor does not
    train, and a missing measurement is not a KL of 0 (which lowered the coefficient by 1 - 0.2 * n / horizon)."""
    import asyncio
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    tests = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(tests / "config"), str(tests / "integration")]
    from _config_helpers import compose_config
    from _old_logprob_jobs import batch

    from molt_hydra.cli import to_run_config
    from molt_hydra.runtime.controller import RLController
    from molt_hydra.runtime.roles import _policy_loss
    from molt_hydra.runtime.validate import validate

    class Calls:  # the trainer ranks: log-probs / values of -1 for every token, a critic step's metrics
        async def ranks(self, group, method, *args, shard=None, **kw):
            if method == "compute_logprobs":
                return [[torch.full((len(s["input_ids"]),), -1.0) for s in shard]]
            return [{"value_loss": 0.1}]

    cfg = validate(to_run_config(compose_config([
        "algorithm=ppo_gae", "algorithm.kl.use_loss=true", "algorithm.kl.estimator=k3", "algorithm.kl.coef=0.1",
        "algorithm.kl.target=0.05", "algorithm.kl.horizon=100", "train.critic.actor_freezing_steps=2",
        "parallelism.colocate_models=true", "rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
        "train.max_staleness=1", "train.batch_size=8", "train.micro_batch_size=8"])))
    group = SimpleNamespace(num_ranks=1, dp_size=1, per_shard=list)  # one rank: every result is its shard's
    roles = SimpleNamespace(actor=group, ref=group, critic=group, pad_token_id=0, policy_loss=_policy_loss(cfg),
                            calls=Calls())
    ctl = RLController(cfg, roles, log=None)
    metrics = asyncio.run(ctl.train_step(batch("tiny://qwen3_tiny"), {"timing/generation": 1.0}))
    assert metrics["actor_frozen"] == 1.0 and "kl" not in metrics
    assert ctl.kl_ctl.value == 0.1  # was 0.1 * (1 - 0.2 * 8 / 100) = 0.0984

    # an agent's Result.info "kl" is its own number: it steers nothing (was: the controller's "kl" when none was
    # measured); info keys named as the step's own metrics go under "info/" (was: one overwrote the other)
    infos = {"kl": 5.0, "value_loss": 7.0, "response_length": 99.0, "timing/generation": 3.0, "acc": 1.0,
             "timing/step_total": 4.0}  # (a name the loop adds after the step: its namespace is the loop's)
    agent_batch = batch("tiny://qwen3_tiny")
    for group in agent_batch.groups:
        for t in group.trajectories:
            t.info = dict(infos)
    metrics = asyncio.run(ctl.train_step(agent_batch, {"timing/generation": 1.0}))
    assert ctl.kl_ctl.value == 0.1 and metrics["kl"] == 5.0  # (no KL measured: the name is free)
    assert (metrics["value_loss"], metrics["info/value_loss"]) == (0.1, 7.0)  # the critic's, and the agent's
    assert metrics["info/response_length"] == 99.0 and metrics["response_length"] != 99.0
    assert (metrics["timing/generation"], metrics["info/timing/generation"], metrics["acc"]) == (1.0, 3.0, 1.0)
    assert metrics["info/timing/step_total"] == 4.0 and "timing/step_total" not in metrics


def test_an_adaptive_horizon_that_would_flip_the_coefficient_negative_is_refused():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from test_validation import assert_fires, config_errors

    samples = 128 * 8
    controller = KLController(0.1, target=0.05, horizon=100)
    controller.update(current_kl=0.0, n_steps=samples)  # the first step's KL: policy == reference
    assert controller.value == pytest.approx(0.1 * (1 - 0.2 * samples / 100)) and controller.value < 0
    base = ["algorithm=reinforce", "algorithm.kl.target=0.05", "rollout.batch_size=128",
            "rollout.n_samples_per_prompt=8", "train.batch_size=1024", "parallelism.colocate_models=true"]
    assert_fires(base + ["algorithm.kl.horizon=100"], "algorithm.kl.horizon", "the coefficient would turn negative")
    assert_fires(base + ["algorithm.kl.horizon=204"], "algorithm.kl.horizon", "set algorithm.kl.horizon > 204")
    assert not [e for e in config_errors(base + ["algorithm.kl.horizon=205"]) if e.startswith("algorithm.kl.horizon")]
    assert not [e for e in config_errors(base) if e.startswith("algorithm.kl.horizon")]  # default 10000
