"""serving/front.py against a real upstream HTTP server on loopback: /ping follows readiness,
requests pass through unchanged with TorchServe's key, a streamed reply leaves the front chunk by
chunk, and what is not ``GET /ping`` or ``POST /invocations``, too large, too slow or one
connection too many is refused by the front itself. (The front in front of a real TorchServe:
tests/serving/test_container_entrypoint.py.)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from serving import front as front_module
from serving.front import MAX_BODY_BYTES, Front
from serving.torchserve import free_ports
from tests import loopback

WAIT_S = 20
KEY = {"Authorization": "Bearer torchserve-key"}  # what the front's upstream_auth gives


class Upstream(ThreadingHTTPServer):
    """Echoes a POST's path, body and two headers, unless its ``X-Play`` header says otherwise:
    ``teapot`` echoes with a 418; ``stream`` sends two chunks and, between them, waits until the
    test has received the first one through the front; ``json-chunked`` sends a JSON body in
    chunks (as the async worker sends every 200); ``endless`` streams lines until a
    ``CANCEL_TURN`` arrives (recorded in ``cancels``, with the key it came with)."""

    daemon_threads = True

    def __init__(self):
        self.first_chunk_seen = threading.Event()
        self.cancels: list[tuple[str, str]] = []
        self.cancelled = threading.Event()
        self.requests_seen = 0  # plain (echoed) requests
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)


class _UpstreamHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if body and json.loads(body).get("requestType") == "CANCEL_TURN":
            session = self.headers["X-Amzn-SageMaker-Session-Id"]
            self.server.cancels.append((session, self.headers["Authorization"]))
            self.server.cancelled.set()
        play = self.headers.get("X-Play", "echo")
        if play in ("stream", "json-chunked", "endless"):
            self.send_response(200)
            kind = "application/json" if play == "json-chunked" else "application/jsonlines"
            self.send_header("Content-Type", kind)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            getattr(self, "_" + play.replace("-", "_"))()
            return
        self.server.requests_seen += 1
        echo = json.dumps(
            {
                "path": self.path,
                "body": body.decode(),
                "session": self.headers["X-Session"],
                "authorization": self.headers.get_all("Authorization"),
            }
        ).encode()
        self.send_response(418 if play == "teapot" else 200)
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


def plays(name: str) -> dict[str, str]:
    return {"X-Play": name}


@pytest.fixture
def readiness():
    return {"ready": True}


@pytest.fixture
def front(upstream, readiness):
    front = Front(
        ("127.0.0.1", 0),
        upstream.server_address,
        ready=lambda: readiness["ready"],
        upstream_auth=lambda: KEY,
    )
    with loopback.serving(front) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}"


def address(front: str) -> tuple[str, int]:
    host, port = front.removeprefix("http://").split(":")
    return host, int(port)


def raw_exchange(front: str, request: bytes) -> bytes:
    """``request`` as sent, and everything the front answers until it closes the connection."""
    with socket.create_connection(address(front), timeout=WAIT_S) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def error_of(raw: bytes) -> tuple[int, dict]:
    """A raw reply's status and JSON body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


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


@pytest.mark.parametrize("play", ["echo", "teapot"])
def test_requests_pass_through_unchanged_but_for_torchserves_key(front, play):
    """The caller's own Authorization never reaches TorchServe; the front's key replaces it."""
    headers = {"X-Session": "abc", "Authorization": "Bearer caller", **plays(play)}
    reply = requests.post(f"{front}/invocations", data=b'{"q": 1}', headers=headers, timeout=5)
    assert reply.status_code == (418 if play == "teapot" else 200)
    assert reply.headers["X-Reply-Header"] == "kept"
    assert reply.json() == {
        "path": "/invocations",
        "body": '{"q": 1}',
        "session": "abc",
        "authorization": [KEY["Authorization"]],
    }


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/predictions/llava", 404),  # TorchServe's own inference routes
        ("GET", "/models", 404),
        ("POST", "/workflows?url=http://127.0.0.1:9/x.war", 404),
        ("POST", "/invocations/../models", 404),
        ("GET", "/invocations", 405),
        ("PUT", "/invocations", 405),
        ("DELETE", "/invocations", 405),
        ("PATCH", "/invocations", 405),
        ("OPTIONS", "/invocations", 405),
        ("POST", "/ping", 405),
        ("DELETE", "/ping", 405),
    ],
)
def test_only_ping_and_invocations_are_served_the_rest_never_forwarded(
    front, upstream, method, path, status
):
    body = b'{"requestType": "NEW_SESSION"}'
    reply = raw_exchange(
        front,
        b"%s %s HTTP/1.1\r\nHost: front\r\nContent-Length: %d\r\n\r\n%s"
        % (method.encode(), path.encode(), len(body), body),
    )
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}[status]
    assert error_of(reply)[0] == status and error_of(reply)[1]["error"]["code"] == code
    if status == 405:
        allowed = "GET, HEAD" if path == "/ping" else "POST"
        assert f"\r\nAllow: {allowed}\r\n".encode() in reply
    assert upstream.requests_seen == 0


