"""Whether a streamed reply's lines all arrived: each carries ``"seq"``, its index in the stream,
the last one (the final reply) included (docs/wire.md §Streaming)."""

from __future__ import annotations


def stream_gap(line: dict, received: int) -> str | None:
    """What ``line``, read after ``received`` lines, shows was lost on the way; None: nothing."""
    seq = line.get("seq")
    if seq == received:
        return None
    if not isinstance(seq, int):
        return f"line {received} of the stream carries no sequence number ({seq!r})"
    if seq > received:
        return f"{seq - received} line(s) of the stream never arrived (from line {received})"
    return f"line {seq} of the stream arrived again, or out of order, after {received} lines"
