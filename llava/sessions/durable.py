"""The durable store's layout: a session's record and its images' features, as objects any
instance of the endpoint can read (docs/engine/sessions.md §Durable store).

    sessions/<sha256 of the session id>   the record: history, messages, turns, expiry,
                                          tenant, each image's key, tokens and features name
    features/<sha256 of the object>       one image's features, written once, shared by every
                                          session on that image

A record is named by its id's hash, so no id (a bearer secret, and any characters a caller
sent) is ever part of a key, and a listing of the bucket shows none. Every object is framed and
checksummed as the persistent tier's files are (llava.sessions.record), and carries the
model's identity; a features object is named by its own digest, so a record can only name the
features it was written with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from llava.errors import (
    DurableStoreUnavailable,
    RecordCorrupt,
    RecordExpired,
    RecordForeign,
    RecordNotFound,
    log_id,
)
from llava.sessions.objects import ObjectStore, StoreError
from llava.sessions.record import (
    DIGEST_BYTES,
    BadEntry,
    ForeignEntry,
    Snapshot,
    history_header,
    pack,
    read_snapshot,
    read_tensor,
    tensor_fields,
    unpack,
)

RECORD_MAGIC, FEATURES_MAGIC = b"LLVR", b"LLVD"
RETRY_AFTER_S = 2.0  # what a resume that found the store down is told


def id_hash(session_id: str) -> str:
    """What names a session in the store: the SHA-256 of its id, never the id itself."""
    return hashlib.sha256(session_id.encode()).hexdigest()


def record_name(session_id: str) -> str:
    return f"sessions/{id_hash(session_id)}"


def features_name(digest: bytes) -> str:
    return f"features/{digest.hex()}"


@dataclass(frozen=True)
class Record:
    """A verified record: the session as last committed, and its images' features names."""

    snapshot: Snapshot
    features: tuple[str, ...]  # one per image, in the snapshot's order


class DurableSessions:
    """Records and features of one model in ``objects``."""

    def __init__(self, objects: ObjectStore, model: str, vocab_size: int):
        self.objects = objects
        self.model = model
        self.vocab_size = vocab_size

    # -- writing (llava.sessions.writeback, off any turn's way) ---------------------------
    def features_object(self, features: torch.Tensor) -> tuple[str, bytes]:
        """One image's features as an object, and the name it goes under."""
        fields, payload = tensor_fields(features)
        body = pack(FEATURES_MAGIC, {"model": self.model, **fields}, payload)
        return features_name(body[-DIGEST_BYTES:]), body

    def record_object(self, snapshot: Snapshot, features: list[str]) -> bytes:
        header = {"model": self.model, "session": id_hash(snapshot.session_id)}
        header |= history_header(snapshot)
        return pack(RECORD_MAGIC, header | {"features": features})

    # -- reading (a resume, in the caller's thread) ----------------------------------------
    def read(self, session_id: str, now_wall: float) -> Record:
        """The session's verified, live record; each refusal is its own error."""
        data = self._get(record_name(session_id))
        if data is None:
            raise RecordNotFound(
                f"no record of session {session_id} in the durable store: it was never "
                "written, was closed or resumed already, or is too old"
            )
        try:
            header, _, _ = unpack(data, RECORD_MAGIC, self.model)
            if header.get("session") != id_hash(session_id):
                raise BadEntry("a record under another session's name")
            snapshot = read_snapshot(header, session_id, self.vocab_size)
            features = header.get("features")
            if not isinstance(features, list) or len(features) != len(snapshot.images):
                raise BadEntry("a record whose features do not match its images")
        except ForeignEntry:
            raise RecordForeign(
                f"session {session_id}'s record was written by another model (checkpoint or "
                "dtype): only an endpoint serving the same one resumes it"
            ) from None
        except BadEntry as e:
            raise RecordCorrupt(f"session {session_id}'s record is not whole: {e}") from None
        if snapshot.expires_wall <= now_wall:
            raise RecordExpired(f"session {session_id} expired: its record is never resumed")
        return Record(snapshot, tuple(features))

    def features(self, name: str, tokens: int) -> torch.Tensor:
        """One image's features, verified: its object's digest is its name."""
        if not (isinstance(name, str) and name.startswith("features/")):
            raise RecordCorrupt(f"a record names features {log_id(str(name))} it cannot have")
        data = self._get(name)
        if data is None:
            raise RecordCorrupt("a record names features the durable store does not hold")
        try:
            header, payload, digest = unpack(data, FEATURES_MAGIC, self.model)
            if features_name(digest) != name:
                raise BadEntry("features under another object's name")
            tensor = read_tensor(header, payload)
        except BadEntry as e:
            raise RecordCorrupt(f"an image's features are not whole: {e}") from None
        if tensor.dim() != 2 or tensor.shape[0] != tokens:
            shape = tuple(tensor.shape)
            raise RecordCorrupt(f"features of {shape} for an image of {tokens} tokens")
        return tensor

    def _get(self, name: str) -> bytes | None:
        try:
            return self.objects.get(name)
        except StoreError as e:
            raise DurableStoreUnavailable(
                f"the durable store did not answer ({e}); send it again later",
                retry_after_s=RETRY_AFTER_S,
            ) from None
