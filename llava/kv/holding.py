"""What one session holds, read by everyone and changed only by the memory manager
(llava.kv.memory): its device KV, its host copy, its image features' blocks, and the tier
those make."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from llava.kv.pool import SessionKV


class Tier(enum.Enum):
    """Where a session's KV is (the reply's ``usage.tier`` for the turn that found it)."""

    KV = "kv"  # device
    HOST = "host"
    FEATURES = "features"
    PERSISTED = "persisted"  # parked: in the persistent tier only


@dataclass
class HostKV:
    data: torch.Tensor  # the written blocks, as HostCopies.to_host returns them
    length: int  # tokens written
    nbytes: int


class Holding:
    """What one session (or an opening in progress) holds. Read-only outside the manager."""

    def __init__(self, image_key: bytes | None = None):
        self.label: str | None = None  # the session id, once the store adopts it
        self.image_key = image_key  # its image's content key; None: not shared (or no image)
        self.kv: SessionKV | None = None
        self.host: HostKV | None = None
        self.block_keys: list[bytes] = []  # content keys of its KV's first full blocks
        self.feature_blocks: list[int] = []
        self.feature_shape: tuple[int, int] | None = None
        self.pinned = True  # in a turn (or an opening): never moved by anyone else
        self.evicted = False
        self.persisted = False  # the persistent tier holds its features and history

    @property
    def tier(self) -> Tier:
        if self.kv is not None:
            return Tier.KV
        if self.host is not None:
            return Tier.HOST
        return Tier.PERSISTED if self.parked else Tier.FEATURES

    @property
    def parked(self) -> bool:
        """It has an image whose features are in no pool block (read back on its next turn)."""
        return self.feature_shape is not None and not self.feature_blocks

    @property
    def image_tokens(self) -> int:
        return 0 if self.feature_shape is None else self.feature_shape[0]

    @property
    def device_blocks(self) -> list[int]:
        """Every pool block it references: its features' and its KV's."""
        return self.feature_blocks + ([] if self.kv is None else self.kv.blocks)
