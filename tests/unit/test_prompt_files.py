"""Prompt files that cannot be read (data/prompts.py `load_prompts`, runtime/roles.py `_load_rows`): an empty file, a
malformed JSONL line, a file without rows, a missing column end with one ValueError naming the config key, the file
and the reason. Before: an empty .jsonl raised a bare StopIteration (in the run: 'RuntimeError: coroutine raised
StopIteration'), a malformed line datasets' 'An error occurred while generating the dataset', naming neither; a
null prompt failed each of its rollouts as an agent_exception, every epoch. A configured label / tools / image column
the data lacks was silently absent from every row. Several datasets: a probability of 0 hung the interleaving loop
(that dataset is never drawn, so never exhausted), and data.max_samples capped each dataset but not their union."""

from __future__ import annotations

import json

import pytest

from molt_hydra.data.prompts import load_prompts
from molt_hydra.runtime.roles import _named

FILES = {
    "empty.jsonl": ("", "has no rows (it is empty or blank). Fix: "),
    "blank_lines.jsonl": ("\n  \n\n", "has no rows (it is empty or blank). Fix: "),
    "malformed.jsonl": ('{"prompt": "a", "label": "1"}\n{"prompt": "b", "lab\n', ": line 2 is not JSON ("),
    # datasets named the row of its chunk: "row 6" for line 7, "row 0" for a list on line 3
    "bad_line_7.jsonl": ("\n".join(['{"prompt": "a", "label": "1"}'] * 6 + ['{"prompt": }']),
                         ": line 7 is not JSON (Expecting value). Fix: "),
    "list_row.jsonl": ('{"prompt": "a", "label": "1"}\n\n["a", "b"]\n',
                       ": line 3 is ['a', 'b'], not a JSON object. Fix: "),
    "list_item.json": ('[{"prompt": "a", "label": "1"}, 5]', ": item 2 is 5, not a JSON object. Fix: "),
    "not_utf8.jsonl": ('{"prompt": "a", "label": "1"}\n{"prompt": "caf\udce9", "label": "1"}\n',
                       ": line 2 is not UTF-8 (invalid continuation byte). Fix: save the file as UTF-8"),
    # Before: "'utf-8' codec can't decode byte 0xe9 in position 21: invalid continuation byte", naming no line
    "not_utf8.csv": ("prompt,label\na,1\ncaf\udce9,2\n",
                     ": line 3 is not UTF-8 (invalid continuation byte). Fix: save the file as UTF-8"),
    "no_rows.json": ("[]\n", "has no rows (it is empty or blank). Fix: "),
    "no_column.jsonl": ('{"text": "a"}\n', "data.input_key='prompt' is not a column; columns: ['text']"),
    "roleless_message.jsonl": ('{"prompt": [{"content": "hi"}], "label": "1"}\n',
                               "row 0: data.input_key='prompt' is [{'content': 'hi'}]; "),
    "no_message.jsonl": ('{"prompt": [], "label": "1"}\n', "row 0: data.input_key='prompt' is []; "),
    "tools_not_a_list.jsonl": ('{"prompt": "a", "label": "1", "tools": "not json"}\n',
                               "row 0: data.tools_key='tools' is 'not json'; a row's tools are a list"),
    "null_prompt.jsonl": ('{"prompt": "a", "label": "1"}\n{"prompt": null, "label": "2"}\n',
                          "row 1: data.input_key='prompt' is None; "),
    # Before: the row's label None, graded against as if it were one
    "null_label.jsonl": ('{"prompt": "a", "label": "1"}\n{"prompt": "b"}\n',
                         "row 1: data.label_key='label' is null (or missing from this row). Fix: give every row its "
                         "label, or set data.label_key=null"),
    # Before: a NaN label (JSON's NaN, pandas' missing value in a float column) was graded against as "nan"
    "nan_label.jsonl": ('{"prompt": "a", "label": 1.5}\n{"prompt": "b", "label": NaN}\n',
                        "row 1: data.label_key='label' is NaN (or missing from this row). Fix: give every row its "
                        "label, or set data.label_key=null"),
    # Before: pandas took the first cell for the row's index: prompt "1", label "extra"
    "extra_cell.csv": ("prompt,label\na,1,extra\n", ": line 2 has 3 cells, the header names 2 (['prompt', 'label'])"),
    "twice_named.csv": ("prompt,prompt\na,b\n", ": the header names a column twice (['prompt', 'prompt']). Fix: "),
    "empty_label_cell.csv": ("prompt,label\na,1\nb,\n", "row 1: data.label_key='label' is null"),
    # Before: each row's label silently "" (the math agents then rewarded every answer 0, or an empty \boxed{} 1)
    "no_label_column.jsonl": ('{"prompt": "a", "answer": "1"}\n',
                              "data.label_key='label' is not a column; columns: ['answer', 'prompt']"),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_an_unreadable_prompt_file_is_named_with_its_key_and_reason(tmp_path, name):
    text, reason = FILES[name]
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # (\udce9: the byte 0xe9, Latin-1's é)
    with pytest.raises(ValueError) as err:
        _named("data.train_path", load_prompts, str(path), tools_key="tools" if "tools" in name else None,
               max_images_per_prompt=1)
    message = str(err.value)
    assert message.startswith(f"data.train_path={path}: ") and reason in message, message


# Prompts the chat server would refuse, found at validation (agents/rules.py check_prompts). Before: loaded as they
# were; each rollout of the row failed (a 400 from the chat server), every epoch
SERVER_REFUSED = {
    "unknown_role.jsonl": ('{"prompt": [{"role": "wizard", "content": "hi"}], "label": "1"}\n',
                           "unknown_role.jsonl row 0: data.input_key='prompt' is [{'role': 'wizard', 'content': "
                           "'hi'}]; "
                           "messages[0] must be an object with role in ['assistant', 'developer', 'system', 'tool', "
                           "'user']. Fix: "),
    "number_content.jsonl": ('{"prompt": "a", "label": "1"}\n'
                             '{"prompt": [{"role": "user", "content": 5}], "label": "1"}\n',
                             "row 1: data.input_key='prompt' is [{'role': 'user', 'content': 5}]; messages[0].content "
                             "must be a string or a list of parts. Fix: "),
    "missing_image_part.jsonl": ('{"prompt": [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": '
                                 '"image_url", "image_url": {"url": "file:///no/such.png"}}]}], "label": "1"}\n',
                                 "row 0: data.input_key='prompt' is [{'role': 'user', 'content': [{'type': 'text', "
                                 "'text': 'see'; image 0: cannot open image '/no/such.png': No such file or directory. "
                                 "Fix: give each image_url part an image file's path or a base64 data: URI"),
    "two_image_parts.jsonl": ('{"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": '
                              '"a.png"}}, {"type": "image_url", "image_url": {"url": "b.png"}}]}], "label": "1"}\n',
                              "; 2 image parts > data.max_images_per_prompt=1, the engines' per-prompt limit. Fix: "),
    # the HF chat templates' form; before: "unsupported content part type 'image' (text, image_url)", though a bare
    # {"type": "image"} part is read, and a fix naming neither form the run reads
    "own_image_part.jsonl": ('{"prompt": [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": '
                             '"image", "image": "/data/x.png"}]}], "label": "1"}\n',
                             "; messages[0].content[1] is an image part of its own image ('image': '/data/x.png'), "
                             "a form the run does not read. Fix: write it as {'type': 'image_url', 'image_url': "
                             "{'url': '/data/x.png'}} (an image file's path or a base64 data: URI), or as a bare "
                             "{'type': 'image'} part with the row's image in the column data.image_key names"),
}


# A row's tools as the chat server takes a request's (before: passed; a chat agent sending ctx.tools got a 400 for
# each rollout of the row, every epoch)
TOOLS_REFUSED = {
    "flat_tool.jsonl": ('{"prompt": "a", "label": "1", "tools": [{"type": "function", "name": "calc"}]}\n',
                        "data.tools_key='tools' is [{'type': 'function', 'name': 'calc'}]; tools[0] must be "
                        "{'type': 'function', 'function': {'name': ...}}. Fix: give each row's tools as OpenAI chat "
                        "function tools"),
    "same_name_twice.jsonl": ('{"prompt": [{"role": "user", "content": "a"}], "label": "1", "tools": [{"type": '
                              '"function", "function": {"name": "calc"}}, {"type": "function", "function": {"name": '
                              '"calc"}}]}\n', "; tools[0] and tools[1] are both named 'calc': tool names must be "
                              "unique. Fix: give each row's tools"),
}


@pytest.mark.parametrize("name", sorted(TOOLS_REFUSED))
def test_tools_the_chat_server_would_refuse_are_a_config_error_naming_the_row(tmp_path, name):
    text, reason = TOOLS_REFUSED[name]
    path = tmp_path / name
    path.write_text(text)
    [problem] = _config_problems(str(path), tools_key="tools", runner=CHAT_AGENT)
    assert problem.startswith(f"- data.train_path: {path} row 0: data.tools_key='tools' is ") and reason in problem, \
        problem
    # an Env's tools reach the tokenizer's chat template as they are, where any shape renders: not refused
    assert _config_problems(str(path), tools_key="tools", runner={"_target_": "recipes/agents/toy.py:ToyEnv"}) == []
    path.write_text('{"prompt": "a", "label": "1", "tools": [{"type": "function", "function": {"name": "calc"}}]}\n')
    assert _config_problems(str(path), tools_key="tools", runner=CHAT_AGENT) == []


CHAT_AGENT = {"_target_": "recipes/agents/python_tool_chat.py"}  # its requests go through the chat server


def test_prompt_image_parts_pass_validation_as_image_markers_do(tmp_path):
    """Before: a row's bare {"type": "image"} parts (the form job=sft takes) were refused for any agent, 'unsupported
    content part type 'image' (text, image_url)', though an Env's chat template renders them and a chat agent's
    messages now carry the row's image there (chat_agent.prompt_messages)."""
    path = tmp_path / "rows.jsonl"
    prompt = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "colour?"}]}]
    path.write_text(json.dumps({"prompt": prompt, "label": "R"}) + "\n")
    assert _config_problems(str(path), max_images_per_prompt=1) == []
    assert _config_problems(str(path), max_images_per_prompt=1, runner=CHAT_AGENT) == []


