"""The one request check every wire format goes through: a body's fields, sampling, tool choice, log-probs and
structured output → one canonical `ChatRequest`, or a 4xx `RequestError` that says what is wrong.

Canonical messages are what the chat template renders and what the session compares turn to turn:
`{"role": system|user|assistant|tool, "content": str | [{"type": "text", "text"} | {"type": "image", "source"}],
"tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": str}}], "tool_call_id"?,
"reasoning"?, "reasoning_content"?}` (an assistant's echoed thinking, under both names as vLLM hands a template it).
Text-only part lists collapse to a string, so echoing a message in either shape compares equal.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


# int64, as OpenAI and vLLM's server take a seed (the engine seeds a torch.Generator; n choices add their index) and
# vLLM a top_k
INT64_MAX = 2**63 - 1
MIN_SEED, MAX_SEED = -(2**63), INT64_MAX


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None = None  # OpenAI function-tool shape, as the chat template expects
    overrides: dict = field(default_factory=dict)  # Sampling fields set by this request (checked by the session)
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage
    tool_choice: str | dict = "auto"  # none | auto | required | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None  # False: at most one tool call is returned
    top_logprobs: int | None = None  # None: no logprobs in the reply; k: the sampled token's plus k alternatives
    response_format: dict | None = None  # vLLM structured output: {"json": schema} / {"json_object": True}
    strict_tools: list[str] = field(default_factory=list)  # tools sent with `strict: true`: arguments per schema
    format_param: str = "response_format"  # the field that set response_format (Responses: text.format), for errors
    text: dict | None = None  # Responses: the request's `text` (format, verbosity), which the response object echoes
    thinking: bool | None = None  # Anthropic thinking enabled / disabled (OpenAI: reasoning effort); None: not asked
    thinking_param: str = "thinking"  # the field that set `thinking`, for errors
    thinking_budget: int | None = None  # Anthropic thinking.budget_tokens
    raw_prompt: str | None = None  # /v1/completions: the prompt fed verbatim, no chat template
    image_params: list = field(default_factory=list)  # each image part's position in the request, in render order
    prompt_param: str = "messages"  # the field of the conversation (Responses: input; completions: prompt), for errors
    first_attempt: bool = False  # the client's SDK says so (x-stainless-retry-count: 0): a repeat is a new sample

    def __post_init__(self):
        # before the images are listed: the order they render in
        tool_results_in_call_order(self.messages, self.prompt_param)
        # the parsers mark each image part with where it is on the wire ("at"), for a 400 about the image to name
        # (was: param null); kept here, out of the messages the template renders and a later turn is compared with
        if not self.image_params:
            self.image_params = [p.pop("at", None) for m in self.messages if isinstance(m["content"], list)
                                 for p in m["content"] if p["type"] == "image"]

    def key(self) -> str:
        """What makes two requests the same turn (a client retry): all but how the reply is delivered and which
        attempt the client says it is."""
        return json.dumps(dict(dataclasses.asdict(self), stream=None, include_usage=None, first_attempt=None),
                          sort_keys=True, default=str)

    @property
    def forced_tool(self) -> bool:
        """tool_choice "required" or a named function: the reply is a tool call, enforced by structured output."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)


# Fields of each wire format that are accepted but change nothing here (documented in docs/agents.md);
# any field neither honoured nor listed here is refused with a 400 naming it.
IGNORED_FIELDS = {"model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_retention", "prompt_cache_options", "stream_options",
                  "inference_geo"}  # (Anthropic's region of inference)
# Fields accepted only at the value that changes nothing (sampling shapers training does not assume).
NEUTRAL_VALUES = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "include": ([],),
                  "modalities": (["text"],), "truncation": ("disabled",), "best_of": (1,), "echo": (False,),
                  "min_p": (0, 0.0), "repetition_penalty": (1, 1.0),  # (vLLM's extensions, sent for Qwen models)
                  "verbosity": ("medium",),  # chat's, as Responses' text.verbosity: the model is not trained to it
                  "speed": ("standard",)}  # Anthropic's: "fast" asks for a faster engine than the one generating


