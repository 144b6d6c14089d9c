"""A forced tool call / response_format is sent as a JSON grammar with bounded whitespace (agents/json_grammar.py):
it accepts the JSON the schema allows, compact or in `json.dumps` style, and refuses runs of whitespace, so a weak
model cannot spin on blanks until max_tokens (vLLM's per-request `json` schema allows any whitespace)."""

from __future__ import annotations

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from molt_hydra.agents.json_grammar import compact
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
