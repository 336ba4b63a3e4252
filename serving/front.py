"""The container's front door on port 8080: a ``/ping`` that tells the truth, and a proxy.

TorchServe 0.12's own ``/ping`` answers Healthy before the model is loaded and while its
worker crash-loops (docs/serving.md §TorchServe 0.12 facts), and SageMaker sends traffic on
the first 200. So TorchServe listens on internal loopback ports and this server owns the
public port:

- ``GET /ping``: 200 only while ``ready()`` says a worker is READY, else 503.
- ``POST /invocations`` is forwarded to TorchServe's inference API with TorchServe's key
  (``upstream_auth``), but only while ``ready()``: otherwise a 503 ``NOT_READY`` JSON error at
  once (a request reaching a reloading async worker would crash-loop it: serving/supervisor.py).
  A streamed reply (JSON lines, or server-sent events) is relayed chunk by chunk as it arrives,
  so ``"stream": true`` still streams through the front; any other reply is read whole and sent
  with a ``Content-Length`` (the async worker sends every 200 as a chunked body:
  handlers/service.py, ``_Reply.finish``).
- ``POST /v1/chat/completions`` (OpenAI's chat completions) is forwarded exactly so, to the same
  ``/invocations``: the worker tells a chat body by its ``messages``. The front's own errors on
  it are in OpenAI's shape (``openai_error``).
- nothing else is forwarded (``ROUTES``): another path is a 404, another method a 405.
- a body over SageMaker's 6 MB cap is a 413 before the rest is read; a client that leaves a
  read waiting ``CLIENT_TIMEOUT_S`` is disconnected; at most ``max_connections`` are served at
  once (one more waits ``CONNECTION_WAIT_S``, then gets a 503 ``OVERLOADED``).
- a client that hangs up mid-stream: TorchServe would never tell the worker, so the front sends
  ``{"requestType": "CANCEL_TURN"}`` for the session and its turn stops at the next step.
- the worker dying under a request (TorchServe's 507, a dropped connection, a stream cut
  short): a 503 ``TURN_INTERRUPTED`` with ``Retry-After``, or a last ``{"error": ...}`` line
  in the stream (serving/interrupted.py; in a chat stream, that event and ``data: [DONE]``);
  the session continues after the restart.

Threads, not asyncio: a thread per connection, bounded, is plenty for one worker's requests,
and the stdlib keeps the container free of another web framework.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO
from urllib.parse import urlsplit

from handlers.errors import ErrorReply, openai_error, retry_reply
from llava.errors import clip
from llava_wire import (
    INVALID_REQUEST,
    MAX_REQUEST_BYTES,
    METHOD_NOT_ALLOWED,
    NEW_SESSION_HEADER,
    NOT_FOUND,
    NOT_READY,
    OVERLOADED,
    REQUEST_TOO_LARGE,
    SESSION_HEADER,
)
from serving.interrupted import (
    WORKER_DIED_STATUS,
    StreamEnd,
    interrupted_line,
    interrupted_reply,
    not_ready_reply,
)
from serving.relay import CallerGone, cancel_turn, pieces, write_chunk

# Per-connection headers (RFC 9110 §7.6.1): they describe one hop, so they are not forwarded.
# Content-Length is set again for the body actually sent; Expect: 100-continue was answered here.
HOP_BY_HOP = frozenset(
    {
        "expect",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
CANCEL_TIMEOUT_S = 10.0
CHAT_ROUTE = "/v1/chat/completions"  # OpenAI's; errors on it in OpenAI's shape
# What the public port answers; anything else is refused here and never reaches TorchServe.
ROUTES = {
    "/ping": frozenset({"GET", "HEAD"}),
    "/invocations": frozenset({"POST"}),
    CHAT_ROUTE: frozenset({"POST"}),
}
# TorchServe has no chat route: a chat body goes to /invocations, the worker reads its messages.
UPSTREAM_PATHS = {CHAT_ROUTE: "/invocations"}
DONE_EVENT = b"data: [DONE]"  # the last event of every chat stream, an error's too
# SageMaker's cap on an InvokeEndpoint body (docs/deploy.md §SageMaker's request cap (6 MB)).
MAX_BODY_BYTES = MAX_REQUEST_BYTES
CLIENT_TIMEOUT_S = 60.0  # the longest a client may leave a read (a request, its body) waiting
# Connections served at once (a thread each), and how long one more waits for a free slot
# before it gets a 503 OVERLOADED: far above what SageMaker sends one instance's single worker.
MAX_CONNECTIONS = 128
CONNECTION_WAIT_S = 1.0
MAX_CHUNK_LINE = 1024  # a chunk's size line, extensions included
LINGER_S = 2.0  # how long what a refused client still sends is read and dropped before closing


class Refused(Exception):
    """A request the front answers itself, never forwarded."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        payload = {"error": {"code": code, "message": message}}
        self.reply = ErrorReply(status, payload, headers or {})


