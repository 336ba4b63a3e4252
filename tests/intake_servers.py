"""Test helpers for image intake: loopback HTTP servers, a loopback-only tripwire, images.

Everything here binds loopback addresses only; ``forbid_non_loopback`` makes any attempt to
connect elsewhere fail the test instead of sending a packet.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import socket
import struct
import threading
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

Route = Callable[[BaseHTTPRequestHandler, threading.Event], None]


class LoopbackServer:
    """A threaded HTTP server on a loopback address; ``routes`` maps a path to a ``Route``.

    ``paths`` records every request received (so a test can show none arrived). Routes that
    loop (drip, endless) stop when the client hangs up or the server closes.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.routes: dict[str, Route] = {}
        self.paths: list[str] = []
        self._stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.paths.append(self.path)
                route = server.routes.get(self.path.split("?")[0], respond(b"no route", 404))
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    route(self, server._stopping)  # the client may hang up: as it should

            def log_message(self, *args):
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("Server", (ThreadingHTTPServer,), {"address_family": family})
        self._httpd = server_cls((host, 0), Handler)
        self._httpd.daemon_threads = True
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def url(self, path: str, host: str | None = None) -> str:
        host = host or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def respond(body: bytes, status: int = 200, headers: dict | None = None) -> Route:
    def route(handler, _stopping):
        handler.send_response(status)
        for name, value in (headers or {"Content-Length": str(len(body))}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)

    return route


def redirect(location: str, status: int = 302) -> Route:
    return respond(b"", status, {"Location": location, "Content-Length": "0"})


def drip(interval_s: float, limit_s: float = 30.0) -> Route:
    """Headers at once, then one byte per ``interval_s`` (for at most ``limit_s``)."""

    def route(handler, stopping):
        handler.send_response(200)
        handler.end_headers()
        for _ in range(int(limit_s / interval_s)):
            if stopping.wait(interval_s):
                return
            handler.wfile.write(b"x")
            handler.wfile.flush()

    return route


def stall(limit_s: float = 30.0) -> Route:
    """Accept the request and say nothing (for at most ``limit_s``)."""
    return lambda handler, stopping: stopping.wait(limit_s)


def endless(chunk: bytes = b"\0" * 65536, limit_bytes: int = 256 * 1024 * 1024) -> Route:
    """A body with no Content-Length that goes on until the client hangs up (or 256 MiB)."""

    def route(handler, stopping):
        handler.send_response(200)
        handler.end_headers()
        for _ in range(limit_bytes // len(chunk)):
            if stopping.is_set():
                return
            handler.wfile.write(chunk)

    return route


def forbid_non_loopback(monkeypatch) -> None:
    """Make any connect() to a non-loopback address fail the test before a packet leaves."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(address):
        if isinstance(address, tuple):
            ip = ipaddress.ip_address(address[0].split("%")[0])
            assert ip.is_loopback, f"test tried to connect to non-loopback {address}"

    def connect(self, address):
        check(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        check(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


def image_bytes(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels but holds none: a few dozen bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )
