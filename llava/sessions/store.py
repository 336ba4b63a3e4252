"""SessionStore: the session store. Session id → Session, idle TTL, close, remembered ids,
and the order of one session's turns. It holds no memory policy: the memory manager
(llava.kv.memory) owns every byte; the store pins a session's holding for its turn, releases it
when the session goes, and learns which sessions the manager evicted (docs/engine/memory.md
§Memory policy).

- A session idle for longer than ``ttl_s`` expires: it is removed at the next store call, or
  by ``reap()`` (which ``llava.sessions.reaper.Reaper`` calls on a timer, so an idle server
  frees it).
- Turns of one session are serialized by its lock; a session in a turn is pinned: never
  moved, evicted or expired underneath it. One ask is in flight per session, and at most
  ``max_waiting_asks`` wait behind it: one more is refused (SESSION_BUSY), holding no thread.
- At most ``max_sessions`` are held: one more open evicts the least recently used idle
  text-only session, else is refused (NO_CAPACITY).
- An id is a bearer secret (docs/wire.md §Session ids are bearer secrets): the store makes
  every id it opens carry at least 128 bits (``full_session_id``), and logs only ``log_id``.
Removed ids are remembered for one TTL after they went, so a caller learns *why* an id is no
longer valid, a second close of it is acknowledged, and an open cannot take it again. Lock
order: the store's lock, then the manager's (the manager never calls back).
"""

from __future__ import annotations

import logging
import math
import secrets
import string
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from llava.counters import Counters
from llava.errors import (
    InvalidRequest,
    NoCapacity,
    SessionBusy,
    SessionIdInUse,
    SessionNotFound,
    log_id,
)
from llava.kv.holding import Holding
from llava.kv.integrity import IntegrityError
from llava.sessions.persist import NoJournal, forget_old_gone
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


# What an id's characters are counted as: its length (hyphens not counted) times log2 of the
# alphabet its character classes span.
MIN_ID_BITS = 128
MAX_ID_CHARS = 256  # SageMaker's limit (llava_wire.session_ids)
_CLASSES = (string.digits, string.ascii_lowercase, string.ascii_uppercase)
_ALPHABET = "".join(_CLASSES)
RANDOM_CHARS = 22  # 22 × log2(62) = 131 bits


def id_bits(session_id: str) -> float:
    """The bits ``session_id`` is counted as: non-hyphen characters × log2(alphabet), the
    alphabet being the classes it uses (digits 10, lowercase 26, uppercase 26)."""
    alphabet = sum(len(chars) for chars in _CLASSES if any(c in chars for c in session_id))
    characters = len(session_id.replace("-", ""))
    return characters * math.log2(alphabet) if alphabet else 0.0


def new_session_id() -> str:
    """131 random bits (secrets: os.urandom) in 22 letters and digits, every class among them,
    so the id also counts as 131 bits and ``full_session_id`` keeps it as it is."""
    while True:
        chars = "".join(secrets.choice(_ALPHABET) for _ in range(RANDOM_CHARS))
        if all(any(c in chars for c in cls) for cls in _CLASSES):  # redrawn ~2 % of the time
            return chars


def full_session_id(requested: str | None) -> str:
    """The id a session opens under: a new random one, the caller's if it counts at least
    MIN_ID_BITS, else the caller's with "-" and a random part: a short id anyone could guess
    can never name a live session, so an open's refusal tells nothing about one."""
    if requested is None:
        return new_session_id()
    if id_bits(requested) >= MIN_ID_BITS:
        return requested
    if len(requested) + 1 + RANDOM_CHARS > MAX_ID_CHARS:
        raise InvalidRequest(
            f"'extSessionID' counts {id_bits(requested):.0f} bits, under {MIN_ID_BITS}, and is "
            f"too long for the server's random part: send {MIN_ID_BITS} bits (e.g. 22 letters "
            "and digits), fewer hyphens, or no id",
            code="INVALID_SESSION_ID",
        )
    return f"{requested}-{new_session_id()}"