def test_head_ping_has_no_body(front):
    conn = http.client.HTTPConnection(*address(front), timeout=WAIT_S)
    conn.request("HEAD", "/ping")
    reply = conn.getresponse()
    assert reply.status == 200 and reply.read() == b""
    conn.request("GET", "/ping")  # the same connection: nothing of a HEAD's body is left on it
    assert json.loads(conn.getresponse().read()) == {"status": "READY"}


def test_a_body_of_the_cap_passes(front):
    body = b'{"b64": "%s"}' % (b"A" * (MAX_BODY_BYTES - 11))
    assert len(body) == MAX_BODY_BYTES
    reply = requests.post(f"{front}/invocations", data=body, timeout=WAIT_S)
    assert reply.status_code == 200 and len(reply.json()["body"]) == MAX_BODY_BYTES


@pytest.mark.parametrize("expect", [b"", b"Expect: 100-continue\r\n"], ids=["plain", "expect"])
def test_a_declared_length_over_the_cap_is_a_413_before_any_body(front, upstream, expect):
    """The body is never sent: the front answers the head alone (with no 100 Continue)."""
    reply = raw_exchange(
        front,
        b"POST /invocations HTTP/1.1\r\nHost: front\r\nContent-Length: %d\r\n%s\r\n"
        % (MAX_BODY_BYTES + 1, expect),
    )
    assert reply.startswith(b"HTTP/1.1 413")
    assert error_of(reply)[1]["error"]["code"] == "REQUEST_TOO_LARGE"
    assert upstream.requests_seen == 0


def test_a_chunked_body_is_refused_once_its_count_passes_the_cap(front, upstream):
    """Seven chunks of 1 MiB: the front reads six (the cap), refuses at the seventh's size."""
    mib = 1024 * 1024
    chunk = b"%x\r\n%s\r\n" % (mib, b"A" * mib)
    reply = raw_exchange(
        front,
        b"POST /invocations HTTP/1.1\r\nHost: front\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunk * 7
        + b"0\r\n\r\n",
    )
    status, error = error_of(reply)
    assert (status, error["error"]["code"]) == (413, "REQUEST_TOO_LARGE")
    assert "6,291,456-byte cap" in error["error"]["message"]
    assert upstream.requests_seen == 0


def test_a_client_that_stops_sending_is_disconnected(front, upstream, monkeypatch):
    monkeypatch.setattr(front_module._FrontHandler, "timeout", 0.5)
    with socket.create_connection(address(front), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: front\r\nContent-Length: 10\r\n\r\n{")
        began = time.monotonic()
        assert sock.recv(65536) == b""  # closed, with no reply: the body never came
        assert time.monotonic() - began < WAIT_S / 2
    assert upstream.requests_seen == 0


def test_connections_past_the_bound_wait_then_get_a_503(upstream, monkeypatch):
    """Two slots, both held by idle connections: a third waits CONNECTION_WAIT_S and gets
    503 OVERLOADED; once one of the two hangs up, a new one is served."""
    monkeypatch.setattr(front_module, "CONNECTION_WAIT_S", 0.2)
    front = Front(("127.0.0.1", 0), upstream.server_address, lambda: True, max_connections=2)
    with loopback.serving(front) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        held = [socket.create_connection(address(url), timeout=WAIT_S) for _ in range(2)]
        ping = b"GET /ping HTTP/1.1\r\nHost: front\r\nConnection: close\r\n\r\n"
        reply = raw_exchange(url, ping)
        assert error_of(reply)[1]["error"]["code"] == "OVERLOADED"
        assert reply.startswith(b"HTTP/1.1 503") and b"\r\nRetry-After: 1\r\n" in reply
        held.pop().close()
        deadline = time.monotonic() + WAIT_S
        while not (reply := raw_exchange(url, ping)).startswith(b"HTTP/1.1 200"):
            assert time.monotonic() < deadline, reply
        held.pop().close()


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
    with requests.post(
        f"{front}/invocations", data=b"{}", headers=plays("stream"), stream=True, timeout=WAIT_S
    ) as reply:
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
    reply = requests.post(
        f"{front}/invocations", data=b"{}", headers=plays("json-chunked"), timeout=WAIT_S
    )
    assert reply.json() == {"answer": "whole"}
    assert reply.headers["Content-Length"] == str(len(reply.content))
    assert "Transfer-Encoding" not in reply.headers


def test_a_client_hanging_up_mid_stream_cancels_its_sessions_turn(front, upstream):
    body = b'{"requestType": "SESSION", "inputs": "Hi", "stream": true}'
    client = socket.create_connection(address(front), timeout=WAIT_S)
    client.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: front\r\nContent-Length: %d\r\nX-Play: endless\r\n"
        b"X-Amzn-SageMaker-Session-Id: session-1\r\n\r\n%s" % (len(body), body)
    )
    assert b"200" in client.recv(1024)  # the stream has started
    client.close()
    assert upstream.cancelled.wait(WAIT_S), "no CANCEL_TURN reached the upstream"
    assert upstream.cancels == [("session-1", KEY["Authorization"])]


def test_a_refusal_of_the_standard_library_repeats_a_bounded_piece_of_its_input(front):
    """An unknown 10,000-character method is answered 501 without being echoed whole."""
    reply = raw_exchange(front, b"X" * 10_000 + b" /invocations HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 501") and b"X" * 200 not in reply and len(reply) < 2000
