"""The OpenAI chat-completions routes in front of stand-in containers on loopback: the
container's ``POST /v1/chat/completions`` (serving/front.py) and the local endpoint's
``/endpoints/{name}/openai/v1/chat/completions`` (local_endpoint/server.py) forward a chat body
to ``/invocations`` as an invocation goes, and pass the reply on as it is: status, headers,
body, server-sent events as they come. (Through real TorchServe instances:
tests/serving/test_openai_routes.py.)
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer
from serving.front import Front
from tests import loopback
from tests.endpoint_helpers import ENDPOINT

WAIT_S = 20
HOLD_S = 5  # how long a held stream waits for the test to read its first event
KEY = {"Authorization": "Bearer torchserve-key"}
SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION = "X-Amzn-SageMaker-New-Session-Id"
INSTANCE = "X-Local-Endpoint-Instance"
OPENAI_PATH = f"/endpoints/{ENDPOINT}/openai/v1/chat/completions"
CHAT = {"model": "llava", "messages": [{"role": "user", "content": "What shape is it?"}]}
OPENED = {
    SESSION: "s-1; Expires=2030-01-01T00:00:00Z",
    NEW_SESSION: "s-1; Expires=2030-01-01T00:00:00Z",
}
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "llava",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "a circle"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def chunk_event(delta: dict, finish_reason: str | None = None) -> bytes:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "llava",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return b"data: %s\n\n" % json.dumps(chunk).encode()


FIRST = chunk_event({"role": "assistant", "content": ""})
REST = [chunk_event({"content": "a circle"}), chunk_event({}, "stop"), b"data: [DONE]\n\n"]

Play = Callable[[BaseHTTPRequestHandler], None]


class Container(ThreadingHTTPServer):
    """A container stand-in: records every POST (path, headers, body) and answers it with the
    next play of ``plays``; a ``CANCEL_TURN`` is recorded in ``cancels`` and answered at once."""

    daemon_threads = True

    def __init__(self):
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        self.plays: list[Play] = []
        self.cancels: list[str] = []
        self.cancelled = threading.Event()
        self.first_event_seen = threading.Event()  # set by a test once it read the first event
        super().__init__(("127.0.0.1", 0), _ContainerHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _ContainerHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Container

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if json.loads(body).get("requestType") == "CANCEL_TURN":
            self.server.cancels.append(self.headers[SESSION])
            self.server.cancelled.set()
            loopback.send(self, 200, {"Content-Type": "application/json"}, b"{}")
            return
        self.server.seen.append((self.path, dict(self.headers.items()), body))
        self.server.plays.pop(0)(self)

    def log_message(self, *args):
        pass


def answer(status: int, payload: dict, headers: dict[str, str] | None = None) -> Play:
    def play(handler):
        data = json.dumps(payload).encode()
        loopback.send(
            handler, status, {"Content-Type": "application/json", **(headers or {})}, data
        )

    return play


def events(*, held: bool = False, cut: bool = False, endless: bool = False, headers=None) -> Play:
    """A chat stream, chunked as the async worker sends it: ``held``, the rest only once the
    test has read the first event; ``cut``, the connection dropped after the first (the worker
    died); ``endless``, content events until a ``CANCEL_TURN`` arrives."""

    def play(handler):
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        send(handler, FIRST)
        # a route that kept the first event back never lets the test read it: cut, to fail it
        if cut or (held and not handler.server.first_event_seen.wait(HOLD_S)):
            handler.connection.shutdown(socket.SHUT_RDWR)
            handler.close_connection = True
            return
        if endless:
            with contextlib.suppress(OSError):
                while not handler.server.cancelled.wait(0.01):
                    send(handler, chunk_event({"content": "x"}))
            return
        for event in REST:
            send(handler, event)
        handler.wfile.write(b"0\r\n\r\n")

    return play


def send(handler, data: bytes) -> None:
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
    handler.wfile.flush()


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    with loopback.serving(Container()) as zero, loopback.serving(Container()) as one:
        yield [zero, one]


@pytest.fixture
def endpoint(containers) -> Iterator[str]:
    """The local endpoint over both containers, as ``make endpoint`` routes: its base URL."""
    backends = [
        Backend(f"instance-{i}", c.url, ready=lambda: True, auth=lambda: KEY)
        for i, c in enumerate(containers)
    ]
    with loopback.serving(EndpointServer(("127.0.0.1", 0), ENDPOINT, Router(backends))) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def readiness():
    return {"ready": True}


@pytest.fixture
def front(containers, readiness) -> Iterator[str]:
    """The container's front over the first container: its base URL."""
    front = Front(
        ("127.0.0.1", 0),
        containers[0].server_address,
        ready=lambda: readiness["ready"],
        upstream_auth=lambda: KEY,
    )
    with loopback.serving(front) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(params=["front", "endpoint"])