def test_prompts_placing_images_of_a_column_data_image_key_does_not_read_are_refused(tmp_path):
    """A VLM dataset (an 'images' column, <image> markers or image parts in its prompts) with data.image_key=null (the
    default). Before: every prompt reached the model without its image, the literal <image> in its text, without a
    word; job=sft trained on it so too. Prompts that place no image, or data without an image column, pass."""
    from test_loss_mask import _sft_problems

    rows, sft = tmp_path / "rows.jsonl", tmp_path / "chats.jsonl"
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}]
    why = ("its prompt places an image (<image>, or an image part) and the data has an image column 'images', but "
           "data.image_key=null reads no image: the model would get the prompt without it. Fix: set "
           "data.image_key=images (with a vision-language model.path and data.max_images_per_prompt >= 1), or take "
           "the image places out of the prompts")
    for prompt in ("<image>Find x.", parts):
        rows.write_text(json.dumps({"prompt": "plain", "label": "1", "images": None}) + "\n"
                        + json.dumps({"prompt": prompt, "label": "3", "images": ["a.png"]}) + "\n")
        assert _config_problems(str(rows)) == [f"- data.train_path: {rows} row 1: {why}"]
        sft.write_text(json.dumps({"input": prompt, "output": "3", "images": ["a.png"]}) + "\n")
        assert _sft_problems(str(sft), train__batch_size=1) == [f"- data.image_key: {sft}: SFT row 0: {why}"]
    rows.write_text(json.dumps({"prompt": "Find x.", "label": "3", "images": ["a.png"]}) + "\n")
    assert _config_problems(str(rows)) == []
    rows.write_text(json.dumps({"prompt": "<image>Find x.", "label": "3"}) + "\n")
    assert _config_problems(str(rows)) == []


@pytest.mark.parametrize("name", sorted(SERVER_REFUSED))
def test_a_prompt_the_chat_server_would_refuse_is_a_config_error_naming_the_row(tmp_path, name):
    text, reason = SERVER_REFUSED[name]
    path = tmp_path / name
    path.write_text(text)
    # a row's own images reach a chat agent's server alone (an Env's: test_an_image_url_part_in_an_envs_row_...)
    runner = CHAT_AGENT if "image" in name else None
    [problem] = _config_problems(str(path), max_images_per_prompt=1, runner=runner)
    assert problem.startswith(f"- data.train_path: {path} row ") and reason in problem, problem


