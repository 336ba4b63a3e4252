"""Counters kept as frozen snapshots: a reader gets a consistent copy without a lock."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self


@dataclass(frozen=True)
class Counters:
    def plus(self, **increments: int) -> Self:
        """A copy with ``increments`` added to the named counts."""
        return replace(self, **{name: getattr(self, name) + n for name, n in increments.items()})
