"""Typed engine errors, and what of a caller's input a message or a log line may show.

Every failure the engine reports to a caller is one of these. Each carries a stable
machine-readable ``code``; the HTTP status it maps to is decided in one table in the
handler (``handlers/errors.py``), never here, so the engine stays transport-agnostic.
"""

import hashlib
import hmac
import secrets


class EngineError(Exception):
    """Base class: a failure with a stable code and a message that says what to change."""

    code = "ENGINE_ERROR"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequest(EngineError):
    """The request itself is malformed: bad JSON shape, empty question, bad parameters."""

    code = "INVALID_REQUEST"


class SessionIdInUse(InvalidRequest):
    """An open asked for an id that is live, or was used recently (closed, expired, evicted)."""

    code = "SESSION_ID_IN_USE"


class SessionBusy(EngineError):
    """The session already has an ask in flight (and ``max_waiting_asks`` waiting): send the
    next one when it is answered, or cancel it (HTTP 409)."""

    code = "SESSION_BUSY"


class SessionNotFound(EngineError):
    """The session id is unknown, closed or expired (``code`` says which)."""

    code = "SESSION_NOT_FOUND"


class SessionChanged(EngineError):
    """The session's conversation changed while a request that resends it was on its way (a
    turn of another request committed first): send it again (HTTP 409)."""

    code = "SESSION_CHANGED"


class ImageSourceNotAllowed(EngineError):
    """The image source (scheme, host or address) is refused by the network policy."""

    code = "IMAGE_SOURCE_NOT_ALLOWED"


class ImageTooLarge(EngineError):
    """The image exceeds the byte or pixel limit."""

    code = "IMAGE_TOO_LARGE"


class NotAnImage(EngineError):
    """The bytes are not an image in an allowed format, or cannot be decoded."""

    code = "NOT_AN_IMAGE"


class ImageFetchFailed(EngineError):
    """The image could not be fetched: connection error, timeout, HTTP error, missing key."""

    code = "IMAGE_FETCH_FAILED"


class ShardFailed(EngineError):
    """The engine shard holding the session failed this request (its step raised, or it has
    stopped); sessions on the worker's other shards are unaffected."""

    code = "SHARD_FAILED"


class NoCapacity(EngineError):
    """The server cannot hold this session now (memory budget); retry later or elsewhere."""

    code = "NO_CAPACITY"


class RetryLater(NoCapacity):
    """No capacity now, and when to come back: ``retry_after_s`` (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Busy(RetryLater):
    """A turn cannot get KV memory now, even after demoting every idle session: retry after
    ``retry_after_s``. Nothing of any session was lost."""

    code = "KV_MEMORY_FULL"


class Overloaded(RetryLater):
    """The worker serves ``max_requests_in_flight`` requests already: retry after
    ``retry_after_s``. Refused before it took a thread."""

    code = "OVERLOADED"


class TurnInterrupted(EngineError):
    """The worker serving a request died before answering it. Raised for the worker by what
    fronts it (serving/front.py, the local endpoint), never by the engine: with the persistent
    tier the session continues from its last answered turn once the restarted worker is up,
    so the call may be sent again after ``retry_after_s`` (HTTP 503 with Retry-After)."""

    code = "TURN_INTERRUPTED"

    def __init__(self, message: str, *, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DurableStoreOff(InvalidRequest):
    """A resume asked of a server with no durable store (the ``durable_store`` setting)."""

    code = "DURABLE_STORE_OFF"


class DurableStoreUnavailable(RetryLater):
    """The durable store did not answer a resume: retry after ``retry_after_s`` (HTTP 503)."""

    code = "DURABLE_STORE_UNAVAILABLE"


class RecordNotFound(EngineError):
    """The durable store holds no record of that session (never written, closed, resumed
    already, or reclaimed) (HTTP 404)."""

    code = "SESSION_RECORD_NOT_FOUND"


class RecordExpired(EngineError):
    """The session's record is past its TTL: it is never resumed (HTTP 410)."""

    code = "SESSION_RECORD_EXPIRED"


class RecordCorrupt(EngineError):
    """The session's record, or its features, are not whole (checksum, shape) (HTTP 422)."""

    code = "SESSION_RECORD_CORRUPT"


class RecordForeign(EngineError):
    """The session's record belongs to another model (HTTP 409): a resume needs the same
    checkpoint and dtype."""

    code = "SESSION_RECORD_FOREIGN"


# The most of any input an error message repeats (docs/wire.md §Echo cap).
ECHO_CHARS = 80


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with its length said:
    a 10,000-character id must not come back whole in the error that refuses it."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` (a message that may hold an input) cut to ``limit`` characters, length said."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


# Keys the log tags of session ids: random per process, so a tag cannot be reversed by trying
# ids, and the logs of two processes cannot be joined on it.
_LOG_KEY = secrets.token_bytes(32)


def log_id(session_id: str) -> str:
    """What a log line shows of a session id: the id is a bearer secret (docs/wire.md §Session
    ids are bearer secrets), so a log names a session by a keyed hash of it (12 hex digits)."""
    return hmac.new(_LOG_KEY, session_id.encode(), hashlib.sha256).hexdigest()[:12]
