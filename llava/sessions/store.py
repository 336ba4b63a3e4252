"""SessionStore: the session store. Session id → Session, idle TTL, close, remembered ids,
and the order of one session's turns. It holds no memory policy: the memory manager
(llava.kv.memory) owns every byte; the store pins a session's holding for its turn, releases it
when the session goes, and learns which sessions the manager evicted (docs/engine/memory.md
§Memory policy).

- A session idle for longer than ``ttl_s`` expires: it is removed at the next store call, or
  by ``reap()`` (which ``llava.sessions.reaper.Reaper`` calls on a timer, so an idle server
  frees it).
- Turns of one session are serialized by its lock; a session in a turn is pinned: never
  moved, evicted or expired underneath it.
Removed ids are remembered (bounded) so a caller learns *why* an id is no longer valid, a
second close of it is acknowledged, and an open cannot take it again. Lock order: the store's
lock, then the manager's (the manager never calls back).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from llava.counters import Counters
from llava.errors import SessionIdInUse, SessionNotFound
from llava.kv.memory import Holding, IntegrityError
from llava.sessions.persist import REMEMBERED_GONE, NoJournal
from llava.sessions.session import Session

logger = logging.getLogger(__name__)

# Why an id is gone → the error code its caller gets.
CLOSED, EXPIRED, EVICTED = "SESSION_CLOSED", "SESSION_EXPIRED", "SESSION_EVICTED"
_MESSAGES = {
    CLOSED: "session {id} was closed; open a new session",
    EXPIRED: "session {id} expired after {ttl:.0f} s idle; open a new session",
    EVICTED: "session {id} was evicted to free memory; open a new session",
    SessionNotFound.code: "session {id} is not known to this server (it may have restarted); "
    "open a new session",
}


class Holdings(Protocol):
    """What the store asks of the memory manager (llava.kv.memory.MemoryManager)."""

    def adopt(self, holding: Holding, label: str) -> None: ...
    def pin(self, holding: Holding) -> bool: ...
    def unpin(self, holding: Holding) -> None: ...
    def release(self, holding: Holding) -> None: ...
    def drain_evicted(self) -> list[str]: ...
    def evict(self, holding: Holding) -> None: ...
    def check_integrity(self) -> set[str]: ...


class Journal(Protocol):
    """What the store asks of the persistent tier (llava.sessions.persist): a session that goes
    loses its entry."""

    def remove(self, session_id: str, reason: str | None = None) -> None: ...


@dataclass(frozen=True)
class StoreCounters(Counters):
    opened: int = 0
    closed: int = 0
    expired: int = 0
    turns: int = 0
    new_tokens: int = 0  # prefilled by turns
    cached_tokens: int = 0  # reused from KV caches by turns


def new_session_id() -> str:
    """Unguessable (uuid4 is 122 random bits from os.urandom), matches SageMaker's pattern."""
    return str(uuid.uuid4())


