"""Tool calls and reasoning parsed by vLLM's own parsers, per model family (agents/tool_parser.py)."""

import json

import pytest

from molt_hydra.agents.tool_parser import ReplyParser, ToolCall

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def with_tokens(tok, *tokens):
    """A copy of the tiny tokenizer that knows another family's tool-call marker tokens."""
    import copy

    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": list(tokens)})
    return t


def test_hermes_single_and_parallel_calls_leave_the_surrounding_text(tok):
    p = ReplyParser(tok, "hermes")
    r = p.parse('Let me run it.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
                TOOLS)
    assert (r.content, r.tool_calls) == ("Let me run it.", [ToolCall("python", {"code": "print(1)"})])
    two = '<tool_call>{"name": "python", "arguments": {}}</tool_call><tool_call>{"name": "python", "arguments": ' \
          '{"code": "x"}}</tool_call>'
    assert p.parse(two, TOOLS).tool_calls == [ToolCall("python", {}), ToolCall("python", {"code": "x"})]


def test_qwen3_coder_xml_calls(tok):
    text = "ok\n<tool_call>\n<function=python>\n<parameter=code>\nprint(6*7)\n</parameter>\n</function>\n</tool_call>"
    r = ReplyParser(tok, "qwen3_coder").parse(text, TOOLS)
    assert r.tool_calls == [ToolCall("python", {"code": "print(6*7)"})] and r.content == "ok"
    assert ReplyParser(tok, "hermes").parse(text, TOOLS).tool_calls == []  # a family's parser, not a guess


def test_llama3_json_calls(tok):
    t = with_tokens(tok, "<|python_tag|>")
    r = ReplyParser(t, "llama3_json").parse('<|python_tag|>{"name": "python", "parameters": {"code": "1"}}', TOOLS)
    assert r.tool_calls == [ToolCall("python", {"code": "1"})]


def test_mistral_calls(tok):
    t = with_tokens(tok, "[TOOL_CALLS]")
    r = ReplyParser(t, "mistral").parse('[TOOL_CALLS][{"name": "python", "arguments": {"code": "2"}}]', TOOLS)
    assert r.tool_calls == [ToolCall("python", {"code": "2"})]


def test_reasoning_is_split_off_before_tool_parsing(tok):
    p = ReplyParser(tok, "hermes", "qwen3")
    text = '<think>\nrun it\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>'
    r = p.parse(text, TOOLS)
    assert r.reasoning.strip() == "run it" and r.tool_calls == [ToolCall("python", {"code": "1"})]
    assert ReplyParser(tok, "hermes").parse(text, TOOLS).reasoning is None


def test_tool_choice_none_and_no_tools_parse_nothing(tok):
    p = ReplyParser(tok, "hermes")
    text = '<tool_call>\n{"name": "python", "arguments": {}}\n</tool_call>'
    assert p.parse(text, TOOLS, parse_tools=False).tool_calls == []
    assert p.parse(text, None).content == text


def test_streamed_content_stops_where_a_tool_call_may_begin(tok):
    p = ReplyParser(tok, "hermes")
    # whitespace before a call is held back as the reply strips it (was: "Let me ", and a blank "\n\n" streamed)
    assert p.streamable("Let me <tool_c", TOOLS, True) == (None, "Let me")
    assert p.streamable("Let me <tool_call>\n{", TOOLS, True) == (None, "Let me")
    assert p.streamable("\n\n<tool_call>\n{", TOOLS, True) == (None, "")
    assert p.streamable("Let me <tool_c", TOOLS, False) == (None, "Let me <tool_c")
    # llama3_json's calls may open with a bare `{` (no <|python_tag|>): it is held too (was: streamed as text)
    llama = ReplyParser(with_tokens(tok, "<|python_tag|>"), "llama3_json")
    text = 'Let me run it. {"name": "python", "arguments": {"code": "1"}}'
    assert llama.streamable(text, TOOLS, True) == (None, "Let me run it.")
    assert llama.parse(text, TOOLS).tool_calls == [ToolCall("python", {"code": "1"})]  # it is a call


def test_forced_tool_choice_parses_the_bare_json(tok):  # the schema that forces it: test_vllm_compat_chat.py
    named = {"type": "function", "function": {"name": "python"}}
    p = ReplyParser(tok, "hermes")
    assert p.parse_forced(json.dumps([{"name": "python", "parameters": {"code": "3"}}]), "required").tool_calls == [
        ToolCall("python", {"code": "3"})]
    assert p.parse_forced('{"code": "4"}', named).tool_calls == [ToolCall("python", {"code": "4"})]


