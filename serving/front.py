"""The container's front door on port 8080: a ``/ping`` that tells the truth, and a proxy.

TorchServe 0.12's own ``/ping`` answers Healthy before the model is loaded and while its
worker crash-loops (docs/serving.md §TorchServe 0.12 facts), and SageMaker sends traffic on
the first 200. So TorchServe listens on internal loopback ports and this server owns the
public port:

- ``GET /ping``: 200 only while ``ready()`` says a worker is READY, else 503.
- anything else (``POST /invocations`` above all) is forwarded to TorchServe's inference API
  unchanged, but only while ``ready()``: otherwise a 503 ``NOT_READY`` JSON error at once (a
  request reaching a reloading async worker would crash-loop it: serving/supervisor.py).
  A streamed reply (JSON lines) is relayed chunk by chunk as it arrives, so ``"stream": true``
  still streams through the front; any other reply is read whole and sent with a
  ``Content-Length`` (the async worker sends every 200 as a chunked body: handlers/service.py,
  ``_Reply.finish``).
- a client that hangs up mid-stream: TorchServe would never tell the worker, so the front sends
  ``{"requestType": "CANCEL_TURN"}`` for the session and its turn stops at the next step.
- the worker dying under a request (TorchServe's 507, a dropped connection, a stream cut
  short): a 503 ``TURN_INTERRUPTED`` with ``Retry-After``, or a last ``{"error": ...}`` line
  in the stream (serving/interrupted.py); the session continues after the restart.

Threads, not asyncio: a thread per connection is plenty for one worker's requests, and the
stdlib keeps the container free of another web framework.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from handlers.errors import ErrorReply
from llava.errors import clip
from llava_wire import NOT_READY, SESSION_HEADER
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
STREAM_TYPE = "application/jsonlines"
CANCEL_TIMEOUT_S = 10.0


class Front(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        upstream: tuple[str, int],
        ready: Callable[[], bool],
        upstream_timeout_s: float = 600.0,
    ):
        super().__init__(address, _FrontHandler)
        self.upstream = upstream
        self.ready = ready
        self.upstream_timeout_s = upstream_timeout_s


class _FrontHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Front

    def send_error(self, code, message=None, explain=None) -> None:
        """The standard library's refusals (a bad request line, an unknown method) quote the
        input: bounded as every other message (llava.errors.clip)."""
        super().send_error(code, message and clip(message), explain)

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/ping":
            self._ping()
        else:
            self._forward()

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        self._forward()

    def do_PUT(self) -> None:
        self._forward()

    def do_DELETE(self) -> None:
        self._forward()

    def _ping(self) -> None:
        ready = self.server.ready()
        self._reply_json(200 if ready else 503, {"status": "READY" if ready else NOT_READY})

    def _forward(self) -> None:
        body = self._read_body()
        if not self.server.ready():
            self._reply_error(not_ready_reply("the model server is starting or restarting"))
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = http.client.HTTPConnection(
            *self.server.upstream, timeout=self.server.upstream_timeout_s
        )
        try:
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
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
        if reply.getheader("Content-Type", "").startswith(STREAM_TYPE):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            end = StreamEnd()
            try:
                for piece in pieces(reply):
                    end.feed(piece)
                    write_chunk(self.wfile, piece)
                if not end.finished:  # the worker died mid-stream: say so in the stream
                    write_chunk(self.wfile, interrupted_line("the stream was cut short"))
                write_chunk(self.wfile, b"")
            except CallerGone:
                session_id = self.headers.get(SESSION_HEADER)
                cancel_turn(*self.server.upstream, session_id, CANCEL_TIMEOUT_S)
                self.close_connection = True
        else:
            payload = reply.read()
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    def _read_chunked(self) -> bytes:
        parts = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            parts.append(self.rfile.read(size))
            self.rfile.readline()  # the CRLF after each chunk
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(parts)

    def _reply_error(self, error: ErrorReply) -> None:
        self._reply_json(error.status, error.payload, error.headers)

    def _reply_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass  # TorchServe's access log already records every forwarded request
