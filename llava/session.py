"""A session's state and its memory tiers.

Hot to cold: ``KV`` (cache + image features + token history: a turn prefills only its new
tokens) → ``FEATURES`` (cache dropped: the next turn re-prefills the history, but never
re-runs the vision tower) → gone (removed from the store). Bytes are counted from the
tensors themselves, so the store's budget is real memory, not an estimate.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

TOKEN_ID_BYTES = 8  # token history kept as Python ints; counted as int64


class Tier(enum.Enum):
    KV = "kv"
    FEATURES = "features"


def cache_bytes(cache: DynamicCache | None) -> int:
    if cache is None:
        return 0
    return sum(
        tensor.nbytes
        for layer in cache.layers
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(tensor, torch.Tensor)
    )


@dataclass(eq=False)
class Session:
    session_id: str
    token_ids: list[int]
    image_features: torch.Tensor | None
    cache: DynamicCache | None
    last_used: float
    turns: int = 0
    # The conversation as chat-template messages: each turn's prompt is rendered from it.
    messages: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tier(self) -> Tier:
        return Tier.KV if self.cache is not None else Tier.FEATURES

    @property
    def cached_tokens(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def bytes_by_tier(self) -> dict[Tier, int]:
        """KV bytes under KV; features and token history under FEATURES."""
        features = 0 if self.image_features is None else self.image_features.nbytes
        return {
            Tier.KV: cache_bytes(self.cache),
            Tier.FEATURES: features + TOKEN_ID_BYTES * len(self.token_ids),
        }

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_tier().values())

    def demote(self) -> int:
        """Drop the KV cache; return the bytes freed. The next turn re-prefills."""
        freed = cache_bytes(self.cache)
        self.cache = None
        return freed
