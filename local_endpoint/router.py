"""Sticky routing: which TorchServe instance holds which session.

A new session goes to the live instance holding the fewest sessions; later calls go where
their session lives. An instance that stops answering takes its sessions with it (their ids
become unknown, as they would on SageMaker once an instance is replaced); it gets no new
sessions until a ``/ping`` answers again. A supervised instance (``ready`` given: its
supervisor's answer, serving/supervisor.py) is asked that instead of ``/ping``, which
TorchServe answers while its worker reloads.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

PROBE_EVERY_S = 2.0  # how often a dead instance is pinged before it gets new sessions again


def answers_ping(url: str) -> bool:
    """Whether the server at ``url`` answers ``/ping`` with 200 within a second."""
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


@dataclass
class Backend:
    name: str
    url: str  # e.g. http://127.0.0.1:8080 (TorchServe's inference address)
    alive: bool = True
    failed_at: float = 0.0
    sessions: set[str] = field(default_factory=set)
    ready: Callable[[], bool] | None = None  # None: probe /ping now and then

    def serving(self) -> bool:
        """Whether requests may go to this instance now."""
        if self.ready is not None:
            return self.ready()
        if not self.alive and time.monotonic() - self.failed_at > PROBE_EVERY_S:
            self.alive = answers_ping(self.url)
            self.failed_at = time.monotonic()
        return self.alive


class Router:
    def __init__(self, backends: list[Backend]):
        if not backends:
            raise ValueError("the endpoint needs at least one instance")
        self.backends = backends
        self._by_session: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def for_session(self, session_id: str) -> Backend | None:
        with self._lock:
            return self._by_session.get(session_id)

    def for_new_session(self, exclude: frozenset[str] = frozenset()) -> Backend | None:
        """The live instance with the fewest sessions (dead ones are re-probed now and then)."""
        with self._lock:
            candidates = [b for b in self.backends if b.name not in exclude]
        live = [b for b in candidates if b.serving()]  # a probe may take a second: unlocked
        with self._lock:
            return min(live, key=lambda b: len(b.sessions), default=None)

    def bind(self, session_id: str, backend: Backend) -> None:
        with self._lock:
            self._by_session[session_id] = backend
            backend.sessions.add(session_id)

    def unbind(self, session_id: str) -> None:
        with self._lock:
            backend = self._by_session.pop(session_id, None)
            if backend is not None:
                backend.sessions.discard(session_id)

    def mark_dead(self, backend: Backend) -> int:
        """The instance stopped answering: forget its sessions; return how many were lost."""
        with self._lock:
            backend.alive = False
            backend.failed_at = time.monotonic()
            lost = backend.sessions
            backend.sessions = set()
            for session_id in lost:
                self._by_session.pop(session_id, None)
            return len(lost)
