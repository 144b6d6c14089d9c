"""A forced tool call / response_format is sent as a JSON grammar with bounded whitespace (agents/json_grammar.py):
it accepts the JSON the schema allows, compact or in `json.dumps` style, and refuses runs of whitespace, so a weak
model cannot spin on blanks until max_tokens (vLLM's per-request `json` schema allows any whitespace)."""

from __future__ import annotations

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from molt_hydra.agents.json_grammar import compact, strict_calls
from molt_hydra.agents.tool_parser import CALL_ENVELOPES
from molt_hydra.agents.wire.request import RequestError
from molt_hydra.compat.vllm import forced_tool_schema

TOOL = {"type": "function", "function": {"name": "python", "description": "Run code", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def accepts(structured: dict, text: str) -> bool:
    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(structured["grammar"]), text)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "python"}}])
def test_forced_tool_call_grammar_refuses_free_whitespace(tool_choice):
    structured = compact({"json": forced_tool_schema([TOOL], tool_choice, None)})
    assert set(structured) == {"grammar"}
    call = '{"code":"print(1)"}'
    good = f'[{{"name":"python","parameters":{call}}}]' if tool_choice == "required" else call
    assert accepts(structured, good)
    assert accepts(structured, good.replace(":", ": ").replace(",", ", "))  # json.dumps style, as templates render
    for blank in (" \t", "\n ", "     "):  # what the tiny model emitted until max_tokens: `[     \t \t {"name": ...`
        assert not accepts(structured, good[0] + blank + good[1:])
        assert not accepts(structured, good.replace(":", ":" + blank, 1))
        assert not accepts(structured, good + blank)
    assert not accepts(structured, good.replace("code", "cod"))  # still only the tool's JSON


def test_response_format_json_object_and_text_pass_through():
    assert accepts(compact({"json_object": True}), '{"a": 1}')
    assert not accepts(compact({"json_object": True}), '{  "a":1}')
    assert compact(None) is None and compact({"regex": "a+"}) == {"regex": "a+"}


def test_a_schema_xgrammar_refuses_is_the_clients_400():
    with pytest.raises(RequestError) as e:
        compact({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}})
    assert e.value.status == 400 and "'response_format' schema cannot be enforced" in e.value.message


def test_strict_tools_under_auto_hold_calls_to_their_schemas_and_leave_text_free():
    """`strict: true` under tool_choice auto (was: accepted, never enforced): text is free; a call opens only as a
    call of a request's tool, a strict tool's arguments follow its schema, a non-strict tool's are a JSON object."""
    free = {"type": "function", "function": {"name": "note"}}  # no parameters: any JSON object
    structured = strict_calls([TOOL, free], ["python"], CALL_ENVELOPES["hermes"], "hermes")

    def call(name: str, args: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'

    assert accepts(structured, "Let me run it. " + call("python", '{"code": "print(1)"}'))
    assert accepts(structured, "No tool needed: 42.")
    assert accepts(structured, call("python", '{"code": "1"}') + "\n" + call("note", '{"any": [1, 2]}'))  # parallel
    assert not accepts(structured, call("python", '{"code": 1}'))  # not the schema's string
    assert not accepts(structured, call("python", '{}'))  # code is required
    assert not accepts(structured, call("shell", '{"code": "1"}'))  # not a tool of the request
    assert not accepts(structured, call("note", "[1]"))  # arguments are an object
    assert not accepts(structured, call("python", '{"code":      "1"}'))  # no runs of whitespace


def test_a_tool_name_json_escapes_is_matched_as_the_parser_reads_it():
    """The call grammar's envelope holds a tool's name as JSON writes it inside the call (was: raw, so a name with a
    quote or backslash could never be called under the grammar, though the hermes parser reads the escaped call)."""
    name = 'say "hi" \\ café'
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    structured = strict_calls([tool], [name], CALL_ENVELOPES["hermes"], "hermes")
    call = json.dumps({"name": name, "arguments": {"a": 1}}, ensure_ascii=False)
    assert accepts(structured, f"<tool_call>\n{call}\n</tool_call>")


@pytest.mark.parametrize("strict", [["python"], []])
def test_a_single_call_under_auto_ends_the_output_after_one_call(strict):
    """parallel_tool_calls false under tool_choice auto, strict tools or not (was: every call sampled, all but the
    first cut from the reply, so the trajectory trained calls the agent never ran): text, then at most one call."""
    structured = strict_calls([TOOL], strict, CALL_ENVELOPES["hermes"], "hermes", single=True)
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>'
    assert accepts(structured, "Let me run it. " + call)
    assert accepts(structured, "No tool needed: 42.")
    assert not accepts(structured, call + "\n" + call)  # a second call
    assert not accepts(structured, call + " and more text")  # the output ends with the call
    assert accepts(strict_calls([TOOL], strict, CALL_ENVELOPES["hermes"], "hermes"), call + "\n" + call)


@pytest.mark.parametrize("strict,param,words", [(["python"], "tools", "send strict false"),
                                                ([], "parallel_tool_calls", "'parallel_tool_calls': false")])
def test_a_call_grammar_for_a_parser_without_a_known_envelope_is_the_clients_400(strict, param, words):
    with pytest.raises(RequestError) as e:
        strict_calls([TOOL], strict, None, "qwen3_coder", single=not strict)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert "agent.tool_parser='qwen3_coder'" in e.value.message and "tool_choice \"required\"" in e.value.message


def test_a_response_format_beside_tools_is_its_json_or_calls_and_for_an_unknown_envelope_the_clients_400():
    """Tools under auto beside a response format: the output is the format's JSON or calls, no free text; a parser
    whose call markup is unknown cannot hold that: a 400 naming the format's field."""
    output = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    structured = strict_calls([TOOL], [], CALL_ENVELOPES["hermes"], "hermes", output=output)
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>'
    texts = ('{"answer": 1}', call, "Sure. " + call, "42", '{"answer": 1} ' + call)
    assert [accepts(structured, text) for text in texts] == [True, True, False, False, False]
    with pytest.raises(RequestError) as e:
        strict_calls([TOOL], [], None, "qwen3_coder", output=output, output_param="text.format")
    assert (e.value.status, e.value.param) == (400, "text.format")
    assert "'text.format' beside 'tools' (the reply is its JSON or a call)" in e.value.message


@pytest.mark.parametrize("build", [
    lambda schema: compact({"json": schema}),  # response_format / output_config.format
    lambda schema: compact({"json": forced_tool_schema([dict(TOOL, function=dict(TOOL["function"], parameters=schema))],
                                                       {"type": "function", "function": {"name": "python"}}, None)}),
    lambda schema: strict_calls([TOOL], [], CALL_ENVELOPES["hermes"], "hermes", output=schema),
])
def test_properties_are_written_in_the_schemas_order(build):
    """As OpenAI's structured outputs and vLLM's server (was: the schema's keys sorted first, so a `reasoning` declared
    before the `answer` it should lead to could only come after it)."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    structured = build(schema)
    assert accepts(structured, '{"reasoning": "6*7", "answer": 42}')
    assert not accepts(structured, '{"answer": 42, "reasoning": "6*7"}')
