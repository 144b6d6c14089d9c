"""logger.debug_rollout (Molt's MOLT_DEBUG_ROLLOUT): one console line per trained sample each step, with its reward,
its return, its group's reward std and its decoded response. Before, it wrote the same trajectory dump as
logger.dump_trajectories (no return, no group std), so with that on it changed nothing."""

import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402

from molt_hydra.algorithm.experience import Experience, collate  # noqa: E402
from molt_hydra.cli import to_run_config  # noqa: E402
from molt_hydra.logging.run_log import RunLog  # noqa: E402
from molt_hydra.runtime.controller import RLController  # noqa: E402


@pytest.mark.parametrize("debug", [True, False])
def test_debug_rollout_prints_each_trained_samples_reward_return_and_group_std(tmp_path, tiny_model, capsys, debug):
    cfg = to_run_config(compose_config(["rollout.n_samples_per_prompt=2", f"logger.debug_rollout={debug}"]))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    responses = [tok.encode(w) for w in (" one", " two three", " four")]
    # group g: rollouts g-0 (reward 1.0) and g-1 (reward 0.0); group h: one rollout (its std is 0)
    exps = [Experience([5, *ids], [False] + [True] * len(ids), [0.0] * (len(ids) + 1), reward, group, rollout)
            for ids, reward, group, rollout in zip(responses, (1.0, 0.0, 0.5), "ggh", ("g-0", "g-1", "h-0"))]
    b = collate(exps, pad_token_id=0)
    returns = torch.arange(b.action_mask.numel(), dtype=torch.float32).reshape(b.action_mask.shape)
    this = SimpleNamespace(cfg=cfg, step=6, log=RunLog(cfg.logger, tmp_path, tok, None, None))
    metrics = {}
    RLController._sample_metrics(this, b, exps, returns, metrics)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("debug_rollout")]
    std_g = statistics.stdev([1.0, 0.0])  # unbiased, over the group's rollouts
    assert metrics["group_reward_std"] == pytest.approx((std_g + std_g + 0.0) / 3)
    if not debug:
        assert lines == []
        return
    expected = []
    for i, (e, std) in enumerate(zip(exps, (std_g, std_g, 0.0))):
        mean_return = returns[i][b.action_mask[i]].mean().item()  # over the sample's action tokens
        expected.append(f"debug_rollout step 7 sample {e.rollout_id} group {e.group_id}: reward {e.reward:.4f} "
                        f"return {mean_return:.4f} group_reward_std {std:.4f} | {tok.decode(responses[i])!r}")
    assert lines == expected
