"""The soak's images: shapes drawn here (not the training generator) and its own image server
on 127.0.0.1, with a slow route and one that resets mid-body (scripts/soak/__main__.py)."""

from __future__ import annotations

import io
import random
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image, ImageDraw

COLORS = {
    "red": (255, 0, 0),
    "green": (0, 128, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "purple": (128, 0, 128),
    "orange": (255, 165, 0),
    "white": (255, 255, 255),
}
# the ones it knows best (docs/demo-model.md §What it knows)
SHAPES = ("circle", "square", "triangle")


# -- images ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Drawn:
    shape: str
    color: str
    png: bytes


def draw_shape(rng: random.Random, side: int | None = None) -> Drawn:
    """One upright shape of a named colour on a plain square canvas, drawn here."""
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    side = side or rng.choice((160, 224, 288))
    dark = color == "white" or rng.random() < 0.3
    canvas = Image.new("RGB", (side, side), (20, 20, 20) if dark else (250, 250, 250))
    half = rng.uniform(0.28, 0.38) * side
    x, y = (rng.uniform(half + 2, side - half - 2) for _ in range(2))
    pen = ImageDraw.Draw(canvas)
    if shape == "circle":
        pen.ellipse((x - half, y - half, x + half, y + half), fill=COLORS[color])
    elif shape == "square":
        s = half * 0.8
        pen.rectangle((x - s, y - s, x + s, y + s), fill=COLORS[color])
    else:
        pen.polygon(
            [(x, y - half), (x - half, y + half * 0.7), (x + half, y + half * 0.7)],
            fill=COLORS[color],
        )
    out = io.BytesIO()
    canvas.save(out, "PNG")
    return Drawn(shape, color, out.getvalue())


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (a decompression bomb's calling card)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    crc = struct.pack(">I", zlib.crc32(chunk))
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + crc


class ImageServer(ThreadingHTTPServer):
    """The soak's own image host on 127.0.0.1: drawn images, a slow one and a broken one."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a fetch given up on (the slow URL) breaks the pipe: expected

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _ImageHandler)
        self.images: dict[str, bytes] = {"/0.png": draw_shape(random.Random(0)).png}
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def add(self, name: str, png: bytes) -> str:
        self.images[f"/{name}.png"] = png
        return self.url(f"/{name}.png")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


class _ImageHandler(BaseHTTPRequestHandler):
    server: ImageServer

    def log_message(self, format, *args):  # noqa: A002 (the stdlib's signature)
        pass

    def do_GET(self):
        if self.path == "/slow.png":  # headers after 20 s
            time.sleep(20.5)
        if self.path == "/reset.png":  # half a body, then a TCP reset
            self.send_response(200)
            self.send_header("Content-Length", "200000")
            self.end_headers()
            self.wfile.write(b"\x89PNG\r\n\x1a\n" + b"\0" * 50_000)
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            return
        body = self.server.images.get("/0.png" if self.path == "/slow.png" else self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def draw_big(rng: random.Random) -> Drawn:
    """A 4000x4000 PNG (16 MP: at the intake.max_pixels limit) of one large shape: small on the
    wire."""
    color = rng.choice(["red", "green", "blue", "yellow", "purple", "orange"])
    canvas = Image.new("RGB", (4000, 4000), (250, 250, 250))
    ImageDraw.Draw(canvas).ellipse((800, 860, 3090, 3140), fill=COLORS[color])
    out = io.BytesIO()
    canvas.save(out, "PNG")
    return Drawn("circle", color, out.getvalue())
