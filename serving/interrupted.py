"""What a front says when the worker dies under a request
(docs/engine/sessions.md §Persistent tier).

TorchServe 0.12 answers a request whose worker died with its own 507 "Worker died.", or the
connection drops; a streamed reply just stops. The container front (serving/front.py) and the
local endpoint turn these into the wire contract's terms: a 503 ``TURN_INTERRUPTED`` with
``Retry-After`` before any byte went out, and a last ``{"error": ...}`` line in a stream that
ended without its final reply. The session itself continues from its last answered turn on the
restarted worker (the persistent tier). Standard library, llava.errors and llava_wire only: the
front and the client-side install import it without torch or TorchServe.
"""

from __future__ import annotations

import json

from handlers.errors import ErrorReply, error_response, retry_reply
from llava.errors import TurnInterrupted
from llava_wire import NOT_READY

# TorchServe's status for "the worker died during this request" (docs/wire.md §Errors that are ours,
# and TorchServe's own answers).
WORKER_DIED_STATUS = 507
# A whole-instance restart with the demo model takes 10-30 s here (docs/performance.md
# §Supervisor numbers); a caller that waits this long usually finds it up, else NOT_READY's.
RETRY_AFTER_S = 10.0
# While the worker (re)starts: fronts refuse at once and say when to come back.
NOT_READY_RETRY_AFTER_S = 5.0
_TOKEN_LINE = b'{"token"'


def interrupted_reply(what: str) -> ErrorReply:
    """The 503 for a request whose worker died before it was answered."""
    return error_response(
        TurnInterrupted(
            f"the model server's worker stopped during this request ({what}); the session "
            "continues from its last answered turn once it is back: send the same call again",
            retry_after_s=RETRY_AFTER_S,
        )
    )


def not_ready_reply(message: str) -> ErrorReply:
    """The 503 while the worker starts or restarts (sessions survive it: retry later)."""
    return retry_reply(503, NOT_READY, message, NOT_READY_RETRY_AFTER_S)


def interrupted_line(what: str) -> bytes:
    """The last line of a stream its worker broke: the contract's error line."""
    return json.dumps(interrupted_reply(what).payload).encode() + b"\n"


class StreamEnd:
    """Follows a JSON-lines reply as it is relayed, keeping only the head of its last line,
    to tell a stream that ended with its final reply (or an error line) from one cut short."""

    def __init__(self):
        self._line = b""  # the head of the line in progress
        self._last = b""  # the head of the last complete, non-empty line

    def feed(self, piece: bytes) -> None:
        *complete, rest = piece.split(b"\n")
        for segment in complete:
            line = (self._line + segment)[: len(_TOKEN_LINE)]
            self._last, self._line = line or self._last, b""
        self._line = (self._line + rest)[: len(_TOKEN_LINE)]

    @property
    def finished(self) -> bool:
        """Every line the server sends ends with a newline; the last one is not a token's."""
        return not self._line and bool(self._last) and not self._last.startswith(_TOKEN_LINE)
