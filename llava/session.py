"""A session's state and its memory tiers.

Hot to cold: ``KV`` (blocks of the engine's KV pool + image features + token history: a turn
prefills only its new tokens) → ``FEATURES`` (blocks given back: the next turn re-prefills the
history, but never re-runs the vision tower) → gone (removed from the store). KV bytes are the
pool blocks the session holds (``SessionKV.nbytes``), so the store's totals are memory the
pool really handed out, not an estimate (docs/design.md §Memory policy).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import torch

from llava.kv_pool import SessionKV

TOKEN_ID_BYTES = 8  # token history kept as Python ints; counted as int64


class Tier(enum.Enum):
    KV = "kv"
    FEATURES = "features"


@dataclass(eq=False)
class Session:
    session_id: str
    token_ids: list[int]
    image_features: torch.Tensor | None
    kv: SessionKV | None
    last_used: float
    turns: int = 0
    # The conversation as chat-template messages: each turn's prompt is rendered from it.
    messages: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tier(self) -> Tier:
        return Tier.KV if self.kv is not None else Tier.FEATURES

    @property
    def cached_tokens(self) -> int:
        return 0 if self.kv is None else self.kv.length

    def bytes_by_tier(self) -> dict[Tier, int]:
        """KV bytes under KV; features and token history under FEATURES."""
        features = 0 if self.image_features is None else self.image_features.nbytes
        return {
            Tier.KV: 0 if self.kv is None else self.kv.nbytes,
            Tier.FEATURES: features + TOKEN_ID_BYTES * len(self.token_ids),
        }

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_tier().values())

    def demote(self) -> int:
        """Give the KV blocks back to the pool; return the bytes freed. The next turn
        re-prefills. The caller holds the store's lock (the pool is not thread-safe)."""
        if self.kv is None:
            return 0
        freed = self.kv.nbytes
        self.kv.free()
        self.kv = None
        return freed
