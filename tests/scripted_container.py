"""A container stand-in on loopback, behind the real local endpoint, that answers from a
script: for client behaviour no real container can be timed or made to show (a 503 while
other turns hold the pool, a session that expires between two calls)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3

from llava_client import LlavaClient
from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer
from tests import loopback
from tests.endpoint_helpers import DUMMY_CREDENTIALS, ENDPOINT

BUSY = (
    503,
    {"Retry-After": "1"},
    {"error": {"code": "KV_MEMORY_FULL", "message": "busy", "retryAfterS": 0.2}},
)
OPENED = (
    200,
    {"X-Amzn-SageMaker-New-Session-Id": "s-1; Expires=2030-01-01T00:00:00Z"},
    {"sessionId": "s-1"},
)
ANSWERED = (200, {}, {"generation": {"text": "a circle"}, "usage": {}})
BAD = (413, {}, {"error": {"code": "IMAGE_TOO_LARGE", "message": "too big"}})


class ScriptedContainer:
    """Answers POST /invocations with the next reply of ``script`` (a body in bytes is sent as
    it is: a streamed reply); counts what it got."""

    def __init__(self):
        self.script: list[tuple[int, dict, dict | bytes]] = []
        self.calls = 0
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        container = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                container.bodies.append(json.loads(body))
                container.headers.append(dict(self.headers.items()))
                container.calls += 1
                status, headers, body = container.script.pop(0)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                loopback.send(self, status, {"Content-Type": "application/json", **headers}, data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        loopback.start(self.httpd)


@contextlib.contextmanager
def behind_an_endpoint() -> Iterator[ScriptedContainer]:
    """A scripted container behind the real local endpoint (its URL: ``endpoint_url``)."""
    container = ScriptedContainer()
    router = Router([Backend("instance-0", container.url, ready=lambda: True)])
    endpoint = EndpointServer(("127.0.0.1", 0), ENDPOINT, router)
    loopback.start(endpoint)
    container.endpoint_url = f"http://127.0.0.1:{endpoint.server_address[1]}"
    try:
        yield container
    finally:
        loopback.stop(endpoint)
        loopback.stop(container.httpd)


def client_for(container, **options) -> LlavaClient:
    rt = boto3.client("sagemaker-runtime", endpoint_url=container.endpoint_url, **DUMMY_CREDENTIALS)
    return LlavaClient(ENDPOINT, runtime=rt, **options)
