"""Wire-format normalization and the image plumbing of the chat path (no engine needed)."""

import base64
import io

import pytest
from PIL import Image

from molt_hydra.agents.chat_agent import prompt_messages
from molt_hydra.agents.wire import anthropic, completions, openai_chat, responses
from molt_hydra.agents.wire.images import image_data_uri, image_sources, load_image
from molt_hydra.agents.wire.request import RequestError


def red(size=4):
    return Image.new("RGB", (size, size), (255, 0, 0))


def b64png(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_openai_messages_and_sampling_fields():
    req = openai_chat.parse({
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "refusal": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
        "max_completion_tokens": 7, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 2, "stop": "END",
        "seed": 3, "stream": True, "stream_options": {"include_usage": True}, "user": "ignored",
    })
    assert req.messages == [
        {"role": "system", "content": "be \nbrief"},  # text parts one per line, as vLLM's server joins them
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    assert req.overrides == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.5, "seed": 3, "stop": ("END",)}
    assert (req.n, req.stream, req.include_usage) == (2, True, True)
    with pytest.raises(RequestError, match="unsupported field 'unknown_field'"):  # never silently dropped
        openai_chat.parse({"messages": [{"role": "user", "content": "hi"}], "unknown_field": 1})
    with pytest.raises(RequestError, match="differ"):  # one cap (was: max_tokens=99 silently dropped)
        openai_chat.parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,
                           "max_tokens": 99})


def test_anthropic_blocks_map_to_the_same_canonical_messages():
    png = b64png(red())
    req = anthropic.parse({
        "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look "},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": png}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                                              {"type": "tool_use", "id": "t2", "name": "f", "input": {}},
                                              {"type": "tool_use", "id": "t3", "name": "f", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "3", "is_error": True},
                {"type": "tool_result", "tool_use_id": "t3", "content": [{"type": "image", "source": {
                    "type": "url", "url": "http://x/a.png"}}], "is_error": True},
                {"type": "text", "text": "thanks"}]},
        ],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "max_tokens": 5, "top_k": 4, "stop_sequences": ["A", "B"],
    })
    assert req.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "look "},
                                     {"type": "image", "source": f"data:image/png;base64,{png}"}]},
        {"role": "assistant", "content": "ok",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "t2", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "t3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "2", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: 3", "tool_call_id": "t2"},  # is_error: the model sees it
        {"role": "tool", "content": [{"type": "text", "text": "Error: "}, {"type": "image", "source": "http://x/a.png"}],
         "tool_call_id": "t3"},
        {"role": "user", "content": "thanks"},
    ]
    assert req.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                           "parameters": {"type": "object"}}}]
    assert req.overrides == {"max_tokens": 5, "top_k": 4, "stop": ("A", "B")}


def test_anthropic_tool_result_is_error_must_be_a_boolean():
    with pytest.raises(RequestError, match=r"content\[0\]\.is_error must be a boolean") as e:
        anthropic.parse({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "x", "is_error": "yes"}]}]})
    assert e.value.status == 400


@pytest.mark.parametrize("body,status,words", [
    ([], 400, "JSON object"),
    ({"messages": []}, 400, "non-empty list"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "content must be"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "'top_p'"),
    ({"messages": [{"role": "user", "content": "x"}], "n": True}, 400, "'n'"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "'stream' must be a boolean"),
])
def test_openai_bad_input_names_the_problem(body, status, words):
    with pytest.raises(RequestError) as e:
        openai_chat.parse(body)
    assert e.value.status == status and words in e.value.message


def test_images_decode_from_both_wire_formats_and_never_from_the_network():
    img = red(6)
    oa = openai_chat.parse({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_uri(img)}}, {"type": "text", "text": "what?"}]}]})
    an = anthropic.parse({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64png(img)}},
        {"type": "text", "text": "what?"}]}]})
    for req in (oa, an):
        (src,) = image_sources(req.messages)
        loaded = load_image(src)
        assert loaded.size == (6, 6) and loaded.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    with pytest.raises(RequestError, match="not fetched"):
        load_image("https://example.com/a.png")


