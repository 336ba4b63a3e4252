"""What a SageMaker caller gets back when a call fails, as exceptions that say what to do.

SageMaker wraps a container's non-200 reply in ``ModelError`` (HTTP 424) with the container's
status in ``OriginalStatusCode`` and its body in ``OriginalMessage``; our container's body is
``{"error": {"code", "message"}}``. SageMaker's own refusals (an unknown session id, a bad
endpoint name) are ``ValidationError`` (400) with just a message.
"""

from __future__ import annotations

import json

from botocore.exceptions import ClientError

from llava_wire import RESUME_REFUSED_CODES, SESSION_GONE_CODES

# A call on a session whose instance no longer holds it, answered from the durable store: a
# record refused (missing, expired, corrupt, another model's) means that session is gone too.
GONE_ON_A_SESSION = SESSION_GONE_CODES | RESUME_REFUSED_CODES


class LlavaError(Exception):
    """A failed call. ``code`` is the container's error code (e.g. ``IMAGE_TOO_LARGE``) or
    SageMaker's (e.g. ``ValidationError``); ``status`` the container's HTTP status, if any."""

    def __init__(
        self, code: str, message: str, status: int | None = None, retry_after_s: float | None = None
    ):
        super().__init__(f"{code}: {message}" + (f" (HTTP {status})" if status else ""))
        self.code, self.message, self.status = code, message, status
        # A 503 that says when to come back (Retry-After, or the body's retryAfterS): the
        # request was refused before anything happened, so sending it again is safe.
        self.retry_after_s = retry_after_s


class SessionGone(LlavaError):
    """The session no longer exists (closed, expired, evicted, or its instance is gone).

    Raised by a ``Session`` call, it says what went with it: ``session_id``, ``turns`` (how
    many turns the session held, None if no reply said) and ``history`` (the turns asked
    through that object, to re-ask them elsewhere); ``resume_error``: why the server could not
    resume it (``recover="resume"``: e.g. ``DURABLE_STORE_OFF``), None if it was not asked.
    ``code`` stays the one that said the session was gone."""

    session_id: str | None = None
    turns: int | None = None
    history: tuple = ()
    resume_error: LlavaError | None = None


class StreamGap(LlavaError):
    """Lines of a streamed answer were lost on the way; the text yielded stopped at the gap.

    The turn itself completed and the session holds it; ``text`` is the whole answer, from
    the stream's final reply."""

    def __init__(self, message: str, text: str):
        super().__init__("STREAM_GAP", message)
        self.text = text


def from_client_error(err: ClientError, with_session: bool) -> LlavaError:
    """Translate botocore's error; ``with_session``: the call named an existing session id."""
    response = err.response
    aws_code = response.get("Error", {}).get("Code", "Unknown")
    message = response.get("Error", {}).get("Message", str(err))
    if aws_code == "ModelError":
        status = response.get("OriginalStatusCode")
        error = _container_error(response.get("OriginalMessage", ""))
        code = str(error.get("code", "ModelError"))
        message = str(error.get("message", response.get("OriginalMessage") or message))
        gone = GONE_ON_A_SESSION if with_session else SESSION_GONE_CODES
        cls = SessionGone if code in gone else LlavaError
        retry_after = _seconds(error.get("retryAfterS")) if status == 503 else None
        return cls(code, message, status, retry_after)
    # SageMaker's router refuses an id it does not know before any container sees it (the
    # local endpoint adds an ErrorCode that says whether it was lost with its instance).
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    if aws_code == "ValidationError" and with_session and "session" in message.lower():
        code = headers.get("x-local-endpoint-error-code")
        return SessionGone(code if code in SESSION_GONE_CODES else aws_code, message)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    retry_after = _seconds(headers.get("retry-after")) if status == 503 else None
    return LlavaError(aws_code, message, status if status == 503 else None, retry_after)


def from_stream_error(payload: dict) -> LlavaError:
    """The last JSON line of a stream that failed after it began: ``{"error": {...}}``."""
    error = payload.get("error") or {}
    code = str(error.get("code", "UNKNOWN"))
    cls = SessionGone if code in GONE_ON_A_SESSION else LlavaError
    return cls(code, str(error.get("message", payload)))


def _container_error(original: str) -> dict:
    """Our container's ``{"error": {...}}``; {} for another shape (e.g. TorchServe's)."""
    try:
        error = json.loads(original)["error"]
    except (ValueError, TypeError, KeyError):
        return {}
    return error if isinstance(error, dict) and "code" in error and "message" in error else {}


def _seconds(value) -> float | None:
    """A Retry-After in seconds (the HTTP-date form is not used by our container)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if 0 <= seconds < float("inf") else None
