"""A dataset of several configs (subsets), as the hub holds one (openai/gsm8k: main and socratic): a directory of data
files whose README's `configs` section names each config's files per split, read as datasets.load_dataset(path, name,
split) reads it. data.config_name / eval.config_name pick the config (data/prompts.py `_repository`). Before: no key
could pass datasets its `name`, so such a dataset could not be read at all (a hub one failed at the run's start with
datasets' 'Config name is missing', a local copy was refused as "a directory but no save_to_disk output")."""

from __future__ import annotations

import json

import pytest

from molt_hydra.data.prompts import load_prompts
from molt_hydra.runtime.roles import _named

CONFIGS = {"main": {"train": 3, "test": 2}, "socratic": {"train": 4, "test": 1}}
README = """---
configs:
""" + "".join(f"""- config_name: {name}
  data_files:
""" + "".join(f"""  - split: {split}
    path: {name}/{split}.jsonl
""" for split in splits) for name, splits in CONFIGS.items()) + "---\n"
FIX = "Fix: set data.config_name (for eval.data_path: eval.config_name) to one of them"


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """The dataset's directory; each row's prompt names its config, split and row, its label the row's number."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # (not the user's cache)
    for name, splits in CONFIGS.items():
        (tmp_path / "gsm" / name).mkdir(parents=True)
        for split, n in splits.items():
            (tmp_path / "gsm" / name / f"{split}.jsonl").write_text("".join(
                json.dumps({"prompt": f"{name} {split} {i}", "label": str(i)}) + "\n" for i in range(n)))
    (tmp_path / "gsm" / "README.md").write_text(README)
    return tmp_path / "gsm"


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("split", ["train", "test"])
def test_the_chosen_config_and_split_are_read(repo, name, split):
    rows = load_prompts(str(repo), split=split, config_name=name)
    assert rows == [{"prompt": f"{name} {split} {i}", "label": str(i), "datasource": "default"}
                    for i in range(CONFIGS[name][split])]


def test_no_config_or_an_unknown_one_names_the_configs_and_the_key(repo):
    """Before: datasets' 'Config name is missing ... `load_dataset('gsm', 'main')`' (a call the user cannot make), or
    "BuilderConfig 'nope' not found", naming no key."""
    for config, why in ((None, "has several configs ['main', 'socratic'] and none is chosen"),
                        ("nope", "has no config 'nope'; its configs: ['main', 'socratic']")):
        with pytest.raises(ValueError) as err:
            _named("data.train_path", load_prompts, str(repo), config_name=config)
        assert str(err.value) == f"data.train_path={repo}: {repo} {why}. {FIX}"


def test_a_split_the_config_lacks_names_its_splits(repo):
    with pytest.raises(ValueError) as err:
        load_prompts(str(repo), split="validation", config_name="main")
    assert str(err.value) == (f"{repo} (config main) has no split 'validation'; its splits: ['test', 'train']. Fix: "
                              "set data.split (for eval.data_path: eval.split) to one of them")


def test_a_directory_of_plain_data_files_is_read_as_its_one_config(tmp_path, monkeypatch):
    """A directory of data files without a README (datasets names the split by the file: train.jsonl) is one config,
    `default`; a directory of no data file is named as such (before: refused as no save_to_disk output, whatever it
    held)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "train.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": "2"}\n')
    assert [r["prompt"] for r in load_prompts(str(tmp_path / "plain"))] == ["a", "b"]
    assert [r["prompt"] for r in load_prompts(str(tmp_path / "plain"), config_name="default")] == ["a", "b"]
    with pytest.raises(ValueError,
                       match=r"has no config 'main'; its configs: \['default'\]. Fix: set data.config_name"):
        load_prompts(str(tmp_path / "plain"), config_name="main")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"code is a directory of no data file datasets reads \(.*\), and no "
                                         r"save_to_disk output \(no state.json or dataset_dict.json\). Fix: point"):
        load_prompts(str(tmp_path / "code"))