def fields(body: Any, honoured: set[str], api: str) -> None:
    """The body is a JSON object whose every field is honoured, ignored or at its neutral value."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    for key, value in body.items():
        if value is None or key in honoured or key in IGNORED_FIELDS:
            continue
        if key in NEUTRAL_VALUES:
            if value not in NEUTRAL_VALUES[key]:
                raise bad(f"'{key}'={value!r} is not supported by the training chat server ({api}): it would change "
                          f"what is sampled; omit it or send {NEUTRAL_VALUES[key][0]!r}", key)
            continue
        raise bad(f"unsupported field '{key}' for {api}; honoured: {sorted(honoured)}; accepted and ignored: "
                  f"{sorted(IGNORED_FIELDS)} (see docs/agents.md)", key)


def unicode_text(body: Any) -> None:
    """Every string of a parsed body, keys too, is valid Unicode. JSON's `\\udXXX` escape can name half of a UTF-16
    pair alone, which Python keeps as a lone surrogate that no tokenizer, template or engine encodes (was: a 500)."""
    stack: list[tuple[Any, tuple | None]] = [(body, None)]  # (value, (parent's path, key)): formatted on a failure
    while stack:  # iterative: a body nested as deeply as the JSON decoder allows
        v, at = stack.pop()
        if isinstance(v, str):
            _encodable(v, at)
        elif isinstance(v, dict):
            for k, x in v.items():
                _encodable(k, at)
                stack.append((x, (at, k)))
        elif isinstance(v, list):
            stack.extend((x, (at, i)) for i, x in enumerate(v))


def _encodable(s: str, at: tuple | None) -> None:
    if s.isascii():
        return
    try:
        s.encode()
    except UnicodeEncodeError as e:
        keys = []
        while at is not None:
            at, key = at
            keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        where = "".join(reversed(keys)).removeprefix(".") or None
        raise bad(f"{where or 'the request body'} holds a lone UTF-16 surrogate ({s[e.start]!r} at character "
                  f"{e.start}): text must be valid Unicode; send a character outside the BMP as UTF-8 or as its "
                  "escaped surrogate pair (\\ud83d\\ude00)", where) from None


def tool_results_in_call_order(messages: list[dict], param: str = "messages") -> None:
    """Each run of tool results right after an assistant's tool calls, put in the order of the calls they answer, by
    id. Chat templates render a result without its id, so the model pairs results with calls by position (was: results
    sent in the order the tools finished showed the model each under another call). Where the calls' ids tell them
    apart and every result names one, a result naming no call, two for one call, or a call left unanswered is a 400,
    as at OpenAI and Anthropic; results without ids keep their order (their position is all that pairs them).
    A result after no assistant message, or calls with ids and no result before the next message, is a 400 too (was:
    served, the model reading a result to no call, e.g. an agent's input of only its new function_call_output)."""
    for i, m in enumerate(messages):
        # (after an assistant's text it is served: an agent without agent.tool_parser reads the calls from the text)
        if m["role"] == "tool" and (messages[i - 1]["role"] if i else None) not in ("assistant", "tool"):
            raise bad(f"a tool result (for id {m.get('tool_call_id')!r}) follows no assistant message: send the "
                      "call (tool_calls / tool_use / function_call) right before its result", param)
        ids = [tc["id"] for tc in m.get("tool_calls") or []]
        end = i + 1
        while end < len(messages) and messages[end]["role"] == "tool":
            end += 1
        answered = [r.get("tool_call_id") for r in messages[i + 1 : end]]
        if not ids or not all(ids) or len(set(ids)) < len(ids) or (answered and not all(answered)):
            continue
        unknown = [a for a in answered if a not in ids]
        twice = sorted({a for a in answered if answered.count(a) > 1})
        missing = [c for c in ids if c not in answered]
        if unknown or twice or missing:
            why = (f"tool result(s) for id(s) {unknown} answer none of the tool calls {ids} of the assistant message "
                   "before them" if unknown else f"call id(s) {twice} are answered by more than one tool result"
                   if twice else f"tool call id(s) {missing} of an assistant message have no tool result after it")
            raise bad(f"{why}: send one tool result per call, right after the assistant message, each naming its "
                      "call's id (tool_call_id / tool_use_id / call_id)", param)
        messages[i + 1 : end] = sorted(messages[i + 1 : end], key=lambda r: ids.index(r["tool_call_id"]))


def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param, "invalid_request_error")


def number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi):
        raise bad(f"'{key}' must be a number in [{lo}, {hi}], got {v!r}", key)
    return None if v is None else float(v)


def integer(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo or hi is not None and v > hi):
        raise bad(f"'{key}' must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {v!r}", key)
    return v


def flag(body: dict, key: str, default: bool | None = False) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {v!r}", key)
    return default if v is None else v


