"""Bytes → an RGB ``PIL.Image``: format by content, the project's pixel limit checked before
anything is decoded (Pillow's own decompression-bomb check included), decoded no larger than
the model needs, with the memory of concurrent decodes bounded
(docs/engine/memory.md §Image memory).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image, ImageOps

from llava.errors import ImageTooLarge, NotAnImage

from .policy import IntakePolicy

_WHITE = (255, 255, 255)
_PREFIX_BYTES = 16  # what Pillow's format checks look at
# Bytes a decode may hold per pixel: 4 bytes a pixel at most (RGBA, I, F), twice over while
# the full-size image and its reduced copy coexist.
BYTES_PER_PIXEL = 8
_TRIM_AFTER_BYTES = 32 << 20  # a decode this large hands its freed memory back to the OS


def decode_image(data: bytes, policy: IntakePolicy, fit: int | None = None) -> Image.Image:
    """Decode ``data`` into an RGB image, oriented as its EXIF says.

    Only the policy's formats are even parsed (``formats=``: no exotic decoder sees the
    bytes). The pixel count comes from the header and is checked against ``max_pixels``
    before Pillow's own, larger bomb limit and before any pixel is decoded. ``fit``: the side
    the model resizes to; an image whose shorter side exceeds twice that is decoded reduced
    (a JPEG at 1/2, 1/4 or 1/8 scale by its decoder, any format by an integer box filter
    after), so what stays in memory is small. PIL raises many kinds of exception on hostile
    input, so every failure while parsing or decoding is ``NotAnImage``.
    """
    width, height = _declared_size(data, policy)
    if width * height > policy.max_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height} pixels, more than intake.max_pixels "
            f"= {policy.max_pixels}; send a smaller image or raise intake.max_pixels"
        )
    needed = min(width * height * BYTES_PER_PIXEL, policy.decode_budget_bytes)
    if needed >= _TRIM_AFTER_BYTES:
        _map_large_buffers()
    with DECODES.hold(needed, policy.decode_budget_bytes):
        try:
            with _open(data, policy) as image:
                try:
                    return _to_rgb(ImageOps.exif_transpose(_decoded_to_fit(image, fit)))
                except Exception as e:
                    raise NotAnImage(
                        f"the {image.format} image cannot be decoded ({e}); is it truncated?"
                    ) from e
        finally:
            if needed >= _TRIM_AFTER_BYTES:
                give_memory_back()


def _declared_size(data: bytes, policy: IntakePolicy) -> tuple[int, int]:
    """The size the header declares, read by the policy's formats' own parsers without
    Pillow's bomb check (``Image.open`` runs it before a caller sees the size)."""
    Image.init()
    prefix = data[:_PREFIX_BYTES]
    for name in sorted(policy.formats):
        factory, accept = Image.OPEN.get(name, (None, None))
        if factory is None or (accept is not None and accept(prefix) is not True):
            continue
        try:
            with factory(io.BytesIO(data), None) as header:
                return header.size
        except Exception:
            continue
    raise _not_an_image(policy)


def _open(data: bytes, policy: IntakePolicy) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=sorted(policy.formats))
    except Image.DecompressionBombError as e:  # PIL's own limit, when max_pixels is above it
        raise ImageTooLarge(f"image is too large ({e}); send a smaller image") from e
    except Exception as e:
        raise _not_an_image(policy) from e


def _not_an_image(policy: IntakePolicy) -> NotAnImage:
    return NotAnImage(
        f"not an image in an allowed format ({', '.join(sorted(policy.formats))}); "
        f"send one of those or add the format to intake.formats"
    )


def _decoded_to_fit(image: Image.Image, fit: int | None) -> Image.Image:
    """``image`` decoded, at most about twice ``fit`` on its shorter side."""
    factor = 1 if fit is None else min(image.size) // (2 * fit)
    if factor >= 2 and image.format == "JPEG":
        image.draft(image.mode, (image.width // factor, image.height // factor))
    image.load()
    factor = 1 if fit is None else min(image.size) // (2 * fit)  # what the draft left
    if factor < 2:
        return image
    if image.mode not in ("L", "LA", "RGB", "RGBA", "I", "F"):  # e.g. P, 1, CMYK
        image = image.convert("RGBA" if image.has_transparency_data else "RGB")
    return image.reduce(factor)


def _to_rgb(image: Image.Image) -> Image.Image:
    """Normalise any mode to RGB: alpha composited on white, 16/32-bit grey scaled to 8."""
    if image.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        # Full-range 16-bit grey: a plain convert("L") would clip everything above 255 to white.
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, _WHITE)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


class DecodeBudget:
    """Decodes run at once only while the memory they may take fits the budget; one larger
    than the whole budget runs alone. Waiting is the bound: a burst of large images queues
    instead of multiplying a worker's peak."""

    def __init__(self):
        self._held = 0
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, needed: int, budget: int) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._held == 0 or self._held + needed <= budget)
            self._held += needed
        try:
            yield
        finally:
            with self._changed:
                self._held -= needed
                self._changed.notify_all()

    def held(self) -> int:
        with self._changed:
            return self._held


DECODES = DecodeBudget()  # one per process: the worker's decodes share its memory


def _libc():
    """glibc, or None elsewhere (musl, macOS): what follows is glibc's allocator's business."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


_LIBC = _libc()
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_MMAP_AT_BYTES = 4 << 20  # blocks this large are mapped on their own and unmapped when freed
_mmap_set = threading.Event()


def _map_large_buffers() -> None:
    """Before the first large decode: buffers of 4 MiB and more (Pillow's 16 MiB image blocks)
    are mapped on their own and returned to the OS when freed. glibc's default threshold rises
    to the size of the first large buffer freed, after which such buffers come from the heap
    of the thread's arena and stay there: measured in a worker, the second 7000x7000 PNG left
    ~190 MiB held for good, which malloc_trim did not give back."""
    if _LIBC is not None and not _mmap_set.is_set():
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_AT_BYTES)
        _mmap_set.set()


def give_memory_back() -> None:
    """Return the heap's free pages to the OS (what smaller buffers of a decode left)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
