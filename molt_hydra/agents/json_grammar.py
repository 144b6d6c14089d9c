"""JSON-shaped output (a forced tool call, `response_format`, a strict tool's arguments) as a grammar without runs of
whitespace.

vLLM compiles a request's `json` schema with the engine-wide whitespace rule (`structured_outputs_config.
disable_any_whitespace`, off by default; its per-request flag is not read by the xgrammar backend), and a grammar
that allows any whitespace between JSON tokens lets a weak model emit blanks until `max_tokens`. So the schema is
converted here, with xgrammar (the structured-output library vLLM itself uses), into a grammar that allows at most
one whitespace character between JSON tokens and none after the value, sent as vLLM's per-request `grammar`: the
same JSON values, both the compact and the `json.dumps` style (`", "`, `": "`, what chat templates render and
models learn), and no way to spin on whitespace, on CPU and GPU. xgrammar is imported where a grammar is first built
(deferred: heavy).
"""

from __future__ import annotations

import functools
import json

from molt_hydra.agents.wire.request import RequestError


WHITESPACE_RUN = 1  # most whitespace characters between two JSON tokens: `": "` passes, a run of blanks does not


@functools.lru_cache(maxsize=64)
def _grammar(schema_json: str) -> str:
    import xgrammar

    return str(xgrammar.Grammar.from_json_schema(schema_json, any_whitespace=True, max_whitespace_cnt=WHITESPACE_RUN))


@functools.lru_cache(maxsize=64)
def _tag_grammar(tag_json: str) -> str:
    import xgrammar

    return str(xgrammar.Grammar.from_structural_tag(tag_json))


def strict_calls(tools: list[dict], strict: list[str], envelope: tuple[str, ...] | None, parser: str | None,
                 single: bool = False, output: dict | None = None, output_param: str = "response_format") -> dict:
    """vLLM structured output for `strict: true` tools, or at most one call (`single`: parallel_tool_calls false),
    under tool_choice "auto": text stays free; from where the model opens a tool call (the family's `envelope`:
    trigger, text before the name, between name and arguments, after them) the call is held to a tool of the
    request, a strict tool's arguments to its schema and the others' to a JSON object, and with `single` the output
    ends after the first call (vLLM's own server does the same, with its structural tags). With an `output` schema
    (a response format beside the tools) the reply is either that JSON or calls, no free text."""
    if envelope is None:
        what, fix, param = (f"'strict': true (tools {strict}; a Responses tool is strict unless it says false)",
                            "send strict false (and check the arguments)", "tools")
        if not strict:
            what, fix, param = ("'parallel_tool_calls': false (Anthropic: 'disable_parallel_tool_use': true)",
                                "omit it (and run each call returned)", "parallel_tool_calls")
        if output is not None:
            what, fix, param = (f"'{output_param}' beside 'tools' (the reply is its JSON or a call)",
                                f"send '{output_param}' or 'tools', not both", output_param)
        raise RequestError(400, f"{what} under tool_choice \"auto\" cannot be enforced for agent.tool_parser="
                           f"{parser!r}: its tool-call markup is not known here; {fix}, or tool_choice \"required\" "
                           "/ a named tool (enforced for every parser)", param)
    trigger, before, between, after = envelope
    # the name as JSON writes it inside the call, where the parser reads it
    tags = [{"type": "tag", "begin": before + json.dumps(fn["name"], ensure_ascii=False)[1:-1] + between,
             "end": after, "content": {
                 "type": "json_schema", "max_whitespace_cnt": WHITESPACE_RUN,
                 "json_schema": (fn.get("parameters") or {"type": "object"}) if fn["name"] in strict else
                 {"type": "object"}}}
            for fn in (t["function"] for t in tools)]
    calls = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": single}
    if output is not None:  # calls separated as the template renders them, or the format's JSON
        calls = {"type": "or", "elements": [
            {"type": "json_schema", "json_schema": output, "max_whitespace_cnt": WHITESPACE_RUN},
            {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
             "stop_after_first": single}]}
    tag = {"type": "structural_tag", "format": calls}
    try:
        return {"grammar": _tag_grammar(json.dumps(tag))}  # key order kept: the schema's is the output's (below)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar refuses a schema: the client's mistake
        raise RequestError(400, f"'tools' strict schema cannot be enforced: {str(e).splitlines()[0][:300]}",
                           "tools") from None


def compact(structured: dict | None, param: str = "response_format") -> dict | None:
    """vLLM structured-output fields with `json` / `json_object` replaced by a whitespace-bounded JSON `grammar`."""
    if not structured or not ("json" in structured or structured.get("json_object")):
        return structured
    schema = structured.get("json") or {"type": "object"}
    try:
        # the schema's key order kept: xgrammar has the properties written in it, as OpenAI and vLLM's server do (was:
        # sorted, so {reasoning, answer} forced the answer before the reasoning meant to lead to it)
        return {"grammar": _grammar(json.dumps(schema))}
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar refuses the schema: the client's mistake
        raise RequestError(400, f"'{param}' schema cannot be enforced: {str(e).splitlines()[0][:300]}", param) from None