def test_a_directory_named_as_a_data_file_is_read_as_a_directory_its_split_chosen(tmp_path, monkeypatch):
    """Before: a directory named data.jsonl was taken for a file by its name: its load failed ("[Errno 21] Is a
    directory"), and data.split was refused as changing nothing (a data file has no splits)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    assert_fires, config_errors = _validation()
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    for split, prompts in (("train", "abc"), ("test", "xy")):
        (folder / f"{split}.jsonl").write_text("".join(f'{{"prompt": "{p}", "label": "1"}}\n' for p in prompts))
    assert [r["prompt"] for r in load_prompts(str(folder))] == ["a", "b", "c"]
    assert [r["prompt"] for r in load_prompts(str(folder), split="test")] == ["x", "y"]
    assert config_errors([f"data.train_path={folder}", "data.split=test", "rollout.batch_size=2",
                          "train.batch_size=8", "train.micro_batch_size=8"]) == []


def test_eval_data_of_other_columns_than_training_is_refused_naming_the_fix_that_keeps_both(tmp_path):
    """Eval rows are read with the training data's column keys (data.input_key, ...). Before: the fix was "set
    data.input_key to the prompt column", which breaks the training data's read. Where the training data is a builtin
    task (no column read) or the job is eval, that key reads eval's rows alone and its fix stands."""
    _, config_errors = _validation()
    (tmp_path / "train.jsonl").write_text('{"question": "a", "answer": "1"}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "b", "label": "2"}\n')
    keys = ["data.input_key=question", "data.label_key=answer", "rollout.batch_size=1", "train.batch_size=4",
            "train.micro_batch_size=4", f"eval.data_path={tmp_path / 'eval.jsonl'}", "eval.every_steps=5"]
    reason = (f"eval.data_path: data.input_key='question' is not a column; columns: ['label', 'prompt'] "
              f"({tmp_path / 'eval.jsonl'}).")
    assert config_errors([f"data.train_path={tmp_path / 'train.jsonl'}", *keys]) == [
        f"{reason} Fix: give eval.data_path's rows the training data's column names (both are read with "
        "data.input_key, data.label_key, data.tools_key and data.image_key), e.g. rename its columns"]
    assert config_errors(["data.train_path=builtin://toy", *keys]) == [
        f"{reason} Fix: set data.input_key to the prompt column"]


def _validation():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from test_validation import assert_fires, config_errors

    return assert_fires, config_errors


def test_validation_reads_the_chosen_config_before_the_run_starts(repo):
    """A dry run finds a missing or unknown config (or split), keyed at the data key with the fix; the chosen one's
    rows are read as the run will (here: fewer than rollout.batch_size=8)."""
    assert_fires, config_errors = _validation()
    data = [f"data.train_path={repo}", "rollout.batch_size=2", "train.batch_size=16", "train.micro_batch_size=16"]
    evals = [f"eval.data_path={repo}", "eval.every_steps=5"]
    assert_fires(data, "data.train_path", "has several configs ['main', 'socratic'] and none is chosen. Fix: set "
                 "data.config_name")
    assert_fires([*data, "data.config_name=nope"], "data.train_path", "has no config 'nope'; its configs: ['main', "
                 "'socratic']. Fix: set data.config_name")
    assert_fires([*data, "data.config_name=main", "data.split=dev"], "data.train_path", "has no split 'dev'")
    assert config_errors([*data, "data.config_name=main"]) == []
    assert config_errors([*data, "data.config_name=socratic", *evals, "eval.config_name=main", "eval.split=test"]) == []
    assert_fires([*data, "data.config_name=main", *evals], "eval.data_path", "none is chosen. Fix: set "
                 "data.config_name (for eval.data_path: eval.config_name)")
    assert_fires([*data[:1], "data.config_name=main", "rollout.batch_size=8"], "data.train_path",
                 "has 3 row(s) to train on, fewer than the rollout.batch_size=8")


def test_a_config_of_data_that_has_none_is_refused(tmp_path):
    """A builtin task, a data file or a save_to_disk directory has no configs: data.config_name / eval.config_name
    would change nothing (as data.split on a data file); without eval data, eval.config_name tunes nothing."""
    import datasets

    assert_fires, _ = _validation()
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "label": "1"}\n')
    datasets.Dataset.from_list([{"prompt": "a", "label": "1"}]).save_to_disk(str(tmp_path / "saved"))
    for spec in ("builtin://toy", tmp_path / "rows.jsonl", tmp_path / "saved"):
        assert_fires([f"data.train_path={spec}", "data.config_name=main"], "data.config_name",
                     "has no configs to choose from")
        assert_fires([f"eval.data_path={spec}", "eval.every_steps=5", "eval.config_name=main"], "eval.config_name",
                     "has no configs to choose from")
    assert_fires(["eval.config_name=main"], "eval.config_name", "eval.data_path=null runs none")
    assert_fires(["job=eval", "eval.data_path=builtin://toy_eval", "data.config_name=main"], "data.config_name",
                 "scores the rows of eval.data_path only")
