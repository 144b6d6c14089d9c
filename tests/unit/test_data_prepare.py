"""Data preparation for the recipes' datasets, on small local files in each hub dataset's own columns (no hub access):
the prepared rows load with the recipe's keys and grade with the math agents' grader."""

from __future__ import annotations

import json

import datasets
import pytest
from PIL import Image

from molt_hydra.agents.math_grading import grade_math
from molt_hydra.data.prepare import BOXED, main, prepare
from molt_hydra.data.prompts import load_prompts

DAPO = ("Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put your "
        "answer on its own line after \"Answer:\".")


def test_dapo_math_unwraps_the_answer_template_asks_for_a_box_and_dedupes(tmp_path):
    problems = [("What is $2+3$?", "5"), ("Find $x$ if $2x=14$.", "7")]
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO.format(p)}],
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"}} for p, a in problems * 3]
    src = tmp_path / "dapo.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(src))
    out = tmp_path / "dapo_math_17k.jsonl"
    assert prepare("dapo_math", str(out), source=str(src)) == 2  # each problem repeated 3x in the source
    loaded = load_prompts(str(out), input_key="prompt", label_key="label")  # recipes/qwen3_4b_math.yaml's keys
    assert [r["label"] for r in loaded] == ["5", "7"]
    assert loaded[0]["prompt"] == [{"role": "user", "content": f"What is $2+3$?\n\n{BOXED}"}]
    assert grade_math("so \\boxed{7}", loaded[1]["label"]) == 1.0


def test_gsm8k_label_is_the_number_after_the_hashes(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps({"question": "Tom has 1,000 apples and buys 234 more. How many?",
                               "answer": "1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"}) + "\n")
    out = tmp_path / "gsm8k_train.jsonl"
    main(["gsm8k", str(out), "--source", str(src)])
    (row,) = load_prompts(str(out))
    assert row["label"] == "1234" and row["datasource"] == "gsm8k"
    assert row["prompt"][0]["content"].endswith(BOXED)
    assert grade_math("\\boxed{1234}", row["label"]) == 1.0


def test_aime_reads_either_capitalisation_and_limits(tmp_path):
    src = tmp_path / "aime.jsonl"
    src.write_text("".join(json.dumps({"Problem": f"Problem {i}", "Answer": 100 + i}) + "\n" for i in range(5)))
    out = tmp_path / "aime_2024.jsonl"
    assert prepare("aime_2024", str(out), source=str(src), limit=3) == 3
    assert [r["label"] for r in load_prompts(str(out))] == ["100", "101", "102"]


def test_geometry3k_keeps_the_figures_and_the_image_marker(tmp_path):
    figures = [Image.new("RGB", (32 + i, 24), color=(10 * i, 0, 0)) for i in range(2)]
    src = tmp_path / "geo3k_source.parquet"
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    datasets.Dataset.from_dict({"images": [[f] for f in figures],
                                "problem": ["<image>Find x.", "<image>Find the area."],
                                "answer": ["3", "12"]}, features=features).to_parquet(str(src))
    out = tmp_path / "geo3k_train.parquet"
    assert prepare("geometry3k", str(out), source=str(src)) == 2
    rows = load_prompts(str(out), image_key="images", max_images_per_prompt=1)  # recipes/qwen3_moe_geo3k.yaml's keys
    assert [r["label"] for r in rows] == ["3", "12"]
    assert rows[0]["prompt"][0]["content"].startswith("<image>Find x.")
    for row, figure in zip(rows, figures):
        (image,) = row["images"]
        assert image.size == figure.size and image.convert("RGB").getpixel((0, 0)) == figure.getpixel((0, 0))
    with pytest.raises(ValueError, match="parquet"):
        prepare("geometry3k", str(tmp_path / "geo.jsonl"), source=str(src))


def test_geo3k_prepared_file_is_what_the_geo3k_recipe_plans_from(tmp_path, capsys):
    """`python -m molt_hydra.data.prepare geo3k data/geo3k_train.parquet` (here from a local copy in the hub
    dataset's columns) writes the file qwen3_moe_geo3k names; the recipe validates and plans from it."""
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from molt_hydra.runtime.validate import validate
    from molt_hydra.runtime.plan import make_plan

    src = tmp_path / "geo3k_source.parquet"
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    n = 32  # the recipe's rollout.batch_size: the prompts of one step (fewer are refused)
    datasets.Dataset.from_dict({"images": [[Image.new("RGB", (40, 30), (9, 9, 9))]] * n,
                                "problem": ["<image>Find x."] * n, "answer": ["5"] * n},
                               features=features).to_parquet(str(src))
    out = tmp_path / "data" / "geo3k_train.parquet"
    main(["geo3k", str(out), "--source", str(src)])
    assert capsys.readouterr().out.strip() == f"geo3k: {n} rows -> {out}"
    assert sorted(datasets.load_dataset("parquet", data_files=str(out), split="train").column_names) == [
        "datasource", "images", "label", "prompt"]
    cfg = compose_config(["+recipe=qwen3_moe_geo3k", f"data.train_path={out}", "dry_run=true"],
                         output_dir=str(tmp_path))
    run_cfg = validate(OmegaConf.to_object(cfg))
    assert run_cfg.data.train_path == str(out) and run_cfg.data.image_key == "images"
    plan = make_plan(run_cfg)
    assert [r.name for r in plan.roles][:1] == ["rollout engine"] and plan.batch
    row, *others = load_prompts(str(out), image_key=run_cfg.data.image_key,
                                max_images_per_prompt=run_cfg.data.max_images_per_prompt)
    assert len(others) == n - 1 and row["label"] == "5" and row["images"][0].size == (40, 30)


