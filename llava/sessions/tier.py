"""The persistent tier's one owner (docs/engine/sessions.md §Persistent tier): what is written
after an open and after each committed turn, what a parked session reads back, and which
sessions a restarted worker adopts. The files are llava.sessions.persist's; the memory ladder
parks only a session this marks as kept (llava.kv.memory).

With a durable store (docs/engine/sessions.md §Durable store) each write is also handed to the
write-behind writer (llava.sessions.writeback), a close or an expiry deletes the session's
record, and a session resumed from a record is kept here as an adopted one is (``take``)."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from llava.errors import NoCapacity, log_id
from llava.kv.holding import Holding
from llava.sessions.durable import DurableSessions
from llava.sessions.persist import BadEntry, NoJournal, SessionJournal, Snapshot
from llava.sessions.session import Session, Sharing
from llava.sessions.store import CLOSED, EXPIRED, SessionStore
from llava.sessions.writeback import WriteBehind

logger = logging.getLogger(__name__)


class Marks(Protocol):
    """What the tier asks of the memory manager (llava.kv.memory.MemoryManager)."""

    def mark_persisted(self, holding: Holding, persisted: bool) -> None: ...
    def hold_parked(self, images: list[tuple[bytes | None, tuple[int, int]]]) -> Holding: ...
    def features(self, holding: Holding) -> torch.Tensor | None: ...


class PersistentTier:
    def __init__(
        self,
        journal: SessionJournal | NoJournal,
        memory: Marks,
        ttl_s: float,
        durable: DurableSessions | None = None,
    ):
        self.journal = journal
        self.memory = memory
        self.ttl_s = ttl_s
        # the durable store's writer (None: no durable store; it needs this tier on)
        self.writer = None if durable is None else WriteBehind(durable, self._kept_features)

    def write(self, session: Session, with_features: bool = False) -> None:
        """The session's committed state (``with_features``: its images' features too, at open
        and when a turn changed its images) on disk before its reply goes; the caller holds
        the session's turn. A session kept here is parked under pressure, one that is not is
        evicted."""
        if not self.journal.enabled:
            return
        holding = session.holding
        features = None
        if with_features:  # none at all any more: an empty tensor says so
            features = self.memory.features(holding)
            features = torch.empty(0) if features is None else features.to("cpu")
        snapshot = Snapshot(
            session.session_id,
            list(session.token_ids),  # copies: the writer may write them after later turns
            list(session.messages),
            session.turns,
            time.time(),
            self.ttl_s,
            tuple((_hex(image.key), image.tokens) for image in holding.images),
            session.sharing.tenant,
            session.sharing.opening_tokens,
            session.opening_images,
        )
        try:
            kept = self.journal.save(snapshot, features)
        except Exception:  # a bug here must not fail a committed turn: the entry goes instead
            logger.exception("persistent tier: session %s not kept", log_id(session.session_id))
            self.journal.remove(session.session_id)
            kept = False
        self.memory.mark_persisted(holding, kept)
        if self.writer is not None:
            per_image = None if features is None else _per_image(snapshot, features)
            self.writer.dirty(snapshot, per_image)

    def read_back(self, session: Session) -> list[torch.Tensor]:
        """A parked session's features, one per image (BadEntry: they cannot be read)."""
        counts = [image.tokens for image in session.holding.images]
        return _split(self.journal.features(session.session_id), counts)

    def _kept_features(self, snapshot: Snapshot) -> list[torch.Tensor]:
        """The writer's fallback: a snapshot's features, one per image, read back here."""
        if not snapshot.images:
            return []
        return _per_image(snapshot, self.journal.features(snapshot.session_id))

    def remove(self, session_id: str, reason: str | None = None) -> None:
        """The session went (closed, expired, evicted): its entry goes, and why is noted. A
        closed or expired one's durable record goes too; an evicted one's stays, resumable."""
        self.journal.remove(session_id, reason)
        if self.writer is not None and reason in (CLOSED, EXPIRED):
            self.writer.forget(session_id)

    def take(
        self,
        store: SessionStore,
        snapshot: Snapshot,
        features: list[torch.Tensor],
        shares_images: bool,
        replaces: str | None = None,
    ) -> None:
        """A session resumed from the durable store continues here: kept in this tier with
        its features and added to ``store`` parked, as an adopted session is (its next turn
        recomputes its KV from them). ``replaces``: the id it was resumed from, whose record
        goes once this one's is written (None: it keeps its id, and its record stands)."""
        idle_s = max(0.0, time.time() - snapshot.last_used_wall)  # a resumed one's: none
        joined = torch.cat(features) if features else torch.empty(0)
        if not self.journal.save(snapshot, joined):
            raise NoCapacity("the persistent tier cannot keep a resumed session now")
        hidden = features[0].shape[1] if features else 0
        try:
            store.add(self._session(snapshot, hidden, shares_images), idle_s)
        except BaseException:
            self.journal.remove(snapshot.session_id)
            raise
        if self.writer is not None and replaces is not None:
            self.writer.dirty(snapshot, features, replaces=replaces)

    def adopt(self, store: SessionStore, shares_images: bool) -> int:
        """Sessions a previous worker of this model left here continue in ``store``: same
        ids, same expiry, history and features. They are adopted parked (nothing in memory
        but their history): each one's next turn reads its features back and recomputes its
        KV (tier PERSISTED). ``shares_images``: their features and prefix are shared under
        their image's key. Returns how many."""
        now = time.time()
        loaded = self.journal.load(now)
        for session_id, reason in loaded.gone.items():
            store.remember_gone(session_id, reason)
        for session_id in loaded.expired:
            store.refuse_entry(session_id, EXPIRED)
        for entry in loaded.live:
            snapshot = entry.snapshot
            hidden = 0 if entry.features_shape is None else entry.features_shape[1]
            session = self._session(snapshot, hidden, shares_images)
            store.restore(session, idle_s=max(0.0, now - snapshot.last_used_wall))
        if loaded.live:
            logger.info("persistent tier: adopted %d sessions", len(loaded.live))
        return len(loaded.live)

    def _session(self, snapshot: Snapshot, hidden: int, shares_images: bool) -> Session:
        """The session a snapshot holds, parked: nothing in memory but its history."""
        images = [  # keys already salted with their tenant
            (bytes.fromhex(key) if key and shares_images else None, (tokens, hidden))
            for key, tokens in snapshot.images
        ]
        holding = self.memory.hold_parked(images)
        sharing = Sharing(snapshot.tenant, snapshot.opening_tokens)
        session = Session(snapshot.session_id, list(snapshot.token_ids), holding, sharing=sharing)
        session.messages, session.turns = list(snapshot.messages), snapshot.turns
        session.opening_images = snapshot.opening_images
        return session

    def stop(self) -> None:
        if self.writer is not None:
            self.writer.stop()


def _hex(key: bytes | None) -> str | None:
    return None if key is None else key.hex()


def _split(features: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Features of several images, one after the other, as one tensor per image."""
    if sum(counts) != features.shape[0]:
        raise BadEntry(f"{features.shape[0]} rows of features for {sum(counts)} image tokens")
    return list(torch.split(features, counts))


def _per_image(snapshot: Snapshot, features: torch.Tensor) -> list[torch.Tensor]:
    return [] if not snapshot.images else _split(features, [t for _, t in snapshot.images])
