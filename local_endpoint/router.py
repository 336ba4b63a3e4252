"""Sticky routing: which TorchServe instance holds which session.

A new session goes to the live instance holding the fewest sessions, opens still in flight
counted (24 opens at the same moment spread over the instances instead of all landing where
nothing was placed yet); later calls go where their session lives. An instance that stops
answering, or whose worker dies, takes its sessions with it, as on SageMaker once an instance
is replaced: the router remembers which ids were lost and with how many others (``Loss``), so
they are told apart from ids that never existed (docs/client.md §The local endpoint). It gets no
new sessions until a ``/ping`` answers again. A supervised instance (``ready`` given: its
supervisor's answer, serving/supervisor.py) is asked that instead of ``/ping``, which
TorchServe answers while its worker reloads.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

PROBE_EVERY_S = 2.0  # how often a dead instance is pinged before it gets new sessions again
LOST_REMEMBERED = 100_000  # lost ids kept to answer SESSION_LOST (~100 B each), oldest dropped


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
    # Supervised with a persistent tier: whether its supervisor is still bringing it back,
    # sessions and all (False once it gave up). None: its sessions die with its worker.
    supervised: Callable[[], bool] | None = None
    placing: int = 0  # opens and stateless calls sent here and not answered yet
    # The headers every call to it carries: a TorchServe instance's inference key
    # (TorchServeInstance.auth_headers); none for a server that asks for none.
    auth: Callable[[], dict[str, str]] = dict

    def coming_back(self) -> bool:
        """A supervised instance that is (or will be) serving again, with its sessions."""
        return self.supervised is not None and self.supervised()

    def serving(self) -> bool:
        """Whether requests may go to this instance now."""
        if self.ready is not None:
            return self.ready()
        if not self.alive and time.monotonic() - self.failed_at > PROBE_EVERY_S:
            self.alive = answers_ping(self.url)
            self.failed_at = time.monotonic()
        return self.alive

    def load(self) -> int:
        return len(self.sessions) + self.placing


@dataclass(frozen=True)
class Loss:
    """One instance's death, as its lost sessions are told about it."""

    instance: str
    sessions: int  # how many sessions it took with it
    how: str = "whose worker died or stopped answering"


class Router:
    def __init__(self, backends: list[Backend]):
        if not backends:
            raise ValueError("the endpoint needs at least one instance")
        self.backends = backends
        self._by_session: dict[str, Backend] = {}
        self._lost: OrderedDict[str, Loss] = OrderedDict()
        self._lock = threading.Lock()

    def for_session(self, session_id: str) -> Backend | None:
        with self._lock:
            return self._by_session.get(session_id)

    def lost(self, session_id: str) -> Loss | None:
        """How ``session_id`` was lost with its instance; None if it was not (or is forgotten)."""
        with self._lock:
            return self._lost.get(session_id)

    def place(self, exclude: frozenset[str] = frozenset()) -> Backend | None:
        """The live instance with the least load (sessions plus opens in flight), counted as
        one more open in flight until ``placed``; dead ones are re-probed now and then."""
        with self._lock:
            candidates = [b for b in self.backends if b.name not in exclude]
        live = [b for b in candidates if b.serving()]  # a probe may take a second: unlocked
        with self._lock:
            chosen = min(live, key=Backend.load, default=None)
            if chosen is not None:
                chosen.placing += 1
            return chosen

    def placed(self, backend: Backend) -> None:
        """The call ``place`` chose ``backend`` for is answered (its session, if any, bound)."""
        with self._lock:
            backend.placing -= 1

    def bind(self, session_id: str, backend: Backend) -> None:
        with self._lock:
            self._by_session[session_id] = backend
            backend.sessions.add(session_id)
            self._lost.pop(session_id, None)

    def unbind(self, session_id: str) -> None:
        with self._lock:
            backend = self._by_session.pop(session_id, None)
            if backend is not None:
                backend.sessions.discard(session_id)
            self._lost.pop(session_id, None)

    def mark_dead(self, backend: Backend, how: str = Loss.how) -> int:
        """The instance stopped answering or its worker died (or it was replaced: ``how``): its
        sessions are lost, each remembered with the count of the whole loss (whichever request
        notices first). Returns that count."""
        with self._lock:
            backend.alive = False
            backend.failed_at = time.monotonic()
            lost, backend.sessions = backend.sessions, set()
            loss = Loss(backend.name, len(lost), how)
            for session_id in lost:
                self._by_session.pop(session_id, None)
                self._lost[session_id] = loss
            while len(self._lost) > LOST_REMEMBERED:
                self._lost.popitem(last=False)
            return loss.sessions
