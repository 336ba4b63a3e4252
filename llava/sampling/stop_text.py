"""Stop sequences: an answer's text ends before the first of them, even mid-stream.

Text is streamed as it is generated, so a chunk that might be the start of a stop sequence is
held back until the next chunks say whether it is (then it and the rest are dropped, and the
turn ends) or not (then it goes out). The chunks that go out concatenate to the answer, as
without stop sequences (llava.sampling.detokenizer).
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self.stopped = False
        self._sent: list[str] = []
        self._held = ""  # text that may begin a stop sequence

    @property
    def text(self) -> str:
        """Everything let through so far."""
        return "".join(self._sent)

    def push(self, chunk: str) -> str:
        """The part of ``chunk`` (with what was held) that can go out now; after a stop
        sequence nothing does (``stopped``)."""
        if self.stopped or not self.stops:
            return self._send("" if self.stopped else chunk)
        pending = self._held + chunk
        found = [i for i in (pending.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return self._send(pending[: min(found)])
        keep = max((_overlap(pending, stop) for stop in self.stops), default=0)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._send(pending[: len(pending) - keep])

    def flush(self) -> str:
        """What was held back, at the end of an answer no stop sequence ended."""
        held, self._held = self._held, ""
        return self._send(held)

    def _send(self, text: str) -> str:
        if text:
            self._sent.append(text)
        return text


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop``."""
    for length in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-length:]):
            return length
    return 0
