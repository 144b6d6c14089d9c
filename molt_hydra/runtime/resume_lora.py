"""A checkpoint's LoRA adapter against this run's, before anything starts (runtime/entrypoint.py's resume checks):
model.lora as the trainer takes it (alpha None -> 2 x rank, target_modules None -> the family's default, a set as
PEFT matches it), so a config that spells out what the saved one left to its default is the same run; and, where the
adapters differ (rank, targets, base) or one side has none, why its weights cannot start this run, with the fix that
works for a resume and a warm start alike: a new run from an HF export.
"""

from __future__ import annotations

import copy

# a warm start (checkpoint.load_model_only) loads the checkpoint's weights by name, so an export starts a new run
NEW_RUN = "in a new run (checkpoint.dir a new directory, checkpoint.load_model_only=false)"


def as_trained(tree: dict) -> dict:
    """A config_as_dict tree (this run's or a checkpoint's record) with model.lora's alpha and target_modules as the
    trainer resolves them (runtime/trainer_options.py, models/lora.py); targets sorted (PEFT takes them as a set).
    Before: a resume that set alpha=2 x rank or the family's default targets, which the saved run left null, was
    refused as a changed model.lora."""
    from molt_hydra.models.lora import resolve_targets
    from molt_hydra.models.rules import model_fields

    lora = (tree.get("model") or {}).get("lora") or {}
    if lora.get("rank") is None:
        return tree
    out = copy.deepcopy(tree)
    resolved = out["model"]["lora"]
    if "alpha" in lora:
        resolved["alpha"] = float(lora["alpha"] or 2.0 * lora["rank"])
    if "target_modules" in lora:
        model_type = (model_fields(tree["model"].get("path")) or {}).get("model_type")
        targets = resolve_targets(model_type, lora["target_modules"])
        resolved["target_modules"] = sorted(set(targets)) if targets is not None else None
    return out


def adapter_change(now: dict, saved: dict) -> tuple[str, str] | None:
    """(why, fix) where the checkpoint saved under config `saved` holds weights this run (config `now`, both
    config_as_dict trees) cannot load: full weights under an adapter, an adapter under full weights, or an adapter of
    another rank, targets or base; None where both train full weights or the same adapter."""
    def shape(tree: dict, resolved: bool) -> tuple:
        model = (as_trained(tree) if resolved else tree).get("model") or {}
        lora = model.get("lora") or {}
        return lora.get("rank"), lora.get("target_modules"), model.get("path")

    if shape(now, True) == shape(saved, True) or shape(now, False)[0] is None and shape(saved, False)[0] is None:
        return None
    (rank, targets, path), before = shape(now, False), shape(saved, False)
    if before[0] is None:
        return ("holds full weights (saved with model.lora.rank=null), and a LoRA run's engines serve model.path's "
                "base and receive only the adapter: its base cannot come from a checkpoint (the trainer would train "
                "on its, the engines sample from model.path's)",
                "set model.path to its HF export (checkpoint.export_dir, or checkpoint.save_hf's "
                f"<checkpoint.dir>/hf/step_N) {NEW_RUN}")
    merged = f"set model.path to its merged export (<checkpoint.export_dir>/merged, checkpoint.export_merged=true) " \
             f"{NEW_RUN}"
    if rank is None:
        return (f"holds a LoRA adapter (saved with model.lora.rank={before[0]}), which does not load into the full "
                "weights this run trains", merged)
    return (f"holds an adapter of rank {before[0]} on {before[1] or 'the family default'} over model.path="
            f"{before[2]}; this run's is rank {rank} on {targets or 'the family default'} over {path}: an adapter "
            "loads only into one of its shape, and the engines serve model.path's base", f"{merged} to train a new "
            "adapter on it")
