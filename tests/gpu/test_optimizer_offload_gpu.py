"""parallelism.offload=optimizer on one GPU (run on the device): `python -m pytest -m gpu
tests/gpu/test_optimizer_offload_gpu.py`. The params stay on the GPU, the fp32 masters and AdamW moments live on
the host, the GPU holds less, and the training is the in-place optimizer's (both compute in fp32: in bf16, an fp32
rounding difference between CPU and CUDA AdamW can flip a bf16 rounding in the next forward; in fp32 only the AdamW
arithmetic differs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import _master_weight_jobs as mw_jobs  # noqa: E402

from molt_hydra.parallel.launch import run_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_optimizer_offloaded_to_the_host_on_one_gpu(tmp_path):
    runs = {}
    for offload in (False, True):
        run_ranks(mw_jobs.offload_steps, 1, tmp_path / f"offload_{offload}.pt", offload, timeout_s=300)
        runs[offload] = torch.load(tmp_path / f"offload_{offload}.pt", weights_only=False)
    off, inplace = runs[True], runs[False]
    assert off["param_devices"] == inplace["param_devices"] == {"cuda:0"}
    assert off["state_devices"] == {"cpu"} and not any(off["master_is_param"].values())
    assert all(off["master_equals_param"].values())  # fp32 params: each step writes its host masters back exactly
    assert off["peak_bytes"] < inplace["peak_bytes"]
    for name, p in inplace["params"].items():
        torch.testing.assert_close(off["params"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    print(f"\npeak GPU memory: in place {inplace['peak_bytes'] / 2**20:.1f} MiB, "
          f"optimizer on the host {off['peak_bytes'] / 2**20:.1f} MiB")
