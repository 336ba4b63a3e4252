"""The asks in flight, per session, so that a CANCEL_TURN request can stop them.

TorchServe 0.12 never tells the worker that a client went away
(docs/serving.md §TorchServe 0.12 facts). The servers in front of it do see the client's socket
close (serving/front.py, local_endpoint/): they send ``{"requestType": "CANCEL_TURN"}`` for the
session, and each of its asks in flight (running or waiting for the session) ends at the
engine's next step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TurnsInFlight:
    def __init__(self):
        self._lock = threading.Lock()
        self._flags: dict[str, list[threading.Event]] = {}

    @contextmanager
    def track(self, session_id: str) -> Iterator[threading.Event]:
        """An ask of ``session_id`` for the duration of the block; the event says "cancelled"."""
        flag = threading.Event()
        with self._lock:
            self._flags.setdefault(session_id, []).append(flag)
        try:
            yield flag
        finally:
            with self._lock:
                flags = self._flags[session_id]
                flags.remove(flag)
                if not flags:
                    del self._flags[session_id]

    def cancel(self, session_id: str) -> int:
        """Flag every ask of the session in flight now; how many there were."""
        with self._lock:
            flags = list(self._flags.get(session_id, ()))
        for flag in flags:
            flag.set()
        return len(flags)
