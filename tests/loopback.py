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


@contextlib.contextmanager
def serving(server: Server) -> Iterator[Server]:
    start(server)
    try:
        yield server
    finally:
        stop(server)
