"""NeMo AutoModel: what this project reaches into, and the releases it is checked against.

Written for nemo-automodel 0.7.x (the H200 device's; it is not installed on CPU hosts, where `model.backend=automodel`
is refused before anything here runs). Any other release is refused by each function below, naming the installed
version. Reached into here:

- `install_sync_free_permute`: AutoModel's grouped-GEMM experts permute their tokens with
  `nemo_automodel.components.moe.experts._permute_tokens_for_grouped_mm(indices, weights, token_mask,
  n_local_experts, experts_start_idx, *, return_slot_ids)`; it is replaced by one that hands calls with every expert
  local to a given sync-free permutation (models/automodel.py) and the others to AutoModel's own.
- `has_own_model_class`: `nemo_automodel._transformers.model_init.get_is_hf_model(config, force_hf)`, whether
  AutoModel would build a model with transformers' class (no AutoModel class of its own for the architecture).
- `hf_views`: a state-dict adapter's `convert_single_tensor_to_hf(fqn, tensor, for_checkpoint_load=True)`
  (grouped experts as views, `nemo_automodel.components.moe.state_dict_mixin`) and the `_inplace_loaded_native_keys`
  mark it leaves, undone.
- `engine_routing`: `nemo_automodel.components.moe.router_replay.RouterReplay` (its `apply(indices)`, called by every
  gate with its fresh top-k, its registry in layer order, its `replay` context). AutoModel's replay swaps the whole
  selection; the engine leaves some tokens unrouted (-1 rows: the last generated token, tokens it never saw), whose
  -1 ids then index the gate's scores out of range (a device-side assert, seen on an H100). `apply` is wrapped so the
  gate keeps its own top-k on those rows, and, with replay off, everywhere (the engine's selection only compared).
"""

from __future__ import annotations

from contextlib import contextmanager

from molt_hydra.compat import written_for
# imported where used: nemo_automodel (GPU hosts only)

SUPPORTED = {"nemo-automodel": ("0.7",)}


def install_sync_free_permute(n_experts: int, permute_all_local) -> None:
    """Route AutoModel's grouped-GEMM experts through `permute_all_local(indices, weights, token_mask, n_experts, *,
    return_slot_ids)` whenever a call has all `n_experts` local (ep = 1); expert-parallel calls (fewer local
    experts) keep AutoModel's own permutation. Installing again replaces the previous one."""
    written_for("the sync-free token permutation", "automodel", SUPPORTED)
    from nemo_automodel.components.moe import experts

    original = getattr(experts._permute_tokens_for_grouped_mm, "_molt_original", experts._permute_tokens_for_grouped_mm)

    def permute(indices, weights, token_mask, n_local_experts, experts_start_idx, *, return_slot_ids=False):
        if n_local_experts == n_experts and experts_start_idx == 0:
            return permute_all_local(indices, weights, token_mask, n_experts, return_slot_ids=return_slot_ids)
        return original(indices, weights, token_mask, n_local_experts, experts_start_idx,
                        return_slot_ids=return_slot_ids)

    permute._molt_original = original
    experts._permute_tokens_for_grouped_mm = permute


def has_own_model_class(config) -> bool:
    """Whether AutoModel builds `config`'s architecture with a model class of its own (not transformers')."""
    written_for("the model-class lookup", "automodel", SUPPORTED)
    from nemo_automodel._transformers.model_init import get_is_hf_model

    return not get_is_hf_model(config, False)


@contextmanager
def engine_routing(per_layer: list, *, replay: bool, observe=None):
    """Inside, every AutoModel gate meets the engine's selection `per_layer` (one [tokens, top_k] tensor per MoE layer,
    -1 rows unrouted): it uses it where the engine routed the token if `replay` (R3), else keeps its own top-k; each
    gate call reports `observe(layer, own, used, engine)` when given (routing statistics)."""
    written_for("routing replay on the engine's routed tokens", "automodel", SUPPORTED)
    import torch
    from nemo_automodel.components.moe.router_replay import RouterReplay, RouterReplayMode

    original = getattr(RouterReplay.apply, "_molt_original", RouterReplay.apply)

    def apply(self, indices):
        if self.mode != RouterReplayMode.REPLAY:
            return original(self, indices)
        engine = original(self, indices).to(indices.dtype)  # AutoModel's own checks: a target set, the same shape
        used = torch.where((engine >= 0).all(-1, keepdim=True), engine, indices) if replay else indices
        if observe is not None:
            observe(RouterReplay.instances().index(self), indices, used, engine)
        return used

    apply._molt_original = original
    RouterReplay.apply = apply
    try:
        with RouterReplay.replay(per_layer):
            yield
    finally:
        RouterReplay.apply = original


def hf_views(adapter):
    """`convert(fqn, tensor)`: AutoModel's conversion of one native tensor to its HF tensors
    (`convert_single_tensor_to_hf`), grouped experts as views of `tensor` where AutoModel can give them: its
    checkpoint-load form (`for_checkpoint_load=True`), not the export form, which copies each expert contiguous and runs
    `gc.collect` and `torch.cuda.empty_cache` per grouped tensor (~0.4 s a weight sync for a 10 GB MoE). The single
    pass then shares the trainer's own expert storage with the engine (a view's storage is the parameter's), and a
    bucket packs the views without the copies. That form also marks `fqn` as loaded in place
    (`_inplace_loaded_native_keys`, read by the adapter's next `from_hf`, which then skips rebuilding it): nothing was
    loaded, so the mark is undone. Some adapters' load form gives fresh destinations for a later rebuild, not the
    values (DeepSeek-V4's): unless every tensor is a view of `tensor`, the export form is what comes back. The release
    is checked once here, not per tensor (a metadata lookup, ~0.6 ms: thousands of expert tensors a sync)."""
    written_for("the HF view of grouped experts", "automodel", SUPPORTED)

    def convert(fqn: str, tensor):
        marks = getattr(adapter, "_inplace_loaded_native_keys", None)
        kept = None if marks is None else set(marks)
        try:
            out = adapter.convert_single_tensor_to_hf(fqn, tensor, for_checkpoint_load=True)
        finally:
            adapter._inplace_loaded_native_keys = kept
        storage = tensor.untyped_storage().data_ptr()
        if all(t.untyped_storage().data_ptr() == storage for _, t in out):
            return out
        return adapter.convert_single_tensor_to_hf(fqn, tensor)

    return convert
