"""JSON-shaped output (a forced tool call, `response_format`) as a grammar without free whitespace.

vLLM compiles a request's `json` schema with the engine-wide whitespace rule (`structured_outputs_config.
disable_any_whitespace`, off by default; its per-request flag is not read by the xgrammar backend), and a grammar
that allows any whitespace between JSON tokens lets a weak model emit blanks until `max_tokens`. So the schema is
converted here, with xgrammar (the structured-output library vLLM itself uses), into a grammar of compact JSON and
sent as vLLM's per-request `grammar`: the same JSON values, and no way to spin on whitespace, on CPU and GPU.
"""

from __future__ import annotations

import functools
import json

from molt_hydra.agents.chat_messages import RequestError


@functools.lru_cache(maxsize=64)
def _grammar(schema_json: str) -> str:
    import xgrammar

    return str(xgrammar.Grammar.from_json_schema(schema_json, any_whitespace=False, separators=(",", ":")))


def compact(structured: dict | None, param: str = "response_format") -> dict | None:
    """vLLM structured-output fields with `json` / `json_object` replaced by a compact-JSON `grammar`."""
    if not structured or not ("json" in structured or structured.get("json_object")):
        return structured
    schema = structured.get("json") or {"type": "object"}
    try:
        return {"grammar": _grammar(json.dumps(schema, sort_keys=True))}
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar refuses the schema: the client's mistake
        raise RequestError(400, f"'{param}' schema cannot be enforced: {str(e).splitlines()[0][:300]}", param) from None