def test_a_readable_file_loads(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n')
    assert _named("data.train_path", load_prompts, str(path)) == [{"prompt": "a", "label": "1",
                                                                    "datasource": "default"}]


def test_a_bom_blank_lines_crlf_a_last_line_without_newline_and_u2028_in_a_string_read_as_written(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "label": "1"}\r\n\n{"prompt": "b\xe2\x80\xa8c", "label": "2"}')
    assert [(r["prompt"], r["label"]) for r in load_prompts(str(path))] == [("a", "1"), ("b\u2028c", "2")]


def test_json_values_are_read_as_written_in_a_column_of_mixed_types(tmp_path):
    """Before: datasets read a column of mixed types (text and chat messages; a label and a list of labels) as Json,
    decoding its strings: the prompt "42" became the number 42 (refused), the labels "1" and "null" 1 and None."""
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "42", "label": "1"}, {"prompt": [{"role": "user", "content": "hi"}], "label": ["2", "two"]},
            {"prompt": "c", "label": "null"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [(r["prompt"], r["label"]) for r in load_prompts(str(path))] == [(r["prompt"], r["label"]) for r in rows]


def test_a_json_file_of_one_pretty_printed_object_is_one_row_as_datasets_reads_it(tmp_path):
    path = tmp_path / "row.json"
    path.write_text('{\n  "prompt": "a",\n  "label": "1"\n}\n')
    assert [(r["prompt"], r["label"]) for r in load_prompts(str(path))] == [("a", "1")]
    assert _config_problems(str(path)) == []


@pytest.mark.parametrize("key", ["label_key", "tools_key", "image_key"])
def test_a_configured_column_the_data_lacks_is_named_with_its_fix(tmp_path, key):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n')
    with pytest.raises(ValueError, match=rf"data\.{key}='nope' is not a column; columns: \['label', 'prompt'\].*Fix: "):
        _named("data.train_path", load_prompts, str(path), **{key: "nope"})
    assert load_prompts(str(path), label_key=None) == [{"prompt": "a", "label": "", "datasource": "default"}]


def _two_files(tmp_path) -> str:
    for name, n in (("a", 5), ("b", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"prompt": "{name}{i}", "label": "{i}"}}\n'
                                                        for i in range(n)))
    return f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"


@pytest.mark.parametrize("probs", [None, [0.5, 0.5]])
def test_max_samples_caps_each_dataset_and_their_union(tmp_path, probs):
    rows = load_prompts(_two_files(tmp_path), max_samples=4, probs=probs)
    assert len(rows) == 4  # a: 4 of 5, b: 3 of 3, together 7 (or 8 interleaved) -> 4
    if probs is None:
        assert [r["prompt"] for r in rows] == ["a0", "a1", "a2", "a3"]


@pytest.mark.timeout(30)  # before: an endless loop
def test_a_dataset_with_probability_zero_is_refused_not_looped_on(tmp_path):
    with pytest.raises(ValueError, match=r"data.train_probs=\[1.0, 0.0\]: every dataset needs a probability > 0"):
        load_prompts(_two_files(tmp_path), probs=[1.0, 0.0])


def test_a_split_the_saved_datasetdict_lacks_is_named_with_its_splits(tmp_path):
    """Before: the KeyError's bare 'test' ("data.train_path=DIR: test")."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "label": "1"}])}).save_to_disk(
        str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"has no split 'test'; its splits: \['train'\]. Fix: set data.split"):
        _named("data.train_path", load_prompts, str(tmp_path / "dict"), split="test")


def test_a_saved_datasetdict_with_an_empty_split_loads_its_other_splits(tmp_path):
    """Before: datasets' load_from_disk of the whole DatasetDict raised IndexError ('list index out of range') when
    any split was empty, whichever one was asked for: a traceback out of validation (and of the run's load). An empty
    split, or an empty saved Dataset, asked for is named as having no rows."""
    import datasets

    rows, empty = datasets.Dataset.from_list([{"prompt": "a", "label": "1"}]), datasets.Dataset.from_list([])
    datasets.DatasetDict({"train": rows, "test": empty}).save_to_disk(str(tmp_path / "dict"))
    empty.save_to_disk(str(tmp_path / "none"))
    assert load_prompts(str(tmp_path / "dict")) == [{"prompt": "a", "label": "1", "datasource": "default"}]
    assert _config_problems(str(tmp_path / "dict")) == []
    no_rows = "has no rows (an empty Dataset was saved there). Fix: save the rows again (a filter kept none?), or " \
              "point the key at a dataset with rows"
    with pytest.raises(ValueError) as err:
        load_prompts(str(tmp_path / "dict"), split="test")
    assert str(err.value) == f"{tmp_path / 'dict' / 'test'} {no_rows}"
    assert _config_problems(str(tmp_path / "none")) == [f"- data.train_path: {tmp_path / 'none'} {no_rows}"]
    with pytest.raises(ValueError, match=r"has no split 'dev'; its splits: \['test', 'train'\]. Fix: set data.split"):
        load_prompts(str(tmp_path / "dict"), split="dev")
    # what a filter that kept none saves: one arrow file of no rows (was: taken, then told "set rollout.batch_size
    # <= 0" as train data, or loaded only as the run started as eval data)
    rows.filter(lambda row: False).save_to_disk(str(tmp_path / "filtered"))
    assert _config_problems(str(tmp_path / "filtered")) == [f"- data.train_path: {tmp_path / 'filtered'} {no_rows}"]


def test_a_null_datasource_is_the_default_one(tmp_path):
    """Before: a row with "datasource": null was scored under the eval metrics eval_None_*."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "label": "1", "datasource": "gsm8k"}\n{"prompt": "b", "label": "2", '
                    '"datasource": null}\n')
    assert [r["datasource"] for r in load_prompts(str(path))] == ["gsm8k", "default"]


def test_a_falsy_datasource_keeps_its_name(tmp_path):
    """Datasources numbered from 0 keep each its own eval metrics. Before: datasource 0 (falsy) became "default", its
    scores merged with the unnamed rows' (eval_default_pass1) while datasource 1 kept eval_1_pass1."""
    path = tmp_path / "rows.jsonl"
    ids = [0, 1, None]
    path.write_text("".join(json.dumps({"prompt": "a", "label": "1", "datasource": i}) + "\n" for i in ids))
    assert [r["datasource"] for r in load_prompts(str(path))] == [str(i) if i is not None else "default" for i in ids]


