"""What every wire format's reply shares: ids, server-sent-event frames, and the shape of a streamed turn."""

from __future__ import annotations

import json
import secrets
import time

from molt_hydra.agents.wire.request import ChatRequest, RequestError


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def sse(data: dict, event: str | None = None) -> bytes:
    return (f"event: {event}\n" if event else "").encode() + f"data: {json.dumps(data)}\n\n".encode()


class Stream:
    """One streamed turn as SSE frames: `start()` once the turn has begun (its prompt is tokenized), `delta(kind,
    text)` for each piece of "reasoning" or "content" the engine samples, `end(reply)` with the whole `TurnReply`.
    A stream of blocks (Responses items, Anthropic content blocks) opens a block at each change of kind."""

    ID_PREFIX = ""  # of the reply's id

    def __init__(self, req: ChatRequest, model: str, session):
        self.req, self.model, self.session = req, model, session
        self.id, self.created = new_id(self.ID_PREFIX), int(time.time())
        self.kind, self.index = None, -1  # the open block
        self.kinds_sent: set[str] = set()  # kinds of the blocks streamed so far (the end sends the reply's others)

    def start(self) -> list[bytes]:
        return []

    def delta(self, kind: str, text: str) -> list[bytes]:
        if kind == self.kind:
            return self.piece(text)
        out = self.close()  # of the block that was open
        self.kind, self.index = kind, self.index + 1
        self.kinds_sent.add(kind)
        return out + self.open() + self.piece(text)

    def open(self) -> list[bytes]:
        return []

    def piece(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def close(self) -> list[bytes]:
        return []

    def end(self, reply) -> list[bytes]:
        raise NotImplementedError

    def error(self, e: RequestError) -> list[bytes]:
        """A failure after the stream began, as the API's own error event (its SDK raises it with the message)."""
        raise NotImplementedError
