"""The sagemaker-runtime REST surface, forwarding to TorchServe's ``/invocations``.

``POST /endpoints/{name}/invocations`` and ``.../invocations-response-stream`` with the
session header ``X-Amzn-SageMaker-Session-Id``:

* ``NEW_SESSION``: goes to the least-loaded instance; the container's session header comes
  back as ``X-Amzn-SageMaker-New-Session-Id`` and binds the id to that instance.
* an id: goes to its instance; an id the endpoint does not know is a 400 ``ValidationError``
  (SageMaker's router answers it; the container never sees it) with the code
  ``SESSION_NOT_FOUND``, or ``SESSION_LOST`` for one lost with its instance (how many went with
  it in the message), in the body's ``ErrorCode`` and in ``X-Local-Endpoint-Error-Code`` (botocore
  keeps only the headers of an error it has no model for); closing a lost session is the
  container's idempotent 200. A reply
  carrying ``X-Amzn-SageMaker-Closed-Session-Id`` unbinds the id.
* none: a stateless call, to the least-loaded instance.

A body over SageMaker's 6 MB cap (``MAX_BODY_BYTES``) is refused with a 400 ``ValidationError``
before any container sees it, as SageMaker refuses it.

A container reply other than 200 becomes what SageMaker makes of it: 424 ``ModelError`` with
``OriginalStatusCode`` and ``OriginalMessage`` (the container's body). A supervised instance
that is restarting keeps its sessions (the persistent tier brings them back): a call meanwhile
gets the container front's 503 ``NOT_READY``, a call its dying worker held (TorchServe's 507,
a dropped connection) a 503 ``TURN_INTERRUPTED``, and a stream cut short ends with that error
line, as the container's front (serving/front.py) answers them (serving/interrupted.py).
Streamed replies are framed as ``PayloadPart`` events. Every reply names the instance in
``X-Local-Endpoint-Instance`` (SageMaker has no such header; tests use it to see stickiness).

``POST /endpoints/{name}/openai/v1/chat/completions`` is SageMaker's OpenAI-compatible path
(what OpenAI's SDKs call with ``base_url=.../endpoints/{name}/openai/v1``): routed by the session
header as an invocation is, the body forwarded unchanged to the same ``/invocations``, and the
container's reply passed on raw (status, headers, body; server-sent events chunk by chunk as
they come), as SageMaker returns it. What the endpoint answers itself there (an unknown
endpoint, route or session, what the container's front would say) is in OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``, with the status and code an invocation
gets.

Not SageMaker's: ``POST /local-admin/instances/{name}/replace[?kill=1]``, from loopback only,
replaces an instance as SageMaker replaces one (local_endpoint/__main__.py ``Slot.replace``;
docs/client.md §Replacing an instance) and answers, once the fresh one is READY, what it did.
"""

from __future__ import annotations

import http.client
import json
import re
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from handlers.errors import ErrorReply, openai_error
from llava.errors import clip, echo
from llava_wire import (
    CLOSE,
    CLOSE_SESSION,
    CLOSED_SESSION_HEADER,
    INVALID_SESSION_ID,
    MAX_REQUEST_BYTES,
    NEW_SESSION,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    SESSION_LOST,
    SESSION_NOT_FOUND,
    session_ids,
)
from local_endpoint import eventstream
from local_endpoint.router import Backend, Loss, Router
from serving.front import (
    HOP_BY_HOP,
    announced_session,
    relay_stream,
    streamed,
    unframed,
)
from serving.interrupted import WORKER_DIED_STATUS, interrupted_reply, not_ready_reply
from serving.relay import CallerGone, cancel_turn

INSTANCE_HEADER = "X-Local-Endpoint-Instance"
ERROR_CODE_HEADER = "X-Local-Endpoint-Error-Code"
FORWARDED = ("Content-Type", "Accept", "X-Amzn-SageMaker-Custom-Attributes", SESSION_HEADER)
MAX_BODY_BYTES = MAX_REQUEST_BYTES  # SageMaker's cap, the one the client checks too
INVOKE, STREAM, OPENAI = "invocations", "invocations-response-stream", "openai"
_ROUTE = re.compile(r"/endpoints/([^/]+)/(invocations|invocations-response-stream)")
_OPENAI = re.compile(r"/endpoints/([^/]+)/openai/(.*)")  # errors under it in OpenAI's shape
OPENAI_ROUTE = "v1/chat/completions"  # the one route OpenAI's SDK calls under the prefix
CLOSES = (CLOSE_SESSION, CLOSE)  # the body's request types that close a session
_ADMIN = re.compile(r"/local-admin/instances/([^/]+)/replace")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