def chat_url(request, containers) -> str:
    """The chat route of the front, or of the local endpoint (whose first open goes to the
    first container, as the front's only one)."""
    if request.param == "front":
        return request.getfixturevalue("front") + "/v1/chat/completions"
    return request.getfixturevalue("endpoint") + OPENAI_PATH


def post(url: str, session: str | None = None, **options) -> requests.Response:
    headers = {"Authorization": "Bearer caller", **({SESSION: session} if session else {})}
    return requests.post(url, data=json.dumps(CHAT), headers=headers, timeout=WAIT_S, **options)


@pytest.mark.parametrize("status", [200, 400])
def test_a_chat_body_goes_to_invocations_and_its_reply_comes_back_as_it_is(
    chat_url, containers, status
):
    """Body and session header unchanged, TorchServe's key for the caller's; status, session
    headers and body back as the container sent them (an error too: no SageMaker wrapping)."""
    payload = COMPLETION if status == 200 else {"error": {"code": "UNSUPPORTED_FIELD"}}
    containers[0].plays.append(answer(status, payload, OPENED))
    reply = post(chat_url, "NEW_SESSION")
    assert (reply.status_code, reply.json()) == (status, payload)
    assert reply.headers[NEW_SESSION] == OPENED[NEW_SESSION]
    assert reply.headers["Content-Length"] == str(len(reply.content))
    ((path, headers, body),) = containers[0].seen
    assert (path, json.loads(body), headers[SESSION]) == ("/invocations", CHAT, "NEW_SESSION")
    assert headers["Authorization"] == KEY["Authorization"]


def test_a_chat_stream_passes_event_by_event(chat_url, containers):
    """The container holds all but its first event until the test has read that one through
    the route: a route that buffered the stream would time out here."""
    containers[0].plays.append(events(held=True))
    with post(chat_url, stream=True) as reply:
        assert reply.headers["Content-Type"] == "text/event-stream"
        lines = reply.iter_lines()
        assert next(lines) == FIRST.strip()
        containers[0].first_event_seen.set()
        rest = [line for line in lines if line]
    assert rest == [event.strip() for event in REST]


def test_a_chat_stream_cut_short_ends_with_an_error_event_then_done(chat_url, containers):
    containers[0].plays.append(events(cut=True))
    with post(chat_url, stream=True) as reply:
        data = [line for line in reply.iter_lines() if line]
    assert data[0] == FIRST.strip() and data[-1] == b"data: [DONE]"
    error = json.loads(data[1].removeprefix(b"data: "))["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "TURN_INTERRUPTED",
        "server_error",
        None,
    )


def test_a_caller_hanging_up_a_chat_stream_cancels_the_turn_it_opened(chat_url, containers):
    """The turn of an open (``NEW_SESSION``) is cancelled under the id its reply announced."""
    containers[0].plays.append(events(endless=True, headers=OPENED))
    body = json.dumps(CHAT).encode()
    host, port = chat_url.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + chat_url.removeprefix("http://").split("/", 1)[1]
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as client:
        client.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"%s: NEW_SESSION\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), SESSION.encode(), len(body), body)
        )
        received = b""
        while b"data:" not in received:
            piece = client.recv(4096)
            assert piece, "the route closed the stream"
            received += piece
    assert containers[0].cancelled.wait(WAIT_S)
    assert containers[0].cancels == ["s-1"]


def test_the_fronts_own_errors_on_the_chat_route_are_in_openai_shape(front, readiness):
    readiness["ready"] = False
    reply = post(f"{front}/v1/chat/completions")
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["type"]) == (503, "NOT_READY", "server_error")
    assert error["param"] is None and error["message"] and reply.headers["Retry-After"]
    reply = requests.get(f"{front}/v1/chat/completions", timeout=WAIT_S)
    error = reply.json()["error"]
    assert (reply.status_code, error["code"]) == (405, "METHOD_NOT_ALLOWED")
    assert error["type"] == "invalid_request_error" and reply.headers["Allow"] == "POST"


