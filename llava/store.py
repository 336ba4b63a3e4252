"""SessionStore: session id → Session, with idle TTL, explicit close and a byte budget.

Policy, in bytes counted from the sessions' tensors:
- A session idle for longer than ``ttl_s`` expires: it is removed at the next store call, or
  by ``reap()`` (which ``llava.reaper.Reaper`` calls on a timer, so an idle server frees it).
- When the sessions together hold more than ``budget_bytes``, the least recently used
  sessions are demoted one tier (KV cache dropped, features + tokens kept) until the total
  fits; only if every idle session is already demoted are the least recently used removed
  ("evicted"). Pressure therefore slows later turns (a re-prefill) before it loses anyone.
- A session whose own features and tokens exceed the budget is refused (NoCapacity).
- KV lives in the engine's pool (llava.kv_pool): a turn short of blocks demotes the least
  recently used idle sessions until it fits (``reserve``); if even demoting every idle
  session could not make room it gets Busy and nobody is demoted (docs/design.md
  §Memory policy). Every pool change happens under the store's lock.
- Turns of one session are serialized by its lock; sessions in a turn are never demoted,
  evicted or expired underneath it.
Removed ids are remembered (bounded) so a caller learns *why* an id is no longer valid, a
second close of it is acknowledged, and an open cannot take it again.

Totals per tier are kept as sessions change (a session's tensors change only inside a turn,
by demotion, or by removal), so no request walks every session (docs/design.md
§Per-request cost and kept totals).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from llava.errors import Busy, NoCapacity, SessionIdInUse, SessionNotFound
from llava.kv_pool import KVPoolFull, SessionKV
from llava.session import Session, Tier

_REMEMBERED_IDS = 10_000
_RETRY_AFTER_S = 1.0  # a turn lasts seconds: by then running turns have ended and are idle

# Why an id is gone → the error code its caller gets.
CLOSED, EXPIRED, EVICTED = "SESSION_CLOSED", "SESSION_EXPIRED", "SESSION_EVICTED"
_MESSAGES = {
    CLOSED: "session {id} was closed; open a new session",
    EXPIRED: "session {id} expired after {ttl:.0f} s idle; open a new session",
    EVICTED: "session {id} was evicted to free memory; open a new session",
    SessionNotFound.code: "session {id} is not known to this server (it may have restarted); "
    "open a new session",
}


@dataclass(frozen=True)
class StoreCounters:
    opened: int = 0
    closed: int = 0
    expired: int = 0
    demoted: int = 0
    evicted: int = 0
    turns: int = 0
    new_tokens: int = 0  # prefilled by turns
    cached_tokens: int = 0  # reused from KV caches by turns


@dataclass(frozen=True)
class StoreStats:
    sessions_by_tier: dict[Tier, int]
    bytes_by_tier: dict[Tier, int]
    budget_bytes: int
    counters: StoreCounters = field(default_factory=StoreCounters)

    @property
    def sessions(self) -> int:
        return sum(self.sessions_by_tier.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_tier.values())


class _Ledger:
    """Sessions and bytes per tier, updated one session at a time."""

    def __init__(self):
        self.sessions = {tier: 0 for tier in Tier}
        self.bytes = {tier: 0 for tier in Tier}
        self._entries: dict[str, tuple[Tier, dict[Tier, int]]] = {}  # id → last measurement

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def measure(self, session: Session) -> None:
        """(Re)count a session after its tensors changed."""
        self.forget(session.session_id)
        entry = (session.tier, session.bytes_by_tier())
        self._entries[session.session_id] = entry
        self._apply(entry, +1)

    def forget(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._apply(entry, -1)

    def _apply(self, entry: tuple[Tier, dict[Tier, int]], sign: int) -> None:
        tier, by_tier = entry
        self.sessions[tier] += sign
        for each, nbytes in by_tier.items():
            self.bytes[each] += sign * nbytes


def new_session_id() -> str:
    """Unguessable (uuid4 is 122 random bits from os.urandom), matches SageMaker's pattern."""
    return str(uuid.uuid4())