class Rejected(Exception):
    """An answer of the endpoint itself (not of a container), as botocore parses it."""

    def __init__(self, status: int, error_type: str, message: str, **fields):
        super().__init__(message)
        self.status, self.error_type, self.message, self.fields = (
            status,
            error_type,
            message,
            fields,
        )
        self.front: ErrorReply | None = None  # the container front's own answer, if it is one


def validation_error(message: str, **fields) -> Rejected:
    return Rejected(400, "ValidationError", message, **fields)


def unknown_session(session_id: str, loss: Loss | None) -> Rejected:
    """The router's answer to an id it does not hold: lost with its instance, or never known.
    ``ErrorCode`` tells them apart without reading the message."""
    if loss is None:
        return validation_error(
            f"Session {session_id} does not exist: it was never opened, or was closed or expired",
            ErrorCode=SESSION_NOT_FOUND,
        )
    return validation_error(
        f"Session {session_id} was lost with {loss.instance}, {loss.how} ({loss.sessions} "
        "sessions lost with it): open a new session, or resume it where the endpoint has a "
        "durable store",
        ErrorCode=SESSION_LOST,
    )


def closed_lost(session_id: str) -> tuple[bytes, dict[str, str]]:
    """The container's idempotent close, for a session the endpoint knows was lost."""
    body = {"sessionId": session_id, "closed": True, "alreadyGone": "lost"}
    return json.dumps(body).encode(), {
        "Content-Type": "application/json",
        CLOSED_SESSION_HEADER: session_id,
    }


def oversize(length: int) -> Rejected:
    """SageMaker's answer to a body over its cap (the message as seen from SageMaker, with the
    sizes added)."""
    return validation_error(
        f"Request {uuid.uuid4()} has oversize body: {length} bytes, the limit is "
        f"{MAX_BODY_BYTES} bytes."
    )


def model_error(status: int, body: bytes) -> Rejected:
    """A container's non-200 reply, wrapped as SageMaker wraps it (424 ModelError)."""
    original = body.decode("utf-8", errors="replace")
    kind = "client" if status < 500 else "server"
    return Rejected(
        424,
        "ModelError",
        f'Received {kind} error ({status}) from primary with message "{original}".',
        OriginalStatusCode=status,
        OriginalMessage=original,
        ErrorCode=f"{kind.upper()}_ERROR_FROM_MODEL",
        LogStreamArn="local-endpoint",
    )


def front_error(error: ErrorReply) -> Rejected:
    """What the container's front would answer, as SageMaker passes it on (no headers: the
    wait is in the body's ``retryAfterS``); the OpenAI path passes it on raw."""
    rejected = model_error(error.status, json.dumps(error.payload).encode())
    rejected.front = error
    return rejected


class BackendDown(Exception):
    """The instance did not answer at all (connection refused or dropped)."""


