"""The wire contract: request bodies and headers in, typed requests out.

Described in docs/design.md §Wire contract.

Knows nothing of TorchServe, so it is tested (and fuzzed) on its own. Accepts the seeds'
client shapes too: ``extSessionID`` in the body, ``sampling_params`` for ``parameters``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from llava.errors import InvalidRequest
from llava.intake import parse_image_source

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
NEW_SESSION = "NEW_SESSION"
_SESSION_ID = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
_MAX_SESSION_ID = 256


@dataclass(frozen=True)
class OpenSession:
    image: dict | None  # a source object for llava.intake.load_image, or None: text-only


@dataclass(frozen=True)
class AskSession:
    session_id: str
    question: Any  # validated by the engine, which owns the limits
    parameters: dict | None
    stream: bool


@dataclass(frozen=True)
class CloseSession:
    session_id: str


Request = OpenSession | AskSession | CloseSession


def header(headers: Mapping[str, Any], name: str) -> str | None:
    """Case-insensitive header lookup (TorchServe's own lookup is case-sensitive)."""
    wanted = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == wanted:
            return value.decode() if isinstance(value, bytes | bytearray) else str(value)
    return None


def parse_body(body: Any) -> dict:
    """TorchServe hands over parsed JSON, or raw bytes/str when it could not parse it."""
    if isinstance(body, bytes | bytearray | str):
        try:
            body = json.loads(body)
        except (UnicodeDecodeError, ValueError) as err:
            raise InvalidRequest(f"the body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object with a 'requestType'")
    return body


def parse_request(body: Any, headers: Mapping[str, Any]) -> Request:
    payload = parse_body(body)
    session_id = _session_id(payload, headers)
    # Without a requestType, the session header says it: none/NEW_SESSION opens, an id asks.
    kind = payload.get(
        "requestType", NEW_SESSION if session_id in (None, NEW_SESSION) else "SESSION"
    )
    if kind == NEW_SESSION:
        if session_id not in (None, NEW_SESSION):
            raise InvalidRequest(
                f"requestType NEW_SESSION opens a session: send {SESSION_HEADER}: NEW_SESSION "
                "or no session id, not an existing id"
            )
        image = payload.get("image")
        return OpenSession(image=None if image is None else parse_image_source(image))
    if kind not in ("SESSION", "CLOSE_SESSION"):
        raise InvalidRequest(
            f"unknown requestType {kind!r}; use NEW_SESSION, SESSION or CLOSE_SESSION",
            code="UNKNOWN_REQUEST_TYPE",
        )
    if session_id in (None, NEW_SESSION):
        raise InvalidRequest(
            f"requestType {kind} needs the session id in the {SESSION_HEADER} header",
            code="MISSING_SESSION_ID",
        )
    if kind == "CLOSE_SESSION":
        return CloseSession(session_id)
    if "inputs" not in payload:
        raise InvalidRequest("requestType SESSION needs 'inputs': the question to ask")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false")
    return AskSession(session_id, payload["inputs"], _parameters(payload), stream)


def _parameters(payload: dict) -> dict | None:
    if "parameters" in payload and "sampling_params" in payload:
        raise InvalidRequest("send 'parameters' or its alias 'sampling_params', not both")
    return payload.get("parameters", payload.get("sampling_params"))


def _session_id(payload: dict, headers: Mapping[str, Any]) -> str | None:
    from_header = header(headers, SESSION_HEADER)
    from_body = payload.get("extSessionID")
    if from_header is not None:
        from_header = from_header.strip()
    if from_body is not None and not isinstance(from_body, str):
        raise InvalidRequest("'extSessionID' must be a string", code="INVALID_SESSION_ID")
    if from_header and from_body and from_header != from_body:
        raise InvalidRequest(
            f"the {SESSION_HEADER} header and 'extSessionID' name different sessions",
            code="INVALID_SESSION_ID",
        )
    session_id = from_header or from_body or None
    if session_id is None or session_id == NEW_SESSION:
        return session_id
    if len(session_id) > _MAX_SESSION_ID or not _SESSION_ID.match(session_id):
        raise InvalidRequest(
            "a session id is 1-256 letters, digits and single or repeated inner hyphens",
            code="INVALID_SESSION_ID",
        )
    return session_id


def session_header_value(session_id: str, expires_at: datetime) -> str:
    """``<id>; Expires=YYYY-MM-DDTHH:MM:SSZ`` as botocore's NewSessionId expects."""
    return f"{session_id}; Expires={expires_at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