@pytest.mark.parametrize("name,text,message", [
    ("aime_2024", '{"question": "x", "answer": "1"}\n',
     " has no column 'problem' or 'Problem', which aime_2024 reads; its columns: ['answer', 'question']. Fix: --source "
     "a copy of HuggingFaceH4/aime_2024 with its columns"),
    ("gsm8k", '{"question": "x", "answer": "#### 1"}\n{"question": \n',
     ": line 2 is not JSON (Expecting value). Fix: "),
    ("gsm8k", '{"question": "x", "answer": "#### 1"}\n{"question": "y", "answer": null}\n',
     " row 1 cannot be converted (AttributeError: 'NoneType' object has no attribute 'split'); its cells: "
     "{'question': \"'y'\", 'answer': 'None'}. Fix: correct or remove that row"),
])
def test_a_source_prepare_cannot_read_is_one_line_naming_it(tmp_path, capsys, name, text, message):
    """Before: a KeyError('problem') traceback from the first row's conversion, an AttributeError one from a null
    cell's; any ValueError a traceback too."""
    source = tmp_path / "source.jsonl"
    source.write_text(text)
    with pytest.raises(SystemExit) as done:
        main([name, str(tmp_path / "out.jsonl"), "--source", str(source)])
    assert done.value.code == 1
    last = capsys.readouterr().err.splitlines()[-1]  # (after datasets' progress bars)
    assert last.startswith(f"python -m molt_hydra.data.prepare: error: {source}{message}"), last


@pytest.mark.parametrize("name,row,why", [
    ("aime_2024", {"Problem": "p", "Answer": None}, "its answer is None"),
    ("aime_2024", {"Problem": "p", "Answer": " "}, "its answer is ' '"),
    ("aime_2024", {"Problem": " ", "Answer": "3"}, "its problem is blank"),
    ("gsm8k", {"question": "q", "answer": "2 + 3 = 5"}, "its answer is None"),  # no "#### <number>"
    ("gsm8k", {"question": "q", "answer": "2 + 3 = 5\n#### "}, "its answer is ''"),
    ("dapo_math", {"prompt": [{"role": "user", "content": "p"}], "reward_model": {"ground_truth": None}},
     "its answer is None"),
])
def test_a_row_without_an_answer_or_a_problem_is_named_not_written(tmp_path, capsys, name, row, why):
    """Before: a null answer was written as the label "None", a blank one as "", gsm8k's solution without its
    "#### <number>" line as the label whole, and a blank problem as a prompt of the \\boxed{} instruction alone: each
    row then trained with rewards graded against no answer, without a word."""
    source, out = tmp_path / "source.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit) as done:
        main([name, str(out), "--source", str(source)])
    assert done.value.code == 1 and not out.exists()
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"python -m molt_hydra.data.prepare: error: {source} row 0 cannot be converted "
                           f"(ValueError: {why}"), last
    assert last.endswith("Fix: correct or remove that row"), last


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_a_limit_that_keeps_no_row_is_refused_before_anything_is_written(tmp_path, capsys, limit):
    """Before: an empty output file and "aime_2024: 0 rows", exit 0; each run reading it then failed: "has no rows"."""
    source, out = tmp_path / "source.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"problem": "1+1", "answer": "2"}\n')
    with pytest.raises(SystemExit) as done:
        main(["aime_2024", str(out), "--source", str(source), "--limit", limit])
    assert done.value.code == 1 and not out.exists()
    assert capsys.readouterr().err.splitlines()[-1] == (f"python -m molt_hydra.data.prepare: error: --limit {limit} "
                                                        "keeps no row; give a count >= 1, or leave --limit out for "
                                                        "every row")


def test_gsm8k_from_a_local_copy_of_its_hub_repository_reads_its_config(tmp_path, monkeypatch, capsys):
    """A local copy of openai/gsm8k (its README's `configs`: main and socratic, each a directory of data files) reads
    the hub dataset's config, main, or the one --config names; one it lacks names its configs and the flag. Before:
    refused as no save_to_disk folder ('is neither a `Dataset` directory nor a `DatasetDict` directory')."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # (not the user's cache)
    repo = tmp_path / "gsm8k"
    for config, answer in (("main", 7), ("socratic", 8)):
        (repo / config).mkdir(parents=True)
        (repo / config / "train.jsonl").write_text(json.dumps({"question": f"{config}?", "answer": f"#### {answer}"})
                                                   + "\n")
    (repo / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
        for c in ("main", "socratic")) + "---\n")
    assert prepare("gsm8k", str(tmp_path / "main.jsonl"), source=str(repo)) == 1
    assert [r["label"] for r in load_prompts(str(tmp_path / "main.jsonl"))] == ["7"]
    main(["gsm8k", str(tmp_path / "socratic.jsonl"), "--source", str(repo), "--config", "socratic"])
    assert [r["label"] for r in load_prompts(str(tmp_path / "socratic.jsonl"))] == ["8"]
    with pytest.raises(SystemExit):
        main(["gsm8k", str(tmp_path / "none.jsonl"), "--source", str(repo), "--config", "nope"])
    assert capsys.readouterr().err.endswith(f"error: {repo} has no config 'nope'; its configs: ['main', 'socratic']. "
                                            "Fix: set --config to one of them\n")