class EndpointServer(ThreadingHTTPServer):
    daemon_threads = True
    # Connections not yet accepted: socketserver's 5 overflowed when 32 sessions opened at once
    # on 2 busy cores, and the kernel then reset some of them.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        endpoint_name: str,
        router: Router,
        part_bytes: int = 0,  # > 0: split streamed chunks into parts of at most this size
        timeout_s: float = 60.0,  # SageMaker gives a container 60 s to answer
        # The admin route's work: replace the instance of that name (kill: at once, as a
        # hardware fault), answering what was done; raises Rejected. None: no such route.
        replace: Callable[[str, bool], dict] | None = None,
    ):
        super().__init__(address, _Handler)
        self.endpoint_name = endpoint_name
        self.router = router
        self.part_bytes = part_bytes
        self.timeout_s = timeout_s
        self.replace = replace


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle on, the body would wait for the
    # client's delayed ACK (~40 ms) on every reply.
    disable_nagle_algorithm = True
    server: EndpointServer
    openai = False  # whether the request is under the OpenAI path (its errors in OpenAI's shape)

    def log_message(self, format, *args):  # noqa: A002 (BaseHTTPRequestHandler's signature)
        pass

    def send_error(self, code, message=None, explain=None):
        """The standard library's refusals (a bad request line, an unknown method) quote the
        input: bounded as every other message (llava.errors.clip)."""
        super().send_error(code, message and clip(message), explain)

    def do_GET(self):
        self.openai = _OPENAI.fullmatch(urlsplit(self.path).path) is not None
        if urlsplit(self.path).path == "/ping":
            self._send(200, b"{}", {"Content-Type": "application/json"})
        else:
            self._reject(no_route(self.path))

    def do_POST(self):
        self.openai = _OPENAI.fullmatch(urlsplit(self.path).path) is not None
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._drain(length)
            self._reject(oversize(length))
            return
        body = self.rfile.read(length)
        try:
            if urlsplit(self.path).path.startswith("/local-admin/"):
                self._admin()
                return
            name, api = self._api()
            if name != self.server.endpoint_name:
                raise validation_error(f"Endpoint {echo(name)} of account local not found.")
            self._invoke(body, self.headers.get(SESSION_HEADER), api)
        except Rejected as rejected:
            self._reject(rejected)

    def _api(self) -> tuple[str, str]:
        """The endpoint's name and the API called: ``INVOKE``, ``STREAM`` or ``OPENAI``."""
        path = urlsplit(self.path).path
        if route := _ROUTE.fullmatch(path):
            return unquote(route[1]), route[2]
        if (route := _OPENAI.fullmatch(path)) and route[2] == OPENAI_ROUTE:
            return unquote(route[1]), OPENAI
        raise no_route(self.path)

    def _admin(self) -> None:
        """The local endpoint's own route (no SageMaker API has it): replace an instance. It
        answers when the fresh instance is READY; other requests are served meanwhile."""
        url = urlsplit(self.path)
        route = _ADMIN.fullmatch(url.path)
        if route is None or self.server.replace is None:
            raise no_route(self.path)
        if self.client_address[0] not in LOOPBACK:
            raise Rejected(403, "AccessDeniedException", "the admin route answers loopback only")
        kill = parse_qs(url.query).get("kill", ["0"])[-1] in ("1", "true")
        done = self.server.replace(unquote(route[1]), kill)
        self._send(200, json.dumps(done).encode(), {"Content-Type": "application/json"})

    def _drain(self, length: int) -> None:
        """Read and drop a refused body: a client still sending would see a reset instead of
        the answer."""
        while length > 0 and (chunk := self.rfile.read(min(length, 1 << 20))):
            length -= len(chunk)

    def _invoke(self, body: bytes, session_id: str | None, api: str) -> None:
        if session_id is None or session_id == NEW_SESSION:
            if api == STREAM and session_id == NEW_SESSION:
                raise validation_error(
                    "InvokeEndpointWithResponseStream cannot start a session: "
                    "open it with InvokeEndpoint and SessionId NEW_SESSION"
                )
            backend, reply = self._forward_to_any(body)
            try:
                self._answer(backend, reply, api, opening=session_id == NEW_SESSION)
            finally:
                self.server.router.placed(backend)  # bound by now, if it opened a session
            return
        _check_session_id(session_id)
        router = self.server.router
        backend = router.for_session(session_id)
        if backend is None:
            if (loss := router.lost(session_id)) is not None and _is_close(body):
                self._send(200, *closed_lost(session_id))
                router.unbind(session_id)
                return
            raise unknown_session(session_id, loss)
        try:
            reply = self._forward_to_session(backend, body)
        except BackendDown:
            router.mark_dead(backend)
            # again, now as a lost id: the close answered, the ask told how many went with it
            self._invoke(body, session_id, api)
            return
        self._answer(backend, reply, api, opening=False)

    def _answer(
        self, backend: Backend, reply: http.client.HTTPResponse, api: str, opening: bool
    ) -> None:
        with reply:
            if reply.status == WORKER_DIED_STATUS and backend.coming_back():
                raise front_error(interrupted_reply("TorchServe: worker died"))
            if api == OPENAI:
                self._pass(backend, reply, opening)
            elif reply.status != 200:
                raise model_error(reply.status, reply.read())
            elif api == STREAM:
                self._stream(backend, reply)
            else:
                self._relay(backend, reply, opening)

    def _forward_to_session(self, backend: Backend, body: bytes) -> http.client.HTTPResponse:
        """To the session's instance. One restarting with the persistent tier keeps its
        sessions: a call meanwhile is ``NOT_READY``, one it dropped ``TURN_INTERRUPTED``.
        Otherwise ``BackendDown``: its sessions are lost."""
        if not backend.serving():
            if backend.coming_back():
                raise front_error(not_ready_reply(f"instance {backend.name} is restarting"))
            raise BackendDown(f"instance {backend.name} is not serving")
        try:
            return self._forward(backend, body)
        except BackendDown as down:
            if backend.coming_back():
                raise front_error(interrupted_reply(str(down))) from None
            raise

    def _forward_to_any(self, body: bytes) -> tuple[Backend, http.client.HTTPResponse]:
        """Opens and stateless calls may go anywhere: try the live instances, least loaded
        first. The one that answers counts the call as in flight until ``placed``."""
        tried: set[str] = set()
        while (backend := self.server.router.place(frozenset(tried))) is not None:
            try:
                return backend, self._forward(backend, body)
            except BackendDown:
                self.server.router.placed(backend)
                if not backend.coming_back():  # else its sessions come back with its worker
                    self.server.router.mark_dead(backend)
                tried.add(backend.name)
        raise Rejected(503, "ServiceUnavailable", "no instance of the endpoint is answering")

    def _forward(self, backend: Backend, body: bytes) -> http.client.HTTPResponse:
        target = urlsplit(backend.url)
        conn = http.client.HTTPConnection(target.hostname, target.port, self.server.timeout_s)
        headers = {name: self.headers[name] for name in FORWARDED if name in self.headers}
        try:
            conn.request("POST", "/invocations", body=body, headers={**headers, **backend.auth()})
            return conn.getresponse()
        except (ConnectionError, http.client.HTTPException) as err:
            conn.close()
            raise BackendDown(str(err)) from err

    def _follow(self, backend: Backend, reply: http.client.HTTPResponse, opening: bool) -> dict:
        """Bind the id an open's reply announces to its instance, unbind a closed one; the
        session headers SageMaker passes back."""
        headers = {}
        announced = reply.getheader(NEW_SESSION_HEADER) or reply.getheader(SESSION_HEADER)
        if opening and announced:
            self.server.router.bind(announced_session(reply), backend)
            headers[NEW_SESSION_HEADER] = announced
        if closed := reply.getheader(CLOSED_SESSION_HEADER):
            self.server.router.unbind(closed.strip())
            headers[CLOSED_SESSION_HEADER] = closed
        return headers

    def _relay(self, backend: Backend, reply: http.client.HTTPResponse, opening: bool) -> None:
        headers = {
            "Content-Type": reply.getheader("Content-Type", "application/octet-stream"),
            INSTANCE_HEADER: backend.name,
            **self._follow(backend, reply, opening),
        }
        self._send(200, reply.read(), headers)

    def _stream(self, backend: Backend, reply: http.client.HTTPResponse) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.amazon.eventstream")
        self.send_header("X-Amzn-SageMaker-Content-Type", reply.getheader("Content-Type", ""))
        self.send_header(INSTANCE_HEADER, backend.name)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.end_headers()

        def parts(piece: bytes) -> list[bytes]:
            return [eventstream.payload_part(p) for p in _split(piece, self.server.part_bytes)]

        self._relay_stream(backend, reply, parts)

    def _pass(self, backend: Backend, reply: http.client.HTTPResponse, opening: bool) -> None:
        """The OpenAI path: the container's reply as it is, status and headers included."""
        if reply.status == 200:
            self._follow(backend, reply, opening)
        self.send_response_only(reply.status, reply.reason or None)
        for name, value in reply.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header(INSTANCE_HEADER, backend.name)
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        if not streamed(reply):
            data = reply.read()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._relay_stream(backend, reply)

    def _relay_stream(
        self, backend: Backend, reply: http.client.HTTPResponse, frame=unframed
    ) -> None:
        """Chunk by chunk as they come; a caller that hangs up gets its turn cancelled."""
        try:
            relay_stream(reply, self.wfile, f"instance {backend.name} broke the stream", frame)
        except CallerGone:
            target = urlsplit(backend.url)
            session_id = announced_session(reply) or self.headers.get(SESSION_HEADER)
            timeout_s = self.server.timeout_s
            cancel_turn(target.hostname, target.port, session_id, timeout_s, backend.auth())
            self.close_connection = True

    def _reject(self, rejected: Rejected) -> None:
        if self.openai:
            self._reject_openai(rejected)
            return
        body = {"message": rejected.message, **rejected.fields}
        headers = {"Content-Type": "application/json", "x-amzn-ErrorType": rejected.error_type}
        if "ErrorCode" in rejected.fields:
            headers[ERROR_CODE_HEADER] = rejected.fields["ErrorCode"]
        self._send(rejected.status, json.dumps(body).encode(), headers)

    def _reject_openai(self, rejected: Rejected) -> None:
        """In OpenAI's shape, with an invocation's status and code; the front's answer as is."""
        error = rejected.front
        if error is None:
            code = rejected.fields.get("ErrorCode", rejected.error_type)
            headers = {ERROR_CODE_HEADER: code} if "ErrorCode" in rejected.fields else {}
            payload = {"error": {"code": code, "message": rejected.message}}
            error = ErrorReply(rejected.status, payload, headers)
        error = openai_error(error)
        headers = {"Content-Type": "application/json", **error.headers}
        self._send(error.status, json.dumps(error.payload).encode(), headers)

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.end_headers()
        self.wfile.write(body)


def no_route(path: str) -> Rejected:
    return Rejected(404, "UnknownOperationException", f"no route {echo(path)}")


def _check_session_id(session_id: str) -> None:
    """SageMaker's own check of the id (botocore does not check the pattern or the length)."""
    if (why := session_ids.refusal(session_id, "SessionId")) is not None:
        raise validation_error(why, ErrorCode=INVALID_SESSION_ID)


def _is_close(body: bytes) -> bool:
    try:
        return json.loads(body).get("requestType") in CLOSES
    except (ValueError, AttributeError):
        return False


def _split(data: bytes, size: int) -> list[bytes]:
    if size <= 0:
        return [data]
    return [data[i : i + size] for i in range(0, len(data), size)]