class SessionStore:
    def __init__(
        self,
        memory: Holdings,
        ttl_s: float = 20 * 60,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        journal: Journal | None = None,
    ):
        self.memory = memory
        self.journal = NoJournal() if journal is None else journal
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall_offset = lambda: wall_clock() - clock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._gone: OrderedDict[str, str] = OrderedDict()  # id → reason code
        self._counters = StoreCounters()
        self._lock = threading.RLock()

    # -- lifecycle -------------------------------------------------------------------------
    def add(self, session: Session) -> None:
        """Register an opened session (its holding is the manager's, pinned until now)."""
        with self._lock:
            self._sweep()
            self.check_id_free(session.session_id)
            session.last_used = self._clock()
            self._sessions[session.session_id] = session
            self.memory.adopt(session.holding, session.session_id)
            self._count(opened=1)

    def restore(self, session: Session, idle_s: float) -> None:
        """Register a session adopted from the persistent tier, idle for ``idle_s`` already
        (so it keeps its expiry); callers restore least recently used first."""
        with self._lock:
            session.last_used = self._clock() - idle_s
            self._sessions[session.session_id] = session
            self.memory.adopt(session.holding, session.session_id)

    def remember_gone(self, session_id: str, reason: str) -> None:
        """An id a previous worker held and noted as gone (its gone log): it is answered with
        that reason, and closing it is idempotent."""
        with self._lock:
            self._remember(session_id, reason)

    def refuse_entry(self, session_id: str, reason: str) -> None:
        """A previous worker's session this one does not take (it EXPIRED while no worker
        held it): its entry goes with that reason (noted for a later restart too), and the id
        is answered with it, as for a session removed here."""
        with self._lock:
            self.journal.remove(session_id, reason)
            self._remember(session_id, reason)

    def check_id_free(self, session_id: str) -> None:
        """Refuse an id a client asked for if it is live or still remembered."""
        with self._lock:
            self._forget_evicted()
            if session_id in self._sessions:
                raise SessionIdInUse(
                    f"session id {session_id} belongs to a live session; choose another id, "
                    "or leave out 'extSessionID' to get a server-chosen one"
                )
            if session_id in self._gone:
                raise SessionIdInUse(
                    f"session id {session_id} was used recently ({self._gone[session_id]}); "
                    "ids are never reused: choose another id, or leave out 'extSessionID'"
                )

    @contextmanager
    def use(self, session_id: str) -> Iterator[Session]:
        """Hold the session for one turn: serialized with its other turns, never moved."""
        session = self.begin_turn(session_id)
        try:
            yield session
        finally:
            self.end_turn(session)

    def begin_turn(self, session_id: str) -> Session:
        """Take the session for a turn (waits for a close in progress); pair with end_turn.
        Until then it is never moved, evicted or expired by anyone else."""
        with self._lock:
            self._sweep()
            session = self._lookup(session_id)
        session.lock.acquire()
        with self._lock:  # it may have gone while we waited for the lock
            if self._sessions.get(session_id) is session and self.memory.pin(session.holding):
                return session
            self._forget_evicted()
            session.lock.release()
            raise self._not_found(session_id)

    def end_turn(self, session: Session) -> None:
        with self._lock:
            session.last_used = self._clock()
            if self._sessions.get(session.session_id) is session:
                self._sessions.move_to_end(session.session_id)
                self.memory.unpin(session.holding)
            session.lock.release()

    def lose(self, session: Session, why: str) -> SessionNotFound:
        """A session in its turn that cannot go on (its parked state is unreadable): evicted,
        logged with ``why``; returns the error its caller gets (SESSION_EVICTED)."""
        logger.warning("session %s evicted: %s", session.session_id, why)
        with self._lock:
            self.memory.evict(session.holding)
            self._forget_evicted()
            return self._not_found(session.session_id)

    def close(self, session_id: str) -> str | None:
        """Close a live session (returns None), or acknowledge one that is already gone
        (returns why: CLOSED, EXPIRED or EVICTED). Only a never-seen id is an error."""
        with self._lock:
            self._sweep()
            session = self._sessions.get(session_id)
            if session is None:
                return self._why_gone(session_id)
        with session.lock, self._lock:  # waits for a turn in flight to finish
            self._forget_evicted()
            if self._sessions.get(session_id) is not session:
                return self._why_gone(session_id)
            self._remove(session_id, CLOSED)
            self._count(closed=1)
            return None

    def reap(self) -> int:
        """Remove the expired idle sessions now; return how many went."""
        with self._lock:
            return self._sweep()

    def record_turn(self, new_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self._count(turns=1, new_tokens=new_tokens, cached_tokens=cached_tokens)

    # -- views -----------------------------------------------------------------------------
    def session(self, session_id: str) -> Session:
        """The live session (to read: its tier, history, messages); SessionNotFound if gone."""
        with self._lock:
            self._forget_evicted()
            return self._lookup(session_id)

    def expires_at(self, session: Session) -> datetime:
        wall = session.last_used + self.ttl_s + self._wall_offset()
        return datetime.fromtimestamp(wall, tz=UTC).replace(microsecond=0)

    def counters(self) -> StoreCounters:
        with self._lock:
            self._sweep()
            return self._counters

    def check_integrity(self) -> None:
        """The manager's books hold, and its sessions are exactly the live ones."""
        with self._lock:
            self._forget_evicted()
            held = self.memory.check_integrity()
            if held != set(self._sessions):
                raise IntegrityError(
                    f"{len(held ^ set(self._sessions))} sessions live in only one of the "
                    "store and the memory manager"
                )

    def remembers(self, session_id: str) -> bool:
        """Live, or gone recently enough that its id still answers why (and is not reused)."""
        with self._lock:
            return session_id in self._sessions or session_id in self._gone

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            self._forget_evicted()
            return session_id in self._sessions

    def __len__(self) -> int:
        with self._lock:
            self._forget_evicted()
            return len(self._sessions)

    # -- internals (caller holds self._lock) -----------------------------------------------
    def _count(self, **increments: int) -> None:
        self._counters = self._counters.plus(**increments)

    def _lookup(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise self._not_found(session_id)
        return session

    def _why_gone(self, session_id: str) -> str:
        if session_id not in self._gone:
            raise self._not_found(session_id)
        return self._gone[session_id]

    def _not_found(self, session_id: str) -> SessionNotFound:
        code = self._gone.get(session_id, SessionNotFound.code)
        message = _MESSAGES[code].format(id=session_id, ttl=self.ttl_s)
        return SessionNotFound(message, code=code)

    def _remove(self, session_id: str, reason: str) -> None:
        session = self._sessions.pop(session_id)
        self.memory.release(session.holding)  # a no-op for an evicted one
        self.journal.remove(session_id, reason)
        self._remember(session_id, reason)

    def _remember(self, session_id: str, reason: str) -> None:
        self._gone[session_id] = reason
        while len(self._gone) > REMEMBERED_GONE:
            self._gone.popitem(last=False)

    def _forget_evicted(self) -> None:
        """Sessions the manager evicted are gone, with that reason; one already idle past its
        TTL is EXPIRED (it expired first: the manager evicts the least recently used, which is
        often a session the sweep has not reached yet)."""
        deadline = self._clock() - self.ttl_s
        for session_id in self.memory.drain_evicted():
            session = self._sessions.get(session_id)
            if session is None:
                continue
            if session.last_used <= deadline:
                self._remove(session_id, EXPIRED)
                self._count(expired=1)
            else:
                self._remove(session_id, EVICTED)

    def _sweep(self) -> int:
        self._forget_evicted()
        deadline = self._clock() - self.ttl_s
        candidates = []
        for session_id, session in self._sessions.items():  # least recently used first
            if session.last_used > deadline:
                break  # the rest are younger: a sweep costs what it removes, not what is held
            candidates.append((session_id, session))
        expired = 0
        for session_id, session in candidates:
            if session.lock.acquire(blocking=False):  # not in a turn
                try:
                    self._remove(session_id, EXPIRED)
                    expired += 1
                finally:
                    session.lock.release()
        if expired:
            self._count(expired=expired)
        return expired
