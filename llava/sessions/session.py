"""A session: its conversation, its turn lock, the memory it holds, and who may reuse it.

The memory (KV on device or host, image features) belongs to llava.kv.memory's manager; the
session only points at its ``Holding`` (docs/engine/memory.md §Memory policy).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

from llava.kv.holding import Holding, Tier
from llava.kv.pool import SessionKV

__all__ = ["Session", "Sharing", "Tier"]


@dataclass(frozen=True)
class Sharing:
    """What decides which other sessions may reuse the KV blocks a session publishes
    (docs/engine/memory.md §Shared prefixes)."""

    tenant: str | None = None  # salts every key it publishes or looks up
    opening_tokens: int = 0  # its first ids holding no caller text: image, operator's prompt
    # salts the keys of its blocks of caller text: a secret, so only it finds them again
    own_salt: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)


@dataclass(eq=False)
class Session:
    session_id: str
    token_ids: list[int]
    holding: Holding
    last_used: float = 0.0
    turns: int = 0
    # The conversation as chat-template messages: each turn's prompt is rendered from it.
    messages: list[dict] = field(default_factory=list)
    sharing: Sharing = field(default_factory=Sharing)
    # Images its open brought (0 or 1): shown in its first question's message, before any
    # image that question brings (the rest are the messages' own image parts).
    opening_images: int = 0
    # A stateless answer's session: never written to the persistent tier, closed after its
    # one turn (llava.engine.Engine.chat without a session).
    transient: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tier(self) -> Tier:
        return self.holding.tier

    @property
    def kv(self) -> SessionKV | None:
        return self.holding.kv

    @property
    def image_tokens(self) -> int:
        return self.holding.image_tokens

    @property
    def images(self) -> int:
        return len(self.holding.images)
