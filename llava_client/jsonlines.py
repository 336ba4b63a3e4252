"""Reassemble JSON lines from stream parts split anywhere.

SageMaker delivers a streamed reply as ``PayloadPart`` events whose boundaries have nothing
to do with the container's lines: one part may hold half a line, or the middle of a multi-byte
UTF-8 character, or several lines. So bytes are buffered and only complete lines decoded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator


class JsonLines:
    def __init__(self) -> None:
        self._pending = b""

    def feed(self, part: bytes) -> Iterator[dict]:
        """The objects of every line that ``part`` completes."""
        *lines, self._pending = (self._pending + part).split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)

    def close(self) -> None:
        """The stream ended: a partial line left over means it was cut short."""
        if self._pending.strip():
            raise ValueError(f"the stream ended inside a line: {self._pending[:80]!r}")