def test_tools_as_json_text_are_decoded_per_row(tmp_path):
    """JSON text keeps each row's schemas as written (datasets merges JSON objects of a column into one struct, adding
    every other row's keys as nulls). Before: the text was handed to the chat template as it was."""
    one = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"type": "int"}}}}}]
    two = [{"type": "function", "function": {"name": "g", "parameters": {"properties": {"y": {"type": "str"}}}}}]
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "a", "label": "1", "tools": json.dumps(t)} for t in (one, two)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [r["tools"] for r in load_prompts(str(path), tools_key="tools")] == [one, two]


def _config_problems(spec: str, max_images_per_prompt: int = 0, batch_size: int = 1, runner: dict | None = None,
                     **data) -> list[str]:
    """The data rules' problems with data.train_path=spec: where it points and its rows (runtime/validate.py runs
    both rules). rollout.batch_size=1 unless given: the files here are of a few rows, and their count against the
    batch is tested on its own (test_training_data_of_fewer_rows_than_a_batch_...)."""
    from molt_hydra.agents.rules import check_agent
    from molt_hydra.config.schema import RunConfig
    from molt_hydra.config.validate import Problems
    from molt_hydra.data.rules import check_data

    cfg, problems = RunConfig(), Problems()
    cfg.data.train_path, cfg.data.max_images_per_prompt = spec, max_images_per_prompt
    cfg.rollout.batch_size = batch_size
    cfg.agent.runner = runner or {"_target_": "recipes/agents/toy.py:ToyEnv"}  # an Env unless given
    for key, value in data.items():
        setattr(cfg.data, key, value)
    check_data(cfg, problems)
    check_agent(cfg, problems)  # (it checks the rows, as a chat agent's server or an Env takes them)
    return problems.lines


def test_a_local_dataset_the_run_cannot_read_is_a_config_error_before_anything_starts(tmp_path):
    """Validation (a dry run too) reads local data as the run will. Before, each failed only once the run had started
    Ray and its engines: a bad JSONL line, a file of another type (datasets: "Couldn't find any data file at" the file
    that is there), a directory of no data file. A directory of data files is read as datasets reads a hub dataset's
    (tests/unit/test_dataset_configs.py; was: refused as no save_to_disk output)."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": \n')
    (tmp_path / "rows.txt").write_text('{"prompt": "a", "label": "1"}\n')
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "rows.jsonl").write_text('{"prompt": "a", "label": "1"}\n')
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "make_rows.py").write_text("rows = []\n")
    readable = "a data file (.arrow, .csv, .json, .jsonl, .parquet), a directory of data files or a save_to_disk " \
               "directory"
    assert _config_problems(str(tmp_path / "bad.jsonl")) == [
        f"- data.train_path: {tmp_path / 'bad.jsonl'}: line 2 is not JSON (Expecting value). Fix: one JSON object "
        "per line (.jsonl), or one JSON list of objects (.json)"]
    assert _config_problems(str(tmp_path / "rows.txt")) == [
        f"- data.train_path: '{tmp_path / 'rows.txt'}' is a file of a type the run does not read (suffix '.txt'). "
        f"Fix: convert it to {readable}"]
    assert _config_problems(str(tmp_path / "plain")) == []
    assert _config_problems(str(tmp_path / "code")) == [
        f"- data.train_path: {tmp_path / 'code'} is a directory of no data file datasets reads (No (supported) data "
        f"files found in {tmp_path / 'code'}), and no save_to_disk output (no state.json or dataset_dict.json). Fix: "
        "point the key at data files (.jsonl, .json, .csv, .parquet, .arrow), a directory of them or a save_to_disk "
        "directory"]
    assert _config_problems(str(tmp_path / "plain" / "rows.jsonl")) == []
    # a directory named as a data file is read as a directory (was: "[Errno 21] Is a directory")
    (tmp_path / "named.jsonl").mkdir()
    (tmp_path / "named.jsonl" / "part.jsonl").write_text('{"prompt": "a", "label": "1"}\n')
    assert _config_problems(str(tmp_path / "named.jsonl")) == []
    assert load_prompts(str(tmp_path / "named.jsonl")) == [{"prompt": "a", "label": "1", "datasource": "default"}]


def test_csv_cells_are_read_as_written(tmp_path):
    """Before: pandas guessed each column's type: labels "2", "007" and "1.50" became 2, 7 and 1.5 (graded as those
    against the model's \\boxed{} answer), and a prompt "42" the number 42."""
    path = tmp_path / "rows.csv"
    path.write_bytes(b'\xef\xbb\xbfprompt,label\n42,2\n"a, b",007\nc,1.50\n')
    assert [(r["prompt"], r["label"]) for r in load_prompts(str(path))] == [("42", "2"), ("a, b", "007"), ("c", "1.50")]


def test_a_csv_file_read_as_pandas_reads_it_blank_lines_skipped_and_one_without_rows_named(tmp_path):
    """Before: a blank first line was read as a header of no column, and every row refused ('line 2 has 2 cells, the
    header names 0 ([])'), where pandas skips it; a header alone, or blank lines alone, was datasets' 'Instruction
    "train" corresponds to no data!' / 'No columns to parse from file'."""
    path = tmp_path / "rows.csv"
    path.write_text("\nprompt,label\na,1\n\nb,2\n")
    assert [(r["prompt"], r["label"]) for r in load_prompts(str(path))] == [("a", "1"), ("b", "2")]
    fix = "Fix: write a header line of the column names, then one line per row"
    for text, why in (("prompt,label\n", "has no rows below its header."), ("\n\n", "has no rows (it is blank).")):
        path.write_text(text)
        assert _config_problems(str(path)) == [f"- data.train_path: {path} {why} {fix}"]


def test_a_path_under_home_written_with_a_tilde_loads(tmp_path, monkeypatch):
    """Validation expands "~" (config/validate.py check_location), so data.train_path=~/rows.jsonl passed it; then the
    run, once Ray and the engines had started, failed with "Unable to find '<cwd>/~/rows.jsonl'"."""
    from molt_hydra.data.sft_dataset import load_rows

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "label": "1"}\n')
    (tmp_path / "chats.jsonl").write_text('{"input": "a", "output": "b"}\n')
    assert [r["prompt"] for r in load_prompts("~/rows.jsonl")] == ["a"]
    assert load_rows("~/chats.jsonl") == [{"input": "a", "output": "b"}]
    assert _config_problems("~/rows.jsonl") == []


