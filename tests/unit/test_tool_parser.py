import pytest

from molt_hydra.agents.tool_parser import ToolCall, get_tool_parser, parse_hermes


def test_single_and_parallel_calls_leave_the_surrounding_text():
    r = parse_hermes('Let me run it.\n<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    assert (r.content, r.tool_calls) == ("Let me run it.", [ToolCall("python", {"code": "print(1)"})])
    r = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert r.tool_calls == [ToolCall("a", {}), ToolCall("b", {})] and r.content == ""


def test_string_encoded_arguments_are_decoded():
    r = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert r.tool_calls == [ToolCall("f", {"x": 2})]


@pytest.mark.parametrize("body", ['{"name": "f"', '["f"]', '{"arguments": {}}', '{"name": "f", "arguments": [1]}',
                                  '{"name": 3}', '{"name": "f", "arguments": "not json"}'])
def test_malformed_blocks_stay_in_the_content(body):
    text = f"x <tool_call>{body}</tool_call>"
    assert parse_hermes(text) == parse_hermes(text).__class__(text.strip(), [])


def test_parses_the_tiny_tokenizers_decoded_ids(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok('<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call><|im_end|>',
              add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>")  # a single special token
    text = tok.decode(ids[:-1], skip_special_tokens=False)
    assert parse_hermes(text).tool_calls == [ToolCall("python", {"code": "print(6*7)"})]


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tool parser 'qwen9'; known: \['hermes'\]"):
        get_tool_parser("qwen9")
