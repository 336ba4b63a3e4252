"""A test's HTTP server on 127.0.0.1, served from a daemon thread and stopped fast.

``serve_forever``'s default poll interval (0.5 s) is how long ``shutdown`` may wait: a suite
that starts a server per test would spend most of its time stopping them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from socketserver import BaseServer
from typing import TypeVar

POLL_S = 0.02
Server = TypeVar("Server", bound=BaseServer)


def start(server: Server) -> Server:
    """Serve ``server`` from a daemon thread; stop it with ``stop``."""
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True
    ).start()
    return server


def stop(server: BaseServer) -> None:
    server.shutdown()
    server.server_close()


def send(handler, status: int, headers: dict[str, str], data: bytes) -> None:
    """A whole reply from a ``BaseHTTPRequestHandler``: status, headers (their own
    Content-Length left out), Content-Length, body."""
    handler.send_response(status)
    for name, value in headers.items():
        if name.lower() != "content-length":
            handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@contextlib.contextmanager
def serving(server: Server) -> Iterator[Server]:
    start(server)
    try:
        yield server
    finally:
        stop(server)
