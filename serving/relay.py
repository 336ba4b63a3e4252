"""What the container front and the local endpoint both do with a streamed reply: pass it on as
the chunks of a chunked reply, and when the caller hangs up, tell the worker, since TorchServe
never does (docs/serving.md §Cancellation (`CANCEL_TURN`)). Standard library only: the local
endpoint imports it in the client's torch-free install."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import BinaryIO

from llava_wire import CANCEL_TURN, SESSION_HEADER

RELAY_CHUNK = 64 * 1024  # the most of a streamed reply passed on at once


class CallerGone(Exception):
    """The caller hung up while its reply was being written."""


def pieces(reply: http.client.HTTPResponse) -> Iterator[bytes]:
    """Whatever has arrived of a streamed reply, no waiting; ends quietly where the upstream
    broke off (the caller tells a finished stream from a broken one by its last line)."""
    try:
        while piece := reply.read1(RELAY_CHUNK):
            yield piece
    except (OSError, http.client.HTTPException):
        return


def write_chunk(wfile: BinaryIO, data: bytes) -> None:
    """One chunk of a chunked reply, sent at once (empty: the last one)."""
    try:
        wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        wfile.flush()
    except (BrokenPipeError, ConnectionResetError) as err:
        raise CallerGone from err


def cancel_turn(
    host: str, port: int, session_id: str | None, timeout_s: float, auth: dict[str, str]
) -> None:
    """Ask the TorchServe at host:port to stop the session's turn at its next step (a call
    without a session has no turn to stop), with ``auth``, its inference key's header
    (``TorchServeInstance.auth_headers``). Best effort: a worker that does not answer ends
    the turn at its deadline anyway."""
    if not session_id:
        return
    upstream = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        upstream.request(
            "POST",
            "/invocations",
            body=json.dumps({"requestType": CANCEL_TURN}),
            headers={"Content-Type": "application/json", SESSION_HEADER: session_id, **auth},
        )
        upstream.getresponse().read()
    except (OSError, http.client.HTTPException):
        pass
    finally:
        upstream.close()