def test_prompt_image_markers_become_data_uri_parts_in_order():
    a, b = red(), Image.new("RGB", (4, 4), (0, 0, 255))
    msgs = prompt_messages([{"role": "user", "content": "<image>first <image>second<image>"}], [a, b])
    parts = msgs[0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text", "image_url", "text", "text"]
    assert parts[4] == {"type": "text", "text": "<image>"}  # more markers than images: kept literally
    assert load_image(parts[0]["image_url"]["url"]).getpixel((0, 0)) == (255, 0, 0)
    assert load_image(parts[2]["image_url"]["url"]).getpixel((0, 0)) == (0, 0, 255)
    assert prompt_messages("plain", []) == [{"role": "user", "content": "plain"}]


def test_prompt_image_parts_become_data_uri_parts_in_order():
    """A bare {"type": "image"} part (the processors' and TRL's form; other keys null as a parquet column of parts
    holds them) is the row's next image, as an <image> marker is. Before: sent on as it was, a 400 ('unsupported
    content part type') for each rollout; and refused at validation for an Env too, whose chat template renders it."""
    a, b = red(), Image.new("RGB", (4, 4), (0, 0, 255))
    row = [{"role": "system", "content": [{"type": "image", "text": None}]},  # (a system message's: left alone)
           {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "and", "image": None},
                                        {"type": "image"}, {"type": "image", "image": "own.png"}, {"type": "image"}]}]
    parts = prompt_messages(row, [a, b])[1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text", "image_url", "image", "text"]
    assert parts[1] == {"type": "text", "text": "and", "image": None} and parts[3] == row[1]["content"][3]
    assert parts[4] == {"type": "text", "text": "<image>"}  # more places than images: the marker literally
    assert [load_image(parts[i]["image_url"]["url"]).getpixel((0, 0)) for i in (0, 2)] == [(255, 0, 0), (0, 0, 255)]
    assert row[1]["content"][0] == {"type": "image", "text": None}  # the row itself unchanged


def test_responses_items_become_the_chat_messages_a_chat_request_would_send():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    req = responses.parse({
        "model": "policy", "instructions": "sys", "tools": [tool], "store": False, "max_output_tokens": 9,
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "let me", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}', "id": "fc_1"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "function_call_output", "call_id": "c2", "output": "2"},
        ],
        "tool_choice": {"type": "function", "name": "f"}, "text": {"format": {"type": "json_object"}},
    })
    call = lambda cid, args: {"id": cid, "type": "function", "function": {"name": "f", "arguments": args}}  # noqa
    assert req.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "let me", "tool_calls": [call("c1", '{"x": 1}'), call("c2", "{}")]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
    ]
    assert req.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                           "parameters": {"type": "object"}}}]
    assert req.overrides == {"max_tokens": 9}
    assert req.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert req.response_format == {"json_object": True}
    for body, words in (({"input": "x", "previous_response_id": "r"}, "stores no responses"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
                        ({"input": "x", "reasoning": {"effort": "high"}}, "'reasoning.effort'='high' is not served")):
        with pytest.raises(RequestError, match=words):
            responses.parse(body)


@pytest.mark.parametrize("system", [["plain text"], [3], [None]])
def test_anthropic_system_blocks_that_are_not_objects_are_a_400_naming_the_block(system):
    with pytest.raises(RequestError) as e:
        anthropic.parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "system": system})
    assert e.value.status == 400 and "text part needs a string 'text'" in e.value.message


def test_completions_and_anthropic_tool_choice_and_thinking():
    req = completions.parse({"prompt": ["abc"], "max_tokens": 3, "logprobs": 2, "stop": "\n"})
    assert (req.raw_prompt, req.overrides, req.top_logprobs) == ("abc", {"max_tokens": 3, "stop": ("\n",)}, 2)
    with pytest.raises(RequestError, match="'echo'"):
        completions.parse({"prompt": "abc", "echo": True})
    base = {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    assert anthropic.parse(dict(base, tool_choice={"type": "any"})).tool_choice == "required"
    req = anthropic.parse(dict(base, tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True}))
    assert (req.tool_choice, req.parallel_tool_calls) == ({"type": "function", "function": {"name": "f"}}, False)
    assert anthropic.parse(dict(base, thinking={"type": "enabled", "budget_tokens": 50})).thinking is True
    with pytest.raises(RequestError, match="less than 'max_tokens'"):
        anthropic.parse(dict(base, thinking={"type": "enabled", "budget_tokens": 100}))
    with pytest.raises(RequestError, match="not in tools"):
        anthropic.parse(dict(base, tool_choice={"type": "tool", "name": "g"}))