def test_a_bad_row_of_a_local_prompt_file_is_a_config_error_before_anything_starts(tmp_path):
    """load_prompts' row checks, run at validation on a JSON file's rows: before, a null prompt, a message of another
    role or a null label surfaced only once Ray and the engines had started (and not in a dry run)."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n\n{"prompt": [{"role": "wizard", "content": "x"}], "label": "2"}\n')
    assert _config_problems(str(path)) == [
        f"- data.train_path: {path} row 1: data.input_key='prompt' is [{{'role': 'wizard', 'content': 'x'}}]; "
        "messages[0] must be an object with role in ['assistant', 'developer', 'system', 'tool', 'user']. Fix: give "
        "each row its prompt as text or as a non-empty list of chat messages, each an object with a 'role' (system, "
        "developer, user, assistant or tool) and a 'content' (a string or a list of parts)"]
    path.write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b"}\n')
    assert _config_problems(str(path)) == [
        f"- data.train_path: {path} row 1: data.label_key='label' is null (or missing from this row). Fix: give every "
        "row its label, or set data.label_key=null for data without labels (the agent then gets '')"]


@pytest.mark.parametrize("blank", ["", "   ", "\n\t"])
def test_a_blank_text_prompt_is_a_config_error_naming_the_row(tmp_path, blank):
    """Before: it passed validation and loading; the model was asked an empty user message (data.apply_chat_template,
    the default) without a word, or, with data.apply_chat_template=false, each rollout of the row failed once the run
    had started ("the first prompt of ToyEnv is empty text")."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a", "label": "1"}) + "\n" + json.dumps({"prompt": blank, "label": "2"}))
    want = (f"{path} row 1: data.input_key='prompt' is {blank!r}; blank text. Fix: give each row its prompt as text or "
            "as a non-empty list of chat messages, each an object with a 'role' (system, developer, user, assistant "
            "or tool) and a 'content' (a string or a list of parts)")
    assert _config_problems(str(path)) == [f"- data.train_path: {want}"]
    with pytest.raises(ValueError) as e:
        load_prompts(str(path))
    assert str(e.value) == want
    # the same in chat messages: every message's content blank (a message of tool calls, or of parts, is not)
    messages = [{"role": "system", "content": blank}, {"role": "user", "content": blank}]
    path.write_text(json.dumps({"prompt": messages, "label": "1"}))
    assert _config_problems(str(path)) == [
        f"- data.train_path: {path} row 0: data.input_key='prompt' is {messages!r:.60}; chat messages of blank text "
        f"alone. Fix: {want.partition(' Fix: ')[2]}"]
    fine = [[messages[0], {"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text":
            "hi"}]}], [messages[0], {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]]
    path.write_text("".join(json.dumps({"prompt": m, "label": "1"}) + "\n" for m in fine))
    assert [r["prompt"] for r in load_prompts(str(path))] == fine


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".jsonl"])
def test_chat_messages_written_as_json_text_are_read_as_the_messages(tmp_path, suffix):
    """A CSV cell holds no list, so chat rows exported to CSV (or a column json.dumps wrote) carry their messages as
    JSON text. Before: that text was the prompt, sent to the model as the user's words without a word. Text that is
    not a list of messages stays text."""
    import datasets

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi, there"}]
    prompts = [json.dumps(messages), "[1, 2] is a list", '[{"a": 1}]', "plain"]
    path = tmp_path / f"rows{suffix}"
    rows = [{"prompt": p, "label": str(i)} for i, p in enumerate(prompts)]
    getattr(datasets.Dataset.from_list(rows), "to_json" if suffix == ".jsonl" else f"to_{suffix[1:]}")(str(path))
    loaded = load_prompts(str(path))
    assert [r["prompt"] for r in loaded] == [messages, *prompts[1:]]
    assert [r["label"] for r in loaded] == ["0", "1", "2", "3"]
    assert _config_problems(str(path)) == []


def test_a_bad_row_of_a_parquet_file_or_a_saved_dataset_is_a_config_error(tmp_path):
    """The same checks on the rows datasets reads from a parquet file or a save_to_disk directory (before: found
    once Ray and the engines had started); a corrupt parquet file is named too."""
    import datasets

    datasets.Dataset.from_list([{"prompt": "a", "label": "1"}, {"prompt": None, "label": "2"}]).to_parquet(
        str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": 5}], "label": "1"}]).save_to_disk(
        str(tmp_path / "saved"))
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet")
    fix = "Fix: give each row its prompt as text or as a non-empty list of chat messages, each an object with a 'role'"
    [problem] = _config_problems(str(tmp_path / "rows.parquet"))
    assert problem.startswith(f"- data.train_path: {tmp_path / 'rows.parquet'} row 1: data.input_key='prompt' is "
                              f"None; not text or a non-empty list of chat messages. {fix}"), problem
    [problem] = _config_problems(str(tmp_path / "saved"))
    assert problem.startswith(f"- data.train_path: {tmp_path / 'saved'} row 0: data.input_key='prompt' is [{{'role': "
                              f"'user', 'content': 5}}]; messages[0].content must be a string or a list of parts. "
                              f"{fix}"), problem
    [problem] = _config_problems(str(tmp_path / "corrupt.parquet"))
    assert problem.startswith(f"- data.train_path: {tmp_path / 'corrupt.parquet'} is not a readable parquet file: "
                              "Parquet magic bytes not found in footer"), problem


def _too_few(spec: str, rows: int, batch_size: int) -> list[str]:
    """The rule's line (agents/rules.py `_fills_a_batch`)."""
    return [f"- data.train_path: {spec} has {rows} row(s) to train on, fewer than the rollout.batch_size={batch_size} "
            "prompts each step takes: a step would train on a partial batch, or hold a prompt twice (over several "
            f"train.num_episodes). Fix: set rollout.batch_size <= {rows} (raise rollout.n_samples_per_prompt to keep "
            "the samples per step), or give it more rows"]


def test_training_data_of_fewer_rows_than_a_batch_is_refused_with_its_count(tmp_path):
    """Before: 1 row and rollout.batch_size=8 passed validation, and the run trained one step on one prompt group
    without a word. The count is of the rows the run loads: several datasets together, a builtin task by its size."""
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "a", "label": "1"}\n')
    assert _config_problems(str(one), batch_size=8) == _too_few(str(one), 1, 8)
    assert _config_problems(str(one), batch_size=1) == []
    two = _two_files(tmp_path)  # 5 + 3 rows
    assert _config_problems(two, batch_size=9) == _too_few(two, 5 + 3, 9)
    assert _config_problems(two, batch_size=8) == []
    assert _config_problems("builtin://toy_eval", batch_size=33) == _too_few("builtin://toy_eval", 32, 33)  # 32 rows
    assert _config_problems("builtin://toy_eval", batch_size=32) == []


