"""Data preparation: the public datasets the recipes name, turned into the rows molt_hydra reads (`prompt` as chat
messages ending in a \\boxed{} instruction, `label`, `datasource`, and `images` for geometry3k), with `datasets`.

    python -m molt_hydra.data.prepare dapo_math data/dapo_math_17k.jsonl     # recipes/qwen3_4b_math.yaml
    python -m molt_hydra.data.prepare aime_2024 data/aime_2024.jsonl         #   its eval set
    python -m molt_hydra.data.prepare gsm8k data/gsm8k_train.jsonl
    python -m molt_hydra.data.prepare geo3k data/geo3k_train.parquet         # recipes/qwen3_moe_geo3k.yaml

`--source` reads a local file (json/jsonl/csv/parquet), a `save_to_disk` folder, a directory of data files (a local
copy of the hub dataset) or another hub name with the same columns instead of the default hub dataset; `--config`
picks its config (default: the hub dataset's, e.g. gsm8k's main); `--split`, `--limit` as named. Images need
parquet/arrow output.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from molt_hydra.data.prompts import load_dataset
# imported where used: datasets (heavy)

BOXED = "Put the final answer in \\boxed{}."
# DAPO-Math-17k wraps each problem in its "Answer: $Answer" instructions; the reference math agents grade \boxed{}
_DAPO = re.compile(r"^Solve the following math problem step by step\..*?\n\n(?P<problem>.*)\n\nRemember to put your "
                   r"answer on its own line after \"Answer:\"\.?\s*$", re.S)


def _ask(problem: str) -> list[dict]:
    if not problem.strip():  # (was: a prompt of the instruction alone)
        raise ValueError("its problem is blank")
    return [{"role": "user", "content": f"{problem.strip()}\n\n{BOXED}"}]


def _column(row: dict, *names: str):
    """The first of `names` present in `row` (hub copies of one dataset differ in capitalisation)."""
    for n in names:
        if n in row:
            return row[n]
    raise KeyError(f"none of the columns {names} in {sorted(row)}")


def _answer(value) -> str:
    """A row's answer as its label; a null or blank one is an error (was: written as the label "None" or "", and every
    rollout of the row graded against it)."""
    if value is None or not str(value).strip():
        raise ValueError(f"its answer is {value!r}, nothing to grade against")
    return str(value)


def dapo_math(row: dict) -> dict:
    prompt = _column(row, "prompt")
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    match = _DAPO.match(text)
    return {"prompt": _ask(match["problem"] if match else text), "label": _answer(row["reward_model"]["ground_truth"]),
            "datasource": "dapo_math"}


def gsm8k(row: dict) -> dict:
    # the reference solution ends with "#### <number>"; thousands separators are not part of the number. One without
    # it has no answer to take (was: its whole solution text became the label)
    parts = row["answer"].split("####")
    number = parts[-1].strip().replace(",", "") if len(parts) > 1 else None
    return {"prompt": _ask(row["question"]), "label": _answer(number), "datasource": "gsm8k"}


def aime(row: dict) -> dict:
    return {"prompt": _ask(_column(row, "problem", "Problem")), "label": _answer(_column(row, "answer", "Answer")),
            "datasource": "aime_2024"}


def geometry3k(row: dict) -> dict:
    # the problem text keeps its "<image>" marker: the geo3k agents put the figure there (recipes/agents/geo3k.py)
    return {"prompt": _ask(row["problem"]), "label": _answer(row["answer"]), "datasource": "geometry3k",
            "images": row["images"]}


@dataclass(frozen=True)
class Preparer:
    hub: str
    config: str | None
    convert: Callable[[dict], dict]
    columns: tuple[tuple[str, ...], ...]  # the columns `convert` reads, each as its alternative spellings
    dedupe: bool = False  # DAPO-Math-17k repeats each of its 17k problems ~100 times


PREPARERS = {
    "dapo_math": Preparer("BytedTsinghua-SIA/DAPO-Math-17k", None, dapo_math, (("prompt",), ("reward_model",)),
                          dedupe=True),
    "aime_2024": Preparer("HuggingFaceH4/aime_2024", None, aime, (("problem", "Problem"), ("answer", "Answer"))),
    "gsm8k": Preparer("openai/gsm8k", "main", gsm8k, (("question",), ("answer",))),
    "geometry3k": Preparer("hiyouga/geometry3k", None, geometry3k, (("problem",), ("answer",), ("images",))),
}
PREPARERS["geo3k"] = PREPARERS["geometry3k"]  # the name the geo3k recipes and issue 37 use


def prepare(name: str, out: str, *, source: str | None = None, config: str | None = None, split: str | None = None,
            limit: int | None = None) -> int:
    """Write dataset `name` to `out` (.jsonl / .json / .parquet); returns the number of rows written."""
    if name not in PREPARERS:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(PREPARERS)}")
    p = PREPARERS[name]
    suffix = Path(out).suffix
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"output {out}: write .jsonl, .json or .parquet")
    if p.convert is geometry3k and suffix != ".parquet":
        raise ValueError(f"output {out}: {name} has images; write .parquet")
    if limit is not None and limit < 1:  # (was: an empty file written, exit 0, which every run then refuses)
        raise ValueError(f"--limit {limit} keeps no row; give a count >= 1, or leave --limit out for every row")
    # every default hub dataset's training split; a source of other configs than the hub dataset's: --config
    ds = load_dataset(source or p.hub, split or "train", config or p.config, config_fix="set --config")
    for names in p.columns:  # (was: a bare KeyError from the first row's conversion)
        if not set(names) & set(ds.column_names):
            raise ValueError(f"{source or p.hub} has no column {' or '.join(map(repr, names))}, which {name} reads; "
                             f"its columns: {sorted(ds.column_names)}. Fix: --source a copy of {p.hub} with its "
                             "columns")
    ds = ds.map(_converting(p.convert, source or p.hub), with_indices=True, remove_columns=ds.column_names)
    if p.dedupe:
        seen: set[str] = set()
        keep = [i for i, m in enumerate(ds["prompt"]) if not (m[-1]["content"] in seen or seen.add(m[-1]["content"]))]
        ds = ds.select(keep)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        ds.to_parquet(out)
    else:
        ds.to_json(out, lines=suffix == ".jsonl", force_ascii=False)
    return len(ds)


def _converting(convert: Callable[[dict], dict], source: str) -> Callable[[dict, int], dict]:
    """`convert`, a row it cannot convert (a null or odd-shaped cell) a ValueError naming the row (was: the
    AttributeError / TypeError of the conversion, a traceback)."""
    def run(row: dict, index: int) -> dict:
        try:
            return convert(row)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            cells = {k: f"{v!r:.40}" for k, v in row.items() if k != "images"}
            raise ValueError(f"{source} row {index} cannot be converted ({type(e).__name__}: {e}); its cells: "
                             f"{cells}. Fix: correct or remove that row") from None
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m molt_hydra.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(PREPARERS))
    parser.add_argument("out", help="output file: .jsonl, .json or .parquet (geometry3k: .parquet)")
    parser.add_argument("--source", help="local file / save_to_disk folder / hub name instead of the default hub")
    parser.add_argument("--config", help="config (subset) of a hub dataset or a directory of data files (default: "
                        "the default hub dataset's, e.g. gsm8k's main)")
    parser.add_argument("--split", help="split to read (default: the dataset's training split)")
    parser.add_argument("--limit", type=int, help="keep the first N rows")
    a = parser.parse_args(argv)
    try:
        n = prepare(a.name, a.out, source=a.source, config=a.config, split=a.split, limit=a.limit)
    except (OSError, ValueError) as e:  # a missing or malformed source, a bad output name: one line, no traceback
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    print(f"{a.name}: {n} rows -> {a.out}")


if __name__ == "__main__":
    main()
