"""The wire contract: request bodies and headers in, typed requests out.

Described in docs/wire.md §Wire contract.

Knows nothing of TorchServe, so it is tested (and fuzzed) on its own. Accepts the seeds'
client shapes too: ``extSessionID`` in the body (on an open: the id the client wants for its
new session, which the engine extends with a random part when it counts under 128 bits:
llava.sessions.store.full_session_id), ``sampling_params`` for ``parameters``. Each request
type accepts a stated set of top-level keys and refuses any other, so nothing a client sends is
dropped unread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from handlers.chat_protocol import ChatBody, is_chat, parse_chat
from llava.errors import InvalidRequest, clip, echo
from llava.intake import parse_image_source
from llava_wire import (
    CANCEL_TURN,
    CLOSE,
    CLOSE_SESSION,
    CUSTOM_ATTRIBUTES_HEADER,
    INPUTS_WITHOUT_SESSION,
    INVALID_SESSION_ID,
    MISSING_SESSION_ID,
    NEW_SESSION,
    SESSION,
    SESSION_HEADER,
    UNKNOWN_KEY,
    UNKNOWN_REQUEST_TYPE,
    session_ids,
)


@dataclass(frozen=True)
class OpenSession:
    image: dict | None  # a source object for llava.intake.load_image, or None: text-only
    session_id: str | None = None  # the client's own id (extSessionID), or None: we pick one
    system: Any = None  # the session's system prompt (checked by the engine), None: the default
    tenant: str | None = None  # its sessions share nothing with another tenant's
    resume_from: str | None = None  # continue this session from the durable store instead


@dataclass(frozen=True)
class AskSession:
    session_id: str
    question: Any  # validated by the engine, which owns the limits
    parameters: dict | None
    stream: bool
    rewind_turns: Any = 0  # drop the session's last N turns first (checked by the engine)
    image: dict | None = None  # a source for llava.intake.load_image: this turn adds that image


@dataclass(frozen=True)
class CloseSession:
    session_id: str


@dataclass(frozen=True)
class CancelTurn:
    """Stop the session's asks in flight at the engine's next step (the session stays open)."""

    session_id: str


@dataclass(frozen=True)
class ChatCompletion:
    """A chat-completions body (docs/wire.md §Chat completions): stateless without a session
    id, opening a session under ``NEW_SESSION``, else continuing ``session_id``."""

    body: ChatBody
    session_id: str | None
    new_session: bool
    tenant: str | None  # for a new or stateless one (a session keeps its own)


Request = OpenSession | AskSession | CloseSession | CancelTurn | ChatCompletion

# Keys that only mean something when asking: an open that carries them would drop them.
_ASK_KEYS = ("inputs", "parameters", "sampling_params")

# The top-level keys each request type reads (docs/wire.md §Request bodies). "stream" is
# accepted on an open too: its reply is one small object either way.
ACCEPTED_KEYS = {
    NEW_SESSION: ("requestType", "image", "extSessionID", "system", "stream", "resumeFrom"),
    SESSION: (
        "requestType",
        "inputs",
        "parameters",
        "sampling_params",
        "stream",
        "rewind_turns",
        "image",
        "extSessionID",
    ),
    CLOSE_SESSION: ("requestType", "extSessionID"),
    CANCEL_TURN: ("requestType", "extSessionID"),
}


# SageMaker forwards the backend's CustomAttributes verbatim in this header: at most 1024
# visible US-ASCII characters, a list of attributes separated by "," or ";". Ours is
# "tenant=<key>"; any other attribute is the backend's own and passes unread.
MAX_CUSTOM_ATTRIBUTES = 1024
_ATTRIBUTE_SEPARATORS = re.compile(r"[,;]")
_TEXT = re.compile(r"[\t\x20-\x7e]*")


def tenant_attribute(value: str | None) -> str | None:
    """The ``tenant=<key>`` attribute of a custom-attributes header's ``value`` (None: no
    header, or no tenant in it); a malformed header is refused, naming it."""
    if value is None:
        return None
    where = f"the {CUSTOM_ATTRIBUTES_HEADER} header"
    if len(value) > MAX_CUSTOM_ATTRIBUTES or not _TEXT.fullmatch(value):
        raise InvalidRequest(
            f"{where} must be at most {MAX_CUSTOM_ATTRIBUTES} visible US-ASCII characters"
        )
    tenants = []
    for attribute in _ATTRIBUTE_SEPARATORS.split(value):
        name, equals, key = attribute.partition("=")
        if name.strip().lower() != "tenant":
            continue
        if not equals or not key.strip():
            raise InvalidRequest(f"{where} names a tenant without a key: send tenant=<key>")
        tenants.append(key.strip())
    if len(tenants) > 1:  # which one applies would be a guess
        raise InvalidRequest(f"{where} names the tenant {len(tenants)} times; send it once")
    return tenants[0] if tenants else None


def header(headers: Mapping[str, Any], name: str) -> str | None:
    """Case-insensitive header lookup (TorchServe's own lookup is case-sensitive)."""
    wanted = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == wanted:
            if isinstance(value, bytes | bytearray):  # not UTF-8: U+FFFD, which checks refuse
                return value.decode(errors="replace")
            return str(value)
    return None


# The deepest a body may nest (a request needs 3: an image source's object). Python's json
# and repr recurse: a 10,000-deep body raises RecursionError in them, so it stops here.
MAX_BODY_DEPTH = 32


def parse_body(body: Any) -> dict:
    """TorchServe hands over parsed JSON, or raw bytes/str when it could not parse it (a body
    too deep for its json.loads comes as bytes too)."""
    if isinstance(body, bytes | bytearray | str):
        try:
            body = json.loads(body)
        except RecursionError:
            raise InvalidRequest(f"the body nests deeper than {MAX_BODY_DEPTH} levels") from None
        except (UnicodeDecodeError, ValueError) as err:
            raise InvalidRequest(f"the body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object with a 'requestType'")
    for key, value in body.items():
        _check_value(echo(key), key, value)
    return body


def _check_value(field: str, key: str, value: Any) -> None:
    """Refuse, naming the body's ``field``, a value nested past MAX_BODY_DEPTH or a string that
    is not text: a lone surrogate (the JSON escape "\\ud800") encodes as no UTF-8, and the
    tokenizer or a reply would fail on it as a 500. Iterative: the depth is not yet known."""
    pending = [(key, 1), (value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_BODY_DEPTH:
            raise InvalidRequest(f"{field} nests deeper than {MAX_BODY_DEPTH} levels")
        if isinstance(item, dict):
            pending += [(part, depth + 1) for pair in item.items() for part in pair]
        elif isinstance(item, list):
            pending += [(part, depth + 1) for part in item]
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise InvalidRequest(
                    f"{field} is not UTF-8 text: it holds a lone surrogate "
                    f"(U+{ord(item[err.start]):04X}); send the character it stands for"
                ) from None


def parse_request(body: Any, headers: Mapping[str, Any]) -> Request:
    payload = parse_body(body)
    raw_id = header(headers, SESSION_HEADER)
    from_header = _checked_id(raw_id, f"the {SESSION_HEADER} header")
    if is_chat(payload):
        new_session = raw_id is not None and raw_id.strip() == NEW_SESSION
        tenant = tenant_attribute(header(headers, CUSTOM_ATTRIBUTES_HEADER))
        return ChatCompletion(parse_chat(payload), from_header, new_session, tenant)
    from_body = _checked_id(payload.get("extSessionID"), "'extSessionID'")
    # Without a requestType, a session id says "ask"; no id at all says "open".
    no_id = from_header is None and from_body is None
    kind = payload.get("requestType", NEW_SESSION if no_id else SESSION)
    if kind == CLOSE:  # AWS's and LMI's spelling: the same request
        kind = CLOSE_SESSION
        payload = {**payload, "requestType": CLOSE_SESSION}
    if kind == NEW_SESSION:
        tenant = tenant_attribute(header(headers, CUSTOM_ATTRIBUTES_HEADER))
        return _open(payload, from_header, from_body, tenant)
    if kind not in (SESSION, CLOSE_SESSION, CANCEL_TURN):
        raise InvalidRequest(
            f"unknown requestType {echo(kind)}; use NEW_SESSION, SESSION, CLOSE_SESSION (or "
            f"CLOSE) or {CANCEL_TURN}, or send a chat-completions body with 'messages'",
            code=UNKNOWN_REQUEST_TYPE,
        )
    session_id = _one_session_id(from_header, from_body)
    if session_id is None:
        raise InvalidRequest(
            f"requestType {kind} needs the session id in the {SESSION_HEADER} header",
            code=MISSING_SESSION_ID,
        )
    _check_keys(payload, kind)
    if kind == CLOSE_SESSION:
        return CloseSession(session_id)
    if kind == CANCEL_TURN:
        return CancelTurn(session_id)
    if "inputs" not in payload:
        raise InvalidRequest("requestType SESSION needs 'inputs': the question to ask")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false")
    rewind = payload.get("rewind_turns", 0)
    # An image on a turn: the same sources, checked the same way, as an open's
    image = _image_source(payload)
    return AskSession(session_id, payload["inputs"], _parameters(payload), stream, rewind, image)


def _open(
    payload: dict, from_header: str | None, from_body: str | None, tenant: str | None
) -> OpenSession:
    """An open names no existing session; ``extSessionID`` is the id the client wants."""
    if from_header is not None:
        raise InvalidRequest(
            f"requestType NEW_SESSION opens a session: send {SESSION_HEADER}: NEW_SESSION "
            "or no session id, not an existing id (your own id for the new session goes in "
            "'extSessionID')"
        )
    asked = [key for key in _ASK_KEYS if key in payload]
    if asked:
        raise InvalidRequest(
            f"an open answers no question, so it would drop {', '.join(asked)}: send "
            '{"requestType": "NEW_SESSION"} (with "image" and "extSessionID" if you like), then '
            f'{{"requestType": "SESSION", "inputs": ...}} with the session id in {SESSION_HEADER}',
            code=INPUTS_WITHOUT_SESSION,
        )
    _check_keys(payload, NEW_SESSION)
    resume_from = _checked_id(payload.get("resumeFrom"), "'resumeFrom'")
    if resume_from is not None:  # the record holds its images and system prompt
        given = [key for key in ("image", "system") if key in payload]
        if given:
            raise InvalidRequest(
                f"a resume takes its session's images and system prompt from its record: "
                f"leave out {', '.join(given)} with 'resumeFrom'"
            )
        return OpenSession(None, from_body, None, tenant, resume_from)
    return OpenSession(_image_source(payload), from_body, payload.get("system"), tenant)


def _image_source(payload: dict) -> dict | None:
    """The body's ``image`` source, its shape checked (no I/O yet); None: no image."""
    image = payload.get("image")
    return None if image is None else parse_image_source(image)


def _check_keys(payload: dict, kind: str) -> None:
    accepted = ACCEPTED_KEYS[kind]
    unknown = [key for key in payload if key not in accepted]
    if not unknown:
        return
    raise InvalidRequest(
        f"requestType {kind} does not take {clip(', '.join(map(echo, unknown)))}; "
        f"it takes {', '.join(accepted)}",
        code=UNKNOWN_KEY,
    )


def _parameters(payload: dict) -> dict | None:
    if "parameters" in payload and "sampling_params" in payload:
        raise InvalidRequest("send 'parameters' or its alias 'sampling_params', not both")
    return payload.get("parameters", payload.get("sampling_params"))


def _one_session_id(from_header: str | None, from_body: str | None) -> str | None:
    if from_header and from_body and from_header != from_body:
        raise InvalidRequest(
            f"the {SESSION_HEADER} header and 'extSessionID' name different sessions",
            code=INVALID_SESSION_ID,
        )
    return from_header or from_body


def _checked_id(value: Any, where: str) -> str | None:
    """A well-formed session id, or None for "no session" (absent, empty or NEW_SESSION)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string", code=INVALID_SESSION_ID)
    value = value.strip()
    if value in ("", NEW_SESSION):
        return None
    if (why := session_ids.refusal(value, where)) is not None:
        raise InvalidRequest(why, code=INVALID_SESSION_ID)
    return value


def session_header_value(session_id: str, expires_at: datetime) -> str:
    """``<id>; Expires=YYYY-MM-DDTHH:MM:SSZ`` as botocore's NewSessionId expects."""
    return f"{session_id}; Expires={expires_at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