def include_usage(body: dict) -> bool:
    """OpenAI's `stream_options.include_usage` (chat and completions): a usage chunk ends the stream."""
    options = stream_options(body, {"include_usage", "include_obfuscation", "continuous_usage_stats"})
    v = options.get("include_usage")
    if options.get("continuous_usage_stats") not in (None, False):  # vLLM's (was: ignored)
        raise bad("'stream_options.continuous_usage_stats' (usage on every chunk, vLLM's) is not served: the usage "
                  "comes once, in a last chunk, with include_usage; omit it", "stream_options.continuous_usage_stats")
    if v is not None and not isinstance(v, bool):
        raise bad(f"'stream_options.include_usage' must be a boolean, got {v!r}", "stream_options.include_usage")
    return bool(v)


def stream_options(body: dict, served: set[str]) -> dict:
    """`stream_options`, an object of the `served` keys (include_obfuscation, OpenAI's random padding of the events
    against side channels on its network, changes nothing here), sent with `stream: true` only, as OpenAI and vLLM's
    server answer (was: accepted and ignored on a plain request, which those servers refuse, and any key, a misspelt
    one too, ignored)."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad(f"'stream_options' must be an object, got {options!r}", "stream_options")
    if unknown := sorted(set(options) - served):
        raise bad(f"'stream_options' keys {unknown} are not served (served: {sorted(served)})",
                  f"stream_options.{unknown[0]}")
    stream = body.get("stream")  # (a stream that is no boolean: the 400 of its own check)
    if stream is None or stream is False:
        raise bad("'stream_options' is only allowed when 'stream' is true: it shapes a streamed reply, and a plain "
                  "reply carries its usage anyway; omit it, or send stream: true", "stream_options")
    return options


def content(parts: list[dict]) -> str | list[dict]:
    """Text-only part lists collapse to one string, the parts one per line, as vLLM's server renders them for a
    template that takes string content (was: joined with nothing, so a block ran straight into the next: a
    `<system-reminder>` block into the user's text)."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def text_or_parts(v: Any, where: str, part) -> str | list[dict]:
    """Content at `where` (a message's, a tool result's): a string, or a list of parts each read by `part(p, at)`."""
    if isinstance(v, list):
        return content([part(p, f"{where}[{j}]") for j, p in enumerate(v)])
    if not isinstance(v, str):
        raise bad(f"{where} must be a string or a list of parts", where)
    return v


def text_part(p: Any, where: str) -> dict:
    if not isinstance(p, dict) or not isinstance(p.get("text"), str):
        raise bad(f"{where}: text part needs a string 'text'", where)
    return {"type": "text", "text": p["text"]}


def sampling(body: dict, max_keys: tuple[str, ...], stop_key: str | None = None,
             temperature_max: float = 2.0) -> dict:
    """Sampling fields the client set (the session checks them against the recipe); `max_keys` name the token cap
    (chat: max_completion_tokens and its deprecated alias max_tokens), which must agree where more than one is set."""
    caps = {key: v for key in max_keys if (v := integer(body, key, 1)) is not None}
    if len(set(caps.values())) > 1:  # (was: the first taken, the other silently ignored)
        raise bad(f"{' and '.join(f'{k!r}={v}' for k, v in caps.items())} differ: they name one token cap; send one "
                  f"({max_keys[0]!r})", max_keys[-1])
    overrides = {"max_tokens": next(iter(caps.values()), None),
                 "temperature": number(body, "temperature", 0.0, temperature_max),
                 "top_p": number(body, "top_p", 1e-9, 1.0), "seed": integer(body, "seed", MIN_SEED, MAX_SEED),
                 "top_k": integer(body, "top_k", -1, INT64_MAX)}
    if overrides["top_k"] == 0:  # vLLM's other spelling of -1, "all tokens" (was: both a 400, though the recipe's)
        overrides["top_k"] = -1
    stop = body.get(stop_key) if stop_key else None
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad(f"'{stop_key}' must be a non-empty string or a list of non-empty strings, got {stop!r}",
                      stop_key)
        overrides["stop"] = tuple(stop)
    return {key: v for key, v in overrides.items() if v is not None}


def tool_choice(v: Any, tools: list[dict] | None, param: str = "tool_choice") -> str | dict:
    """none | auto | required | a named function (chat or Responses shape), checked against the tools."""
    if v is None:
        return "auto"
    if isinstance(v, dict) and v.get("type") == "function":
        fn = v.get("function") if "function" in v else v  # chat / responses shape
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad(f"'{param}' names no function", param)
        # as OpenAI and Anthropic's tool_choice (was: ignored, e.g. a "strict" or "allowed_tools" that binds nothing)
        shapes = [(param, v, {"type", "name"})] if fn is v else [(param, v, {"type", "function"}),
                                                                 (f"{param}.function", fn, {"name"})]
        for where, obj, keys in shapes:
            if unknown := sorted(set(obj) - keys):
                raise bad(f"{where}.{unknown[0]}: Extra inputs are not permitted ({where} takes {sorted(keys)})",
                          f"{where}.{unknown[0]}")
        v = {"type": "function", "function": {"name": name}}
    elif v not in ("none", "auto", "required"):
        raise bad(f"'{param}' must be none, auto, required or a named function, got {v!r}", param)
    if v == "required" or isinstance(v, dict):
        names = [t["function"]["name"] for t in tools or []]
        if not names:
            raise bad(f"'{param}'={v!r} needs 'tools'", param)
        if isinstance(v, dict) and v["function"]["name"] not in names:
            raise bad(f"'{param}' names {v['function']['name']!r}, which is not in tools {names}", param)
    return v


def schema(v: Any, where: str, param: str = "tools") -> dict | None:
    """A tool's JSON schema (parameters / input_schema): absent, or an object."""
    if v is not None and not isinstance(v, dict):
        raise bad(f"{where} must be a JSON schema object, got {v!r}", param)
    return v


def description(v: Any, where: str) -> str | None:
    """A tool's description: absent, or a string (vLLM's request model, which parsing the reply builds from the
    tools, refuses any other: was a 500 once the turn had been generated)."""
    if v is not None and not isinstance(v, str):
        raise bad(f"{where} must be a string, got {v!r}", "tools")
    return v


def unique_names(names: list[str]) -> None:
    """Tool names are unique (OpenAI and Anthropic refuse a duplicate): a call names its tool, and two of one name
    would leave it unsaid which one the model called, and a forced or strict call's grammar with two schemas."""
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if first.setdefault(name, i) != i:
            raise bad(f"tools[{first[name]}] and tools[{i}] are both named {name!r}: tool names must be unique",
                      "tools")


def strict_names(functions: list[dict], param: str = "tools", default: bool = False) -> list[str]:
    """The names of the tools (function specs: name, `strict`?) whose arguments must follow their schema; `strict`
    absent or null is the API's `default`."""
    for i, fn in enumerate(functions):
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad(f"{param}[{i}] 'strict' must be a boolean, got {fn['strict']!r}", param)
    return [fn["name"] for fn in functions if (default if fn.get("strict") is None else fn["strict"])]


# OpenAI's reasoning efforts the policy can honour, as thinking asked for: "none" (a model that does not think) and
# "medium", OpenAI's default (the model thinks as it was trained to); it has no knob for another level
EFFORTS = {"none": False, "medium": True}


def reasoning_effort(v: Any, param: str) -> bool | None:
    """Chat `reasoning_effort` / Responses `reasoning.effort` as the thinking asked for (the session checks it
    against the model, as Anthropic's `thinking`); absent or null asks nothing (was: a 400 on any `reasoning`)."""
    if v is None:
        return None
    if not isinstance(v, str) or v not in EFFORTS:
        raise bad(f"'{param}'={v!r} is not served: the policy has no effort setting and thinks as it was trained to; "
                  "send 'medium' (a model set up to think, agent.reasoning_parser) or 'none' (one that is not), or "
                  "omit it", param)
    return EFFORTS[v]


def response_format(v: Any, param: str = "response_format") -> dict | None:
    """OpenAI response_format (or Responses text.format) → vLLM structured output fields."""
    if v is not None and not isinstance(v, dict):  # (was: "type must be ..., got None" of a format sent as "text")
        raise bad(f"'{param}' must be an object {{type: text | json_object | json_schema, ...}}, got {v!r}", param)
    kind = v.get("type") if isinstance(v, dict) else None
    if v is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = v.get("json_schema", v)  # chat nests it; the Responses API puts it at the top
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad(f"'{param}' json_schema needs a 'schema' object", param)
        return {"json": schema}
    raise bad(f"'{param}' type must be text, json_object or json_schema, got {kind!r}", param)


def top_logprobs(body: dict, flag_key: str | None) -> int | None:
    """OpenAI's `top_logprobs` (<= 20), gated by `logprobs: true` where the API has that flag."""
    top = integer(body, "top_logprobs", 0, 20)
    if flag_key is not None and not flag(body, flag_key):
        if top:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0