class Front(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64  # the kernel's backlog while every slot is taken

    def __init__(
        self,
        address: tuple[str, int],
        upstream: tuple[str, int],
        ready: Callable[[], bool],
        upstream_auth: Callable[[], dict[str, str]] = dict,
        upstream_timeout_s: float = 600.0,
        max_connections: int = MAX_CONNECTIONS,
    ):
        super().__init__(address, _FrontHandler)
        self.upstream = upstream
        self.ready = ready
        self.upstream_auth = upstream_auth  # TorchServe's Authorization header
        self.upstream_timeout_s = upstream_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        """A thread for the connection once a slot is free; after ``CONNECTION_WAIT_S``
        without one, a 503 ``OVERLOADED`` from the accepting thread, and the connection closed."""
        if self._slots.acquire(timeout=CONNECTION_WAIT_S):
            super().process_request(request, client_address)
        else:
            _refuse_connection(request)
            self.shutdown_request(request)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _refuse_connection(sock: socket.socket) -> None:
    """Answer an over-the-bound connection without a thread. What of its request has arrived
    is read first: closing on unread bytes would reset the connection before the reply."""
    error = retry_reply(503, OVERLOADED, "too many connections", 1.0)
    body = json.dumps(error.payload).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in error.headers.items())
    try:
        sock.settimeout(0.1)
        sock.recv(65536)
        sock.sendall(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n%s\r\n%s"
            % (len(body), head.encode(), body)
        )
    except OSError:
        pass


class _FrontHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT_S  # the socket's: a read that waits longer closes the connection
    server: Front

    def send_error(self, code, message=None, explain=None) -> None:
        """The standard library's refusals (a bad request line, an unknown method) quote the
        input: bounded as every other message (llava.errors.clip)."""
        super().send_error(code, message and clip(message), explain)

    def _route(self) -> None:
        """Every method comes here (see below the class): a route of ``ROUTES``, or a refusal."""
        try:
            if self._admit() == "/ping":
                self._ping()
            else:
                self._forward(self._read_body())
        except Refused as refused:
            self._refuse(refused)

    def handle_expect_100(self) -> bool:
        """A request to refuse is refused before its client sends the body (curl waits for
        the 100 with bodies over 1 MB)."""
        try:
            self._admit()
        except Refused as refused:
            self._refuse(refused)
            return False
        return super().handle_expect_100()

    def _admit(self) -> str:
        """The path, if the front serves this method there and the declared body fits."""
        path = urlsplit(self.path).path
        if path not in ROUTES:
            raise Refused(
                404, NOT_FOUND, f"no route {clip(path)!r}: POST /invocations or {CHAT_ROUTE}"
            )
        if self.command not in ROUTES[path]:
            allowed = ", ".join(sorted(ROUTES[path]))
            raise Refused(405, METHOD_NOT_ALLOWED, f"{path} takes {allowed}", {"Allow": allowed})
        self._content_length()
        return path

    def _refuse(self, refused: Refused) -> None:
        """Reply, then read and drop what the client still sends, for a moment, before the
        connection closes: closing on unread bytes resets it, and the client may lose the reply."""
        reply = refused.reply
        self._reply_error(
            ErrorReply(reply.status, reply.payload, {**reply.headers, "Connection": "close"})
        )
        try:
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_S
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(65536):
                    break
        except OSError:
            pass

    def _ping(self) -> None:
        ready = self.server.ready()
        self._reply_json(200 if ready else 503, {"status": "READY" if ready else NOT_READY})

    def _forward(self, body: bytes | None) -> None:
        if not self.server.ready():
            self._reply_error(not_ready_reply("the model server is starting or restarting"))
            return
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() != "authorization"  # ours replaces it
        }
        headers.update(self.server.upstream_auth())
        url = urlsplit(self.path)
        target = url._replace(path=UPSTREAM_PATHS.get(url.path, url.path)).geturl()
        upstream = http.client.HTTPConnection(
            *self.server.upstream, timeout=self.server.upstream_timeout_s
        )
        try:
            try:
                upstream.request(self.command, target, body=body, headers=headers)
            except OSError as e:  # TorchServe not (yet, or no longer) listening
                self._reply_error(not_ready_reply(f"model server unavailable: {e}"))
                return
            try:
                reply = upstream.getresponse()
            except (OSError, http.client.HTTPException) as e:  # it took the request and died
                self._reply_error(interrupted_reply(f"connection dropped: {e}"))
                return
            if reply.status == WORKER_DIED_STATUS:
                self._reply_error(interrupted_reply("TorchServe: worker died"))
                return
            self._relay(reply)
        finally:
            upstream.close()

    def _relay(self, reply: http.client.HTTPResponse) -> None:
        self.send_response_only(reply.status, reply.reason or None)  # TorchServe sends none
        for name, value in reply.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        if streamed(reply):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                relay_stream(reply, self.wfile, "the stream was cut short")
            except CallerGone:
                # an open's turn is cancelled under the id its reply announced
                session_id = announced_session(reply) or self.headers.get(SESSION_HEADER)
                auth = self.server.upstream_auth()
                cancel_turn(*self.server.upstream, session_id, CANCEL_TIMEOUT_S, auth)
                self.close_connection = True
        else:
            payload = reply.read()
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    def _read_body(self) -> bytes | None:
        """The request's body, at most ``MAX_BODY_BYTES``: a declared length over it is
        refused unread, a chunked body as soon as its count passes it."""
        if self._chunked():
            return self._read_chunked()
        length = self._content_length()
        return self.rfile.read(length) if length else None

    def _content_length(self) -> int:
        """The declared body length, refused over the cap (0 for a chunked body)."""
        if self._chunked():
            return 0
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise Refused(400, INVALID_REQUEST, "Content-Length is not a number") from None
        if length < 0:
            raise Refused(400, INVALID_REQUEST, "Content-Length is negative")
        if length > MAX_BODY_BYTES:
            raise _too_large(f"a body of {length:,} bytes")
        return length

    def _chunked(self) -> bool:
        return "chunked" in self.headers.get("Transfer-Encoding", "").lower()

    def _read_chunked(self) -> bytes:
        parts, count = [], 0
        while size := self._chunk_size():
            count += size
            if count > MAX_BODY_BYTES:
                raise _too_large("a chunked body")
            parts.append(self.rfile.read(size))
            self.rfile.readline(MAX_CHUNK_LINE)  # the CRLF after each chunk
        while self.rfile.readline(MAX_CHUNK_LINE) not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(parts)

    def _chunk_size(self) -> int:
        line = self.rfile.readline(MAX_CHUNK_LINE)
        try:
            size = int(line.split(b";")[0], 16)
        except ValueError:
            size = -1
        if size < 0:
            raise Refused(400, INVALID_REQUEST, "a chunk's size is not a hex number")
        return size

    def _reply_error(self, error: ErrorReply) -> None:
        if urlsplit(self.path).path == CHAT_ROUTE:
            error = openai_error(error)
        self._reply_json(error.status, error.payload, error.headers)

    def _reply_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass  # TorchServe's access log already records every forwarded request


