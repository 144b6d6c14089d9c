"""`model.backend=automodel`: the policy / reference built and parallelized by NeMo AutoModel on the device mesh of the
`parallelism` group, its weights named back to the checkpoint's HF names, and R3 through AutoModel's RouterReplay.

AutoModel owns the model classes (grouped experts, fp32 gate), the mesh (dp shard x cp x tp, ep carved out of
dp shard x cp), FSDP2 with its mixed-precision policy, and full / selective activation checkpointing; the trainer
(parallel/trainer.py) only calls forward / backward / the optimizer on what `build_automodel` returns.

Only a GPU runs it: AutoModel takes `torch.cuda.current_device()` while building any model
(`nemo_automodel/_transformers/auto_model.py`, `_build_model`) and its Qwen3-MoE rotary cache is created on
`cuda:N`; on a CPU-only torch that raises "Torch not compiled with CUDA enabled". The parts that need no GPU
(mesh sizes, R3 index layout) are plain functions here, tested on CPU.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch

from molt_hydra.compat import automodel as automodel_compat
from molt_hydra.compat import transformers as transformers_compat
from molt_hydra.models import vlm
from molt_hydra.models.build import DTYPES, decoder_layers, load_config
from molt_hydra.models.moe_routing import expert_counts
# imported where used: nemo_automodel and torch.distributed (GPU hosts only)

AC_MODES = {False: False, True: "full", "none": False, "full": "full", "selective": "selective"}
VISION_PREFIXES = ("visual.", "vision_tower.", "vision_model.", "model.visual.", "model.vision_tower.")
ROUTER_PARAM = re.compile(r"\.mlp\.gate\.")


def parallel_sizes(world: int, *, dp: int, tp: int = 1, ep: int = 1, cp: int = 1) -> dict:
    """AutoModel's ParallelismSizes for `world` ranks: the dense mesh is dp_shard x cp x tp (= world); experts
    shard over ep ranks taken from dp_shard x cp, so ep must divide dp x cp. Raises ValueError with the fix."""
    for name, v in dict(dp=dp, tp=tp, ep=ep, cp=cp).items():
        if v < 1:
            raise ValueError(f"parallelism.{name} must be >= 1, got {v}")
    if dp * tp * cp != world:
        raise ValueError(f"dp {dp} x tp {tp} x cp {cp} = {dp * tp * cp} != {world} trainer ranks; "
                         f"set parallelism.trainer_devices to a multiple of tp x cp")
    if (dp * cp) % ep:
        raise ValueError(f"ep {ep} must divide dp x cp = {dp * cp} (AutoModel takes expert ranks from the "
                         f"data/context-parallel ranks); choose parallelism.ep among the divisors of {dp * cp}")
    return dict(dp_size=dp, tp_size=tp, cp_size=cp, ep_size=ep)


def per_layer_replay_indices(routed: torch.Tensor) -> list[torch.Tensor]:
    """[B, L, layers, topk] routed experts (the sample key `routed_experts`, right-padded with -1) -> one [B*L, topk]
    int64 tensor per MoE layer in the token order the gates see (rows flattened); -1 rows (padding, tokens the engine
    did not route) stay -1: the gate's own top-k there (compat/automodel.py `engine_routing`)."""
    b, n, layers, k = routed.shape
    flat = routed.long().reshape(b * n, layers, k)
    return [flat[:, i].contiguous() for i in range(layers)]


def permute_tokens_all_local(indices: torch.Tensor, weights: torch.Tensor, token_mask: torch.Tensor,
                             n_experts: int, *, return_slot_ids: bool = False):
    """AutoModel's `_permute_tokens_for_grouped_mm` for the case where every expert is local (ep = 1), without a
    device -> host sync. The original filters its [tokens * topk] assignments to the local experts with boolean masks
    (three `t[mask]` and a `nonzero`: each waits for the GPU, ~64 stalls per 30B-A3B-shape step, measured 109
    cudaStreamSynchronize per step) and counts with `bincount` (another sync for its length). With every expert
    local, nothing needs filtering: the assignments are sorted by expert as they are, counted with a scatter-add.
    A padded token (token_mask False) keeps its experts with routing weight 0, so its expert output is 0 as when it
    is dropped, and no gradient reaches its weights. Returns what the original returns, in the same order."""
    num_tokens, topk = indices.shape
    flat = indices.reshape(-1)
    kept = torch.where(token_mask.unsqueeze(-1), weights.float(), 0.0).reshape(-1)
    order = flat.argsort(stable=True)  # slot ids (token * topk + k) grouped by expert, token order inside
    tokens_per_expert = expert_counts(flat, n_experts, torch.int64)
    offs = tokens_per_expert.cumsum(0).to(torch.int32)
    sorted_token_ids, sorted_weights = order // topk, kept[order]
    if return_slot_ids:
        return sorted_token_ids, order, sorted_weights, tokens_per_expert, offs
    return sorted_token_ids, sorted_weights, tokens_per_expert, offs


