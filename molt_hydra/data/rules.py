"""Validation rules that read the datasets' names: where data.train_path / eval.data_path point, and whether their
rows carry images the engine can take. Run by runtime/validate.py beside config/validate.py's rules."""

from __future__ import annotations

import os
from pathlib import Path

from molt_hydra.config.bounds import get
from molt_hydra.config.schema import RunConfig
from molt_hydra.config.validate import Problems, changed, check_location
from molt_hydra.data.prompts import (BUILTIN, BUILTIN_TASKS, FILE_TYPES, IMAGE_COLUMNS, IMAGE_TASKS, JSON_TYPES,
                                     READABLE, SFT_TASKS, builtin_size, image_places, saved_dir, unread_images,
                                     unread_name)
from molt_hydra.data.sft_dataset import check_sft_rows

COLUMN_KEYS = ("data.input_key", "data.label_key", "data.tools_key", "data.image_key")


def check_data(cfg: RunConfig, problems: Problems) -> None:
    """Both datasets' locations. Image rows need an engine that takes images: a builtin image task with 0 images per
    prompt (e.g. for a text-only model) would drop every row; blanking images that never reach the engine changes
    nothing."""
    d = cfg.data
    fix = f"give files, directories, hub dataset ids or one of {[BUILTIN + n for n in sorted(BUILTIN_TASKS)]}"
    for key, spec in (("data.train_path", d.train_path), ("eval.data_path", cfg.eval.data_path)):
        problems.check(spec is None or bool(spec.replace(",", "").strip()), key, f"{spec!r} names no dataset.",
                       fix + ", or null")
        parts, entries = _specs(spec), (spec or "").split(",")
        empty = [i for i, entry in enumerate(entries, 1) if not entry.strip()]
        # (was: skipped without a word, e.g. a dataset's name lost between two commas)
        problems.check(not parts or not empty, key, f"{spec!r} has an empty entry at position{'s' * (len(empty) > 1)} "
                       f"{', '.join(map(str, empty))} of its {len(entries)} comma-separated entries.",
                       "name one dataset between each two commas, or remove the extra comma")
        for part in parts:
            if part.startswith(BUILTIN):
                problems.check(part[len(BUILTIN):] in BUILTIN_TASKS, key, f"{part!r} is not a builtin task.", fix)
            elif why := unread_name(part):  # (a suffix or a pattern: its own fix, not a hub id's)
                raised(problems, key, ValueError(why), fix)
            else:
                check_location(problems, key, part, "file or directory", fix)
                _check_local(cfg, problems, key, Path(os.path.expanduser(part)))
        image = next((p for p in parts if p.startswith(BUILTIN) and p[len(BUILTIN):] in IMAGE_TASKS), None)
        problems.check(image is None or d.max_images_per_prompt > 0, "data.max_images_per_prompt",  # once per key
                       f"{key} has image rows ({image}), but 0 images per prompt reach the engine (a text-only setup).",
                       "set data.max_images_per_prompt=1 with a vision-language model.path")
    # a dataset never drawn is never exhausted, and interleaving runs until every one is (data/prompts.py)
    problems.check(all(p > 0 for p in d.train_probs or ()), "data.train_probs",
                   f"{list(d.train_probs or [])} gives a dataset probability 0: it would never be drawn.",
                   "give every dataset of data.train_path a probability > 0, or remove that dataset")
    # (job=sft refuses any train_probs: config/job_ignores.py)
    problems.check(not (d.train_probs is not None and len(d.train_probs) == 1 and cfg.job.value == "rl"),
                   "data.train_probs", f"one dataset ({d.train_path}) is drawn with probability 1, so interleaving "
                   "reads its rows in the order concatenation does and it changes nothing.",
                   "unset data.train_probs, or list several datasets in data.train_path (comma-separated)")
    _sft_data(cfg, problems)
    problems.check(not (d.blank_images and d.max_images_per_prompt == 0), "data.blank_images",
                   "no image reaches the engine (data.max_images_per_prompt=0), so there is nothing to blank.",
                   "set data.blank_images=false, or data.max_images_per_prompt to the images per row")
    # a row's images come from a builtin image task or a file's data.image_key column (data/prompts.py); an image an
    # agent adds itself is no prompt image, and stays as it is
    specs = _specs(cfg.eval.data_path) + ([] if cfg.job.value == "eval" else _specs(d.train_path))
    problems.check(not (d.blank_images and d.max_images_per_prompt > 0 and cfg.job.value != "sft" and specs and all(
        s[len(BUILTIN):] not in IMAGE_TASKS if s.startswith(BUILTIN) else d.image_key is None for s in specs)),
        "data.blank_images", f"no dataset of the run has prompt images ({', '.join(specs)}: builtin text tasks, or "
        "files read without data.image_key), so there is nothing to blank.",
        "set data.blank_images=false, or point the data at images (a builtin image task, or data.image_key)")
    _unread_keys(cfg, problems)