def test_a_thinking_model_thinks_before_its_forced_tool_call(tok):
    """The engine's grammar starts where the reasoning ends (the engine gets agent.reasoning_parser): the reply is
    thinking, then the forced JSON; the thinking is surfaced as reasoning and the JSON read as the call."""
    p = ReplyParser(tok, "hermes", "deepseek_r1")
    r = p.parse_forced('<think>I should run it.</think>{"code": "5"}', {"type": "function", "function": {
        "name": "python"}})
    assert (r.reasoning, r.content, r.tool_calls) == ("I should run it.", "", [ToolCall("python", {"code": "5"})])
    cut = p.parse_forced("<think>still thinking", "required")  # cut by max_tokens inside the thinking: no call
    assert (cut.reasoning, cut.tool_calls) == ("still thinking", [])



def test_unknown_parser_names_fail_naming_the_key(tok):
    with pytest.raises(ValueError, match=r"agent.tool_parser='qwen9' is not a vLLM tool parser.*hermes"):
        ReplyParser(tok, "qwen9")
    with pytest.raises(ValueError, match=r"agent.reasoning_parser='nope'"):
        ReplyParser(tok, "hermes", "nope")


def test_a_parser_that_does_not_fit_the_tokenizer_names_the_fix(tok):
    with pytest.raises(ValueError, match=r"agent.tool_parser='llama3_json' does not fit this model's tokenizer"):
        ReplyParser(tok, "llama3_json")  # the tiny Qwen tokenizer has no <|python_tag|>


def test_a_tool_call_cut_by_a_stop_string_is_counted_with_one_warning_line(tok, caplog):
    """vLLM's Hermes parser logs an ERROR with a traceback for an unclosed call; here it is one warning, counted as
    agent/tool_parse_failures, and the text goes back to the agent as written."""
    import logging

    from molt_hydra.agents.tool_parser import parse_failures

    vllm_log = logging.getLogger("vllm.tool_parsers.hermes_tool_parser")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # what reaches vLLM's own handlers (after the logger's filters)
    vllm_log.addHandler(handler)
    try:
        p = ReplyParser(tok, "hermes")
        before = parse_failures()
        cut = 'Let me run it.\n<tool_call>\n{"name": "python", "arguments": {"code": "pri'
        with caplog.at_level(logging.WARNING, logger="molt_hydra.agents.tool_parser"):
            r = p.parse(cut, TOOLS)
        bad_args = p.parse('<tool_call>{"name": "python", "arguments": "print(1)"}</tool_call>', TOOLS)
    finally:
        vllm_log.removeHandler(handler)
    assert (r.content, r.tool_calls) == (cut, [])
    assert bad_args.tool_calls == []
    assert parse_failures() == before + 2
    assert not [rec for rec in seen if rec.levelno >= logging.ERROR], "vLLM's traceback reached its handlers"
    cut_warning, args_warning = [rec for rec in caplog.records if rec.name == "molt_hydra.agents.tool_parser"]
    assert {cut_warning.levelno, args_warning.levelno} == {logging.WARNING}
    assert cut_warning.exc_info is None and "\n" not in cut_warning.getMessage()
    assert cut_warning.getMessage().startswith("agent.tool_parser=hermes could not read a tool call (JSONDecodeError: ")
    assert "(arguments of 'python' are not a JSON object)" in args_warning.getMessage()
    assert p.parse('<tool_call>{"name": "python", "arguments": {}}</tool_call>', TOOLS).tool_calls  # still parses
    assert parse_failures() == before + 2


def test_a_chat_runner_built_in_python_refuses_an_unknown_parser_at_once_not_per_rollout():
    from molt_hydra.agents.chat_agent import ChatAgent, ChatAgentRunner

    class Agent(ChatAgent):
        async def run(self, ctx):
            return None

    with pytest.raises(ValueError, match=r"agent.tool_parser='qwen9' is not a vLLM tool parser"):
        ChatAgentRunner(Agent, tool_parser="qwen9")
    with pytest.raises(ValueError, match=r"agent.reasoning_parser='nope'"):
        ChatAgentRunner(Agent).configure_chat("hermes", "nope")
