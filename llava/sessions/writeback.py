"""Write-behind to the durable store: one thread writes each committed session's record after
its reply has gone, never in a turn's way (docs/engine/sessions.md §Durable store).

A turn's commit only notes the session as dirty (``dirty``: a dictionary update under a lock).
The writer takes the dirty sessions oldest first and writes, for each, the features objects the
store does not hold yet and then the record that names them, so a record never names absent
features. A session committed again before its write keeps one pending entry with the newer
state (at most one turn behind); a store that fails or stalls is retried with a growing pause,
and every failure is logged and counted, never raised into a turn. ``flush`` waits, bounded,
until nothing is pending: what a worker told to stop does (handlers/).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from llava.counters import Counters
from llava.errors import log_id
from llava.sessions.durable import DurableSessions, record_name
from llava.sessions.objects import StoreError
from llava.sessions.record import Snapshot

logger = logging.getLogger(__name__)

FIRST_PAUSE_S, LAST_PAUSE_S = 0.25, 30.0  # after a failure, doubling up to the last
FLUSH_PAUSE_S = 0.05  # after a failure while a flush waits
# A features object is shared and never rewritten by a session, but the bucket's lifecycle rule
# expires objects by age (docs/deploy.md §The durable store): one older than this when a record
# names it is written again, so an image in use never expires under its sessions (the rule
# must keep objects longer: `python -m deploy create` takes whole days).
REFRESH_FEATURES_S = 12 * 3600
MAX_KNOWN_FEATURES = 100_000  # names remembered as written (~200 B each)
# Features waiting to be written are host copies; past this many bytes of them a pending
# write keeps none and reads its session's features back from the persistent tier instead.
MAX_PENDING_FEATURE_BYTES = 1 << 30


@dataclass(frozen=True)
class DurableCounters(Counters):
    writes: int = 0  # records written
    feature_writes: int = 0  # features objects written (not already in the store)
    deletes: int = 0  # records deleted (closed, expired, resumed elsewhere)
    failures: int = 0  # writes or deletes the store failed (each retried)
    pending: int = 0  # sessions whose latest state is not in the store yet
    lag_s: float = 0.0  # how long the oldest of them has waited


@dataclass
class _Pending:
    snapshot: Snapshot | None  # None: the record goes (closed or expired)
    features: list[torch.Tensor] | None  # its images', when they changed; None: as last written
    since: float  # when it first became dirty (monotonic)
    replaces: list[str] = field(default_factory=list)  # ids whose records go once this is written


class WriteBehind:
    """``features_of(snapshot)``: the snapshot's images' features, one per image, when the
    writer holds none for it (the persistent tier reads them back)."""

    def __init__(
        self,
        sessions: DurableSessions,
        features_of: Callable[[Snapshot], list[torch.Tensor]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.sessions = sessions
        self._features_of = features_of
        self._clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # oldest first
        self._written: dict[str, list[str]] = {}  # id → the features names its record names
        self._held_features: dict[str, float] = {}  # name → when known written (monotonic)
        self._pending_bytes = 0
        self._writing: str | None = None  # the id being written now
        self._counters = DurableCounters()
        self._changed = threading.Condition()
        self._stopped = False
        self._flushing = False  # a flush is waiting: failed writes are retried without pause
        self._pause_s = 0.0
        threading.Thread(target=self._run, name="durable-writer", daemon=True).start()

    # -- what commits, closes and resumes call ----------------------------------------------
    def dirty(
        self,
        snapshot: Snapshot,
        features: list[torch.Tensor] | None = None,
        replaces: str | None = None,
    ) -> None:
        """The session's committed state, to be written; ``features``: its images' (one per
        image) when they changed, None when they did not. ``replaces``: a session this one
        was resumed from, whose record goes once this one's is written."""
        nbytes = _bytes(features)
        with self._changed:  # an entry keeps its place in the queue: oldest first
            old = self._pending.get(snapshot.session_id)
            entry = _Pending(snapshot, features, old.since if old else self._clock())
            if old is not None:
                self._pending_bytes -= _bytes(old.features)
                entry.replaces = old.replaces
                if features is None and old.snapshot is not None:
                    entry.features = old.features  # a newer state; its images as before
                    nbytes = _bytes(old.features)
            if replaces is not None:
                entry.replaces.append(replaces)
            if self._pending_bytes + nbytes > MAX_PENDING_FEATURE_BYTES:
                entry.features, nbytes = None, 0  # read back when written (features_of)
                self._written.pop(snapshot.session_id, None)
            self._pending_bytes += nbytes
            self._pending[snapshot.session_id] = entry
            self._changed.notify_all()

    def forget(self, session_id: str) -> None:
        """The session was closed or expired: its record goes (after any write pending)."""
        with self._changed:
            old = self._pending.get(session_id)
            self._pending_bytes -= _bytes(old.features if old else None)
            since = old.since if old else self._clock()
            self._pending[session_id] = _Pending(None, None, since, old.replaces if old else [])
            self._changed.notify_all()

    def flush(self, timeout_s: float) -> list[str]:
        """Wait until every pending write is done, at most ``timeout_s``; the ids still
        pending then (their latest state is not in the store). Failed writes are retried
        without their pause meanwhile."""
        deadline = self._clock() + timeout_s
        with self._changed:
            self._flushing, self._pause_s = True, 0.0
            self._changed.notify_all()
            try:
                while self._pending or self._writing is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        break
                    self._changed.wait(min(left, 0.05))
                return list(self._pending) + ([self._writing] if self._writing else [])
            finally:
                self._flushing = False

    def counters(self) -> DurableCounters:
        with self._changed:
            oldest = next(iter(self._pending.values()), None)
            lag = 0.0 if oldest is None else self._clock() - oldest.since
            pending = len(self._pending) + (self._writing is not None)
            return replace(self._counters, pending=pending, lag_s=round(lag, 3))

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    # -- the writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._stopped:
                    self._changed.wait()
                if self._stopped:
                    return
                session_id, entry = self._pending.popitem(last=False)
                self._pending_bytes -= _bytes(entry.features)
                self._writing = session_id
            try:
                self._write(session_id, entry)
                failed = False
            except Exception as e:  # a store error, or a bug: logged, retried, never raised
                failed = True
                self._failed(session_id, entry, e)
            with self._changed:
                self._writing = None
                if failed:
                    self._requeue(session_id, entry)
                else:
                    self._pause_s = 0.0
                self._changed.notify_all()
                pause = self._pause_s
            if failed and pause > 0:
                with self._changed:
                    self._changed.wait_for(lambda: self._stopped or self._pause_s == 0, pause)

    def _write(self, session_id: str, entry: _Pending) -> None:
        objects = self.sessions.objects
        if entry.snapshot is None:
            objects.delete(record_name(session_id))
            self._written.pop(session_id, None)
            self._count(deletes=1)
        else:
            names = self._features_names(entry)
            objects.put(record_name(session_id), self.sessions.record_object(entry.snapshot, names))
            self._written[session_id] = names
            self._count(writes=1)
        for old in entry.replaces:
            objects.delete(record_name(old))
            self._count(deletes=1)

    def _features_names(self, entry: _Pending) -> list[str]:
        """Each image's features object, written if the store does not hold it."""
        snapshot = entry.snapshot
        written = self._written.get(snapshot.session_id)
        if (
            entry.features is None
            and written is not None
            and len(written) == len(snapshot.images)
            and all(self._recently_held(name) for name in written)
        ):
            return written
        features = entry.features
        if features is None:
            features = self._features_of(snapshot)
        names = []
        for tensor in features:
            name, data = self.sessions.features_object(tensor)
            self._hold_features(name, data)
            names.append(name)
        return names

    def _recently_held(self, name: str) -> bool:
        known = self._held_features.get(name)
        return known is not None and self._clock() - known < REFRESH_FEATURES_S

    def _hold_features(self, name: str, data: bytes) -> None:
        """Make sure the store holds this features object, and will for REFRESH_FEATURES_S."""
        if self._recently_held(name):
            return
        now = self._clock()
        age = self.sessions.objects.age_s(name)
        if age is None or age >= REFRESH_FEATURES_S:
            self.sessions.objects.put(name, data)
            self._count(feature_writes=1)
            age = 0.0
        if len(self._held_features) >= MAX_KNOWN_FEATURES:  # bounded: asked again if needed
            self._held_features.clear()
        self._held_features[name] = now - age

    def _failed(self, session_id: str, entry: _Pending, error: Exception) -> None:
        what = "delete" if entry.snapshot is None else "write"
        if isinstance(error, StoreError):
            logger.warning("durable store: %s of %s failed: %s", what, log_id(session_id), error)
        else:
            logger.exception("durable store: %s of %s failed", what, log_id(session_id))
        self._count(failures=1)

    def _requeue(self, session_id: str, entry: _Pending) -> None:
        """A failed entry goes back, oldest first, unless a newer state came meanwhile (which
        keeps the failed one's features if it brought none, and its ids to delete)."""
        newer = self._pending.get(session_id)
        if newer is None:
            self._pending[session_id] = entry
            self._pending.move_to_end(session_id, last=False)
            self._pending_bytes += _bytes(entry.features)
        else:
            newer.since = entry.since
            newer.replaces = entry.replaces + newer.replaces
            if newer.features is None and newer.snapshot is not None and entry.snapshot:
                newer.features = entry.features
                self._pending_bytes += _bytes(entry.features)
        if self._flushing:  # retried at once, but not in a tight loop
            self._pause_s = FLUSH_PAUSE_S
        else:
            self._pause_s = min(LAST_PAUSE_S, max(FIRST_PAUSE_S, 2 * self._pause_s))

    def _count(self, **increments: int) -> None:
        with self._changed:
            self._counters = self._counters.plus(**increments)


def _bytes(features: list[torch.Tensor] | None) -> int:
    return sum(f.numel() * f.element_size() for f in features or ())
