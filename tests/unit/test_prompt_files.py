"""Prompt files that cannot be read (data/prompts.py `load_prompts`, runtime/roles.py `_load_rows`): an empty file, a
malformed JSONL line, a file without rows, a missing column end with one ValueError naming the config key, the file
and the reason. Before: an empty .jsonl raised a bare StopIteration (in the run: 'RuntimeError: coroutine raised
StopIteration'), a malformed line datasets' 'An error occurred while generating the dataset', naming neither; a
null prompt failed each of its rollouts as an agent_exception, every epoch."""

from __future__ import annotations

import pytest

from molt_hydra.data.prompts import load_prompts
from molt_hydra.runtime.roles import _named

FILES = {
    "empty.jsonl": ("", "is not a readable jsonl file: it is empty"),
    "malformed.jsonl": ('{"prompt": "a", "label": "1"}\n{"prompt": "b", "lab\n',
                        "is not a readable jsonl file: JSON parse error"),
    "no_rows.json": ("[]\n", "is not a readable json file: "),
    "no_column.jsonl": ('{"text": "a"}\n', "data.input_key='prompt' is not a column; columns: ['text']"),
    "null_prompt.jsonl": ('{"prompt": "a"}\n{"prompt": null}\n', "row 1: data.input_key='prompt' is None; "),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_an_unreadable_prompt_file_is_named_with_its_key_and_reason(tmp_path, name):
    text, reason = FILES[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        _named("data.train_path", load_prompts, str(path))
    message = str(err.value)
    assert message.startswith(f"data.train_path={path}: ") and reason in message, message


def test_a_readable_file_loads(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n')
    assert _named("data.train_path", load_prompts, str(path)) == [{"prompt": "a", "label": "1",
                                                                    "datasource": "default"}]
