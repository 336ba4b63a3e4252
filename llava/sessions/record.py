"""A committed session as bytes, and back: what the persistent tier's state files
(llava.sessions.persist) and the durable store's records (llava.sessions.durable) both hold.

Every file or object is framed alike: a magic naming its kind, a format version, a JSON header,
a payload, and a SHA-256 of everything before it; the header names the model it belongs to.
So what is read is either whole, verified and this model's, or refused with ``BadEntry``
(docs/engine/sessions.md §Persistent tier).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass

import torch

FORMAT = 1
_HEAD = struct.Struct("<4sII")  # magic, format, header length
DIGEST_BYTES = hashlib.sha256().digest_size


class BadEntry(ValueError):
    """A file that is not a whole, verified entry of this model: never used."""


class ForeignEntry(BadEntry):
    """A whole entry, but of another model (another checkpoint, or this one in another dtype)."""


@dataclass(frozen=True)
class Snapshot:
    """A session as committed: what an engine needs to continue it."""

    session_id: str
    token_ids: list[int]
    messages: list[dict]
    turns: int
    last_used_wall: float  # time.time() of its last commit
    ttl_s: float
    # each image's hex content key its features and prefix are shared under (None: not
    # shared) and its image tokens, in the order the conversation shows them
    images: tuple[tuple[str | None, int], ...] = ()
    tenant: str | None = None  # whose sessions it shares with (llava.sessions.session.Sharing)
    opening_tokens: int = 0  # its first ids that hold no caller text
    opening_images: int = 0  # images its open brought (llava.sessions.session.Session)

    @property
    def expires_wall(self) -> float:
        return self.last_used_wall + self.ttl_s


def snapshot_header(snapshot: Snapshot) -> dict:
    """The snapshot as JSON fields (``read_snapshot`` reads them back), its id included."""
    return {
        "sessionId": snapshot.session_id,
        **history_header(snapshot),
    }


def history_header(snapshot: Snapshot) -> dict:
    """Everything of the snapshot but its id (a durable record names its id by hash only)."""
    return {
        "tokenIds": snapshot.token_ids,
        "messages": snapshot.messages,
        "turns": snapshot.turns,
        "lastUsedWall": snapshot.last_used_wall,
        "ttlS": snapshot.ttl_s,
        "images": [{"key": key, "tokens": tokens} for key, tokens in snapshot.images],
        "tenant": snapshot.tenant,
        "openingTokens": snapshot.opening_tokens,
        "openingImages": snapshot.opening_images,
    }


def read_snapshot(header: dict, session_id: str, vocab_size: int) -> Snapshot:
    """The snapshot a header holds, every field checked (BadEntry: one is missing or wrong,
    or a token id lies outside the vocabulary and would index past the embeddings)."""
    try:
        snapshot = Snapshot(
            session_id=session_id,
            token_ids=[int(i) for i in header["tokenIds"]],
            messages=list(header["messages"]),
            turns=int(header["turns"]),
            last_used_wall=float(header["lastUsedWall"]),
            ttl_s=float(header["ttlS"]),
            images=_images(header.get("images", [])),
            tenant=_tenant(header.get("tenant")),
            opening_tokens=_count(header.get("openingTokens", 0), "openingTokens"),
            opening_images=_count(header.get("openingImages", 0), "openingImages"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadEntry(f"a state without {e}") from None
    if not all(0 <= i < vocab_size for i in snapshot.token_ids):
        raise BadEntry(f"token ids outside the vocabulary (0..{vocab_size - 1})")
    if snapshot.opening_images > len(snapshot.images):
        raise BadEntry("an open's image that is not among its images")
    return snapshot


def pack(magic: bytes, header: dict, payload: bytes = b"") -> bytes:
    """One framed entry: magic, format, header, payload, and the SHA-256 of all of them."""
    text = json.dumps(header, separators=(",", ":")).encode()
    body = _HEAD.pack(magic, FORMAT, len(text)) + text + payload
    return body + hashlib.sha256(body).digest()


def unpack(data: bytes, magic: bytes, model: str) -> tuple[dict, bytes, bytes]:
    """A verified entry's header, payload and trailing digest (BadEntry: not whole, not of
    this kind or format; ForeignEntry: another model's)."""
    if len(data) < _HEAD.size + DIGEST_BYTES:
        raise BadEntry("truncated")
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    found_magic, version, length = _HEAD.unpack_from(body)
    if found_magic != magic:
        raise BadEntry("not an entry")
    if hashlib.sha256(body).digest() != digest:
        raise BadEntry("checksum mismatch (corrupt or truncated)")
    if version != FORMAT:
        raise BadEntry(f"format {version}, this server reads {FORMAT}")
    try:
        header = json.loads(body[_HEAD.size : _HEAD.size + length])
    except ValueError:
        raise BadEntry("an unreadable header") from None
    if not isinstance(header, dict):
        raise BadEntry("an unreadable header")
    if header.get("model") != model:
        raise ForeignEntry("another model's entry")
    return header, body[_HEAD.size + length :], digest


def tensor_fields(features: torch.Tensor) -> tuple[dict, bytes]:
    """A tensor as header fields (dtype, shape) and payload bytes, on the host."""
    data = features.detach().to("cpu").contiguous()
    dtype = str(data.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(data.shape)}, data.view(torch.uint8).numpy().tobytes()


def read_tensor(header: dict, payload: bytes) -> torch.Tensor:
    """The tensor ``tensor_fields`` wrote (BadEntry: the payload does not fit the header)."""
    try:
        dtype = getattr(torch, header["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{header['dtype']} is not a dtype")
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
        return flat.view(*header["shape"])
    except (AttributeError, KeyError, TypeError, RuntimeError) as e:
        raise BadEntry(f"features that do not fit their header ({e})") from None


def image_key(value) -> str | None:
    if value is not None and not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
        raise ValueError("a well-formed image key")
    return value


def _images(value) -> tuple[tuple[str | None, int], ...]:
    if not isinstance(value, list) or not all(isinstance(image, dict) for image in value):
        raise ValueError("a well-formed images list")
    return tuple((image_key(image["key"]), _count(image["tokens"], "images")) for image in value)


def _tenant(value) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError("a well-formed tenant")
    return value


def _count(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a well-formed {field}")
    return value