def _check_local(cfg: RunConfig, problems: Problems, key: str, path: Path) -> None:
    """A local dataset the run can read (`readable_local`); job=sft: its chat rows pass the loader's checks (RL prompt
    rows: agents/rules.py check_prompts, with the chat server's parser). Before, each failed once the run had started
    Ray and its engines: a malformed line or row (an unknown suffix: data/prompts.py unread_name). A directory is read
    as datasets reads it (save_to_disk output, or data files: agents/rules.py)."""
    if readable_local(path):
        if cfg.job.value == "sft" and path.suffix in JSON_TYPES and path.is_file():
            try:  # (job=sft reads .jsonl / .json files alone: _sft_data; RL prompt rows: agents/rules.py check_prompts)
                rows = check_sft_rows(str(path), cfg.data.input_key, cfg.data.output_key)
            except (KeyError, OSError, ValueError) as e:
                raised(problems, key, e, f"point {key} at {READABLE}")
                return
            _sft_images(cfg, problems, str(path), rows)
            if key == "data.train_path":
                _sft_fills_a_batch(cfg, problems, str(path), len(rows))


def readable_local(spec: str | Path) -> bool:
    """A local dataset the run reads: a non-empty data file of a type it reads, or a non-empty directory (`save_to_disk`
    output, or data files as a hub dataset holds them; anything else: check_location's or _check_local's problem;
    agents/rules.py reads the prompt rows of these)."""
    if not str(spec).strip():  # (Path("") is the current directory)
        return False
    path = Path(os.path.expanduser(spec))
    # (os.path's tests: False for a name too long to be a path, where Path's raise OSError; check_location says so)
    if os.path.isfile(path):
        return path.suffix in FILE_TYPES and path.stat().st_size > 0
    return os.path.isdir(path) and any(path.iterdir())


def raised(problems: Problems, key: str, error: Exception, fix: str) -> None:
    """A loader's error, "reason. Fix: fix" (a KeyError's: its argument), as key's problem (`fix` where it has none)."""
    reason, _, given = (error.args[0] if isinstance(error, KeyError) else str(error)).partition(" Fix: ")
    problems.check(False, key, reason.rstrip(".") + ".", given or fix)


def _sft_fills_a_batch(cfg: RunConfig, problems: Problems, source: str, count: int) -> None:
    """job=sft trains steps of train.batch_size samples, one per row at most, and drops an epoch's partial batch
    (parallel/sft.py): fewer rows (at most data.max_samples of them) train nothing. Was: the trainer ranks refused it
    once the run had started ("train.batch_size=64 must divide over 2 ranks and be <= 1 samples")."""
    n, bs = min(count, cfg.data.max_samples), cfg.train.batch_size
    capped = n < count
    problems.check(n >= bs, "data.max_samples" if capped else "data.train_path",
                   f"{source} has {count} SFT row(s){f', {n} of them read (data.max_samples)' if capped else ''}, "
                   f"fewer than the train.batch_size={bs} samples of one optimizer step: nothing would be trained.",
                   f"set train.batch_size <= {n} (train.micro_batch_size with it), or "
                   + (f"raise data.max_samples to >= {bs}" if capped else "give it more rows"))


