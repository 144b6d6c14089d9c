"""`train.epochs` > 1 (PPO epochs over each batch): the step's logged actor and critic metrics are over every epoch's
optimizer steps and tokens (docs/metrics.md: "mean grad norm over the step's optimizer steps"; Molt's policy_train
reduces the metrics of its whole fit, every epoch: inventory 4.7), not the last epoch's as before. Real controller
step driving real FSDP2 actor and critic ranks (gloo, one process each role) through in-process calls; the expected
values are the same epochs run as separate train steps on fresh ranks from the same weights, averaged (every epoch
sees the same samples and tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from molt_hydra.parallel.launch import run_ranks

import _old_logprob_jobs as jobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

pytestmark = pytest.mark.timeout(600)

EPOCHS = 2


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    from molt_hydra.cli import to_run_config
    from molt_hydra.runtime.validate import validate
    cfg = validate(to_run_config(compose_config([
        "algorithm=ppo_gae", "algorithm.is_correction.level=token", f"train.epochs={EPOCHS}", "train.batch_size=8",
        "train.micro_batch_size=8", "rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
        "train.max_staleness=1", "parallelism.colocate_models=true"])))
    out = tmp_path_factory.mktemp("epochs") / "step.pt"
    run_ranks(jobs.epochs_step, 1, out, cfg, timeout_s=300)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("role, keys", [
    ("actor", ["policy_loss", "policy_clip_ratio", "policy_kl", "advantage_mean", "is_filter_ratio",
               "actor_grad_norm"]),
    ("critic", ["value_loss", "value_clip_frac", "critic_grad_norm"]),
])
def test_the_step_logs_the_mean_over_every_epoch(step, role, keys):
    epochs = step["separate"][role]
    assert len(epochs) == EPOCHS
    for key in keys:
        per_epoch = [m[key] for m in epochs]
        assert step["metrics"][key] == pytest.approx(sum(per_epoch) / EPOCHS, rel=1e-5, abs=1e-7), (key, per_epoch)
    # the epochs differ (the first one's ratios are all 1, the second's are not): a last-epoch value would not pass
    assert epochs[0]["policy_clip_ratio" if role == "actor" else "value_clip_frac"] != pytest.approx(
        epochs[-1]["policy_clip_ratio" if role == "actor" else "value_clip_frac"])
    assert step["metrics"][f"{role}_lr"] == epochs[-1][f"{role}_lr"]  # the LR is the last one's


def test_the_epochs_train_as_separate_steps_would(step):
    for role, (trained, fresh) in step["weights"].items():
        diffs = {k: (trained[k] - fresh[k]).abs().max().item() for k in trained}
        assert max(diffs.values()) < 1e-6, (role, sorted(diffs.items(), key=lambda kv: -kv[1])[:3])
