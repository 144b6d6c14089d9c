"""compat/torch.py's host-memory DTensor (parallelism.offload=optimizer keeps fp32 masters and moments in host
memory, placed like the GPU parameters): built from the parameter's spec, its shard stays in host memory. The public
`DTensor.from_local` moves a shard to its mesh's device, which is what put every "offloaded" state tensor back on the
GPU on the H200 (2026-12-04). A CUDA-typed mesh without CUDA (backend not initialised) shows the difference on CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from molt_hydra.compat.torch import dtensor_in_place

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + __import__("sys").argv[1], rank=0, world_size=1)
    mesh = DeviceMesh("cuda", [0], _init_backend=False)  # a GPU parameter's mesh, on a machine without CUDA
    shard = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    param = DTensor(shard, DTensorSpec(mesh, (Shard(0),), TensorMeta((2, 3), (3, 1), torch.bfloat16)),
                    requires_grad=False)
    host = shard.float()
    master = dtensor_in_place(host, param)
    assert master._local_tensor is host, "the host shard was copied or moved"
    assert master.dtype == torch.float32 and master.shape == param.shape and master.placements == param.placements
    assert master.device_mesh is mesh
    try:
        DTensor.from_local(host, mesh, (Shard(0),), run_check=False)
    except (AssertionError, RuntimeError) as e:  # torch moves the shard to "cuda": not compiled here
        print("from_local moves:", e)
    else:
        raise SystemExit("from_local kept the host shard: compat's constructor is no longer needed")
    print("OK")
""")


def test_a_host_shard_placed_like_a_gpu_parameter_stays_in_host_memory():
    from molt_hydra.parallel.launch import free_port

    done = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr


def test_the_compiled_graph_count_rises_by_one_per_new_graph_and_not_on_reuse():
    """`perf/compiled_graphs` reads torch.compile's own counter: a fresh function compiles one graph, a call with the
    same shapes reuses it."""
    import torch

    from molt_hydra.compat.torch import compiled_graphs

    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")
    before = compiled_graphs()
    fn(torch.ones(3))
    assert compiled_graphs() == before + 1
    fn(torch.zeros(3))
    assert compiled_graphs() == before + 1


def test_the_fp32_grad_sum_compiles_one_graph_that_adds_as_eager_torch():
    """parallel/optim.py's fused add (MasterWeightAdamW's fp32 grad sums over micro-batches; it runs on a GPU, here on
    the CPU's inductor): over shapes of 1 to 3 dims, sizes from 2 elements to odd ones past any vector width, and grads
    that are slices at odd offsets of one buffer (as FSDP2's reduced shards are), main += bf16 grad is the exact sum
    rounded once to fp32, bit for bit eager torch's mixed-dtype add_, and one graph serves them all (a graph per size,
    per rank or per view base would rise here)."""
    import torch

    from molt_hydra.parallel.optim import fused_add_, fused_add_graphs

    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(8000, generator=gen).bfloat16()
    grads = [torch.randn(s, generator=gen).bfloat16() for s in ((2,), (3,), (1000,), (37, 111), (3, 7, 11), (4099,))]
    grads += [flat[off:off + n] for off, n in ((3, 129), (1001, 1999))] + [flat[4000:].view(50, 80)]
    for grad in grads:
        main = torch.randn(grad.shape, generator=gen)
        exact = main.double() + grad.double()  # exact: both fit 53 bits at these magnitudes
        eager = main.clone().add_(grad)
        fused_add_(main, grad)
        assert torch.equal(main, exact.float()) and torch.equal(main, eager), grad.shape
    assert fused_add_graphs() == 1
