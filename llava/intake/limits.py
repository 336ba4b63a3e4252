"""The two limits every fetch shares: a total deadline and a byte cap, both enforced while
streaming (a Content-Length header is a claim, not a limit)."""

from __future__ import annotations

import time
from collections.abc import Callable

from llava.errors import ImageFetchFailed, ImageTooLarge

CHUNK = 64 * 1024


class Deadline:
    """A point in (monotonic) time by which a whole fetch must be done."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def check(self, source: str) -> None:
        if self.remaining() <= 0:
            raise ImageFetchFailed(
                f"fetching {source} took longer than {self.seconds:g} s; "
                f"serve it faster or raise intake.deadline_s"
            )


def too_large(source: str, limit: int) -> ImageTooLarge:
    return ImageTooLarge(
        f"{source} is larger than {limit} bytes; send a smaller image or raise intake.max_bytes"
    )


def read_capped(read: Callable[[int], bytes], limit: int, deadline: Deadline, source: str) -> bytes:
    """Call ``read(n)`` until it returns b"", refusing more than ``limit`` bytes or time."""
    data = bytearray()
    while True:
        deadline.check(source)
        chunk = read(CHUNK)
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > limit:
            raise too_large(source, limit)
