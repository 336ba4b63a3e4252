"""What one session holds, read by everyone and changed only by the memory manager
(llava.kv.memory): its device KV, its host copy, its images' features' blocks, and the tier
those make."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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


@dataclass(eq=False)
class HeldImage:
    """One image of a session: its features' shape and the pool blocks holding them (none:
    parked, the persistent tier keeps them)."""

    key: bytes | None  # its content key, under which features and prefix are shared; None: not
    shape: tuple[int, int]  # (image tokens, hidden)
    blocks: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.shape[0]


@dataclass(frozen=True)
class NewImage:
    """An image a reservation adds to a holding: shared from the pool under ``key`` when it
    holds the features, else ``features`` are stored."""

    key: bytes | None
    features: torch.Tensor | None = None  # (image tokens, hidden); None: the pool holds them


class Holding:
    """What one session (or an opening in progress) holds. Read-only outside the manager."""

    def __init__(self):
        self.label: str | None = None  # the session id, once the store adopts it
        self.kv: SessionKV | None = None
        self.host: HostKV | None = None
        self.block_keys: list[bytes] = []  # content keys of its KV's first full blocks
        self.images: list[HeldImage] = []  # in the order the conversation shows them
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
        return any(not image.blocks for image in self.images)

    @property
    def image_tokens(self) -> int:
        return sum(image.tokens for image in self.images)

    @property
    def feature_blocks(self) -> list[int]:
        """The pool blocks of every image's features (an image held twice: listed twice)."""
        return [block for image in self.images for block in image.blocks]

    @property
    def device_blocks(self) -> list[int]:
        """Every pool block it references: its features' and its KV's."""
        return self.feature_blocks + ([] if self.kv is None else self.kv.blocks)
