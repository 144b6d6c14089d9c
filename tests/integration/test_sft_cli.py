"""`molt-run job=sft` on a tiny chat dataset: 2 FSDP2 gloo ranks, the loss falls, an HF model comes out."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

MOLT_RUN = str(Path(sys.executable).with_name("molt-run"))


def test_sft_job_lowers_the_loss(tmp_path):
    rng = random.Random(0)
    data = tmp_path / "chats.jsonl"
    with open(data, "w") as f:
        for _ in range(64):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                             {"role": "assistant", "content": f"The answer is {a + b}."}]}) + "\n")
    out = tmp_path / "run"
    proc = subprocess.run([MOLT_RUN, "job=sft", f"data.train_path={data}", "data.input_key=messages",
                           "train.batch_size=16", "train.micro_batch_size=4", "train.epochs=3",
                           "train.optimizer.lr=1e-3", f"hydra.run.dir={out}"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 64 // 16  # one optimizer step per 16 chats, 3 epochs
    assert rows[-1]["sft_loss"] < 0.7 * rows[0]["sft_loss"]
    assert (out / "run_record.json").exists() and list(out.rglob("model.safetensors"))
    # its training data's identity, which a resume compares (runtime/entrypoint.py `_refuse_other_sft_data`)
    from molt_hydra.data.sft_dataset import data_identity
    from molt_hydra.parallel.checkpoint import saved_client_state

    assert saved_client_state(out / "checkpoints" / "step_12")["train_data"] == data_identity(data)