def _sft_data(cfg: RunConfig, problems: Problems) -> None:
    """SFT reads one .jsonl / .json file of chat rows, or a builtin task with replies (data/sft_dataset.py
    load_rows): a list of datasets, a directory, another file type, a hub dataset or a prompt-only task failed the
    run once it had started."""
    if cfg.job.value != "sft":
        return
    tasks = [BUILTIN + n for n in SFT_TASKS]
    for key, spec in (("data.train_path", cfg.data.train_path), ("eval.data_path", cfg.eval.data_path)):
        parts = _specs(spec)
        if parts and parts[0] in tasks and len(parts) == 1:
            try:  # its rows' columns, as a local file's are (_check_local; colors_warm's 256 rows: ~25 ms). Was: any
                # data.input_key / output_key passed, and the trainer ranks refused the first row once started
                rows = check_sft_rows(parts[0], cfg.data.input_key, cfg.data.output_key)
            except ValueError as e:
                raised(problems, key, e, f"set data.input_key / data.output_key to the columns of {parts[0]}")
                continue
            _sft_images(cfg, problems, parts[0], rows)
            if key == "data.train_path":
                _sft_fills_a_batch(cfg, problems, parts[0], builtin_size(parts[0]))
        # a directory named *.jsonl too is refused (was: passed, and the trainer ranks failed on "Is a directory")
        folder = len(parts) == 1 and os.path.isdir(Path(os.path.expanduser(parts[0])))
        if not parts or len(parts) == 1 and (parts[0] in tasks or Path(parts[0]).suffix in JSON_TYPES and not folder):
            continue
        prompts_only = len(parts) == 1 and parts[0].startswith(BUILTIN)
        problems.check(False, key, f"job=sft reads one .jsonl or .json file of chat rows (or one of {tasks}), got "
                       f"{spec!r}" + (": a builtin prompt task has no replies to train on." if prompts_only else
                                      ", a directory." if folder else "."),
                       f"point {key} at one .jsonl/.json file (a dataset converts with datasets' to_json), or "
                       "use job=rl for prompt data")


def _sft_images(cfg: RunConfig, problems: Problems, source: str, rows: list) -> None:
    """SFT rows' images are read from data.image_key alone (data/sft_dataset.py): a key no row has, or none on a
    builtin image task's rows, trained every row on its text alone, a literal <image> left in the prompt, without a
    word. (A file's rows without the column are text rows; a builtin task's images are its 'images' column.)"""
    image_key, columns = cfg.data.image_key, sorted({k for row in rows if isinstance(row, dict) for k in row})
    builtin_images = source.startswith(BUILTIN) and source[len(BUILTIN):] in IMAGE_TASKS
    problems.check(image_key is None or image_key in columns, "data.image_key",
                   f"{image_key!r} is a column of no row of {source} (its columns: {columns}), so no row's images "
                   "would be read: each would train on its text alone.",
                   "set data.image_key=images" if builtin_images else
                   "set data.image_key to the rows' image column, or null for text-only data")
    unread = next((c for c in IMAGE_COLUMNS if c in columns), None) if image_key is None else None
    at = next((i for i, r in enumerate(rows) if isinstance(r, dict) and image_places(r.get(cfg.data.input_key))),
              None) if unread and not builtin_images else None
    if at is not None:
        raised(problems, "data.image_key", ValueError(unread_images(f"{source}: SFT row {at}", unread)), "")
    problems.check(not (image_key is None and builtin_images), "data.image_key",
                   f"the rows of {source} carry images (column 'images'), but data.image_key=null reads none: "
                   "each row would train on its text alone, a literal <image> in its prompt.",
                   "set data.image_key=images (with a vision-language model.path)")


