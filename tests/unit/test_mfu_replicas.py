"""perf/mfu's sequence length (the attention term of the FLOPs per token) under tensor / context parallelism: the
tp x cp ranks of one data-parallel group hold the same samples, so the batch's mean length is its tokens over the
samples of the DP groups, not over the samples x every rank. Before, it was divided by the world size: tp=2 halved
the length the attention FLOPs were counted at, cp=8 (Molt's long-context recipes) cut it 8x, and perf/mfu read low
(at 32k tokens most of a step's FLOPs are attention). Two real gloo ranks (tp=2: one DP group); the trainer object is
a stand-in holding only what the metric reduction reads."""

import socket
import subprocess
import sys

import pytest

RANKS = r"""
import sys, torch
import torch.distributed as dist
import torch.multiprocessing as mp
from types import SimpleNamespace

def rank_main(rank, port):
    from transformers import Qwen3Config
    from molt_hydra.parallel.trainer import TrainerWorker
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=1000, head_dim=16)
    worker = SimpleNamespace(world_size=2, dp_size=1, role="actor", moe=False, compile_blocks=False,
                             device=torch.device("cpu"), spec=SimpleNamespace(peak_tflops=1.0),
                             model=SimpleNamespace(config=config),
                             scheduler=SimpleNamespace(get_last_lr=lambda: [1e-3]))
    samples = [{"input_ids": torch.zeros(n, dtype=torch.long)} for n in (100, 300)]  # both tp ranks: the same two
    m = TrainerWorker._step_metrics(worker, samples, {"_tokens": torch.tensor(0.0)}, [torch.tensor(1.0)], 2.0, [1])
    if rank == 0:
        print(f"MFU {m['perf/mfu']!r} TOKENS_PER_SEC {m['perf/train_tokens_per_sec']!r}", flush=True)

if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2)
"""


@pytest.mark.slow  # ~20 s idle, a minute on 2 busy cores: three processes import torch and transformers
def test_mfu_counts_attention_at_the_batchs_sequence_length_under_tensor_parallelism(tmp_path):
    from transformers import Qwen3Config

    from molt_hydra.parallel.perf import flops_per_token, mfu

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    out = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=300)
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("MFU ")] or [out.stderr[-3000:]]
    _, got, _, tokens_per_sec = line.split()
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=1000, head_dim=16)
    tokens, seconds = 100 + 300, 2.0  # the DP group's two samples, once (the two tp ranks share them)
    assert float(tokens_per_sec) == tokens / seconds
    # their mean length, 200 tokens; on the world's 2 devices at a peak of 1 TFLOP/s each
    assert float(got) == mfu(tokens, seconds, flops_per_token(config, 200), 1e12, 2)
