"""Loss masks from chat-template-discovered reply markers cover exactly the assistant tokens (+ the stop token),
for ChatML (the tiny model's template) and a Gemma-style template written here."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from molt_hydra.data.sft_dataset import build_sft_samples, discover_reply_markers, load_rows

GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
         "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# Llama-2-ish family without a stop token after replies: nothing after the content but the next turn
NO_TERMINATOR = ("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{{ m.content }}{% else %}"
                 "<|user|>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "The answer is 5."}, {"role": "user", "content": "and 4+4?"},
        {"role": "assistant", "content": "It is 8, done."}]


@pytest.fixture(scope="module")
def tok(tiny_model):
    t = AutoTokenizer.from_pretrained(tiny_model)
    t.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<|assistant|>",
                                                        "<|user|>"]})
    return t


def expected_mask(tok, template, close_text, last_only=False):
    """Tokens whose characters fall inside an assistant content (+ its close text), via offsets."""
    text = tok.apply_chat_template(CHAT, tokenize=False, chat_template=template)
    spans, pos = [], 0
    for m in CHAT:
        at = text.index(m["content"], pos)
        pos = at + len(m["content"])
        if m["role"] == "assistant":
            spans.append((at, pos + len(close_text)))
    spans = spans[-1:] if last_only else spans
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [int(any(a <= s and e <= b for a, b in spans)) for s, e in enc["offset_mapping"]]


@pytest.mark.parametrize("template,close_text,open_text", [
    (None, "<|im_end|>", "<|im_start|>assistant\n"),
    (GEMMA, "<end_of_turn>", "<start_of_turn>model\n"),
    (NO_TERMINATOR, "", "<|assistant|>"),
])
@pytest.mark.parametrize("last_only", [False, True])
def test_mask_covers_exactly_assistant_tokens(tok, template, close_text, open_text, last_only):
    markers = discover_reply_markers(tok, template)
    assert tok.decode(list(markers.reply_open)) == open_text
    assert (markers.reply_close is not None) == bool(close_text)  # a terminator is supervised
    ids, want = expected_mask(tok, template, close_text, last_only)
    [s] = build_sft_samples([{"input": CHAT}], tok, chat_template=template, train_on_last_turn_only=last_only)
    assert s["input_ids"].tolist() == ids
    assert s["loss_mask"].int().tolist() == want
    assert sum(want) > 8
    supervised = tok.decode([i for i, m in zip(ids, want) if m])
    assert supervised == ("" if last_only else "The answer is 5." + close_text) + "It is 8, done." + close_text


def test_rows_without_reply_are_dropped_and_all_empty_is_an_error(tok):
    rows = [{"input": "hi", "output": "hello"}, {"input": "no reply"}]
    samples = build_sft_samples(rows[:1], tok, output_key="output")
    assert len(samples) == 1
    with pytest.raises(ValueError, match="no SFT samples"):
        build_sft_samples(rows[1:], tok)


@pytest.mark.parametrize("rows,output_key,message", [
    ([{"input": "hi", "output": "a"}, {"input": "x"}], "output",
     "SFT row 1: data.output_key='output' is missing (keys ['input'])"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], None, "SFT row 0: data.input_key='input' is missing"),
    ([{"input": None, "output": "a"}], "output", "SFT row 0: data.input_key='input' is None"),
    ([{"input": "hi", "output": 5}], "output", "SFT row 0: data.output_key='output' is 5"),
    ([{"input": "hi", "output": "a"}, 7], "output", "SFT row 1 is 7, not an object"),
    ([{"input": [{"content": "hi"}, {"role": "assistant", "content": "a"}]}], None,
     "SFT row 0: data.input_key='input' holds {'content': 'hi'}, not a chat message"),
    ([{"input": ["hi", "a"]}], None, "SFT row 0: data.input_key='input' holds 'hi', not a chat message"),
    ([{"input": "hi", "output": {"content": "a"}}], "output",
     "SFT row 0: data.output_key='output' holds {'content': 'a'}, not a chat message"),
    # before: rendered as the template pleased (Qwen's drops a message of another role) / a TypeError in the template
    ([{"input": [{"role": "wizard", "content": "hi"}], "output": "a"}], "output",
     "SFT row 0: data.input_key='input' holds {'role': 'wizard', 'content': 'hi'}, not a chat message"),
    ([{"input": "hi", "output": {"role": "assistant", "content": 7}}], "output",
     "SFT row 0: data.output_key='output' holds {'role': 'assistant', 'content': 7}, not a chat message"),
])
def test_a_row_without_its_columns_is_named_with_the_key(tok, rows, output_key, message):
    """Before: a bare KeyError('output') / TypeError("'NoneType' object is not iterable") from the trainer rank."""
    with pytest.raises(ValueError, match=re.escape(message) + ".*Fix: "):
        build_sft_samples(rows, tok, output_key=output_key)


@pytest.mark.parametrize("name,text,message", [
    ("bad.jsonl", '{"input": "a", "output": "b"}\n\n{"input": "a", "output"}\n', "line 3 is not JSON"),
    ("bad.json", '[{"input": "a"},\n{"input": "b"', "line 2 is not JSON"),
    ("scalar.json", '5', "item 1 is 5, not a JSON object"),
    ("lines_in.json", '{"input": "a", "output": "b"}\n{"input": }\n', "line 2 is not JSON"),  # (was: 'Extra data')
])
def test_sft_data_that_is_not_rows_is_named_with_its_line(tmp_path, name, text, message):
    """Before: json's bare "Expecting ':' delimiter: line 1 column 24" (the line within the .jsonl line, not the file's,
    and no file), and a .json object a TypeError from slicing it."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / name))}'?: {message}.*Fix: "):
        load_rows(str(tmp_path / name))