@contextlib.contextmanager
def replay_routed_experts(routed: torch.Tensor, *, replay: bool = True, stats=None,
                          real_tokens: torch.Tensor | None = None):
    """The engine's routed experts `routed` inside: under R3 (`replay`) every gate uses them where the engine routed
    the token and its own top-k elsewhere (router logits stay live, so the router still learns); without, the gates
    keep their own. Either way `stats` (models/moe_routing.py `RoutingStats`) counts the gates' agreement with the
    engine, and expert loads over `real_tokens` ([B, L], 0 on right-padding) only, as the HF routers (was: padding
    counted, its own top-k skewing routing/expert_load_entropy). Keep the backward inside the block:
    activation-checkpoint recompute runs the gates again and must replay too."""
    real = None if real_tokens is None else real_tokens.reshape(-1)  # the gates' token order: rows flattened

    def observe(layer, own, used, engine):
        stats.add(layer, None, own, used, engine, real=None if real is None else real.to(own.device))

    with automodel_compat.engine_routing(per_layer_replay_indices(routed), replay=replay,
                                         observe=None if stats is None else observe):
        yield


def build_automodel(path: str, *, role: str = "actor", dp_size: int, tp_size: int = 1, ep_size: int = 1,
                    cp_size: int = 1, param_dtype: str = "bf16", gradient_checkpointing=False,
                    random_init: bool = False, config_overrides: dict | None = None,
                    attn_implementation: str = "sdpa", compile_blocks: bool = False, moe_dispatcher: str = "torch",
                    experts_backend: str | None = None, linear_backend: str | None = None,
                    rms_norm: str = "torch_fp32", gate_precision: str = "float32",
                    freeze_moe_router: bool = False, freeze_visual_encoder: bool = False,
                    moe_reshard_after_forward: bool = False, sequence_parallel: bool = False,
                    master_weights: str = "fsdp"):
    """fp32 master weights, FSDP2 bf16 compute (fp32 grad reduce), AutoModel's own model class where it has one.
    master_weights=optimizer on one rank: no FSDP2 at all (the trainer casts the params; nothing to shard), VLMs
    aside."""
    import torch.distributed as dist
    from nemo_automodel import NeMoAutoModelForCausalLM
    from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config, MoEParallelizerConfig
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.moe.router_replay import RouterReplay
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = load_config(path, config_overrides, random_init)
    config.dtype = torch.float32  # master weights; AutoModel's model classes read the storage dtype from the config
    if not getattr(config, "architectures", None):  # AutoModel picks its own model class by architecture name
        config.architectures = [transformers_compat.causal_lm_architecture(config.model_type)]
    if not automodel_compat.has_own_model_class(config):
        raise ValueError(f"model.backend=automodel: NeMo AutoModel has no model class of its own for "
                         f"{config.architectures[0]}; set model.backend=hf")
    moe, world = bool(getattr(config, "num_experts", 0)), dist.get_world_size()
    # AutoModel's mesh and FSDP2 strategy: bf16 compute, fp32 grad reduce; experts sharded over ep when ep > 1
    sizes = parallel_sizes(world, dp=dp_size, tp=tp_size, ep=ep_size, cp=cp_size)
    ac = AC_MODES[gradient_checkpointing] if role != "ref" else False
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32, output_dtype=None,
                              cast_forward_inputs=False)
    strategy = FSDP2Config(sequence_parallel=sequence_parallel, mp_policy=mp, activation_checkpointing=ac,
                           enable_compile=compile_blocks,
                           # one rank: keep gathered params from forward to backward (nothing to save by freeing)
                           reshard_after_forward=None if world > 1 else False)
    moe_cfg = MoEParallelizerConfig(reshard_after_forward=moe_reshard_after_forward, mp_policy=mp) \
        if moe and ep_size > 1 else None
    setup = DistributedSetup.build(strategy, ParallelismSizes(**sizes), moe_parallel_config=moe_cfg,
                                   activation_checkpointing=ac)
    backend = BackendConfig(attn=attn_implementation, linear=linear_backend or "torch", rms_norm=rms_norm,
                            rope_fusion=False, experts=experts_backend or "torch_mm", dispatcher=moe_dispatcher,
                            gate_precision=gate_precision)
    kw = dict(distributed_setup=setup, dtype=torch.float32, backend=backend, use_liger_kernel=False,
              load_base_model=not random_init)
    if moe:  # every gate gets a RouterReplay: the engine's experts are replayed under R3, compared without it
        kw["moe_overrides"] = {"enable_routing_replay": True}
    RouterReplay.clear_registry()  # gates register in construction order: this model's layers only
    if moe and ep_size == 1:
        automodel_compat.install_sync_free_permute(config.num_experts, permute_tokens_all_local)
    model = NeMoAutoModelForCausalLM.from_config(config, **kw)
    if world == 1 and (master_weights != "optimizer" or vlm.is_vlm(config)):  # a VLM keeps FSDP2's input cast
        _shard_one_rank(model, param_dtype)  # (its fp32 pixel values meet bf16 params), as on the HF path
    model._molt_mesh = setup.mesh_context  # the grad-norm reduction needs the dense and expert meshes
    freeze(model, router=freeze_moe_router or role == "ref", visual=freeze_visual_encoder or role == "ref",
           everything=role == "ref")
    model.train(role != "ref")
    return model