def test_the_count_of_interleaved_data_is_the_count_the_run_loads(tmp_path):
    """data.train_probs draws until every dataset is exhausted once: at least 5 + 3 rows, as many as load_prompts
    returns with the run's seed. A data.max_samples below the batch is config/validate.py's rule alone."""
    from molt_hydra.config.schema import RunConfig

    two, probs = _two_files(tmp_path), [0.5, 0.5]
    n = len(load_prompts(two, probs=probs, seed=RunConfig().seed))
    assert n >= 5 + 3
    assert _config_problems(two, batch_size=n + 1, train_probs=probs) == _too_few(two, n, n + 1)
    assert _config_problems(two, batch_size=n, train_probs=probs) == []
    assert _config_problems(two, batch_size=9, max_samples=4) == []


def _run_config(spec: str, batch_size: int, **data):
    from molt_hydra.config.schema import RunConfig

    cfg = RunConfig()
    cfg.data.train_path, cfg.rollout.batch_size, cfg.model.path = spec, batch_size, "tiny://qwen3_tiny"
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def _too_few_loaded(spec: str, rows: int, batch_size: int) -> str:
    """runtime/roles.py `_load_rows`' error: validation's line (`_too_few`), counted as loaded."""
    return (f"data.train_path={spec} has {rows} row(s) to train on as loaded, fewer than the rollout.batch_size="
            f"{batch_size} prompts each step takes: a step would train on a partial batch, or hold a prompt twice "
            f"(over several train.num_episodes). Fix: set rollout.batch_size <= {rows} (raise "
            "rollout.n_samples_per_prompt to keep the samples per step), or give it more rows")


def test_a_hub_dataset_of_fewer_rows_than_a_batch_ends_the_run_at_its_load(tmp_path, monkeypatch):
    """Validation counts local data only (a hub dataset is not read before the run starts): a hub dataset's rows are
    counted once loaded (runtime/roles.py `_load_rows`), with validation's message. Before: a hub dataset of 3 rows
    and rollout.batch_size=8 trained without a word. The hub dataset is one datasets loaded before, read offline
    from datasets' cache, as a run without the network reads it (tests never reach the hub)."""
    import datasets

    from molt_hydra.runtime.roles import _load_rows

    assert datasets.config.HF_HUB_OFFLINE  # (conftest.py)
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"prompt": "{p}", "label": "{i}"}}\n' for i, p in enumerate("abc")))
    cache = tmp_path / "cache"
    datasets.load_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train", cache_dir=str(cache))
    # renamed as datasets (5.x) caches hub dataset org/tiny: <cache>/org___tiny/default/<version>/<hash>/tiny-*.arrow
    (cache / "json").rename(cache / "org___tiny")
    (config,) = (cache / "org___tiny").glob("default-*")
    config.rename(config.with_name("default"))
    (arrow,) = (cache / "org___tiny" / "default").glob("*/*/json-train.arrow")
    arrow.rename(arrow.with_name("tiny-train.arrow"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    assert _config_problems("org/tiny", batch_size=8) == []  # validation cannot count it
    with pytest.raises(ValueError) as err:
        _load_rows(_run_config("org/tiny", 8), scoring=False)
    assert str(err.value) == _too_few_loaded("org/tiny", 3, 8)
    prompts, eval_rows = _load_rows(_run_config("org/tiny", 3), scoring=False)
    assert [(r["prompt"], r["label"]) for r in prompts] == [("a", "0"), ("b", "1"), ("c", "2")] and eval_rows is None


def test_rows_dropped_for_their_images_at_load_are_counted_against_the_batch(tmp_path):
    """Validation counts a local file's rows before their images are decoded; a row whose image cannot be read is
    dropped at load (one bad image costs one sample): 2 rows, 1 left, rollout.batch_size=2. Before: trained on a
    partial batch without a word."""
    from PIL import Image

    from molt_hydra.runtime.roles import _load_rows

    Image.new("RGB", (8, 8), "red").save(tmp_path / "red.png")
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "<image>" + p, "label": p, "images": [str(tmp_path / image)]}) + "\n"
                            for p, image in (("a", "none.png"), ("b", "red.png"))))
    data = dict(image_key="images", max_images_per_prompt=1)
    assert _config_problems(str(path), batch_size=2, **data) == []
    with pytest.raises(ValueError) as err:
        _load_rows(_run_config(str(path), 2, **data), scoring=False)
    assert str(err.value) == _too_few_loaded(str(path), 1, 2)



# Gemma's template refuses a system message and roles out of order with raise_exception (jinja2's TemplateError); the
# "!" clause refuses a row for its text alone
REFUSING = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
            "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("
            "'Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if '!' in "
            "m['content'] %}{{ raise_exception('no shouting') }}{% endif %}<start_of_turn>{{ m['role'] }}\n"
            "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
            "{% endif %}")
TEMPLATE_FIX = ("Fix: give the rows the roles and order the chat template takes (e.g. a system message folded into "
                "the first user message), or use a model whose template renders them")