def test_a_json_file_reads_as_prompt_files_do(tmp_path):
    """A list of rows, one (pretty-printed) object or JSON Lines, as datasets reads a prompt .json. Before: JSON Lines
    was json's 'Extra data: line 2 column 1', one object a refusal."""
    for text in ('[{"input": "a"}, {"input": "b"}]', '{"input": "a"}\n{"input": "b"}\n'):
        (tmp_path / "rows.json").write_text(text)
        assert load_rows(str(tmp_path / "rows.json")) == [{"input": "a"}, {"input": "b"}]
    (tmp_path / "rows.json").write_text('{\n  "input": "a"\n}\n')
    assert load_rows(str(tmp_path / "rows.json")) == [{"input": "a"}]


def test_a_bom_and_a_u2028_inside_a_string_read_as_written(tmp_path):
    """Before: a UTF-8 BOM was 'line 1 is not JSON (Unexpected UTF-8 BOM)', and a U+2028 in a string (JSON leaves it
    unescaped) split its line in two, each 'not JSON'. Prompt files (read by datasets) took both."""
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"input": "a", "output": "b"}\n{"input": "c\xe2\x80\xa8d", "output": "e"}')
    assert load_rows(str(path)) == [{"input": "a", "output": "b"}, {"input": "c\u2028d", "output": "e"}]


def test_rows_skipped_or_cut_are_counted_and_logged_with_their_ids(tok, caplog):
    """Before: a row without a reply, or whose reply lay past data.max_len, was skipped without a word, and a row
    longer than max_len cut without one."""
    def chat(ask: str, reply: str | None = None) -> dict:
        reply_message = [{"role": "assistant", "content": reply}] if reply else []
        return {"input": [{"role": "user", "content": ask}] + reply_message}

    long = chat("word " * 40, "the reply")  # the reply lies past max_len=20: nothing to train on
    cut = chat("hi", "word " * 40)  # cut inside its reply: trained on the reply's start
    samples = build_sft_samples([chat("hi", "ok"), chat("no reply"), long, cut], tok, max_len=20)
    whole = tok(tok.apply_chat_template(chat("hi", "ok")["input"], tokenize=False), add_special_tokens=False)
    assert [len(s["input_ids"]) for s in samples] == [len(whole["input_ids"]), 20]
    assert caplog.messages == ["SFT data: of 4 rows, 1 skipped: no assistant message (row ids [1]); 1 skipped: no "
                               "reply token within data.max_len=20 tokens (row ids [2]); 1 cut to data.max_len=20 "
                               "tokens (row ids [3])"]