def _shard_one_rank(model, param_dtype: str) -> None:
    """AutoModel skips fully_shard on one rank (components/distributed/fsdp2.py), and with it the bf16 compute cast:
    the model would compute in fp32. One-rank FSDP2 with the HF path's policy (parallel/fsdp.py) restores it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32, cast_forward_inputs=True)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    for module in [*decoder_layers(model), model]:
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def clip_grad_norm(model, max_norm: float, dp_size: int) -> torch.Tensor:
    """AutoModel's clipping: expert grads rescaled for the EP / FSDP ratio, then one norm over parameters that live
    on different meshes (dense dp_shard and ep), which torch's clip_grad_norm_ cannot stack."""
    from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm

    mesh = model._molt_mesh
    moe = mesh.moe_mesh
    ep_axis = "ep" if moe is not None and "ep" in moe.mesh_dim_names else None
    # clipping off is an infinite bound, not AutoModel's None, which skips the norm and returns 0.0: the step's
    # non-finite check (parallel/trainer.py) and actor_grad_norm need the norm measured (a coefficient of 1 then)
    return scale_grads_and_clip_grad_norm(max_norm if max_norm > 0 else math.inf, [model], norm_type=2.0,
                                          device_mesh=mesh.device_mesh, moe_mesh=moe, ep_axis_name=ep_axis,
                                          dp_group_size=dp_size)


def freeze(model, *, router: bool, visual: bool, everything: bool = False) -> list[str]:
    """requires_grad=False on MoE router (gate) weights and / or the vision tower; returns the frozen names."""
    frozen = []
    for name, p in model.named_parameters():
        clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if everything or (router and ROUTER_PARAM.search(clean)) or (visual and clean.startswith(VISION_PREFIXES)):
            p.requires_grad_(False)
            frozen.append(clean)
    return frozen


def hf_name_mapper(model, views: bool = False):
    """(own name, full tensor) -> [(HF name, tensor), ...] through AutoModel's state-dict adapter: grouped experts
    `...mlp.experts.gate_and_up_projs` [E, H, 2I] become `...mlp.experts.{e}.gate_proj.weight` etc. `views`: as views
    of the tensor where AutoModel can (the weight sync, which only reads them); else contiguous copies (an export,
    which safetensors writes whole)."""
    adapter = getattr(model, "state_dict_adapter", None)
    convert = None if adapter is None else \
        automodel_compat.hf_views(adapter) if views else adapter.convert_single_tensor_to_hf

    def to_hf(name: str, tensor: torch.Tensor):
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        return convert(name, tensor) if convert is not None else [(name, tensor)]

    return to_hf
