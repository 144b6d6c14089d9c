"""Validation rules that read the datasets' names: where data.train_path / eval.data_path point, and whether their
rows carry images the engine can take. Run by runtime/validate.py beside config/validate.py's rules."""

from __future__ import annotations

from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import Problems, check_location
from molt_hydra.data.prompts import BUILTIN, BUILTIN_TASKS, IMAGE_TASKS


def check_data(cfg: RunConfig, problems: Problems) -> None:
    """Both datasets' locations. Image rows need an engine that takes images: a builtin image task with 0 images per
    prompt (e.g. for a text-only model) would drop every row; blanking images that never reach the engine changes
    nothing."""
    d = cfg.data
    fix = f"give files, directories, hub dataset ids or one of {[BUILTIN + n for n in sorted(BUILTIN_TASKS)]}"
    for key, spec in (("data.train_path", d.train_path), ("eval.data_path", cfg.eval.data_path)):
        problems.check(spec is None or bool(spec.replace(",", "").strip()), key, f"{spec!r} names no dataset.",
                       fix + ", or null")
        parts = [p.strip() for p in (spec or "").split(",") if p.strip()]
        for part in parts:
            if not part.startswith(BUILTIN):
                check_location(problems, key, part, "file or directory", fix)
                continue
            problems.check(part[len(BUILTIN):] in BUILTIN_TASKS, key, f"{part!r} is not a builtin task.", fix)
        image = next((p for p in parts if p.startswith(BUILTIN) and p[len(BUILTIN):] in IMAGE_TASKS), None)
        problems.check(image is None or d.max_images_per_prompt > 0, "data.max_images_per_prompt",  # once per key
                       f"{key} has image rows ({image}), but 0 images per prompt reach the engine (a text-only setup).",
                       "set data.max_images_per_prompt=1 with a vision-language model.path")
    problems.check(not (d.blank_images and d.max_images_per_prompt == 0), "data.blank_images",
                   "no image reaches the engine (data.max_images_per_prompt=0), so there is nothing to blank.",
                   "set data.blank_images=false, or data.max_images_per_prompt to the images per row")
