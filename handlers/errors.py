"""The one table from engine errors to HTTP statuses, and the JSON error body."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from llava import errors
from llava_wire import INTERNAL_ERROR

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[errors.EngineError], int] = {
    errors.InvalidRequest: 400,
    errors.SessionNotFound: 400,  # SageMaker clients treat 4xx as "fix the call", not retry
    errors.SessionBusy: 409,  # one ask in flight per session (docs/security.md)
    errors.SessionChanged: 409,  # a resent conversation met a session that moved on
    errors.ImageSourceNotAllowed: 403,
    errors.ImageTooLarge: 413,
    errors.NotAnImage: 415,
    errors.ImageFetchFailed: 424,
    errors.ShardFailed: 500,  # the server failed the turn; the session's history is kept
    errors.NoCapacity: 503,  # and its subclass Busy (KV_MEMORY_FULL), which says when to retry
    errors.TurnInterrupted: 503,  # the worker died during the request: retry after the restart
    errors.RecordNotFound: 404,  # resuming a session (docs/wire.md §Resuming a session)
    errors.RecordExpired: 410,
    errors.RecordCorrupt: 422,
    errors.RecordForeign: 409,
}
INTERNAL_ERROR_STATUS = 500  # anything else: a bug


@dataclass(frozen=True)
class ErrorReply:
    status: int
    payload: dict
    headers: dict[str, str] = field(default_factory=dict)


def error_response(exc: BaseException) -> ErrorReply:
    """Status, ``{"error": {"code", "message"}}`` and headers for any exception; bugs are 500s.

    An error that knows when capacity comes back (``retry_after_s``, llava.errors.Busy) also
    gets ``Retry-After`` in whole seconds, rounded up (RFC 9110 §10.2.3).
    """
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            retry_after_s = getattr(exc, "retry_after_s", None)
            if retry_after_s is None:
                return ErrorReply(STATUS_BY_ERROR[cls], _body(exc.code, exc.message))
            return retry_reply(STATUS_BY_ERROR[cls], exc.code, exc.message, retry_after_s)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    message = f"internal error: {type(exc).__name__}"
    return ErrorReply(INTERNAL_ERROR_STATUS, _body(INTERNAL_ERROR, message))


def retry_reply(status: int, code: str, message: str, retry_after_s: float) -> ErrorReply:
    """A refusal that says when to come back: ``retryAfterS`` in the body, ``Retry-After`` in
    whole seconds, rounded up (RFC 9110 §10.2.3)."""
    body = _body(code, message)
    body["error"]["retryAfterS"] = retry_after_s
    return ErrorReply(status, body, {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def _body(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


# OpenAI's error types by status (its SDKs raise a class per status; the type is for humans).
OPENAI_ERROR_TYPES = {
    403: "permission_error",
    404: "not_found_error",
    410: "not_found_error",
    429: "rate_limit_error",
}


def openai_error(error: ErrorReply, param: str | None = None) -> ErrorReply:
    """The same refusal (status, headers, code, message) in OpenAI's error shape,
    ``{"error": {"message", "type", "param", "code"}}``: what a chat-completions request gets,
    from the handler, the container's front or the local endpoint (docs/wire.md §Chat
    completions); ``param``: the field at fault, if one is."""
    ours, status = error.payload["error"], error.status
    kind = OPENAI_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    shaped = {"message": ours["message"], "type": kind, "param": param, "code": ours["code"]}
    return ErrorReply(status, {"error": shaped}, error.headers)
