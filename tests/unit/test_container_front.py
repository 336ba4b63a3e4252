"""serving/front.py against a real upstream HTTP server on loopback: /ping follows readiness,
requests pass through unchanged, and a streamed reply leaves the front chunk by chunk.
(The front in front of a real TorchServe: tests/serving/test_container_entrypoint.py.)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from serving.front import Front
from serving.torchserve import free_ports
from tests import loopback

WAIT_S = 20


class Upstream(ThreadingHTTPServer):
    """Echoes a POST's path, headers and body; ``/stream`` sends two chunks and, between
    them, waits until the test has received the first one through the front; ``/json-chunked``
    sends a JSON body in chunks (as the async worker sends every 200); ``/endless`` streams
    lines until a ``CANCEL_TURN`` arrives (recorded in ``cancels``)."""

    daemon_threads = True

    def __init__(self):
        self.first_chunk_seen = threading.Event()
        self.cancels: list[str] = []
        self.cancelled = threading.Event()
        self.requests_seen = 0  # plain (echoed) requests
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)


class _UpstreamHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if body and json.loads(body).get("requestType") == "CANCEL_TURN":
            self.server.cancels.append(self.headers["X-Amzn-SageMaker-Session-Id"])
            self.server.cancelled.set()
        if self.path in ("/stream", "/json-chunked", "/endless"):
            self.send_response(200)
            kind = "application/json" if self.path == "/json-chunked" else "application/jsonlines"
            self.send_header("Content-Type", kind)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            getattr(self, "_" + self.path[1:].replace("-", "_"))()
            return
        self.server.requests_seen += 1
        echo = json.dumps(
            {"path": self.path, "body": body.decode(), "session": self.headers["X-Session"]}
        ).encode()
        self.send_response(418 if self.path == "/teapot" else 200)
        self.send_header("X-Reply-Header", "kept")
        self.send_header("Content-Length", str(len(echo)))
        self.end_headers()
        self.wfile.write(echo)

    def _stream(self) -> None:
        self._chunk(b"first\n")
        self.server.first_chunk_seen.wait(WAIT_S)
        self._chunk(b"second\n")
        self.wfile.write(b"0\r\n\r\n")

    def _json_chunked(self) -> None:
        self._chunk(b'{"answer": ')
        self._chunk(b'"whole"}')
        self.wfile.write(b"0\r\n\r\n")

    def _endless(self) -> None:
        """A token every 10 ms until the turn is cancelled (or WAIT_S passed)."""
        with contextlib.suppress(OSError):
            while not self.server.cancelled.wait(0.01):
                self._chunk(b'{"token": {"text": "x"}}\n')
            self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def upstream():
    with loopback.serving(Upstream()) as server:
        yield server


@pytest.fixture
def readiness():
    return {"ready": True}


@pytest.fixture
def front(upstream, readiness):
    front = Front(("127.0.0.1", 0), upstream.server_address, ready=lambda: readiness["ready"])
    with loopback.serving(front) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}"


def test_ping_follows_readiness(front, readiness):
    readiness["ready"] = False  # TorchServe starting
    assert requests.get(f"{front}/ping", timeout=WAIT_S).status_code == 503
    readiness["ready"] = True
    assert requests.get(f"{front}/ping", timeout=WAIT_S).status_code == 200
    readiness["ready"] = False  # a worker that died and is being restarted
    assert requests.get(f"{front}/ping", timeout=WAIT_S).json() == {"status": "NOT_READY"}


def test_requests_while_not_ready_get_a_json_503_and_never_reach_the_upstream(
    front, upstream, readiness
):
    """A request reaching a reloading async worker would crash-loop it (serving/supervisor.py)."""
    readiness["ready"] = False
    for body in (b"{}", b'{"requestType": "NEW_SESSION"}'):
        reply = requests.post(f"{front}/invocations", data=body, timeout=WAIT_S)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "NOT_READY"
    assert upstream.requests_seen == 0
    readiness["ready"] = True
    assert requests.post(f"{front}/invocations", data=b"{}", timeout=WAIT_S).status_code == 200
    assert upstream.requests_seen == 1


@pytest.mark.parametrize("path", ["/invocations", "/teapot"])
def test_requests_pass_through_unchanged(front, path):
    reply = requests.post(
        f"{front}{path}", data=b'{"q": 1}', headers={"X-Session": "abc"}, timeout=WAIT_S
    )
    assert reply.status_code == (418 if path == "/teapot" else 200)
    assert reply.headers["X-Reply-Header"] == "kept"
    assert reply.json() == {"path": path, "body": '{"q": 1}', "session": "abc"}


def test_chunked_request_body_is_forwarded_whole(front):
    reply = requests.post(
        f"{front}/invocations",
        data=iter([b'{"q": ', b"2}"]),  # a generator body goes out chunked
        headers={"X-Session": "c"},
        timeout=WAIT_S,
    )
    assert reply.json()["body"] == '{"q": 2}'


def test_streamed_reply_leaves_chunk_by_chunk(front, upstream):
    """The upstream holds its second chunk back until the first has come out of the front:
    a front that buffered the reply would never deliver the first, and this would time out."""
    with requests.post(f"{front}/stream", data=b"{}", stream=True, timeout=WAIT_S) as reply:
        assert reply.headers["Transfer-Encoding"] == "chunked"
        lines = reply.iter_lines()
        assert next(lines) == b"first"
        upstream.first_chunk_seen.set()
        assert next(lines) == b"second"


def test_upstream_down_is_a_json_503(readiness):
    (closed_port,) = free_ports(1)  # nothing listens there
    front = Front(("127.0.0.1", 0), ("127.0.0.1", closed_port), ready=lambda: True)
    with loopback.serving(front) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=WAIT_S)
        conn.request("POST", "/invocations", body=b"{}")
        reply = conn.getresponse()
        assert reply.status == 503
        assert json.loads(reply.read())["error"]["code"] == "NOT_READY"


def test_expect_continue_is_answered_by_the_front(front):
    """curl sends ``Expect: 100-continue`` with bodies over 1 MB; the front answers it itself."""
    body = b'{"b64": "%s"}' % (b"A" * 2_000_000)
    reply = requests.post(
        f"{front}/invocations",
        data=body,
        headers={"Expect": "100-continue", "X-Session": "e"},
        timeout=WAIT_S,
    )
    assert reply.status_code == 200 and len(reply.json()["body"]) == len(body)


def test_a_chunked_json_reply_leaves_whole_with_a_content_length(front):
    """SageMaker's InvokeEndpoint reads a body with a length; the worker now chunks every 200."""
    reply = requests.post(f"{front}/json-chunked", data=b"{}", timeout=WAIT_S)
    assert reply.json() == {"answer": "whole"}
    assert reply.headers["Content-Length"] == str(len(reply.content))
    assert "Transfer-Encoding" not in reply.headers


def test_a_client_hanging_up_mid_stream_cancels_its_sessions_turn(front, upstream):
    host, port = front.removeprefix("http://").split(":")
    body = b'{"requestType": "SESSION", "inputs": "Hi", "stream": true}'
    client = socket.create_connection((host, int(port)), timeout=WAIT_S)
    client.sendall(
        b"POST /endless HTTP/1.1\r\nHost: front\r\nContent-Length: %d\r\n"
        b"X-Amzn-SageMaker-Session-Id: session-1\r\n\r\n%s" % (len(body), body)
    )
    assert b"200" in client.recv(1024)  # the stream has started
    client.close()
    assert upstream.cancelled.wait(WAIT_S), "no CANCEL_TURN reached the upstream"
    assert upstream.cancels == ["session-1"]


def test_a_refusal_of_the_standard_library_repeats_a_bounded_piece_of_its_input(front):
    """An unknown 10,000-character method is answered 501 without being echoed whole."""
    host, port = front.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(b"X" * 10_000 + b" /invocations HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 501") and b"X" * 200 not in reply and len(reply) < 2000
