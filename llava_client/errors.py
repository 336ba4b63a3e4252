"""What a SageMaker caller gets back when a call fails, as exceptions that say what to do.

SageMaker wraps a container's non-200 reply in ``ModelError`` (HTTP 424) with the container's
status in ``OriginalStatusCode`` and its body in ``OriginalMessage``; our container's body is
``{"error": {"code", "message"}}``. SageMaker's own refusals (an unknown session id, a bad
endpoint name) are ``ValidationError`` (400) with just a message.
"""

from __future__ import annotations

import json

from botocore.exceptions import ClientError

# The container's codes for a session that no longer exists (closed, expired, evicted, lost).
SESSION_GONE_CODES = frozenset(
    {"SESSION_NOT_FOUND", "SESSION_CLOSED", "SESSION_EXPIRED", "SESSION_EVICTED"}
)


class LlavaError(Exception):
    """A failed call. ``code`` is the container's error code (e.g. ``IMAGE_TOO_LARGE``) or
    SageMaker's (e.g. ``ValidationError``); ``status`` the container's HTTP status, if any."""

    def __init__(self, code: str, message: str, status: int | None = None):
        super().__init__(f"{code}: {message}" + (f" (HTTP {status})" if status else ""))
        self.code, self.message, self.status = code, message, status


class SessionGone(LlavaError):
    """The session no longer exists (closed, expired, evicted, or its instance is gone)."""


def from_client_error(err: ClientError, with_session: bool) -> LlavaError:
    """Translate botocore's error; ``with_session``: the call named an existing session id."""
    response = err.response
    aws_code = response.get("Error", {}).get("Code", "Unknown")
    message = response.get("Error", {}).get("Message", str(err))
    if aws_code == "ModelError":
        status = response.get("OriginalStatusCode")
        code, message = _container_error(response.get("OriginalMessage", ""), message)
        cls = SessionGone if code in SESSION_GONE_CODES else LlavaError
        return cls(code, message, status)
    # SageMaker's router refuses an id it does not know before any container sees it.
    if aws_code == "ValidationError" and with_session and "session" in message.lower():
        return SessionGone(aws_code, message)
    return LlavaError(aws_code, message)


def from_stream_error(payload: dict) -> LlavaError:
    """The last JSON line of a stream that failed after it began: ``{"error": {...}}``."""
    error = payload.get("error") or {}
    code = str(error.get("code", "UNKNOWN"))
    cls = SessionGone if code in SESSION_GONE_CODES else LlavaError
    return cls(code, str(error.get("message", payload)))


def _container_error(original: str, fallback: str) -> tuple[str, str]:
    try:
        error = json.loads(original)["error"]
        return str(error["code"]), str(error["message"])
    except (ValueError, TypeError, KeyError):  # not our container's shape (e.g. TorchServe's)
        return "ModelError", original or fallback