def test_anthropic_cache_control_is_accepted_everywhere_and_changes_nothing():
    cached = {"type": "ephemeral", "ttl": "5m"}
    tool = {"name": "f", "input_schema": {"type": "object"}}
    plain = {"max_tokens": 5, "system": [{"type": "text", "text": "s"}], "tools": [tool],
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    marked = {"max_tokens": 5, "cache_control": cached,
              "system": [{"type": "text", "text": "s", "cache_control": cached}],
              "tools": [{**tool, "cache_control": cached}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cached}]}]}
    assert anthropic.parse(marked) == anthropic.parse(plain)
    with pytest.raises(RequestError) as e:
        anthropic.parse({**plain, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]}]})
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].cache_control"


def test_an_undecodable_image_is_the_clients_400():
    with pytest.raises(RequestError) as e:
        load_image("data:image/png;base64,bm90IGFuIGltYWdl")  # "not an image"
    assert e.value.status == 400 and "image data URI is not a decodable image" in e.value.message


def test_anthropic_consecutive_same_role_messages_are_one_turn_as_anthropic_merges_them():
    """Two user messages (or a tool_result message then a text one, or an assistant's text then its tool_use) are one
    turn at Anthropic; rendered as two, the template would show the model a conversation it was never in."""
    png = b64png(red())
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    req = anthropic.parse({"max_tokens": 5, "messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}, img]},
        {"role": "assistant", "content": "let me look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]},
        {"role": "user", "content": "and now?"}, {"role": "user", "content": [{"type": "text", "text": "go"}]}]})
    assert req.messages == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\n\n"},
                                     {"type": "text", "text": "b"},
                                     {"type": "image", "source": f"data:image/png;base64,{png}"}]},
        {"role": "assistant", "content": "let me look",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "1", "tool_call_id": "t1"},
        {"role": "user", "content": "and now?\n\ngo"},
    ]
    one = anthropic.parse({"max_tokens": 5, "messages": [{"role": "user", "content": "a\n\nb"}]})
    assert anthropic.parse({"max_tokens": 5, "messages": [{"role": "user", "content": "a"},
                                                          {"role": "user", "content": "b"}]}) == one


def _tool_turn(wire: str, results: list[tuple[str, str]], call_ids=("a", "b")) -> list[dict]:
    """A request with two tool calls then `results` (id, output), in `wire`'s shape → its canonical messages."""
    if wire == "openai":
        calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}} for c in call_ids]
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls},
                *({"role": "tool", "tool_call_id": c, "content": out} for c, out in results)]
        return openai_chat.parse({"messages": msgs}).messages
    if wire == "anthropic":
        uses = [{"type": "tool_use", "id": c, "name": "f", "input": {}} for c in call_ids]
        blocks = [{"type": "tool_result", "tool_use_id": c, "content": out} for c, out in results]
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": uses},
                {"role": "user", "content": blocks}]
        return anthropic.parse({"max_tokens": 5, "messages": msgs}).messages
    items = [{"role": "user", "content": "q"},
             *({"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"} for c in call_ids),
             *({"type": "function_call_output", "call_id": c, "output": out} for c, out in results)]
    return responses.parse({"input": items}).messages