class SessionStore:
    def __init__(
        self,
        budget_bytes: int,
        ttl_s: float = 20 * 60,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall_offset = lambda: wall_clock() - clock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._gone: OrderedDict[str, str] = OrderedDict()  # id → reason code
        self._ledger = _Ledger()
        self._counters = StoreCounters()
        self._lock = threading.RLock()

    # -- lifecycle -------------------------------------------------------------------------
    def add(self, session: Session) -> None:
        needed = session.bytes_by_tier()[Tier.FEATURES]  # what demotion cannot free
        if needed > self.budget_bytes:
            raise NoCapacity(
                f"this session needs {needed} bytes, more than the server's session "
                f"budget of {self.budget_bytes}; use a smaller image or a larger instance"
            )
        with self._lock:
            self._sweep()
            self.check_id_free(session.session_id)
            session.last_used = self._clock()
            self._sessions[session.session_id] = session
            self._ledger.measure(session)
            self._count(opened=1)
            self._enforce_budget()

    def check_id_free(self, session_id: str) -> None:
        """Refuse an id a client asked for if it is live or still remembered."""
        with self._lock:
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
        """Hold the session for one turn: serialized with its other turns, never evicted."""
        session = self.begin_turn(session_id)
        try:
            yield session
        finally:
            self.end_turn(session)

    def begin_turn(self, session_id: str) -> Session:
        """Take the session for a turn (waits for a close in progress); pair with end_turn.
        Until then it is never demoted, evicted or expired by anyone else."""
        with self._lock:
            self._sweep()
            session = self._lookup(session_id)
        session.lock.acquire()
        with self._lock:  # it may have been closed while we waited for the lock
            if self._sessions.get(session_id) is not session:
                session.lock.release()
                raise self._not_found(session_id)
        return session

    def end_turn(self, session: Session) -> None:
        with self._lock:
            session.last_used = self._clock()
            if self._sessions.get(session.session_id) is session:
                self._sessions.move_to_end(session.session_id)
                self._ledger.measure(session)  # the turn grew (or demoted) it
            session.lock.release()
            self._enforce_budget()

    # -- KV memory (the pool is not thread-safe: every change happens under self._lock) ----
    def reserve(self, kv: SessionKV, extra_tokens: int) -> None:
        """Take pool blocks for ``extra_tokens`` more ids in ``kv``. When the pool is short,
        demote least-recently-used idle sessions until it fits; raise Busy (demoting nobody)
        if even demoting every idle session would not make room now, NoCapacity if the whole
        pool could not hold it."""
        with self._lock:
            try:
                kv.reserve(extra_tokens)
                return
            except KVPoolFull:
                pass
            pool = kv.pool
            needed = pool.blocks_needed(kv, extra_tokens)
            if needed + len(kv.blocks) > pool.total_blocks:
                raise NoCapacity(
                    f"this turn needs {kv.length + extra_tokens} tokens of KV, more than the "
                    f"server's whole KV memory holds ({pool.total_blocks * pool.block_tokens}); "
                    "lower max_new_tokens or open a new session"
                )
            idle = [s for s in self._sessions.values() if s.kv is not None and self._idle(s)]
            try:  # their locks are held until the end: none starts a turn meanwhile
                freeable = sum(len(s.kv.blocks) for s in idle)
                if needed > pool.free_blocks + freeable:
                    raise Busy(
                        f"the KV memory is full: this turn needs {needed} blocks, "
                        f"{pool.free_blocks} are free and idle sessions hold {freeable}; "
                        "retry shortly",
                        retry_after_s=_RETRY_AFTER_S,
                    )
                for session in idle:  # least recently used first
                    if needed <= pool.free_blocks:
                        break
                    session.demote()
                    self._ledger.measure(session)
                    self._count(demoted=1)
                kv.reserve(extra_tokens)
            finally:
                for session in idle:
                    session.lock.release()

    def crop(self, kv: SessionKV, length: int) -> None:
        """Keep the first ``length`` ids of ``kv``; whole blocks past them go back to the pool."""
        with self._lock:
            kv.crop(length)

    def rewind(self, kv: SessionKV, length: int) -> None:
        """Forget what a failed step wrote past ``length``, keeping the blocks reserved."""
        with self._lock:
            if kv.length > length:
                spare = kv.capacity - length
                kv.crop(length)
                kv.reserve(spare)  # the blocks the crop just gave back: it cannot fail

    def demote(self, session: Session) -> None:
        """Drop the KV of a session in a failed turn (it may hold part of the turn)."""
        with self._lock:
            session.demote()

    def release(self, kv: SessionKV) -> None:
        """Give back the blocks of a KV that no session holds (an open that failed)."""
        with self._lock:
            kv.free()

    def close(self, session_id: str) -> str | None:
        """Close a live session (returns None), or acknowledge one that is already gone
        (returns why: CLOSED, EXPIRED or EVICTED). Only a never-seen id is an error."""
        with self._lock:
            self._sweep()
            session = self._sessions.get(session_id)
            if session is None:
                return self._why_gone(session_id)
        with session.lock, self._lock:  # waits for a turn in flight to finish
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
    def expires_at(self, session: Session) -> datetime:
        wall = session.last_used + self.ttl_s + self._wall_offset()
        return datetime.fromtimestamp(wall, tz=UTC).replace(microsecond=0)

    def stats(self) -> StoreStats:
        with self._lock:
            self._sweep()
            ledger = self._ledger
            return StoreStats(
                dict(ledger.sessions), dict(ledger.bytes), self.budget_bytes, self._counters
            )

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- internals (caller holds self._lock) -----------------------------------------------
    def _count(self, **increments: int) -> None:
        current = self._counters
        self._counters = replace(
            current, **{name: getattr(current, name) + n for name, n in increments.items()}
        )

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
        self._ledger.forget(session_id)
        session.demote()
        session.image_features = None
        self._gone[session_id] = reason
        while len(self._gone) > _REMEMBERED_IDS:
            self._gone.popitem(last=False)

    def _idle(self, session: Session) -> bool:
        """True if no turn holds the session; the caller must release it if so."""
        return session.lock.acquire(blocking=False)

    def _sweep(self) -> int:
        deadline = self._clock() - self.ttl_s
        candidates = []
        for session_id, session in self._sessions.items():  # least recently used first
            if session.last_used > deadline:
                break  # the rest are younger: a sweep costs what it removes, not what is held
            candidates.append((session_id, session))
        expired = 0
        for session_id, session in candidates:
            if self._idle(session):
                try:
                    self._remove(session_id, EXPIRED)
                    expired += 1
                finally:
                    session.lock.release()
        if expired:
            self._count(expired=expired)
        return expired

    def _enforce_budget(self) -> None:
        for demote in (True, False):  # first drop KV caches, then whole sessions
            if self._ledger.total_bytes <= self.budget_bytes:
                return
            for session_id, session in list(self._sessions.items()):
                if self._ledger.total_bytes <= self.budget_bytes:
                    return
                if demote and session.tier is not Tier.KV:
                    continue
                if not self._idle(session):
                    continue
                try:
                    if demote:
                        session.demote()
                        self._ledger.measure(session)
                        self._count(demoted=1)
                    else:
                        self._remove(session_id, EVICTED)
                        self._count(evicted=1)
                finally:
                    session.lock.release()
