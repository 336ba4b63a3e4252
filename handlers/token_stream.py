"""A streamed answer's lines, numbered, and sent off the engine's loop thread in few frames.

The engine calls ``on_token`` from its one loop thread, for every session's turn in the step
(llava/engine.py ``Engine.ask``); a blocking socket send there would hold up every other turn.
So ``TokenStream.token`` only queues the line, and a sender thread of the stream's own writes
what is queued: every line that arrived while the previous write was in progress goes out as
one chunk (one worker frame), so a slow frontend gets fewer, larger frames rather than a
backlog of small ones.

What a line looks like is the stream's ``lines``: ``TokenLines`` (this protocol's JSON lines)
by default, or the chat-completions API's server-sent events (handlers/chat_replies.py). In
``TokenLines`` every line carries ``"seq"``, its index in the stream from 0, and the final
reply carries the next one: a reader that counts its lines sees a lost one (docs/wire.md
§Streaming).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)


class TokenLines:
    """This protocol's lines: one JSON object per token, numbered, and the final reply."""

    def __init__(self):
        self._lines = 0  # lines made so far: the next line's seq

    def token(self, text: str, token_id: int | None) -> str:
        line = {"token": {"id": token_id, "text": text}, "seq": self._lines}
        self._lines += 1
        return json.dumps(line) + "\n"

    def last(self, payload: dict) -> str:
        return json.dumps({**payload, "seq": self._lines}) + "\n"


class LineFormat(Protocol):
    def token(self, text: str, token_id: int | None) -> str:
        """A token's text (empty for special ids) as what the stream sends ("" for nothing)."""

    def last(self, payload: dict) -> str:
        """What ends the stream, from the final reply or the error."""


class TokenStream:
    """The token lines of one streamed reply; ``send(chunk)`` writes one chunk to the client."""

    def __init__(self, send: Callable[[str], None], lines: LineFormat | None = None):
        self._send = send
        self._format = lines or TokenLines()
        self._queued: list[str] = []
        self._ending = False
        self._changed = threading.Condition()
        self._sender = threading.Thread(target=self._send_queued, name="token-stream", daemon=True)
        self._sender.start()

    def token(self, text: str, token_id: int | None) -> None:
        """Queue one token's line; never waits for the socket."""
        with self._changed:
            line = self._format.token(text, token_id)
            if line:
                self._queued.append(line)
                self._changed.notify()

    def end(self, last_line: dict) -> str:
        """Wait until every queued line is written; what ends the stream after them, made
        from ``last_line`` (the final reply, or the error)."""
        with self._changed:
            self._ending = True
            self._changed.notify()
        self._sender.join()
        return self._format.last(last_line)

    def _send_queued(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queued or self._ending)
                chunk, self._queued = "".join(self._queued), []
            if not chunk:
                return  # ending, and nothing left
            try:
                self._send(chunk)
            except Exception:  # the worker's socket is gone: the worker is going down
                logger.exception("a streamed chunk could not be sent; dropping the stream")
                return
