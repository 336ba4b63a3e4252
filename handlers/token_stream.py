"""A streamed answer's lines, numbered, and sent off the engine's loop thread in few frames.

The engine calls ``on_token`` from its one loop thread, for every session's turn in the step
(llava/engine.py ``Engine.ask``); a blocking socket send there would hold up every other turn.
So ``TokenStream.token`` only queues the line, and a sender thread of the stream's own writes
what is queued: every line that arrived while the previous write was in progress goes out as
one chunk (one worker frame), so a slow frontend gets fewer, larger frames rather than a
backlog of small ones.

Every line carries ``"seq"``, its index in the stream from 0, and the final reply carries the
next one: a reader that counts its lines sees a lost one (docs/wire.md §Streaming).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class TokenStream:
    """The token lines of one streamed reply; ``send(chunk)`` writes one chunk to the client."""

    def __init__(self, send: Callable[[str], None]):
        self._send = send
        self._queued: list[str] = []
        self._lines = 0  # lines queued so far: the next line's seq
        self._ending = False
        self._changed = threading.Condition()
        self._sender = threading.Thread(target=self._send_queued, name="token-stream", daemon=True)
        self._sender.start()

    def token(self, text: str, token_id: int | None) -> None:
        """Queue one token's line; never waits for the socket."""
        with self._changed:
            line = {"token": {"id": token_id, "text": text}, "seq": self._lines}
            self._queued.append(json.dumps(line) + "\n")
            self._lines += 1
            self._changed.notify()

    def end(self, last_line: dict) -> str:
        """Wait until every queued line is written; ``last_line`` numbered after them, as the
        line that ends the stream (the final reply, or the error)."""
        with self._changed:
            self._ending = True
            self._changed.notify()
        self._sender.join()
        return json.dumps({**last_line, "seq": self._lines}) + "\n"

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