def test_rows_the_chat_template_refuses_are_dropped_at_load_naming_them(tmp_path, tiny_model, caplog):
    """A row the model's chat template refuses is dropped at load, counted and logged with its row id and the fix, as
    one with an unusable image is; all refused is an error naming the first. A row refused for its text alone is
    found where its shape (roles, content kinds) was refused first: 'a!' drops, 'g' of its shape is kept. Before:
    every row loaded, and each rollout of a refused one failed with jinja's TemplateError naming no row, every epoch."""
    import logging

    from transformers import AutoTokenizer

    from molt_hydra.runtime.roles import _load_rows

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = REFUSING
    tok.save_pretrained(tmp_path / "tok")
    user, system = {"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}
    prompts = {"a!": [{"role": "user", "content": "a!"}], "b": [system, user], "c": "c", "d": [system, user],
               "e": [user, user], "f": [user, {"role": "assistant", "content": "x"}, user], "g": [user]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": label}) + "\n" for label, p in prompts.items()))
    cfg = _run_config(str(path), 3)
    cfg.model.tokenizer_path = str(tmp_path / "tok")
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        rows, _ = _load_rows(cfg, scoring=False)
    assert [r["label"] for r in rows] == ["c", "f", "g"]
    assert [r.getMessage() for r in caplog.records] == [
        f"data: dropped {n} of 7 rows of {path}: the chat template refuses their messages (TemplateError: {why}) "
        f"(row ids {ids}). {TEMPLATE_FIX}" for n, why, ids in (
            (1, "no shouting", [0]), (2, "System role not supported", [1, 3]),
            (1, "Conversation roles must alternate user/assistant/user/assistant/...", [4]))]
    cfg.rollout.batch_size = 4  # counted against the batch as loaded
    with pytest.raises(ValueError, match=r"has 3 row\(s\) to train on as loaded, fewer than the rollout.batch_size=4"):
        _load_rows(cfg, scoring=False)
    path.write_text("".join(json.dumps({"prompt": p, "label": str(i)}) + "\n" for i, p in enumerate(
        [[system, user]] * 2)))
    with pytest.raises(ValueError) as err:
        _load_rows(cfg, scoring=False)
    assert str(err.value) == (f"data.train_path={path}: every row of {path} was dropped: the chat template refuses "
                              f"their messages; row 0: TemplateError: System role not supported. {TEMPLATE_FIX}")


@pytest.mark.parametrize("name", ["datasets.parquet", "no_row_group.parquet", "stream.arrow", "file.arrow"])
def test_a_parquet_or_arrow_file_of_no_rows_is_named_as_the_other_empty_inputs_are(tmp_path, name):
    """A file of its columns alone, as datasets writes one (to_parquet of a filter that kept none) or pyarrow does.
    Before: 'is not a readable parquet file: Instruction "train" corresponds to no data!' (datasets' words; for a
    parquet file of no row group 'BatchSize must be greater than 0, got 0'), at validation and at the run's load."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / name
    table = pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())})
    if name == "datasets.parquet":
        datasets.Dataset.from_dict({"prompt": [], "label": []}).to_parquet(str(path))
    elif name.endswith(".parquet"):
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as f, (pa.ipc.new_stream if name == "stream.arrow" else pa.ipc.new_file)(
                f, table.schema) as writer:
            writer.write_table(table)
    reason = (f"{path} has no rows (its columns alone). Fix: write the rows again (a filter kept none?), or point "
              "the key at a dataset with rows")
    assert _config_problems(str(path)) == [f"- data.train_path: {reason}"]
    with pytest.raises(ValueError) as err:
        _named("data.train_path", load_prompts, str(path))
    assert str(err.value) == f"data.train_path={path}: {reason}"


READABLE = "a data file (.arrow, .csv, .json, .jsonl, .parquet), a directory of data files or a save_to_disk directory"


@pytest.mark.parametrize("name, fix", [
    ("train.JSONL", "rename it to train.jsonl (suffixes are read in lower case)"),
    ("train.jsonl.gz", "decompress it to train.jsonl (e.g. gunzip -k FILE), and point the key at that file"),
    ("train.json.gz", "decompress it to train.json (e.g. gunzip -k FILE), and point the key at that file"),
    ("train.jsonl.xz", "decompress it to train.jsonl (e.g. unxz -k FILE), and point the key at that file"),
    ("rows.txt", f"convert it to {READABLE}")])
def test_a_file_of_a_suffix_the_run_does_not_read_is_named_with_the_fix_for_its_suffix(tmp_path, name, fix):
    """An upper-case suffix or a compressed file, at validation and at load (python -m molt_hydra.data.prepare
    --source has no validation). Before: validation told to 'convert' a JSONL file the run reads once renamed, or a
    compressed one; the load took the file for a hub dataset: "Couldn't find any data file at" the file that is
    there."""
    path = tmp_path / name
    path.write_text('{"prompt": "a", "label": "1"}\n')
    suffix = name.rsplit(".", 1)[1]
    reason = (f"{str(path)!r} is a file of a type the run does not read (suffix '.{suffix}'). "
              f"Fix: {fix.replace('FILE', str(path))}")
    assert _config_problems(str(path)) == [f"- data.train_path: {reason}"]
    with pytest.raises(ValueError) as err:
        _named("data.train_path", load_prompts, str(path))
    assert str(err.value) == f"data.train_path={path}: {reason}"


@pytest.mark.parametrize("spec, reason", [
    ("https://x.org/f.jsonl?dl=1", "'https://x.org/f.jsonl?dl=1' is a URL, and the run reads none. Fix: download it, "
                                   "and point the key at the file (or give a hub dataset's id)"),
    ("~nosuchuser_34/x.jsonl", "'~nosuchuser_34/x.jsonl' is neither an existing file or directory nor a hub id")])
def test_a_url_and_an_unknown_users_home_are_told_without_a_traceback(spec, reason):
    """Before: a URL was told a file name pattern (for its query's ?); ~user of no such user ended validation in
    pathlib's RuntimeError traceback ("Could not determine home directory")."""
    (problem,) = _config_problems(spec)
    assert problem.startswith(f"- data.train_path: {reason}"), problem


def test_a_file_name_pattern_is_refused_naming_the_directory_as_the_fix(tmp_path):
    """Before: "is neither an existing file or directory nor a hub id (Repo id must be in the form 'repo_name' ...)"
    at validation, and "[Errno 2] No such file or directory" at load; the pattern's files exist."""
    for n in (1, 2):
        (tmp_path / f"part{n}.jsonl").write_text('{"prompt": "a", "label": "1"}\n')
    spec = str(tmp_path / "part*.jsonl")
    reason = (f"{spec!r} is a file name pattern, and the run expands none. Fix: point the key at the directory "
              "that holds the files (read as one dataset), or name each file, comma-separated (job=sft reads one "
              "file: concatenate them into one)")
    assert _config_problems(spec) == [f"- data.train_path: {reason}"]
    with pytest.raises(ValueError) as err:
        _named("data.train_path", load_prompts, spec)
    assert str(err.value) == f"data.train_path={spec}: {reason}"
    assert len(load_prompts(str(tmp_path))) == 2  # the fix: the directory, its two files one dataset



def test_prompts_over_the_room_their_first_turn_leaves_are_counted_at_load(tmp_path, tiny_model, caplog):
    """A prompt of more tokens than data.max_len leaves beside rollout.max_new_tokens (an Env's rollout left-truncates
    it; a chat agent's turn generates fewer tokens, over data.max_len none): counted at load, with the row ids, the
    longest and the fix. Before: found at each rollout of each row, one log line a rollout, never counted."""
    import logging

    from transformers import AutoTokenizer

    from molt_hydra.runtime.roles import _load_rows

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = ["short", "word " * 40, "hi", "word " * 60, [{"role": "user", "content": "word " * 50}]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": str(i)}) + "\n" for i, p in enumerate(prompts)))
    cfg = _run_config(str(path), 2, max_len=96)
    cfg.rollout.max_new_tokens = 32  # room: 96 - 32 = 64 tokens
    texts = [tok.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else p, tokenize=False,
                                     add_generation_prompt=True) for p in prompts]  # as the step runner renders them
    sizes = [len(tok(text, add_special_tokens=False)["input_ids"]) for text in texts]
    longs = [i for i, n in enumerate(sizes) if n > 64]
    assert longs == [1, 3, 4], sizes  # (the words' sizes are chosen for it)
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        rows, _ = _load_rows(cfg, scoring=False)
    assert len(rows) == 5  # counted, none dropped: an Env's reset may shorten its prompt
    assert [r.getMessage() for r in caplog.records] == [
        f"data: 3 of 5 rows of {path} have prompts over the 64 tokens data.max_len=96 leaves them beside "
        f"max_new_tokens=32 (the longest {max(sizes)} tokens; row ids [1, 3, 4]): an Env's rollout left-truncates "
        "each (one with images fails), a chat agent's first turn generates fewer tokens, none over data.max_len. "
        "Fix: raise data.max_len, lower the max_new_tokens, or filter those rows out"]


def test_the_long_prompt_count_takes_the_rows_the_run_reads_and_their_images_room(caplog, tmp_path):
    """Counted over the rows loaded (data.max_samples applied: a row past the cap is never read), each row's room less
    its images' tokens (`image_fits` each): an image row over it fails at each rollout."""
    import logging

    from molt_hydra.data.prompts import count_long_prompts

    rows = [{"prompt": "a"}, {"prompt": "b", "images": ["im1", "im2"]}, {"prompt": "c"}]
    seen = []

    def lengths_of(items):  # every prompt 50 tokens; the rooms it is given, recorded
        seen.extend(room for _, _, room in items)
        return [50] * len(items)

    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        count_long_prompts(rows, "spec", lengths_of, 96, 32, image_fits=lambda im: 10)
    assert seen == [64, 64 - 2 * 10, 64]
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "data: 1 of 3 rows of spec have prompts over the 64 tokens data.max_len=96 leaves them beside "
        "max_new_tokens=32 and their images (the longest 50 tokens; row ids [1]): ")
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in "abcde"))
    seen.clear()
    assert len(load_prompts(str(path), max_samples=2, prompt_tokens=lengths_of, lengths=(96, 32))) == 2
    assert seen == [64, 64]  # the two rows read, not the file's five
    # interleaved datasets (data.train_probs) repeat the shorter's rows: each row is counted once, in its own dataset
    short, other = tmp_path / "short.jsonl", tmp_path / "other.jsonl"
    short.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in ("LONG", "x")))
    other.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in "abcdef"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="molt_hydra.data.prompts"):
        load_prompts(f"{other},{short}", probs=[0.5, 0.5], lengths=(96, 32),
                     prompt_tokens=lambda items: [100 if p == "LONG" else 1 for p, _, _ in items])
    (record,) = caplog.records
    assert record.getMessage().startswith(f"data: 1 of 2 rows of {short} have prompts over the 64 tokens "), \
        record.getMessage()
    assert "row ids [0])" in record.getMessage()


