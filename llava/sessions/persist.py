"""The persistent tier: sessions that outlive their worker process (docs/engine/sessions.md
§Persistent tier).

A bounded directory (default under /dev/shm, which outlives the process but not the host)
holds, per session, a ``<id>.state`` file (token history, messages, turns, last use, TTL, each
image's content key and token count) and, for a session with images, a ``<id>.features`` file
(its images' features one after the other, written at open and by each turn that changes its
images). Every file is written to a temporary name, fsynced and renamed over the old one, and
carries a format version, the model's identity and a SHA-256 of everything before it, so an
entry is either whole and verified or ignored. The directory is this user's alone (0700,
checked at start: llava.sessions.location) and every file in it 0600. ``SessionJournal`` is what
one engine calls at open, after each committed turn and when a session goes; ``load`` is what
a restarted engine adopts. No TorchServe here: the engine writes, whatever serves it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from llava.errors import log_id
from llava.files import TEMP_PREFIX, write_atomically
from llava.sessions.record import (
    DIGEST_BYTES,
    BadEntry,
    Snapshot,
    image_key,
    pack,
    read_snapshot,
    read_tensor,
    snapshot_header,
    tensor_fields,
    unpack,
)

logger = logging.getLogger(__name__)

STATE, FEATURES = ".state", ".features"
_MAGIC = {STATE: b"LLVS", FEATURES: b"LLVF"}
_FILE_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,255}")
# Why ids went (closed, expired, evicted), one "<id> <code> <wall time>" line each, so a
# restarted worker still tells a gone id from one never seen and refuses to reopen it. An id is
# forgotten only when it went more than one session TTL ago and REMEMBERED_GONE newer ones
# went after it, as the store forgets them: never reusable within a TTL, however many go
# (docs/security.md §What the session id grants), and a late caller still told why. The log
# is rewritten without the forgotten ones once it has twice as many lines as it kept.
GONE_LOG = "gone.log"
REMEMBERED_GONE = 10_000
_REASON = re.compile(r"[A-Z_]{1,40}")


@dataclass(frozen=True)
class Persisted:
    """A verified entry; its features stay on disk (``SessionJournal.features`` reads them
    when the session's next turn needs them), only their shape is read here."""

    snapshot: Snapshot
    features_shape: tuple[int, int] | None
    features_digest: str | None = None

    @property
    def expires_wall(self) -> float:
        return self.snapshot.expires_wall


class Loaded(NamedTuple):
    """What a start finds: the entries to adopt (least recently used first), the ids of
    sessions that expired while no worker held them, and why earlier ones went (id → code)."""

    live: list[Persisted]
    expired: list[str]
    gone: dict[str, str]


def entry_bytes(
    snapshot: Snapshot, features_shape: tuple[int, int] | None, element_size: int
) -> int:
    """What one session's entry takes on disk (what the cap counts): its state as
    ``snapshot`` and, with an image, features of that shape (for capacity arithmetic)."""
    model = "0" * 32  # model_identity's length
    total = len(_pack(STATE, _state_header(model, snapshot, "0" * 2 * DIGEST_BYTES)))
    if features_shape is not None:
        header = _features_header(model, snapshot.session_id, "bfloat16", features_shape)
        rows, hidden = features_shape
        total += len(_pack(FEATURES, header, b"")) + rows * hidden * element_size
    return total


def model_identity(model: torch.nn.Module, dtype: torch.dtype, weights_digest: str | None) -> str:
    """A hash of the checkpoint's config, its weights' names, sizes and dtype, and the digest
    of their values (llava.model.weights_digest; None where nothing outlives the process):
    entries of another checkpoint (a fine-tune of the same shape, or this one loaded in
    another dtype) are never adopted."""
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "_commit_hash", "transformers_version", "dtype"):
        config.pop(volatile, None)
    weights = sorted((name, list(t.shape)) for name, t in model.state_dict().items())
    text = json.dumps([config, weights, str(dtype), weights_digest], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class _Entry:
    """What one session's entry takes on disk, and the digest its state names."""

    features_bytes: int = 0
    features_digest: str | None = None
    state_bytes: int = 0

    @property
    def total(self) -> int:
        return self.features_bytes + self.state_bytes


class NoJournal:
    """The persistent tier turned off: sessions die with their worker, as before."""

    enabled = False

    def save(self, snapshot: Snapshot, features: torch.Tensor | None = None) -> bool:
        return False

    def remove(self, session_id: str, reason: str | None = None) -> None:
        pass

    def load(self, now_wall: float) -> Loaded:
        return Loaded([], [], {})

    def features(self, session_id: str) -> torch.Tensor:
        raise BadEntry("the persistent tier is off")


class SessionJournal:
    """One engine's entries in ``directory``, at most ``max_bytes`` of them.

    A save that would pass the cap removes the session's entry instead (it is then not
    persisted: after a crash its id is not found, as before this tier); saves and removes are
    serialized by one lock, so a removed session is never written back.
    """

    enabled = True

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        model: str,
        vocab_size: int,
        remember_gone_s: float,
    ):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.model = model
        self.vocab_size = vocab_size  # an adopted id past it would index past the embeddings
        self.remember_gone_s = remember_gone_s  # the session TTL
        self._entries: dict[str, _Entry] = {}
        self._total = 0
        self._gone_lines = 0  # lines in the gone log
        self._gone_kept = 0  # lines it kept when last rewritten
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return self._total

    def save(self, snapshot: Snapshot, features: torch.Tensor | None = None) -> bool:
        """Persist a committed state; False if not persisted. ``features``: its images' (at
        open, and when a turn changed them); None keeps those saved before, and a tensor of no
        rows says it holds none any more (a rewind dropped its images)."""
        session_id = snapshot.session_id
        if not _FILE_SAFE_ID.fullmatch(session_id):  # the wire's ids always are (SageMaker's)
            logger.warning(
                "persistent tier: session %s not kept: not a file name", log_id(session_id)
            )
            return False
        none_now = features is not None and features.numel() == 0
        features_file = None
        if features is not None and not none_now:
            features_file = self._features_bytes(session_id, features)
        with self._lock:
            old = self._entries.get(session_id, _Entry())
            new = _Entry() if none_now else _Entry(old.features_bytes, old.features_digest)
            if features_file is not None:
                new = _Entry(len(features_file), features_file[-DIGEST_BYTES:].hex())
            state = _pack(STATE, _state_header(self.model, snapshot, new.features_digest))
            new.state_bytes = len(state)
            if self._total - old.total + new.total > self.max_bytes:
                return self._drop(session_id, f"the directory is full ({self.max_bytes} bytes)")
            try:
                if features_file is not None:  # first: the state names them
                    write_atomically(self._path(session_id, FEATURES), features_file)
                write_atomically(self._path(session_id, STATE), state)
                if none_now:  # after: the state names them no more
                    self._path(session_id, FEATURES).unlink(missing_ok=True)
            except OSError as e:
                return self._drop(session_id, f"writing failed ({e.strerror or type(e).__name__})")
            self._total += new.total - old.total
            self._entries[session_id] = new
            return True

    def remove(self, session_id: str, reason: str | None = None) -> None:
        """Closed, expired or evicted: its entry goes (state first, so none is half-there);
        with ``reason`` (the code a caller is told) the gone log keeps why."""
        with self._lock:
            self._unlink(session_id)
            if reason is not None and _FILE_SAFE_ID.fullmatch(session_id):
                self._note_gone(session_id, reason)

    def load(self, now_wall: float) -> Loaded:
        """Every live, whole entry of this model, least recently used first, and the ids of
        whole ones that expired meanwhile; everything else in the directory that is ours
        (corrupt, truncated, foreign, expired, orphaned, over the cap, temporary) is removed
        with one log line each."""
        found: dict[str, set[str]] = {}
        for path in self.directory.iterdir():
            if path.name.startswith(TEMP_PREFIX):
                _discard(path, "an unfinished write")
            elif path.suffix in (STATE, FEATURES):
                found.setdefault(path.stem, set()).add(path.suffix)
        entries = []
        for session_id, suffixes in found.items():
            if STATE not in suffixes:
                _discard(self._path(session_id, FEATURES), "features without a state")
                continue
            try:
                entry = self._read(session_id)
            except BadEntry as e:
                for suffix in suffixes:
                    _discard(self._path(session_id, suffix), str(e))
                continue
            if FEATURES in suffixes and entry.features_shape is None:
                _discard(self._path(session_id, FEATURES), "features the state does not name")
            entries.append(entry)
        adopted, expired = [], []
        for entry in sorted(entries, key=lambda e: -e.snapshot.last_used_wall):  # newest first
            session_id = entry.snapshot.session_id
            if entry.expires_wall <= now_wall:
                self._drop(session_id, "expired", log=logging.INFO)
                expired.append(session_id)
                continue
            kept = self._on_disk(entry)
            if self._total + kept.total > self.max_bytes:
                self._drop(session_id, f"over the cap ({self.max_bytes} bytes)")
                continue
            self._entries[session_id] = kept
            self._total += kept.total
            adopted.append(entry)
        live = {entry.snapshot.session_id for entry in adopted}
        gone = {i: went for i, went in self._read_gone(now_wall).items() if i not in live}
        if (self.directory / GONE_LOG).exists():
            self._rewrite_gone(gone)  # without the ids gone more than a TTL ago
        return Loaded(adopted[::-1], expired, {i: why for i, (why, _) in gone.items()})

    # -- files -----------------------------------------------------------------------------
    def _path(self, session_id: str, suffix: str) -> Path:
        return self.directory / f"{session_id}{suffix}"

    def _features_bytes(self, session_id: str, features: torch.Tensor) -> bytes:
        fields, payload = tensor_fields(features)
        header = _features_header(self.model, session_id, fields["dtype"], fields["shape"])
        return _pack(FEATURES, header, payload)

    def _on_disk(self, entry: Persisted) -> _Entry:
        session_id = entry.snapshot.session_id
        kept = _Entry(state_bytes=self._path(session_id, STATE).stat().st_size)
        if entry.features_shape is not None:
            kept.features_bytes = self._path(session_id, FEATURES).stat().st_size
            kept.features_digest = entry.features_digest
        return kept

    def _read(self, session_id: str) -> Persisted:
        header, _, _ = self._unpack(session_id, STATE)
        if header.get("sessionId") != session_id:
            raise BadEntry("a state under another session's name")
        snapshot = read_snapshot(header, session_id, self.vocab_size)
        try:
            legacy_key = image_key(header.get("imageKey"))
        except ValueError as e:
            raise BadEntry(f"a state without {e}") from None
        shape = None
        if header.get("features") is not None:
            shape = tuple(self._features(session_id, header["features"]).shape)
        if "images" not in header:  # written before a session could hold several images
            images = () if shape is None else ((legacy_key, shape[0]),)
            snapshot = replace(snapshot, images=images, opening_images=len(images))
        if sum(tokens for _, tokens in snapshot.images) != (0 if shape is None else shape[0]):
            raise BadEntry("features that are not its images' (their token counts differ)")
        return Persisted(snapshot, shape, header.get("features"))

    def features(self, session_id: str) -> torch.Tensor:
        """A kept session's image features, read back and verified (a parked session's next
        turn); raises BadEntry if its entry has none or they are not whole."""
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None or entry.features_digest is None:
            raise BadEntry("no features are kept for it")
        return self._features(session_id, entry.features_digest)

    def _features(self, session_id: str, digest: str) -> torch.Tensor:
        header, payload, found = self._unpack(session_id, FEATURES)
        if found.hex() != digest:
            raise BadEntry("features that are not the ones its state names")
        return read_tensor(header, payload)

    def _unpack(self, session_id: str, suffix: str) -> tuple[dict, bytes, bytes]:
        """A verified entry file's header, payload and trailing digest."""
        path = self._path(session_id, suffix)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise BadEntry(f"unreadable ({e.strerror or type(e).__name__})") from None
        return unpack(data, _MAGIC[suffix], self.model)

    # -- the gone log (the caller holds self._lock, or is load) -----------------------------
    def _note_gone(self, session_id: str, reason: str) -> None:
        try:
            now = time.time()
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
            with os.fdopen(os.open(self.directory / GONE_LOG, flags, 0o600), "a") as log:
                log.write(f"{session_id} {reason} {now:.3f}\n")
            self._gone_lines += 1
            if self._gone_lines > 2 * max(self._gone_kept, REMEMBERED_GONE):
                self._rewrite_gone(self._read_gone(now))
        except OSError as e:  # a close never fails for it: the id is then merely unknown
            logger.warning("persistent tier: %s's end not noted: %s", log_id(session_id), e)

    def _read_gone(self, now_wall: float) -> dict[str, tuple[str, float]]:
        """id → (why, when) of the ids still remembered at ``now_wall`` (those that went less
        than a TTL before it, and the newest REMEMBERED_GONE), oldest first; a torn or
        unreadable line is skipped."""
        try:
            lines = (self.directory / GONE_LOG).read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return {}
        gone: dict[str, tuple[str, float]] = {}
        for line in lines:
            session_id, reason, when = (line.split(" ") + ["", ""])[:3]
            if not (_FILE_SAFE_ID.fullmatch(session_id) and _REASON.fullmatch(reason)):
                continue
            try:
                went = float(when)
            except ValueError:
                continue
            gone.pop(session_id, None)
            gone[session_id] = (reason, went)
        return forget_old_gone(gone, now_wall - self.remember_gone_s)

    def _rewrite_gone(self, gone: dict[str, tuple[str, float]]) -> None:
        text = "".join(f"{i} {why} {went:.3f}\n" for i, (why, went) in gone.items())
        write_atomically(self.directory / GONE_LOG, text.encode())
        self._gone_lines = self._gone_kept = len(gone)

    # -- removal (the caller holds self._lock, or is load) ---------------------------------
    def _drop(self, session_id: str, why: str, log: int = logging.WARNING) -> bool:
        logger.log(log, "persistent tier: session %s not kept: %s", log_id(session_id), why)
        self._unlink(session_id)
        return False

    def _unlink(self, session_id: str) -> None:
        self._total -= self._entries.pop(session_id, _Entry()).total
        for suffix in (STATE, FEATURES):
            self._path(session_id, suffix).unlink(missing_ok=True)


def _state_header(model: str, snapshot: Snapshot, features_digest: str | None) -> dict:
    return {"model": model, **snapshot_header(snapshot), "features": features_digest}


def _features_header(model: str, session_id: str, dtype: str, shape) -> dict:
    return {"model": model, "sessionId": session_id, "dtype": dtype, "shape": list(shape)}


def _pack(suffix: str, header: dict, payload: bytes = b"") -> bytes:
    return pack(_MAGIC[suffix], header, payload)


def _discard(path: Path, why: str) -> None:
    # files are named by their session's id: the log shows its tag instead
    logger.warning("persistent tier: removed %s%s: %s", log_id(path.stem), path.suffix, why)
    path.unlink(missing_ok=True)


def forget_old_gone(
    gone: dict[str, tuple[str, float]], before: float
) -> dict[str, tuple[str, float]]:
    """``gone`` (id → (why, when), oldest first) without the ids that went before ``before``
    and have REMEMBERED_GONE newer ones after them; changed in place and returned."""
    while len(gone) > REMEMBERED_GONE and next(iter(gone.values()))[1] < before:
        del gone[next(iter(gone))]
    return gone