@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
def test_tool_results_sent_out_of_call_order_render_in_call_order(wire):
    """Templates render tool results without their ids: the model pairs them with the calls by position (was: results
    sent in the order the tools finished showed the model call a's result under call b)."""
    results = [m for m in _tool_turn(wire, [("b", "B out"), ("a", "A out")]) if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [("a", "A out"), ("b", "B out")]
    # results whose calls share an id, or without ids, keep their order: position is all that pairs them
    same = [m for m in _tool_turn(wire, [("c", "2nd"), ("c", "1st")], ("c", "c")) if m["role"] == "tool"]
    assert [m["content"] for m in same] == ["2nd", "1st"]


CONVERSATION = {"openai": "messages", "anthropic": "messages", "responses": "input"}  # the field a 400 names


@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
@pytest.mark.parametrize("results,words", [
    ([("a", "1"), ("x", "2")], "tool result(s) for id(s) ['x'] answer none of the tool calls ['a', 'b']"),
    ([("a", "1"), ("a", "2")], "call id(s) ['a'] are answered by more than one tool result"),
    ([("b", "1")], "tool call id(s) ['a'] of an assistant message have no tool result after it"),
])
def test_tool_results_that_do_not_answer_the_calls_one_to_one_are_a_400(wire, results, words):
    """As OpenAI and Anthropic refuse them (was: rendered, the model reading a result under the wrong call)."""
    with pytest.raises(RequestError) as e:
        _tool_turn(wire, results)
    assert e.value.status == 400 and e.value.message.startswith(words) and e.value.param == CONVERSATION[wire]


def _unpaired(wire: str, orphan: bool) -> None:
    """A request in `wire`'s shape with a tool result after no call (`orphan`), or a call whose turn gets no result
    before the user's next message."""
    if wire == "openai":
        call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        turn = [{"role": "tool", "tool_call_id": "a", "content": "1"}] if orphan else [
            {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "go on"}]
        openai_chat.parse({"messages": [{"role": "user", "content": "q"}, *turn]})
    elif wire == "anthropic":
        use = {"type": "tool_use", "id": "a", "name": "f", "input": {}}
        turn = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "1"}]}] \
            if orphan else [{"role": "assistant", "content": [use]}, {"role": "user", "content": "go on"}]
        anthropic.parse({"max_tokens": 5, "messages": [{"role": "user", "content": "q"}, *turn]})
    else:  # what an agent sends that keeps only its new items (the call's turn was answered before)
        turn = [{"type": "function_call_output", "call_id": "a", "output": "1"}] if orphan else [
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"}]
        responses.parse({"input": [{"role": "user", "content": "q"}, *turn]})


@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
def test_a_tool_result_after_no_call_and_a_call_with_no_result_are_a_400(wire):
    """As OpenAI and Anthropic refuse them (was: served, the model reading a tool's output that answers no call, or a
    call that never got its output)."""
    with pytest.raises(RequestError) as e:
        _unpaired(wire, orphan=True)
    assert (e.value.status, e.value.param) == (400, CONVERSATION[wire])
    assert e.value.message.startswith("a tool result (for id 'a') follows no assistant message: send the call")
    with pytest.raises(RequestError) as e:
        _unpaired(wire, orphan=False)
    assert (e.value.status, e.value.param) == (400, CONVERSATION[wire])
    assert e.value.message.startswith("tool call id(s) ['a'] of an assistant message have no tool result after it")


# Qwen2.5's (and Llama 3.1's, Hermes') way with a call: its arguments written with `| tojson`, string or not
TOJSON_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}{%- for tc in m.tool_calls or [] -%}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}</tool_call>'
    "{%- endfor -%}<|im_end|>\n{% endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{% endif -%}")


def test_tool_call_arguments_reach_the_template_as_an_object_as_vllm_hands_them(tiny_model):
    """The wire carries arguments as a JSON string; vLLM's server parses it before the template (the Transformers
    convention). Was: passed as the string, which a `| tojson` template rendered quoted and escaped."""
    import asyncio

    from transformers import AutoTokenizer

    from molt_hydra.agents.tool_parser import reply_parser
    from molt_hydra.agents.wire.session import ChatSession
    from molt_hydra.rollout.generation import Generation, Sampling

    class Engine:  # records the prompt; answers [7, eos]
        async def generate(self, request):
            self.prompt_ids = request.prompt_ids
            return [Generation([7, tok.eos_token_id], [-0.5, -0.25], [0, 0], "stop")]

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = TOJSON_TEMPLATE
    engine = Engine()
    session = ChatSession("s", engine, tok, Sampling(max_tokens=8), 512, reply_parser(tok))
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, "é"]}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "b", "content": "2"}]
    asyncio.run(session.complete(openai_chat.parse({"messages": msgs})))
    prompt = tok.decode(engine.prompt_ids, skip_special_tokens=False)
    assert '<tool_call>{"name": "f", "arguments": {"x": [1, "é"]}}</tool_call>' in prompt
    assert '<tool_call>{"name": "g", "arguments": "not json"}</tool_call>' in prompt  # not an object: as sent


def test_text_blocks_of_one_message_are_one_per_line_as_vllms_server_joins_them():
    """A message's text parts / blocks become one string joined by a newline (vLLM's renderer for string-content
    templates: "\\n".join(texts)), in every wire: a client's separate blocks (a system reminder, then the user's text)
    must not run into each other."""
    blocks = [{"type": "text", "text": "<system-reminder>x</system-reminder>"}, {"type": "text", "text": "fix it"}]
    expected = "<system-reminder>x</system-reminder>\nfix it"
    ant = anthropic.parse({"max_tokens": 5, "system": blocks, "messages": [{"role": "user", "content": blocks}]})
    assert ant.messages == [{"role": "system", "content": expected}, {"role": "user", "content": expected}]
    chat = openai_chat.parse({"messages": [{"role": "user", "content": blocks}]})
    assert chat.messages == [{"role": "user", "content": expected}]