def test_the_endpoint_routes_chats_as_invocations_new_sessions_bound_where_they_opened(
    endpoint, containers
):
    """Two opens land on the two instances; each id then goes to its own, a stateless chat to
    the least loaded; a closed id is unknown after, as an invocation finds it."""
    url = endpoint + OPENAI_PATH
    for i, container in enumerate(containers):
        opened = f"s-{i}; Expires=2030-01-01T00:00:00Z"
        container.plays.append(answer(200, COMPLETION, {NEW_SESSION: opened, SESSION: opened}))
    assert [post(url, "NEW_SESSION").headers[INSTANCE] for _ in containers] == [
        "instance-0",
        "instance-1",
    ]
    for i in (1, 0, 1):
        containers[i].plays.append(answer(200, COMPLETION))
        assert post(url, f"s-{i}").headers[INSTANCE] == f"instance-{i}"
    assert [len(c.seen) for c in containers] == [2, 3]
    assert containers[1].seen[-1][1][SESSION] == "s-1"
    containers[0].plays.append(answer(200, COMPLETION))  # stateless: the first of equals
    assert post(url).headers[INSTANCE] == "instance-0"
    assert SESSION not in containers[0].seen[-1][1]
    closed = {"X-Amzn-SageMaker-Closed-Session-Id": "s-1"}
    containers[1].plays.append(answer(200, {"sessionId": "s-1", "closed": True}, closed))
    invoke = f"{endpoint}/endpoints/{ENDPOINT}/invocations"
    close = json.dumps({"requestType": "CLOSE"})
    assert requests.post(invoke, data=close, headers={SESSION: "s-1"}, timeout=WAIT_S).ok
    reply = post(url, "s-1")
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["type"]) == (
        400,
        "SESSION_NOT_FOUND",
        "invalid_request_error",
    )


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/endpoints/no-such-endpoint/openai/v1/chat/completions", 400, "ValidationError"),
        (f"/endpoints/{ENDPOINT}/openai/v1/completions", 404, "UnknownOperationException"),
        (f"/endpoints/{ENDPOINT}/openai/v1/models", 404, "UnknownOperationException"),
    ],
)
def test_the_endpoints_own_errors_on_the_openai_path_are_in_openai_shape(
    endpoint, containers, path, status, code
):
    for method in ("POST", "GET"):
        reply = requests.request(method, endpoint + path, data=b"{}", timeout=WAIT_S)
        if method == "GET" and status == 400:
            status, code = 404, "UnknownOperationException"  # a GET is no route at all
        error = reply.json()["error"]
        assert (reply.status_code, error["code"]) == (status, code)
        assert set(error) == {"message", "type", "param", "code"}
    assert not containers[0].seen and not containers[1].seen


def test_closing_a_session_lost_with_its_instance_is_the_idempotent_close_for_close_too(
    endpoint, containers
):
    """A lost id's close is answered by the endpoint, ``CLOSE`` as ``CLOSE_SESSION``."""
    url = endpoint + OPENAI_PATH
    containers[0].plays.append(answer(200, COMPLETION, OPENED))
    assert post(url, "NEW_SESSION").ok
    containers[0].shutdown()
    containers[0].server_close()  # instance-0 stops answering: its sessions are lost
    reply = post(url, "s-1")
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "SESSION_LOST")
    invoke = f"{endpoint}/endpoints/{ENDPOINT}/invocations"
    close = json.dumps({"requestType": "CLOSE"})
    reply = requests.post(invoke, data=close, headers={SESSION: "s-1"}, timeout=WAIT_S)
    assert reply.status_code == 200 and reply.json()["alreadyGone"] == "lost"
    assert reply.headers["X-Amzn-SageMaker-Closed-Session-Id"] == "s-1"


def test_openais_sdk_chats_through_the_endpoint(endpoint, containers):
    """What the SDK sends and reads: a completion, a stream, an error with its code."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        base_url=f"{endpoint}/endpoints/{ENDPOINT}/openai/v1", api_key="local", max_retries=0
    )
    containers[0].plays.append(answer(200, COMPLETION))
    completion = client.chat.completions.create(**CHAT)
    assert completion.choices[0].message.content == "a circle"
    containers[0].plays.append(events())
    stream = client.chat.completions.create(**CHAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "a circle"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**CHAT, extra_headers={SESSION: "never-opened-" + "0" * 20})
    assert raised.value.code == "SESSION_NOT_FOUND"