@pytest.mark.parametrize("blank", ["", "  \n", None, [], [{"type": "text", "text": " "}]])
def test_a_row_with_a_blank_assistant_reply_is_skipped_counted_not_trained_to_stop(tok, caplog, blank):
    """Before: trained on, its mask the terminator alone (the model taught to answer nothing), without a word. A reply
    of tool calls alone is no blank reply."""
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    rows = [{"input": [*good, {"role": "user", "content": "and?"}, {"role": "assistant", "content": blank}]},
            {"input": good}, {"input": [good[0], {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}]
    samples = build_sft_samples(rows, tok)
    assert [s["input_ids"].tolist() for s in samples] == [
        tok(tok.apply_chat_template(r["input"], tokenize=False), add_special_tokens=False)["input_ids"]
        for r in rows[1:]]
    assert caplog.messages == ["SFT data: of 3 rows, 1 skipped: a blank assistant reply (no text, no tool call) (row "
                               "ids [0])"]


@pytest.mark.parametrize("template,header", [(None, "<|im_start|>assistant\n"), (GEMMA, "<start_of_turn>model\n")])
def test_a_row_whose_text_holds_the_reply_header_is_skipped_counted_not_trained_as_a_reply(tok, caplog, template,
                                                                                            header):
    """Before: the user's text after a literal reply header (a row quoting a chat transcript) was trained on as a
    reply, without a word: the mask is placed at the header's tokens, which the tokenizer reads in any message's
    text. The clean row's mask is unchanged: its reply and terminator alone."""
    quoted = [{"role": "user", "content": f"What does {header}USER TEXT mean?"}, {"role": "assistant", "content": "a"}]
    clean = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    [sample] = build_sft_samples([{"input": quoted}, {"input": clean}], tok, chat_template=template)
    text = tok.apply_chat_template(clean, tokenize=False, chat_template=template)
    close = "<|im_end|>" if template is None else "<end_of_turn>"
    at = text.index(header + "ok") + len(header)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    want = [int(at <= a and b <= at + len("ok" + close)) for a, b in enc["offset_mapping"]]
    assert sample["input_ids"].tolist() == enc["input_ids"]
    assert sample["loss_mask"].int().tolist() == want and sum(want) == len(tok("ok" + close)["input_ids"])
    assert caplog.messages == [f"SFT data: of 2 rows, 1 skipped: a message's text holds the chat template's reply "
                               f"header {header!r}, so no mask could tell its tokens from a reply's (row ids [0])"]


# Gemma's and Mistral's templates refuse roles they do not take, with raise_exception (jinja2's TemplateError)
ALTERNATING = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("
               "'Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}<start_of_turn>"
               "{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>"
               "assistant\n{% endif %}")


@pytest.mark.parametrize("template,row,error", [
    (ALTERNATING, {"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                   "output": "a"},
     "TemplateError: Conversation roles must alternate user/assistant/user/assistant/..."),
    # text joined to a list of parts: the template's own TypeError
    ("{% for m in messages %}{{ '<|' + m.role + '|>' + m.content }}{% endfor %}{% if add_generation_prompt %}"
     "<|assistant|>{% endif %}", {"input": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                  "output": "a"}, "TypeError: "),
])
def test_a_row_the_chat_template_refuses_is_named_with_the_fix(tok, template, row, error):
    """Before: jinja2's TemplateError (or the template's TypeError) out of every trainer rank, naming no row."""
    good = {"input": "hi", "output": "hello"}
    assert len(build_sft_samples([good], tok, output_key="output", chat_template=template)) == 1
    with pytest.raises(ValueError) as err:
        build_sft_samples([good, row], tok, output_key="output", chat_template=template, source="chats.jsonl")
    assert str(err.value).startswith(f"chats.jsonl: SFT row 1: the chat template refuses its messages ({error}")
    assert str(err.value).endswith("). Fix: give the row the roles and order the template takes, or set "
                                   "data.chat_template to one that renders them")


def test_template_without_generation_prompt_is_refused(tok):
    with pytest.raises(ValueError, match="add_generation_prompt"):
        discover_reply_markers(tok, "{% for m in messages %}{{ m.content }}{% endfor %}")


def test_a_bad_sft_row_is_a_config_error_before_anything_starts(tmp_path):
    """Before: validation (and a dry run) passed it; the trainer ranks refused it once the run had started."""
    from molt_hydra.config.schema import Job, RunConfig
    from molt_hydra.config.validate import Problems
    from molt_hydra.data.rules import check_data

    path = tmp_path / "chats.jsonl"
    path.write_text('{"input": "hi", "output": "a"}\n{"input": [{"role": "wizard", "content": "x"}], "output": "b"}\n')
    cfg, problems = RunConfig(), Problems()
    cfg.job, cfg.data.train_path, cfg.data.input_key, cfg.data.output_key = Job("sft"), str(path), "input", "output"
    check_data(cfg, problems)
    assert problems.lines == [
        f"- data.train_path: {path}: SFT row 1: data.input_key='input' holds {{'role': 'wizard', 'content': 'x'}}, not "
        "a chat message. Fix: make each message an object with a 'role' (one of system, user, assistant, tool) and its "
        "'content' (a string or a list of parts, each an object)"]


def _sft_problems(spec: str, **fields) -> list[str]:
    """data/rules.py check_data's problems for job=sft on `spec` (fields: train.* and data.* values by name)."""
    from molt_hydra.config.schema import Job, RunConfig
    from molt_hydra.config.validate import Problems
    from molt_hydra.data.rules import check_data

    cfg, problems = RunConfig(), Problems()
    cfg.job, cfg.data.train_path, cfg.data.input_key, cfg.data.output_key = Job("sft"), spec, "input", "output"
    for key, value in fields.items():
        group, name = key.split("__")
        setattr(getattr(cfg, group), name, value)
    check_data(cfg, problems)
    return problems.lines


def test_sft_data_of_fewer_rows_than_a_batch_is_a_config_error_naming_the_file(tmp_path):
    """One optimizer step takes train.batch_size samples, one per row at most (parallel/sft.py), so fewer rows train
    nothing. Before: validation passed it; the trainer rank raised "train.batch_size=8 must divide over 1 ranks and
    be <= 3 samples" once the run had started, naming neither the file nor a fix."""
    path = tmp_path / "chats.jsonl"
    path.write_text('{"input": "hi", "output": "a"}\n' * 3)
    assert _sft_problems(str(path), train__batch_size=8) == [
        f"- data.train_path: {path} has 3 SFT row(s), fewer than the train.batch_size=8 samples of one optimizer "
        "step: nothing would be trained. Fix: set train.batch_size <= 3 (train.micro_batch_size with it), or give it "
        "more rows"]
    assert _sft_problems(str(path), train__batch_size=3) == []
    # data.max_samples reads the first rows only: then it is the key to change
    assert _sft_problems(str(path), train__batch_size=3, data__max_samples=2) == [
        f"- data.max_samples: {path} has 3 SFT row(s), 2 of them read (data.max_samples), fewer than the "
        "train.batch_size=3 samples of one optimizer step: nothing would be trained. Fix: set train.batch_size <= 2 "
        "(train.micro_batch_size with it), or raise data.max_samples to >= 3"]
    # a builtin task by its size (colors_warm: 256 rows)
    assert _sft_problems("builtin://colors_warm", train__batch_size=512, data__max_images_per_prompt=1,
                         data__input_key="input", data__image_key="images") == [
        "- data.train_path: builtin://colors_warm has 256 SFT row(s), fewer than the train.batch_size=512 samples of "
        "one optimizer step: nothing would be trained. Fix: set train.batch_size <= 256 (train.micro_batch_size with "
        "it), or give it more rows"]


def test_an_sft_row_error_on_a_trainer_rank_names_its_file(tmp_path, tiny_model):
    """parallel/sft.py tokenizes the train and the eval rows on each rank; a bad row there (a run_sft call that
    validation never saw) named no file. Before: "SFT row 1: ...", train and eval data told apart only by guess."""
    from molt_hydra.parallel.sft import _samples

    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"input": "hi", "output": "a"}\n')
    evals.write_text('{"input": "hi", "output": "a"}\n{"input": "hi", "output": 5}\n')
    kw = dict(input_key="input", output_key="output", max_len=64, chat_template=None, train_on_last_turn_only=False,
              image_key=None, max_images_per_prompt=0, max_samples=None, train_data=str(train), eval_data=str(evals))
    with pytest.raises(ValueError, match=f"^{re.escape(str(evals))}: SFT row 1: data.output_key='output' is 5;"):
        _samples(tiny_model, kw)
    with pytest.raises(ValueError, match=f"^{re.escape(str(evals))}: SFT row 1: "):
        _samples(tiny_model, {**kw, "train_data": str(evals), "eval_data": None})
    with pytest.raises(ValueError, match="^the train rows: no SFT samples with supervised tokens among 1 rows"):
        _samples(tiny_model, {**kw, "train_data": [{"input": "no reply"}], "output_key": None, "eval_data": None})


def test_too_few_sft_samples_on_a_trainer_rank_names_the_file_and_the_fix(tmp_path, tiny_model, monkeypatch):
    """8 rows pass validation against train.batch_size=8, but 5 have no reply (skipped, logged): 3 samples. Before:
    "train.batch_size=8 must divide over 1 ranks and be <= 3 samples", naming no file and no fix."""
    from molt_hydra.parallel.sft import run_sft

    path = tmp_path / "chats.jsonl"
    reply, no_reply = ({"input": [{"role": "user", "content": "hi"}] + extra} for extra in (
        [{"role": "assistant", "content": "a"}], []))
    path.write_text("".join(json.dumps(row) + "\n" for row in [reply] * 3 + [no_reply] * 5))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "29999")):  # this process: the one rank
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as err:
        run_sft(tiny_model, str(path), str(tmp_path / "out"), batch_size=8)
    assert str(err.value) == (f"{path}: 3 SFT samples, fewer than the train.batch_size=8 of one optimizer step: "
                              "nothing would be trained. Fix: set train.batch_size <= 3, or give it more rows with a "
                              "reply")
