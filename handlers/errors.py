"""The one table from engine errors to HTTP statuses, and the JSON error body."""

from __future__ import annotations

import logging

from llava import errors

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[errors.EngineError], int] = {
    errors.InvalidRequest: 400,
    errors.SessionNotFound: 400,  # SageMaker clients treat 4xx as "fix the call", not retry
    errors.ImageSourceNotAllowed: 403,
    errors.ImageTooLarge: 413,
    errors.NotAnImage: 415,
    errors.ImageFetchFailed: 424,
    errors.NoCapacity: 503,
}
INTERNAL_ERROR = 500


def error_response(exc: BaseException) -> tuple[int, dict]:
    """Status and ``{"error": {"code", "message"}}`` for any exception; bugs become 500s."""
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls], _body(exc.code, exc.message)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return INTERNAL_ERROR, _body("INTERNAL_ERROR", f"internal error: {type(exc).__name__}")


def _body(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}
