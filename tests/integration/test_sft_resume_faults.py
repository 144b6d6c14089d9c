"""job=sft's rank loop (parallel/sft.py) on a damaged checkpoint, as the RL run's (test_resume_faults.py): one rank
in this process (as under torchrun: real FSDP2 over gloo, the tiny model, real checkpoint files)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from molt_hydra.parallel.checkpoint import resolve_checkpoint
from molt_hydra.parallel.launch import free_port
from molt_hydra.parallel.sft import run_sft

pytestmark = pytest.mark.timeout(300)


def rows(n: int) -> list[dict]:
    rng = random.Random(0)
    return [{"input": [{"role": "user", "content": f"What is {a}+{b}?"}], "output": f"It is {a + b}."}
            for a, b in ((rng.randint(0, 20), rng.randint(0, 20)) for _ in range(n))]


# 6 rows in batches of 2: 3 steps, one micro-batch each
SMALL = dict(input_key="input", output_key="output", batch_size=2, lr=3e-3, num_ranks=1, lr_warmup_ratio=0.0,
             max_tokens_per_micro_batch=1024, max_len=64, timeout_s=120, param_dtype="fp32", export_hf=False)


@pytest.fixture
def one_rank(monkeypatch):
    """run_sft runs its one rank in this process (as torchrun's ranks do); a process group a failure left is ended."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield lambda: monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if dist.is_initialized():
        dist.destroy_process_group()


def sft(one_rank, out: Path, **kw) -> list[dict]:
    one_rank()
    return run_sft("tiny://qwen3_tiny", rows(6), str(out), ckpt_path=str(out / "ckpt"), **{**SMALL, **kw})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Three steps without a stop, a checkpoint after each."""
    out = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RANK", "0")
        mp.setenv("WORLD_SIZE", "1")
        mp.setenv("MASTER_PORT", str(free_port()))
        history = run_sft("tiny://qwen3_tiny", rows(6), str(out), ckpt_path=str(out / "ckpt"), save_steps=1, **SMALL)
    assert [r["global_step"] for r in history] == [1, 2, 3]
    return out / "ckpt", [r["sft_loss"] for r in history]


def _change_a_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # its length kept: only the CRC32 the load checks can tell
    shard.write_bytes(bytes(data))


def test_a_damaged_shard_of_the_newest_checkpoint_is_passed_over_for_the_one_before(straight, one_rank, tmp_path,
                                                                                     capfd):
    """The run's resume check chose step_3 (it reads the small files only); the load finds its shard changed. Before:
    'Run failed: sft trainer rank 0: DamagedCheckpoint: reading .../step_3 failed', though step_2 was there."""
    shutil.copytree(straight[0], tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "step_3"
    _change_a_byte(newest / "dcp" / "__0_0.distcp")
    history = sft(one_rank, tmp_path, resume=True, resume_step="step_3")
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("Checkpoint passed over")]
    assert len(lines) == 1 and lines[0].startswith(f"Checkpoint passed over: {newest}: dcp/__0_0.distcp: CRC32 ")
    assert lines[0].endswith(f"(its bytes changed since the save); resuming from {tmp_path / 'ckpt' / 'step_2'} "
                             "instead"), lines
    assert [r["global_step"] for r in history] == [3]
    assert history[0]["sft_loss"] == pytest.approx(straight[1][2], rel=1e-5)  # step 3 again, from step 2's state
    assert resolve_checkpoint(tmp_path / "ckpt", checksums=True) == newest  # saved again in its place

