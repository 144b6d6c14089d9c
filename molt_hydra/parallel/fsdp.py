"""FSDP2 wrapping: `fully_shard` on every decoder layer, then on the root, with an fp32-master / bf16-compute policy.

Per-layer units let FSDP2 all-gather one block at a time (and prefetch the next); the root unit holds embeddings,
final norm and lm_head (tied embeddings stay one parameter). A critic's value head is its own fp32 unit.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from molt_hydra.models.build import DTYPES, decoder_layers


def shard_model(model: nn.Module, mesh, *, param_dtype: str = "bf16", offload: bool = False,
                reshard_after_forward: bool = True, compile_blocks: bool = False) -> nn.Module:
    # gradients are reduced in fp32 whatever the compute dtype, as Molt does
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32, cast_forward_inputs=True)
    kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        if compile_blocks:
            compile_block(layer)
        fully_shard(layer, **kw)
    if hasattr(model, "value_head"):
        fully_shard(model.value_head, **{**kw, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32)})
    fully_shard(model, **kw)
    return model


def compile_block(layer: nn.Module) -> None:
    """torch.compile one decoder block's forward (before sharding, as torchtitan): fuses the eager RMSNorm / rotary /
    SiLU casts into a few kernels; identical blocks share one graph; FSDP2's hooks stay outside it. Under HF's
    activation checkpointing the checkpoint moves inside the compiled region (torchtitan's order: AC, then compile),
    so the compiled backward recomputes the fused forward; HF's checkpoint around a compiled block recomputes it
    from outside and measured slower than eager (bench/RESULTS.md: Qwen3-4B with AC, 30.7 % vs 35.5 % MFU). The
    layer's own checkpoint function (`_gradient_checkpointing_func`, set by gradient_checkpointing_enable) wraps
    every call (HF checkpoints only when training); under no_grad it saves nothing to recompute, so that is harmless."""
    forward = layer.forward
    if getattr(layer, "gradient_checkpointing", False):  # transformers' GradientCheckpointingLayer
        layer.gradient_checkpointing = False
        forward = functools.partial(layer._gradient_checkpointing_func, forward)
    layer.forward = torch.compile(forward)


@torch.no_grad()
def to_compute_dtype(model: nn.Module, dtype: torch.dtype, keep: tuple = ()) -> dict:
    """model.master_weights=optimizer: replace every fp32 parameter (sharded or not) by a `dtype` copy, before the
    first forward (FSDP2 reads its params' dtypes lazily then: no cast at all-gather, grads in `dtype`). Parameters
    of the modules in `keep` (a critic's fp32 value head) stay fp32. Returns {new param: the fp32 original}, which
    the optimizer keeps as masters; buffers (rotary frequencies) are left as they are. Tied params stay tied."""
    kept = {id(p) for m in keep for p in m.parameters()}
    new, masters = {}, {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:  # the param itself (kept, or not fp32) or its `dtype` copy; the original: its master
                as_is = id(p) in kept or p.dtype != torch.float32
                new[id(p)] = p if as_is else nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                masters[new[id(p)]] = p.detach()
            setattr(module, name, new[id(p)])
    return masters
