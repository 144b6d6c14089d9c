"""Prompt datasets for RL and eval: files, saved datasets, hub names, or `builtin://NAME` tasks generated here.

A row is a plain dict: `prompt` (string or chat messages), `label`, optional `tools`, `images`, `datasource`
(eval metrics are grouped by it). Keys are renamed from the configured columns, so agents see one shape.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from functools import partial
from pathlib import Path

from jinja2 import TemplateError

from molt_hydra.data.images import blank_like, to_pil_images
# imported where used: PIL and datasets (heavy; builtin tasks need neither)

log = logging.getLogger(__name__)

BUILTIN = "builtin://"
FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
CONFIG_FIX = "set data.config_name (for eval.data_path: eval.config_name)"  # (the run's key; prepare.py: --config)


def _arithmetic(n: int, seed: int, max_operand: int = 20) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": f"What is {a}+{b}? Put the final answer in \\boxed{{}}."}],
             "label": str(a + b), "datasource": "arithmetic"} for a, b in pairs]


def _toy(n: int, seed: int) -> list[dict]:
    # The toy task's reward is computed from the response alone (recipes/agents/toy.py); prompts only vary the context.
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": f"Count: {rng.randint(0, 999)}"}], "label": "", "datasource": "toy"}
            for _ in range(n)]


def _geo_triangles(n: int, seed: int, size: int = 56) -> list[dict]:
    """Synthetic geometry with a figure (the CPU VLM recipe's task, geo3k-shaped): a triangle drawn with two of its
    angles given, find the third. One 56x56 PIL image per row, placed at the prompt's `<image>` marker."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(25, 85), rng.randint(25, 85)
        # vertices: A at the bottom left, B at the bottom right, C where the rays at angles a and b meet
        base = size - 8
        ta, tb = math.tan(math.radians(a)), math.tan(math.radians(b))
        cx = base * tb / (ta + tb)
        cy = min(cx * ta, size - 8)
        y0 = size - 4
        im = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(im).polygon([(4, y0), (4 + base, y0), (4 + cx, y0 - cy)], outline=(0, 0, 0))
        rows.append({"prompt": [{"role": "user", "content": f"<image>Two angles of the triangle are {a} and {b} "
                                 "degrees. Find x, the third angle. Put the final answer in \\boxed{}."}],
                     "label": str(180 - a - b), "datasource": "geo_triangles", "images": [im]})
    return rows


COLORS = {"red": (230, 20, 20), "green": (20, 180, 20), "blue": (20, 20, 230), "yellow": (240, 220, 20)}
COLOR_QUESTION = ("<image>What colour is the shape? Answer with one letter: R (red), G (green), B (blue) or "
                  "Y (yellow).")


def _colors(n: int, seed: int, *, sft: bool = False, size: int = 56) -> list[dict]:
    """The pixel task of the CPU VLM recipe: one big disc or square (most of the image: each of the 4 image tokens of
    the tiny Idefics3 sees it) in one of 4 colours on a white background; the question is the same on every row, so
    only the image tells the answer (chance 1/4). Colours are balanced. The
    answer is the colour's initial (R, G, B, Y): one token of the tiny tokenizer, so one sampled token decides it.
    `sft`: the warm start's rows (`input` / `output`), each answer drawn independently of its image: they teach the
    answer format, never the colour."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    names = [list(COLORS)[i % len(COLORS)] for i in range(n)]
    rng.shuffle(names)
    rows = []
    for name in names:
        r, cx, cy = rng.randint(22, 26), rng.randint(25, size - 25), rng.randint(25, size - 25)
        shade = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in COLORS[name])
        im = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(im)
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([cx - r, cy - r, cx + r, cy + r], fill=shade)
        if sft:
            rows.append({"input": COLOR_QUESTION, "output": rng.choice(list(COLORS))[0].upper(), "images": [im]})
        else:
            rows.append({"prompt": [{"role": "user", "content": COLOR_QUESTION}], "label": name[0].upper(),
                         "datasource": "colors", "images": [im]})
    return rows


# name -> its rows' maker; the first argument is the row count (`builtin_size`: validation counts rows unmade)
BUILTIN_TASKS = {
    "toy": partial(_toy, 512, seed=0),
    "toy_eval": partial(_toy, 32, seed=1),
    "arithmetic": partial(_arithmetic, 2000, seed=0),
    "arithmetic_eval": partial(_arithmetic, 100, seed=1),
    "geo_triangles": partial(_geo_triangles, 256, seed=0),
    "geo_triangles_eval": partial(_geo_triangles, 16, seed=1),
    "colors": partial(_colors, 1024, seed=0),
    "colors_eval": partial(_colors, 32, seed=1),
    "colors_warm": partial(_colors, 256, seed=2, sft=True),
}

IMAGE_TASKS = ("geo_triangles", "geo_triangles_eval", "colors", "colors_eval", "colors_warm")  # rows with images
SFT_TASKS = ("colors_warm",)  # rows with replies (input / output), the only ones job=sft can train on


def builtin_rows(spec: str) -> list[dict]:
    """The rows of `builtin://NAME` (data/rules.py checks the config's names; `run_sft`'s are checked here)."""
    name = spec[len(BUILTIN):]
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown builtin task {name!r}; known: {sorted(BUILTIN_TASKS)}")
    return BUILTIN_TASKS[name]()


def builtin_size(spec: str) -> int:
    """The row count of `builtin://NAME` (a known name), without making its rows."""
    return BUILTIN_TASKS[spec[len(BUILTIN):]].args[0]


def load_dataset(spec: str, split: str, config: str | None = None, config_fix: str = CONFIG_FIX):
    """A data file (json/jsonl/csv/parquet/arrow), a `save_to_disk` folder, a directory of data files or a hub dataset
    name (the last two of config `config`; `config_fix`: how the caller's user picks one), as one split."""
    import datasets

    if why := unread_name(spec):
        raise ValueError(why)
    path = Path(os.path.expanduser(spec))  # as validation reads it (config/validate.py check_location)
    # a directory is read as one whatever its name (was, for one named *.jsonl: "[Errno 21] Is a directory")
    if path.suffix in FILE_TYPES and not os.path.isdir(path):  # a missing file: datasets' FileNotFoundError names it
        if path.suffix in JSON_TYPES and path.is_file():
            check_json_rows(path)
        # a CSV's cells as written: pandas would guess types per column, a label "2" read as 2.0 once a cell of its
        # column is empty, "007" as 7.0 (graded as those); an empty cell is still None (a null label, refused)
        text = {"features": _text_columns(path)} if path.suffix == ".csv" and path.is_file() else {}
        try:
            return datasets.load_dataset(FILE_TYPES[path.suffix], data_files=str(path), split="train", **text)
        except FileNotFoundError:
            raise
        except Exception as e:  # an empty file (a bare StopIteration), malformed rows (DatasetGenerationError)
            if _no_rows(path):  # (was: datasets' 'Instruction "train" corresponds to no data!' or, for a parquet
                # file of no row group, 'BatchSize must be greater than 0, got 0')
                raise ValueError(f"{path} has no rows (its columns alone). Fix: write the rows again (a filter kept "
                                 "none?), or point the key at a dataset with rows") from None
            raise ValueError(f"{path} is not a readable {path.suffix[1:]} file: {_reason(e)}") from None
    if saved_dir(path):
        return _saved(path, split)
    return _repository(str(path) if os.path.isdir(path) else spec, split, config, config_fix)


READABLE = (f"a data file ({', '.join(sorted(FILE_TYPES))}), a directory of data files or a save_to_disk "
            "directory")
COMPRESSED = {".gz": "gunzip -k", ".bz2": "bunzip2 -k", ".xz": "unxz -k", ".zst": "zstd -d", ".zip": "unzip",
              ".lz4": "lz4 -d"}  # (each suffix's tool, told in the fix)


def unread_name(spec: str) -> str | None:
    """Why the run reads no dataset at local name `spec` ("reason. Fix: fix"): a file of a suffix it does not read,
    the fix for an upper-case or compressed one its own, a URL or a file name pattern; else None. Validation's check too
    (data/rules.py). Was: each taken for a hub id: "Couldn't find any data file at" a file that is there; for a
    pattern 'neither an existing file or directory nor a hub id (Repo id must be in the form ...)'."""
    path = Path(os.path.expanduser(spec))
    if os.path.isfile(path) and path.suffix not in FILE_TYPES:
        inner = Path(path.stem).suffix
        fix = (f"rename it to {path.with_suffix(path.suffix.lower()).name} (suffixes are read in lower case)"
               if path.suffix.lower() in FILE_TYPES else
               f"decompress it to {path.stem} (e.g. {COMPRESSED[path.suffix.lower()]} {path}), and point the key at "
               "that file"
               if path.suffix.lower() in COMPRESSED and inner.lower() in FILE_TYPES else f"convert it to {READABLE}")
        return (f"{str(path)!r} is a file of a type the run does not read (suffix {path.suffix or 'none'!r}). "
                f"Fix: {fix}")
    if "://" in spec:  # (was: told a file name pattern, for the ? of its query)
        return (f"{spec!r} is a URL, and the run reads none. Fix: download it, and point the key at the file (or give "
                "a hub dataset's id)")
    if any(c in spec for c in "*?") and not os.path.lexists(path):  # (no hub id holds these)
        return (f"{spec!r} is a file name pattern, and the run expands none. Fix: point the key at the directory "
                "that holds the files (read as one dataset), or name each file, comma-separated (job=sft reads one "
                "file: concatenate them into one)")
    return None


def saved_dir(path: Path) -> bool:
    """A `save_to_disk` directory (datasets.load_from_disk tells it by the same files), not a dataset repository's.
    (os.path's tests: False for a name too long to be a path, where Path's raise OSError; validation says so.)"""
    return os.path.isdir(path) and any(os.path.isfile(path / name) for name in ("state.json", "dataset_dict.json"))


def _repository(spec: str, split: str, config: str | None, config_fix: str):
    """A hub dataset, or a local directory of data files (a hub dataset's copy: its README's `configs`, or files named
    by split), as datasets.load_dataset(spec, config, split=split) reads it. A config it lacks, or none where it has
    several, names them and the key that picks one (was: no key could pass datasets its `name`, so a dataset of
    several configs, e.g. openai/gsm8k's main and socratic, could not be read at all)."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(spec, config)
    except FileNotFoundError as e:
        if not os.path.isdir(spec):  # (a hub dataset's words stand)
            raise
        raise ValueError(f"{spec} is a directory of no data file datasets reads ({_reason(e)}), and no save_to_disk "
                         "output (no state.json or dataset_dict.json). Fix: point the key at data files (.jsonl, "
                         ".json, .csv, .parquet, .arrow), a directory of them or a save_to_disk directory") from None
    except ValueError:  # (datasets' words name load_dataset's `name`, which the run has no knob for)
        names = datasets.get_dataset_config_names(spec)
        if config is None and len(names) > 1 or config is not None and config not in names:
            why = f"has several configs {names} and none is chosen" if config is None else \
                f"has no config {config!r}; its configs: {names}"
            raise ValueError(f"{spec} {why}. Fix: {config_fix} to one of them") from None
        raise
    files = {str(name) for name in builder.config.data_files or ()}
    wanted = {part.split("[")[0].strip() for part in split.split("+")}  # datasets' split syntax: train[:10%]+test
    if files and not wanted <= files:  # (was: datasets' 'Unknown split', naming no key)
        raise ValueError(f"{spec}{f' (config {config})' if config else ''} has no split {split!r}; its splits: "
                         f"{sorted(files)}. Fix: set data.split (for eval.data_path: eval.split) to one of them")
    builder.download_and_prepare()
    return builder.as_dataset(split=split)


def _no_rows(path: Path) -> bool:
    """Whether a parquet or arrow file that datasets could not read is one of no rows (its columns alone)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            return pq.read_metadata(path).num_rows == 0
        with pa.memory_map(str(path)) as source:  # an arrow stream (datasets' form), or an arrow file
            try:
                return pa.ipc.open_stream(source).read_all().num_rows == 0
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all().num_rows == 0
    except (OSError, pa.ArrowException):  # (not parquet / arrow at all: datasets' reason stands)
        return False


def _saved(path: Path, split: str):
    """A `save_to_disk` directory as one split. A DatasetDict's split is loaded alone, from its own directory: datasets'
    load_from_disk of the whole dict raised IndexError ('list index out of range', a traceback out of validation) when
    any of its splits was empty, whichever one was asked for; an empty Dataset is refused as having no rows."""
    import datasets

    if (listed := path / "dataset_dict.json").is_file():
        splits = json.loads(listed.read_text())["splits"]
        if split not in splits:  # (was: a KeyError read as "...: test")
            raise ValueError(f"{path} has no split {split!r}; its splits: {sorted(splits)}. Fix: set data.split (for "
                             "eval.data_path: eval.split) to one of them")
        path = path / split
    # an empty split saves no data file (load_from_disk fails there); a filter that kept none saves one of no rows
    state = path / "state.json"
    no_files = state.is_file() and not json.loads(state.read_text()).get("_data_files")
    loaded = None if no_files else datasets.load_from_disk(str(path))
    if loaded is None or not len(loaded):
        raise ValueError(f"{path} has no rows (an empty Dataset was saved there). Fix: save the rows again (a filter "
                         "kept none?), or point the key at a dataset with rows")
    return loaded


JSON_TYPES = (".json", ".jsonl")


def check_json_rows(path: Path) -> list[dict]:
    """A .jsonl / .json file read as datasets will, line by line, so that an error names the file's line: datasets'
    own name a row of its current chunk (a list row on line 3: 'Column() changed from object to string in row 0'), a
    bad line 7 'row 6', and a file of blank lines 'Instruction "train" corresponds to no data!'. A UTF-8 BOM is read
    over, as datasets does. Also data/rules.py's check, so a dry run finds these before anything starts. Returns the
    rows (objects)."""
    text = _utf8_text(path)
    whole = path.suffix == ".json" and _one_value(text)  # datasets also reads JSON Lines in a .json
    # split at "\n" alone: splitlines also splits at a U+2028 inside a JSON string, which JSON leaves unescaped
    lines = [(1, text)] if whole else [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    out = []
    for n, line in lines:
        try:
            rows = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {e.lineno if whole else n} is not JSON ({e.msg}). Fix: one JSON object "
                             "per line (.jsonl), or one JSON list of objects (.json)") from None
        rows = rows if whole and isinstance(rows, list) else [rows]  # a .json of one object: one row, as datasets
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise ValueError(f"{path}: {f'item {i}' if whole else f'line {n}'} is {row!r:.60}, not a JSON object. "
                                 "Fix: make every row an object of the dataset's columns")
        out.extend(rows)
    if not out:
        raise ValueError(f"{path} has no rows (it is empty or blank). Fix: write one JSON object per line")
    return out


def _utf8_text(path: Path) -> str:
    """A data file's text (a UTF-8 BOM read over, as datasets does); a byte that is not UTF-8 is an error naming its
    line."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line} is not UTF-8 ({e.reason}). Fix: save the file as UTF-8") from None


def _one_value(text: str) -> bool:
    """Whether a .json file's text is one JSON value (a list of rows, or one object over several lines), not JSON
    Lines; a list that does not parse is one too, so that its error names its own line."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return text.lstrip().startswith("[")
    return True


def check_prompt_rows(spec: str, split: str, config: str | None = None, **keys: str | None) -> list[dict]:
    """A local dataset's rows as load_prompts renames and checks them (`_renamed`; images are decoded at load), for
    validation (agents/rules.py check_prompts), so a dry run, and a run before Ray starts, finds a bad row (was:
    found only once Ray and the engines had started)."""
    return _renamed(*_table(spec, split, config), spec, **keys)


def _table(spec: str, split: str, config: str | None) -> tuple:
    """(rows, column names) of a dataset. A JSON file's rows are read here as written, each row's missing keys null
    as datasets reads them: datasets reads a column of mixed types (a label "1" in one row, {"x": 1} in another) as
    Json and decodes its strings, the label "1" read as 1, "null" as None, "42" as a prompt as the number 42."""
    if why := unread_name(spec):  # (before the JSON files' read: a pattern is no file)
        raise ValueError(why)
    if (path := Path(os.path.expanduser(spec))).suffix in JSON_TYPES and not os.path.isdir(path):
        rows = check_json_rows(path)
        columns = sorted({key for row in rows for key in row})
        return [{key: row.get(key) for key in columns} for row in rows], columns
    dataset = load_dataset(spec, split, config)
    return dataset, dataset.column_names


def _text_columns(path: Path):
    """A CSV file's columns, each read as text. A row of more cells than the header names is refused: pandas would
    take its first cell for the row's index and shift the others one column left (a prompt read as its label)."""
    import csv

    import datasets

    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            header = next((row for row in rows if row), [])  # pandas skips blank lines (was: a blank first line
            # read as a header of no column, and every row refused as having more cells than it names)
            if len(set(header)) < len(header):
                raise ValueError(f"{path}: the header names a column twice ({header}). Fix: give each column its "
                                 "own name")
            count = 0
            for count, row in enumerate((row for row in rows if row), 1):
                if len(row) > len(header):
                    raise ValueError(f"{path}: line {rows.line_num} has {len(row)} cells, the header names "
                                     f"{len(header)} ({header}). Fix: quote cells that hold a comma, or name every "
                                     "column")
            if not count:  # (was: datasets' 'Instruction "train" corresponds to no data!' / 'No columns to parse')
                raise ValueError(f"{path} has no rows{' below its header' if header else ' (it is blank)'}. Fix: "
                                 "write a header line of the column names, then one line per row")
    except UnicodeDecodeError:  # (was: the codec's words, naming neither the file nor the line)
        _utf8_text(path)  # raises, naming the line (this stream's error counts bytes from its chunk, not the file)
        raise
    return datasets.Features({name: datasets.Value("string") for name in header})


def _reason(error: BaseException) -> str:
    """The root cause's first line (datasets wraps a parse error in 'An error occurred while generating...')."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = f"{error}".strip().splitlines()
    return text[0] if text else "it is empty" if isinstance(error, StopIteration) else type(error).__name__


def load_prompts(spec: str, *, split: str = "train", config_name: str | None = None, input_key: str = "prompt",
                 label_key: str | None = "label", tools_key: str | None = None, image_key: str | None = None,
                 max_samples: int | None = None, probs: list[float] | None = None, seed: int = 0,
                 max_images_per_prompt: int = 0, blank_images: bool = False, image_fits=None,
                 template_fits=None, prompt_tokens=None, lengths: tuple[int, int] = (0, 0)) -> list[dict]:
    """Rows from comma-separated specs; several specs are concatenated, or interleaved with `probs`. Each row's prompt
    is one `template_fits(prompt, tools)` renders (`usable_template_rows`). Images of `image_key` become PIL images, at
    most `max_images_per_prompt` per row, each one `image_fits` takes (`usable_image_rows`); `blank_images` replaces
    each by a grey one of its size. Prompts over the room `lengths` (data.max_len, max_new_tokens) leave are counted
    (`count_long_prompts`, by `prompt_tokens`)."""
    specs = [s.strip() for s in spec.split(",") if s.strip()]  # `probs`: one per spec (DataConfig checks it)
    if not all(p > 0 for p in probs or ()):  # never drawn, its rows would never be exhausted: the loop below hangs
        raise ValueError(f"data.train_probs={list(probs)}: every dataset needs a probability > 0")
    parts = []
    for s in specs:
        rows = builtin_rows(s) if s.startswith(BUILTIN) else _renamed(
            *_table(s, split, config_name), s, input_key=input_key, label_key=label_key,
            tools_key=tools_key, image_key=image_key)
        if not rows:
            raise ValueError(f"{s} has no rows")
        rows = usable_template_rows(rows, s, template_fits) if template_fits is not None else rows
        rows = usable_image_rows(rows, s, image_key or "images", max_images_per_prompt, blank_images,
                                 fits=image_fits)
        if prompt_tokens is not None:  # the rows of it the run reads (not a hub dataset's millions past max_samples)
            count_long_prompts(rows[:max_samples] if max_samples else rows, s, prompt_tokens, *lengths, image_fits)
        parts.append(rows)
    return combined(parts, max_samples, probs, seed)


def combined(parts: list, max_samples: int | None, probs: list[float] | None, seed: int) -> list:
    """The rows the run trains on, of each dataset's rows (`parts`, in data.train_path's order): each capped at
    `max_samples`, concatenated, or interleaved by `probs`, the whole capped again. Also validation's count of them
    (agents/rules.py check_prompts passes each dataset's row count as a range)."""
    parts = [part[:max_samples] if max_samples else part for part in parts]
    if probs is None:
        out = [r for part in parts for r in part]
    else:  # interleave by probability until every dataset is exhausted once (datasets' "all_exhausted")
        rng, cursors, out = random.Random(seed), [0] * len(parts), []
        while any(c < len(p) for c, p in zip(cursors, parts)):
            i = rng.choices(range(len(parts)), weights=probs)[0]
            out.append(parts[i][cursors[i] % len(parts[i])])
            cursors[i] += 1
    return out[:max_samples] if max_samples else out  # the cap holds per dataset and overall (Molt)


IMAGE_FIX = ("give each row readable images in data.image_key: PIL images, encoded bytes, or paths, a relative one "
             "read from the directory the run starts in ({cwd})")  # (.format(cwd=os.getcwd()) where told)


def unfound_image(rows: list[dict]) -> str | None:
    """The first image path of the renamed `rows` that is not there, where every row with images has one (each such
    row would be dropped at load: `usable_image_rows`); else None. Validation's check, which decodes nothing: before,
    such data (paths relative to the data file's directory, say) passed a dry run and failed at the run's start."""
    first = None
    for row in rows:
        if (value := row.get("images")) is None:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        paths = [i.get("path") if isinstance(i, dict) and not i.get("bytes") else i for i in items]
        missing = next((p for p in paths if isinstance(p, str) and not os.path.isfile(p)), None)
        if missing is None:
            return None
        first = first or missing
    return first


def usable_image_rows(rows: list[dict], spec: str, image_key: str, max_images: int, blank: bool,
                      column: str = "images", dropped: list | None = None, fits=None) -> list[dict]:
    """Rows whose images (`column`, the data's `image_key`) all decode (as RGB PIL images) within `max_images`, and
    that `fits(image)` (the model's processor's count of its tokens: a ValueError for an image it refuses, e.g.
    Qwen-VL's aspect ratio over 200) takes; every other row is dropped, counted and logged with its row id (and,
    given `dropped`, appended to it as (row id, why)), so one bad image costs one sample, never the run (was, for the
    processor's refusal: each of the row's rollouts failed as agent_exception, every epoch). All rows dropped is an
    error."""
    kept, dropped = [], [] if dropped is None else dropped
    for i, r in enumerate(rows):
        if r.get(column) is not None:
            where = f"{spec} row {i} ({image_key})"
            try:
                decoded = to_pil_images(r[column], max_images, where)
                if (places := image_places(r.get("prompt"))) and places != len(decoded):
                    # each marker takes the next image (the Envs' image_parts, the chat agents' prompt_messages):
                    # was, for each rollout of the row every epoch, vLLM's error or a sample dropped at training
                    raise ValueError(f"{where}: its prompt places {places} image(s) (<image> markers, image parts) "
                                     f"for its {len(decoded)} image(s). Fix: write one <image> where each image goes")
                for k, im in enumerate(decoded if fits is not None else ()):
                    try:
                        fits(im)
                    except ValueError as e:
                        raise ValueError(f"{where} image {k}: the model's processor refuses it ({e})") from e
            except ValueError as e:
                log.warning("data: dropped %s", e)
                dropped.append((i, str(e)))
                continue
            r = {**r, column: [blank_like(im) for im in decoded] if blank else decoded}  # the caller's row unchanged
        kept.append(r)
    if dropped:
        log.warning("data: dropped %d of %d rows of %s with unusable images (row ids %s)", len(dropped), len(rows),
                    spec, [i for i, _ in dropped][:20])
    if rows and not kept:
        raise ValueError(f"every row of {spec} was dropped for its images; the first: {dropped[0][1]}. Fix: "
                         f"{IMAGE_FIX.format(cwd=os.getcwd())}")
    return kept


TEMPLATE_FIX = ("give the rows the roles and order the chat template takes (e.g. a system message folded into the "
                "first user message), or use a model whose template renders them")


def usable_template_rows(rows: list[dict], spec: str, fits) -> list[dict]:
    """Rows whose prompt (with its tools) `fits(prompt, tools)` renders: the model's chat template, as the agent
    runners render it. A row it refuses (jinja's TemplateError from its raise_exception: Gemma's 'System role not
    supported', Mistral's role order; a TypeError: content it cannot join) is dropped, counted and logged with its row
    id, as one with an unusable image is (was: each of the row's rollouts failed with jinja's error naming no row, every
    epoch). One row per shape (`_shape`: what templates decide on, short of the text) is rendered, then each row of a
    refused shape: 100k two-message rows took 0.2 s so, 1.9 s rendered in full (the tiny model's template; their load:
    1.5 s), and a real template is longer. A refusal that the text alone decides, in a shape taken, is left to the
    rollout. All rows dropped is an error."""
    refused, verdicts = {}, {}  # refused: reason -> row ids; verdicts: shape -> its first row's refusal, or None

    def refusal(row: dict) -> str | None:
        try:
            fits(row["prompt"], row.get("tools"))
        except (TemplateError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    for i, row in enumerate(rows):
        shape = _shape(row)
        if shape not in verdicts:
            verdicts[shape] = why = refusal(row)
        else:
            why = verdicts[shape] and refusal(row)  # an accepted shape's rows pass; a refused one's each rendered
        if why is not None:
            refused.setdefault(why, []).append(i)
    gone = {i for ids in refused.values() for i in ids}
    for why, ids in refused.items():
        log.warning("data: dropped %d of %d rows of %s: the chat template refuses their messages (%s) (row ids %s). "
                    "Fix: %s", len(ids), len(rows), spec, why, ids[:20], TEMPLATE_FIX)
    if rows and len(gone) == len(rows):
        why, ids = next(iter(refused.items()))
        raise ValueError(f"every row of {spec} was dropped: the chat template refuses their messages; row {ids[0]}: "
                         f"{why}. Fix: {TEMPLATE_FIX}")
    return [row for i, row in enumerate(rows) if i not in gone] if gone else rows


def count_long_prompts(rows: list[dict], spec: str, lengths_of, max_len: int, max_new_tokens: int,
                       image_fits=None) -> None:
    """Log the rows whose first prompt, `lengths_of([(prompt, tools, room), ...])` tokens as the agent runners render
    it (at most `room` where it fits; None where its chat template refuses it: the rollout's error), is over the room
    data.max_len leaves beside max_new_tokens and its images (`image_fits` tokens each), counted, with their row ids.
    Kept: an Env's reset may shorten it. Was: found at each rollout of each row, a log line a rollout (the step
    runner's left cut), never counted."""
    room = max_len - max_new_tokens
    rooms = [room - sum(map(image_fits, row.get("images") or ())) if image_fits else room for row in rows]
    counts = lengths_of([(row["prompt"], row.get("tools"), r) for row, r in zip(rows, rooms)])
    long = {i: n for i, (n, r) in enumerate(zip(counts, rooms)) if n is not None and n > r}
    if long:
        images = " and their images" if any(r < room for r in rooms) else ""
        log.warning("data: %d of %d rows of %s have prompts over the %d tokens data.max_len=%d leaves them beside "
                    "max_new_tokens=%d%s (the longest %d tokens; row ids %s): an Env's rollout left-truncates each "
                    "(one with images fails), a chat agent's first turn generates fewer tokens, none over "
                    "data.max_len. Fix: raise data.max_len, lower the max_new_tokens, or filter those rows out",
                    len(long), len(rows), spec, room, max_len, max_new_tokens, images, max(long.values()),
                    list(long)[:20])


def _shape(row: dict) -> tuple:
    """What a chat template decides on, short of the text: each message's role, the keys it sets and its content's
    kind (text, or the types of its parts), and the row's tools."""
    def kind(content):
        if isinstance(content, list):
            return tuple(p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content)
        return type(content).__name__

    prompt, tools = row["prompt"], row.get("tools")
    messages = "text" if isinstance(prompt, str) else tuple(
        (m.get("role"), tuple(sorted(k for k, v in m.items() if v is not None)), kind(m.get("content")))
        for m in prompt)
    return messages, None if tools is None else json.dumps(tools, sort_keys=True, default=str)


COLUMN_FIX = {"input_key": "set data.input_key to the prompt column",
              "label_key": "set data.label_key to the column of each row's answer, or data.label_key=null for data "
                           "without labels (the agent then gets label '')",
              "tools_key": "set data.tools_key to the tools column, or null",
              "image_key": "set data.image_key to the image column, or null for text-only data"}


def _renamed(dataset, columns: list[str], spec: str, **keys: str | None) -> list[dict]:
    """The dataset's rows in the runner's names. Each configured column must exist: a missing label, tools or image
    column would hand every rollout an empty label, no tools or no images (a math reward of 0 throughout, a VLM
    trained text-only) without a word."""
    for key, column in keys.items():
        if column is not None and column not in columns:
            raise KeyError(f"data.{key}={column!r} is not a column; columns: {sorted(columns)} "
                           f"({spec}). Fix: {COLUMN_FIX[key]}")
    rows = [_rename(row, f"{spec} row {i}", **keys) for i, row in enumerate(dataset)]
    unread = next((c for c in IMAGE_COLUMNS if c in columns), None) if keys.get("image_key", "") is None else None
    if unread and (at := next((i for i, r in enumerate(rows) if image_places(r["prompt"])), None)) is not None:
        raise ValueError(unread_images(f"{spec} row {at}", unread))
    return rows


IMAGE_COLUMNS = ("images", "image")  # the columns a VLM dataset keeps its images in (datasets' and TRL's names)


def image_places(prompt) -> int:
    """The images a prompt (text or chat messages) places: its `<image>` markers and `{"type": "image"}` parts."""
    if isinstance(prompt, str):
        return prompt.count("<image>")
    contents = [m.get("content") for m in prompt if isinstance(m, dict)] if isinstance(prompt, list) else []
    return sum(image_places(c) if isinstance(c, str) else sum(
        isinstance(p, dict) and p.get("type") == "image" for p in c) if isinstance(c, list) else 0 for c in contents)


IMAGE_PART_FIX = ("give the row's images in the column data.image_key names, and a bare {'type': 'image'} part (or an "
                  "<image> marker) where each goes")


def own_image_part(messages, kinds: tuple[str, ...] = ("image",)) -> tuple[str, object] | None:
    """(why, its image) for the first content part of chat `messages` that names its own image, a form the run does
    not read: one of type "image" with an image (`{"type": "image", "image": PATH}`, the HF chat templates' form; a
    bare one is the row's next image), or of another of `kinds` (job=sft reads images from data.image_key alone, so
    "image_url" too); else None."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            image = next(((k, v) for k, v in part.items() if k != "type" and v is not None), None) \
                if kind in kinds else None
            if image is not None:
                return (f"messages[{i}].content[{j}] is an image part of its own image ({image[0]!r}: "
                        f"{image[1]!r:.60}), a form the run does not read", image[1])
    return None


def unread_images(where: str, column: str) -> str:
    """Rows whose prompts place images from a column data.image_key=null does not read (was: each trained on without
    its image, the literal `<image>` in its text, and without a word)."""
    return (f"{where}: its prompt places an image (<image>, or an image part) and the data has an image column "
            f"{column!r}, but data.image_key=null reads no image: the model would get the prompt without it. Fix: set "
            f"data.image_key={column} (with a vision-language model.path and data.max_images_per_prompt >= 1), or "
            "take the image places out of the prompts")


PROMPT_FIX = ("give each row its prompt as text or as a non-empty list of chat messages, each an object with a 'role' "
              "(system, developer, user, assistant or tool) and a 'content' (a string or a list of parts)")


def _rename(row: dict, where: str, input_key: str, label_key: str | None, tools_key: str | None,
            image_key: str | None) -> dict:
    """Row `where` in the runner's names; a row whose prompt is neither text nor a list of chat messages (null: a
    missing value; a message without a role; no message), or blank text, or whose label is null is an error naming the
    row (was, for a bad message: each of its rollouts an agent_exception from the chat template, every epoch; a null
    label was graded as one; blank text was sent as an empty user message, or with data.apply_chat_template=false
    failed each rollout on its empty prompt)."""
    prompt = _messages_text(row[input_key])  # (agents/rules.py check_prompts: each message as the chat server takes)
    if not (isinstance(prompt, str) and prompt.strip() or isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)):
        blank = "blank text" if isinstance(prompt, str) else "not text or a non-empty list of chat messages"
        raise ValueError(f"{where}: data.input_key={input_key!r} is {prompt!r:.60}; {blank}. Fix: {PROMPT_FIX}")
    if isinstance(prompt, list) and not any(m.get("tool_calls") or not (m.get("content") is None or isinstance(
            m["content"], str) and not m["content"].strip()) for m in prompt):  # (a list of parts: not blank here)
        raise ValueError(f"{where}: data.input_key={input_key!r} is {prompt!r:.60}; chat messages of blank text "
                         f"alone. Fix: {PROMPT_FIX}")
    label = row[label_key] if label_key else ""
    if label is None or isinstance(label, float) and math.isnan(label):  # NaN: pandas' missing value, JSON's NaN
        raise ValueError(f"{where}: data.label_key={label_key!r} is {'null' if label is None else 'NaN'} (or missing "
                         "from this row). Fix: give every row its label, or set data.label_key=null for data without "
                         "labels (the agent then gets '')")
    out = {"prompt": prompt, "label": label, "datasource": _datasource(row.get("datasource"))}
    if tools_key and row.get(tools_key) is not None:  # optional columns: absent when unset or null
        out["tools"] = _tools(row[tools_key], where, tools_key)
    if image_key and row.get(image_key) is not None:
        out["images"] = row[image_key]
    return out


def _datasource(value) -> str:
    """The name a row's eval metrics carry (eval_<datasource>_pass1): a null one (a column some rows leave empty; NaN,
    pandas' missing value) or blank text is the default one, not a metric named "None" or "nan"; any other value is
    its own by its text (was: a falsy one, datasource 0 or false, was the default too, its scores merged with the
    unnamed rows' while datasource 1 kept its own)."""
    missing = value is None or isinstance(value, float) and math.isnan(value) or not str(value).strip()
    return "default" if missing else str(value)


def _messages_text(prompt):
    """A prompt of chat messages written as their JSON text (a CSV cell, which holds no list; a column json.dumps
    wrote), as those messages, as a row's tools are read from theirs (was: the JSON sent to the model as the user's
    words, without a word). Other text stays text."""
    if not (isinstance(prompt, str) and prompt.lstrip().startswith("[")):
        return prompt
    try:
        messages = json.loads(prompt)
    except json.JSONDecodeError:
        return prompt
    chat = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    return messages if chat else prompt


def _tools(value, where: str, tools_key: str) -> list[dict]:
    """A row's tools: a list of function schemas, or its JSON text (the form that keeps rows' differing schemas apart:
    datasets merges JSON objects of one column into one struct, adding each row's missing keys as nulls). Anything
    else is an error naming the row (was: handed on as it was; a string rendered into the chat template as text)."""
    try:
        tools = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        tools = e
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: data.tools_key={tools_key!r} is {value!r:.60}; a row's tools are a list of "
                         "function schemas (objects), or that list as JSON text")
    return tools