def missing_data_files(cfg: RunConfig) -> str | None:
    """Problem lines for the data files the run reads (a name with a data file's suffix: the loader never takes one
    for a hub id) that are not there, or None. Was: the run started Ray and its engines, then failed loading it
    ("[Errno 2]"). Not at validation: a dry run plans a recipe whose data is prepared later (recipes/README.md)."""
    keys = ([] if cfg.job.value == "eval" else [("data.train_path", cfg.data.train_path)]) + [
        ("eval.data_path", cfg.eval.data_path)]
    lines = [f"- {key}: {part!r} names a data file, and there is none at {os.path.abspath(os.path.expanduser(part))}. "
             "Fix: write or prepare it (python -m molt_hydra.data.prepare: recipes/README.md), or give its path"
             for key, spec in keys for part in _specs(spec) if not part.startswith(BUILTIN)
             and Path(part).suffix.lower() in FILE_TYPES and not os.path.lexists(os.path.expanduser(part))]
    return "\n".join(lines) or None


def _specs(spec: str | None) -> list[str]:
    return [p.strip() for p in (spec or "").split(",") if p.strip()]


def _set(cfg: RunConfig, key: str) -> bool:
    """Set away from its default, and not to a blank name (handoff_rules.name_rules reports that one)."""
    value = get(cfg, key)
    return changed(cfg, key) and not (isinstance(value, str) and not value.strip())


def _unread_keys(cfg: RunConfig, problems: Problems) -> None:
    """Prompt datasets' keys no dataset of the run reads: builtin:// tasks generate their rows (no column is looked
    up), a split is chosen only in a DatasetDict (a saved directory or a hub dataset), never in a data file, and a
    config only in a hub dataset or a directory of data files.
    job=eval: a recipe's columns are its training data's, left alone (cli.py refuses the command line's)."""
    if cfg.job.value == "sft":  # SFT reads its own keys (runtime/sft_job.py); config/job_ignores.py covers the splits
        return
    specs = _specs(cfg.data.train_path) + _specs(cfg.eval.data_path)
    builtin = [s for s in specs if s.startswith(BUILTIN)]
    problems.table(((cfg.job.value == "eval" or not (specs and len(builtin) == len(specs) and _set(cfg, key)), key,
                     "builtin:// tasks "
                     f"generate their own rows ({', '.join(specs)}); no column is read, so it changes nothing.",
                     f"unset {key}, or point the data at a dataset that has that column") for key in COLUMN_KEYS))
    # a config is chosen only in a hub dataset or a directory of data files (was: no key for one; data/prompts.py)
    splits, configs = "a DatasetDict directory or hub dataset", "a hub dataset or a directory of data files"
    for key, spec, saved, kind, where in (
            ("data.split", cfg.data.train_path, _one_dataset, "Dataset", splits),
            ("eval.split", cfg.eval.data_path, _one_dataset, "Dataset", splits),
            ("data.config_name", cfg.data.train_path, saved_dir, "dataset", configs),
            ("eval.config_name", cfg.eval.data_path, saved_dir, "dataset", configs)):
        fixed = [s for s in _specs(spec) if s.startswith(BUILTIN) or saved(Path(os.path.expanduser(s)))
                 or Path(s).suffix in FILE_TYPES and not os.path.isdir(Path(os.path.expanduser(s)))]  # (a file's name)
        problems.check(not (fixed and len(fixed) == len(_specs(spec)) and _set(cfg, key)), key,
                       f"{', '.join(fixed)} has no {key.split('.')[1].split('_')[0]}s to choose from (a builtin:// "
                       f"task, a data file or a saved {kind}), so it changes nothing.",
                       f"unset {key}, or point the data at {where}")


def _one_dataset(path: Path) -> bool:
    """A `save_to_disk` directory of one Dataset, not of a DatasetDict (datasets.load_from_disk tells them apart by
    the same files): it loads whole, whatever the split."""
    return os.path.isdir(path) and (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file()
