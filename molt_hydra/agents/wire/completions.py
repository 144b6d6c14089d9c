"""OpenAI `/v1/completions`: a raw-text prompt, tokenized as sent (no chat template), and the legacy reply shape.
Without `max_tokens` a completion runs to the turn's cap, as on every route (not OpenAI's default of 16 tokens)."""

from __future__ import annotations

import codecs
import time
from typing import Any

from molt_hydra.agents.wire import request as check
from molt_hydra.agents.wire.openai_chat import error, usage
from molt_hydra.agents.wire.request import ChatRequest, RequestError, bad
from molt_hydra.agents.wire.stream import Stream, new_id, sse

FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream", "logprobs",
          "suffix"}


def parse(body: Any) -> ChatRequest:
    check.fields(body, FIELDS, "/v1/completions")
    if body.get("suffix") not in (None, ""):  # (was: a falsy one of another type, [] or 0, taken as none)
        raise bad(f"'suffix' (fill-in-the-middle) is not supported, got {body['suffix']!r}: omit it", "suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be one non-empty string", "prompt")
    overrides = check.sampling(body, ("max_tokens",), "stop")
    top = check.integer(body, "logprobs", 0, 5)
    return ChatRequest(messages=[], overrides=overrides, n=check.integer(body, "n", 1) or 1, top_logprobs=top,
                       stream=check.flag(body, "stream"), raw_prompt=prompt, prompt_param="prompt",
                       include_usage=check.include_usage(body))


def _logprobs(c) -> dict | None:
    """The chat log-probs in the legacy shape: parallel lists and each token's offset in the text."""
    entries = c.logprobs
    if entries is None:
        return None
    # the characters of the text before each token, counted from the tokens' own bytes: a character split over tokens
    # starts where its first part is (was: each part counted as one U+FFFD, and every later offset ran past the text)
    decoder, offsets, at = codecs.getincrementaldecoder("utf-8")("replace"), [], 0
    for e in entries:
        offsets.append(at)
        at += len(decoder.decode(bytes(e["bytes"])))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _choice(index: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def body(reply, req: ChatRequest, model: str) -> dict:
    return {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [_choice(i, c.content, c.finish_reason, _logprobs(c)) for i, c in enumerate(reply.choices)],
            "usage": usage(reply)}


class CompletionStream(Stream):
    ID_PREFIX = "cmpl-"

    def chunk(self, choices: list[dict], usage=None) -> bytes:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}
        return sse(dict(body, usage=usage) if usage else body)

    def piece(self, text: str) -> list[bytes]:
        # a raw completion has no reasoning channel
        return [self.chunk([_choice(0, text)])] if self.kind == "content" else []

    def end(self, reply) -> list[bytes]:
        out = []
        for i, c in enumerate(reply.choices):  # every choice (n > 1) and its log-probs, once its generation ended
            if not reply.streamed:  # not streamed live (n > 1, a cached retry): the whole text now
                out.append(self.chunk([_choice(i, c.content)]))
            out.append(self.chunk([_choice(i, "", c.finish_reason, _logprobs(c))]))
        if self.req.include_usage:
            out.append(self.chunk([], usage=usage(reply)))
        return out + [b"data: [DONE]\n\n"]

    def error(self, e: RequestError) -> list[bytes]:
        return [sse(error(e))]