# Every method the standard library would otherwise answer 501 is routed (a 405 unless ROUTES
# names it); one it has no name for still gets its 501.
for _method in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"):
    setattr(_FrontHandler, f"do_{_method}", _FrontHandler._route)


class EventStreamEnd:
    """Follows a server-sent-events reply as it is relayed, keeping only its tail, to tell a
    chat stream that ended (``data: [DONE]``) from one cut short."""

    def __init__(self):
        self._tail = b""

    def feed(self, piece: bytes) -> None:
        self._tail = (self._tail + piece)[-2 * len(DONE_EVENT) :]

    @property
    def finished(self) -> bool:
        return self._tail.rstrip().endswith(DONE_EVENT)


def interrupted_event(what: str) -> bytes:
    """The last events of a chat stream its worker broke: the error, then ``[DONE]``."""
    error = openai_error(interrupted_reply(what)).payload
    return b"data: %s\n\n%s\n\n" % (json.dumps(error).encode(), DONE_EVENT)


# The replies relayed chunk by chunk as they arrive, by content type: what follows a stream to
# tell a finished one from one cut short, and the last words a cut one gets.
STREAMED = {
    "application/jsonlines": (StreamEnd, interrupted_line),
    "text/event-stream": (EventStreamEnd, interrupted_event),
}


def streamed(reply: http.client.HTTPResponse) -> tuple | None:
    """``STREAMED``'s entry for the reply's content type; None: a reply to send whole."""
    kind = (reply.getheader("Content-Type") or "").split(";")[0].strip().lower()
    return STREAMED.get(kind)


def unframed(piece: bytes) -> list[bytes]:
    return [piece]


def relay_stream(
    reply: http.client.HTTPResponse,
    wfile: BinaryIO,
    cut_short: str,
    frame: Callable[[bytes], list[bytes]] = unframed,
) -> None:
    """A streamed reply passed on as it arrives, each piece as the chunks ``frame`` makes of it
    (the local endpoint's event-stream parts); one cut short ends with its last words (a
    JSON-lines reply's if its type is none of ``STREAMED``'s). Raises ``CallerGone``."""
    end_type, last_words = streamed(reply) or STREAMED["application/jsonlines"]
    end = end_type()
    for piece in pieces(reply):
        end.feed(piece)
        for chunk in frame(piece):
            write_chunk(wfile, chunk)
    if not end.finished:  # the worker died mid-stream: say so in the stream
        for chunk in frame(last_words(cut_short)):
            write_chunk(wfile, chunk)
    write_chunk(wfile, b"")


def announced_session(reply: http.client.HTTPResponse) -> str | None:
    """The id a reply names in its session headers (an open's ``<id>; Expires=...``), if any;
    reference containers announce a new one in the session header, some in the new one."""
    value = reply.getheader(NEW_SESSION_HEADER) or reply.getheader(SESSION_HEADER)
    return value.split(";", 1)[0].strip() if value else None


def _too_large(what: str) -> Refused:
    return Refused(
        413,
        REQUEST_TOO_LARGE,
        f"{what} is over the {MAX_BODY_BYTES:,}-byte cap on a request (SageMaker's): "
        "pass the image by URL (https://...) or s3:// instead of inline",
    )