class SessionStore:
    def __init__(
        self,
        memory: Holdings,
        ttl_s: float = 20 * 60,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        journal: Journal | None = None,
        max_sessions: int = 1024,
        max_waiting_asks: int = 1,
    ):
        self.memory = memory
        self.journal = NoJournal() if journal is None else journal
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall_offset = lambda: wall_clock() - clock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        # id → (reason code, when it went): oldest first, each kept one TTL after it went
        self._gone: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.max_sessions = max_sessions
        self.max_waiting_asks = max_waiting_asks
        self._opening = 0  # opens admitted and not yet added: they count against max_sessions
        self._asks: dict[str, int] = {}  # id → its asks in flight, waiting ones included
        self._counters = StoreCounters()
        self._lock = threading.RLock()

    # -- lifecycle -------------------------------------------------------------------------
    def add(self, session: Session, idle_s: float = 0.0) -> None:
        """Register an opened session (its holding is the manager's, pinned until now);
        ``idle_s``: idle that long already (one adopted from the durable store keeps its
        expiry)."""
        with self._lock:
            self._sweep()
            self.check_id_free(session.session_id)
            session.last_used = self._clock() - idle_s
            self._sessions[session.session_id] = session
            self.memory.adopt(session.holding, session.session_id)
            self._count(opened=0 if session.transient else 1)  # a stateless answer's: no

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
                    f"session id {session_id} was used recently ({self._gone[session_id][0]}); "
                    "ids are never reused: choose another id, or leave out 'extSessionID'"
                )

    @contextmanager
    def opening(self) -> Iterator[None]:
        """Hold a place for one open until it is added or fails: past ``max_sessions`` the
        least recently used idle text-only session is evicted for it, else it is refused
        (NO_CAPACITY). Opens in progress count, so concurrent ones cannot overshoot."""
        with self._lock:
            self._sweep()
            if len(self._sessions) + self._opening >= self.max_sessions:
                self._evict_for_open()
            self._opening += 1
        try:
            yield
        finally:
            with self._lock:
                self._opening -= 1

    @contextmanager
    def asking(self, session_id: str) -> Iterator[None]:
        """Count one ask of a live session while it is in flight (waiting included): past the
        one running and ``max_waiting_asks`` waiting it is refused at once (SESSION_BUSY), so
        a session's asks never pile up holding request threads."""
        with self._lock:
            self._sweep()
            self._lookup(session_id)
            asks = self._asks.get(session_id, 0)
            if asks > self.max_waiting_asks:
                raise SessionBusy(
                    f"session {session_id} already has an ask in flight"
                    f"{f' and {asks - 1} waiting' if asks > 1 else ''}: send the next one "
                    "when it is answered, or stop it with CANCEL_TURN"
                )
            self._asks[session_id] = asks + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._asks.pop(session_id) - 1
                if left:
                    self._asks[session_id] = left

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
        logger.warning("session %s evicted: %s", log_id(session.session_id), why)
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
            self._count(closed=0 if session.transient else 1)
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
        return self._gone[session_id][0]

    def _not_found(self, session_id: str) -> SessionNotFound:
        code = self._gone.get(session_id, (SessionNotFound.code,))[0]
        message = _MESSAGES[code].format(id=session_id, ttl=self.ttl_s)
        return SessionNotFound(message, code=code)

    def _remove(self, session_id: str, reason: str) -> None:
        session = self._sessions.pop(session_id)
        self.memory.release(session.holding)  # a no-op for an evicted one
        if session.transient:  # nothing of it was kept, and no caller knows its id
            return
        self.journal.remove(session_id, reason)
        self._remember(session_id, reason)

    def _remember(self, session_id: str, reason: str) -> None:
        self._gone.pop(session_id, None)  # to the end: the order is by when they went
        self._gone[session_id] = (reason, self._clock())
        self._forget_old_gone()

    def _forget_old_gone(self) -> None:
        """An id is forgotten only when it went more than one TTL ago and REMEMBERED_GONE
        newer ones went after it: never reusable within a TTL however many go, and a caller
        coming back late is still told why (memory: the newest REMEMBERED_GONE ids, or every
        one gone within a TTL where more went)."""
        forget_old_gone(self._gone, self._clock() - self.ttl_s)

    def _evict_for_open(self) -> None:
        """Make room for one more session: evict the least recently used text-only session
        not in a turn and with no ask in flight (an image session costs its vision tower to
        open again); none: NO_CAPACITY."""
        for session_id, session in self._sessions.items():  # least recently used first
            if session.image_tokens or session_id in self._asks:
                continue
            if session.lock.acquire(blocking=False):  # not in a turn
                break
        else:
            raise NoCapacity(
                f"this server holds max_sessions ({self.max_sessions}) sessions and none is "
                "idle and text-only: close a session, or retry later"
            )
        try:
            self.memory.evict(session.holding)  # counted by the manager (evicted)
        finally:
            session.lock.release()
        logger.info(
            "session %s evicted: max_sessions (%d) reached", log_id(session_id), self.max_sessions
        )
        self._forget_evicted()

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
        self._forget_old_gone()
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
