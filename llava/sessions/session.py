"""A session: its conversation, its turn lock, and the memory it holds.

The memory (KV on device or host, image features) belongs to llava.kv.memory's manager; the
session only points at its ``Holding`` (docs/engine/memory.md §Memory policy).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from llava.kv.memory import Holding, Tier
from llava.kv.pool import SessionKV

__all__ = ["Session", "Tier"]


@dataclass(eq=False)
class Session:
    session_id: str
    token_ids: list[int]
    holding: Holding
    last_used: float = 0.0
    turns: int = 0
    # The conversation as chat-template messages: each turn's prompt is rendered from it.
    messages: list[dict] = field(default_factory=list)
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