@pytest.mark.parametrize("part", [{"type": "image", "image": "/data/x.png"},
                                  {"type": "image_url", "image_url": {"url": "/data/x.png"}}])
def test_an_sft_image_part_of_its_own_image_is_refused_naming_the_form_sft_reads(tmp_path, part):
    """job=sft reads a row's images from data.image_key alone. Before: such a part passed validation, and the row was
    trained without its image (a VLM's chat template rendered its placeholder, given no pixels)."""
    from test_loss_mask import _sft_problems

    path = tmp_path / "chats.jsonl"
    prompt = [{"role": "user", "content": [{"type": "text", "text": "colour?"}, part]}]
    path.write_text(json.dumps({"input": prompt, "output": "R"}) + "\n")
    key, value = next((k, v) for k, v in part.items() if k != "type")
    assert _sft_problems(str(path), train__batch_size=1) == [
        f"- data.train_path: {path}: SFT row 0: data.input_key='input': messages[0].content[1] is an image part "
        f"of its own image ({key!r}: {value!r}), a form the run does not read. Fix: give the row's images in the "
        "column data.image_key names, and a bare {'type': 'image'} part (or an <image> marker) where each goes"]
    bare = [{"role": "user", "content": [{"type": "text", "text": "colour?"}, {"type": "image"}]}]
    path.write_text(json.dumps({"input": bare, "output": "R"}) + "\n")
    assert _sft_problems(str(path), train__batch_size=1) == []


def test_an_image_url_part_in_an_envs_row_is_refused_a_chat_agents_taken(tmp_path):
    """An Env's first prompt takes its images from data.image_key alone (the step runner reads no image_url part; a
    chat agent's server does). Before: such a row passed validation, and each of its rollouts failed as an
    agent_exception ("holds 1 of this vision model's image placeholder ... for the row's 0 image(s)"), every epoch."""
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "x.png")
    url = str(tmp_path / "x.png")
    path = tmp_path / "rows.jsonl"
    prompt = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           {"type": "text", "text": "colour?"}]}]
    path.write_text(json.dumps({"prompt": prompt, "label": "R"}) + "\n")
    assert _config_problems(str(path), max_images_per_prompt=1) == [
        f"- data.train_path: {path} row 0: data.input_key='prompt' is {prompt!r:.60}; messages[0].content[0] is an "
        f"image part of its own image ('image_url': {{'url': {url!r:.52}), a form the run does not read. Fix: give the "
        "row's images in the column data.image_key names, and a bare {'type': 'image'} part (or an <image> marker) "
        "where each goes; an Env's first prompt takes no image_url part (a ChatAgent's server does)"]
    assert _config_problems(str(path), max_images_per_prompt=1, runner=CHAT_AGENT) == []
