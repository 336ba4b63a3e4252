"""MemoryManager: the one owner of every byte a session holds, on the device and on the host.

A session's memory, hot to cold (docs/engine/memory.md §Memory policy):
- ``KV``: its KV in blocks of the device pool; a turn prefills only its new tokens.
- ``HOST``: its KV copied to host memory (pinned on CUDA); the next turn copies it back and
  answers exactly as it would have on device.
- ``FEATURES``: its KV dropped; the next turn re-prefills the history from the features.
- gone: evicted whole; its id then answers SESSION_EVICTED.
Image features live in pool blocks too, so the pool *is* the device budget: KV and features
together can never exceed it; activations and graphs get the stated headroom beside it.

One lock guards the pool's block map, the host bytes and every holding. Under device pressure
a reservation moves the least recently used idle sessions down one rung at a time: device KV
to host (older host copies dropped to make room), then whole sessions out. A reservation that
could not fit even so returns a ``Shortfall`` value (the loop waits or answers Busy) and moves
nobody. The store (llava.sessions.store) pins a session for its turn and learns of evictions from
``drain_evicted``; the manager never calls the store (lock order: store, then memory).
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from llava.counters import Counters
from llava.errors import NoCapacity
from llava.kv.pool import KVPool, SessionKV

RETRY_AFTER_S = 1.0  # a turn lasts seconds: by then running turns have ended and are idle


class Tier(enum.Enum):
    """Where a session's KV is (the reply's ``usage.tier`` for the turn that found it)."""

    KV = "kv"  # device
    HOST = "host"
    FEATURES = "features"


# -- accounting a capacity tool can call (whole blocks, as the pool hands them out) --------
def blocks_for(count: int, per_block: int) -> int:
    return -(-count // per_block)


def session_kv_bytes(tokens: int, bytes_per_token: int, block_tokens: int) -> int:
    """Device bytes of a KV of ``tokens`` tokens; its host-tier copy takes the same."""
    return blocks_for(tokens, block_tokens) * block_tokens * bytes_per_token


def session_feature_bytes(
    image_tokens: int, hidden_size: int, element_size: int, bytes_per_block: int
) -> int:
    """Device bytes of one session's image features, stored in whole pool blocks."""
    elements_per_block = bytes_per_block // element_size
    return blocks_for(image_tokens * hidden_size, elements_per_block) * bytes_per_block


@dataclass(frozen=True)
class MemoryBudget:
    """``device_bytes``: the pool (KV and features); ``headroom_bytes``: device memory left
    beside it for activations and graphs (stated, not allocated); ``host_bytes``: host KV."""

    device_bytes: int
    host_bytes: int = 0
    headroom_bytes: int = 0

    def __post_init__(self):
        if self.device_bytes <= 0 or self.host_bytes < 0 or self.headroom_bytes < 0:
            raise ValueError(f"bad memory budget {self}")


@dataclass(frozen=True)
class Shortfall:
    """A reservation that cannot be met now; nothing was taken and nobody was moved."""

    message: str
    retry_after_s: float = RETRY_AFTER_S


@dataclass(frozen=True)
class MemoryCounters(Counters):
    moved_to_host: int = 0  # device KV copied to host
    restored: int = 0  # host KV copied back for a turn
    demoted: int = 0  # KV dropped (from device or host): the next turn re-prefills
    evicted: int = 0  # whole sessions removed to free device memory


@dataclass(frozen=True)
class MemoryStats:
    sessions_by_tier: dict[Tier, int]
    bytes_by_tier: dict[Tier, int]  # KV: device KV; HOST: host KV; FEATURES: device features
    budget: MemoryBudget
    counters: MemoryCounters


class IntegrityError(AssertionError):
    """The manager's books disagree with what it holds (a bug, never a request's fault)."""


@dataclass
class HostKV:
    data: torch.Tensor  # the written blocks, as KVPool.read_blocks returns them
    length: int  # tokens written
    nbytes: int


class Holding:
    """What one session (or an opening in progress) holds. Read-only outside the manager."""

    def __init__(self):
        self.label: str | None = None  # the session id, once the store adopts it
        self.kv: SessionKV | None = None
        self.host: HostKV | None = None
        self.feature_blocks: list[int] = []
        self.feature_shape: tuple[int, int] | None = None
        self.pinned = True  # in a turn (or an opening): never moved by anyone else
        self.evicted = False

    @property
    def tier(self) -> Tier:
        if self.kv is not None:
            return Tier.KV
        return Tier.HOST if self.host is not None else Tier.FEATURES

    @property
    def device_blocks(self) -> int:
        return len(self.feature_blocks) + (0 if self.kv is None else len(self.kv.blocks))


class _HostCopies:
    """Device ↔ host copies of whole blocks. On CUDA into pinned memory on a side stream (the
    compute stream waits for it before the blocks are reused); on CPU a plain copy."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        device = pool.kv.device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, blocks: list[int]) -> torch.Tensor:
        if not self.cuda:
            return self.pool.read_blocks(blocks)
        shape, dtype = self.pool.blocks_shape(len(blocks)), self.pool.kv.dtype
        out = torch.empty(shape, dtype=dtype, pin_memory=True)
        with self._on_side_stream():
            self.pool.read_blocks(blocks, out)
        return out

    def to_device(self, blocks: list[int], data: torch.Tensor) -> None:
        with self._on_side_stream():
            self.pool.write_blocks(blocks, data)

    @contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        compute = torch.cuda.current_stream(self.pool.kv.device)
        self.stream.wait_stream(compute)  # the blocks hold what earlier steps wrote
        with torch.cuda.stream(self.stream):
            yield
        compute.wait_stream(self.stream)  # later steps see (and may overwrite) after the copy


class MemoryManager:
    def __init__(self, pool: KVPool, budget: MemoryBudget):
        if pool.total_blocks * pool.bytes_per_block > budget.device_bytes:
            raise ValueError("the pool is larger than the device budget")
        self.pool = pool
        self.budget = budget
        self._copies = _HostCopies(pool)
        self._lock = threading.RLock()
        self._holdings: set[Holding] = set()
        self._idle: OrderedDict[Holding, None] = OrderedDict()  # unpinned, least recent first
        self._evicted: list[str] = []  # labels the store has not heard of yet
        self._sessions = {tier: 0 for tier in Tier}  # adopted holdings per tier
        self._feature_blocks = 0
        self._host_bytes = 0
        self._counters = MemoryCounters()

    @classmethod
    def for_model(cls, text_config, budget: MemoryBudget, device, dtype) -> MemoryManager:
        return cls(KVPool(text_config, budget.device_bytes, device, dtype), budget)

    # -- a holding's life ------------------------------------------------------------------
    def hold(self) -> Holding:
        """A new, empty, pinned holding (an opening's); ``adopt`` or ``release`` it."""
        holding = Holding()
        with self._lock:
            self._holdings.add(holding)
        return holding

    def hold_features(self, features: torch.Tensor | None) -> Holding | None:
        """A new pinned holding with ``features`` in pool blocks and no KV (tier FEATURES: the
        next turn re-prefills), for a session adopted from the persistent tier; None if the
        free blocks cannot take them (nobody is moved for a session no one is waiting on)."""
        holding = self.hold()
        if features is None:
            return holding
        with self._lock:
            if blocks_for(features.numel(), self.pool.block_numel) > self.pool.free_blocks:
                self.release(holding)
                return None
            self._store_features(holding, features)
        return holding

    def adopt(self, holding: Holding, label: str) -> None:
        """The store took it as session ``label``: counted, and movable once unpinned."""
        with self._lock:
            holding.label = label
            self._sessions[holding.tier] += 1
            self.unpin(holding)

    def pin(self, holding: Holding) -> bool:
        """Hold it for a turn; False if it was evicted (the store then forgets it)."""
        with self._lock:
            if holding.evicted:
                return False
            holding.pinned = True
            self._idle.pop(holding, None)
            return True

    def unpin(self, holding: Holding) -> None:
        """The turn ended: it is the most recently used idle holding."""
        with self._lock:
            if holding.evicted or holding not in self._holdings:
                return
            holding.pinned = False
            self._idle.pop(holding, None)
            self._idle[holding] = None

    def release(self, holding: Holding) -> None:
        """Free everything it holds (closed, expired, a failed opening). Idempotent."""
        with self._lock:
            if holding not in self._holdings:
                return
            with self._retiering(holding):
                self._drop_kv(holding)
                self._drop_host(holding)
                self.pool.give_back(holding.feature_blocks)
                self._feature_blocks -= len(holding.feature_blocks)
                holding.feature_blocks = []
            self._holdings.discard(holding)
            self._idle.pop(holding, None)
            if holding.label is not None:
                self._sessions[holding.tier] -= 1

    def drain_evicted(self) -> list[str]:
        with self._lock:
            evicted, self._evicted = self._evicted, []
            return evicted

    # -- reservations (the engine loop's thread) -------------------------------------------
    def reserve(
        self, holding: Holding, extra_tokens: int, features: torch.Tensor | None = None
    ) -> Shortfall | None:
        """Device blocks for ``extra_tokens`` more KV tokens (a host copy comes back first)
        and, with ``features``, for the session's image features, stored now. Moves idle
        sessions down to make room; returns a Shortfall (taking nothing) if even moving every
        idle one would not; raises NoCapacity if the whole pool could never hold it."""
        pool = self.pool
        with self._lock:
            kv = holding.kv
            held = kv.length if kv is not None else holding.host.length if holding.host else 0
            if kv is not None:
                needed = pool.blocks_needed(kv, extra_tokens)
            else:
                needed = blocks_for(held + extra_tokens, pool.block_tokens)
            feature_blocks = 0
            if features is not None and not holding.feature_blocks:
                feature_blocks = blocks_for(features.numel(), pool.block_numel)
            if needed + feature_blocks + holding.device_blocks > pool.total_blocks:
                raise NoCapacity(
                    f"this session needs {held + extra_tokens} tokens of KV and its image, "
                    "more than the server's whole device memory for sessions holds "
                    f"({pool.total_blocks * pool.block_tokens} tokens); "
                    "lower max_new_tokens or open a new session"
                )
            shortfall = self._make_room(needed + feature_blocks)
            if shortfall is not None:
                return shortfall
            with self._retiering(holding):
                if feature_blocks:
                    self._store_features(holding, features)
                if kv is not None:
                    kv.reserve(extra_tokens)
                else:
                    self._new_kv(holding, extra_tokens)
            return None

    def features(self, holding: Holding) -> torch.Tensor | None:
        """The session's image features, read out of their blocks (a temporary tensor)."""
        with self._lock:
            if holding.feature_shape is None:
                return None
            rows, hidden = holding.feature_shape
            data = self.pool.read_blocks(holding.feature_blocks)
        return data.view(-1)[: rows * hidden].view(rows, hidden)

    def crop(self, holding: Holding, length: int) -> None:
        """Keep the first ``length`` KV tokens; whole blocks past them go back to the pool."""
        with self._lock:
            holding.kv.crop(length)

    def rewind(self, holding: Holding, length: int) -> None:
        """Forget what a failed step wrote past ``length``, keeping the blocks reserved."""
        with self._lock:
            kv = holding.kv
            if kv.length > length:
                spare = kv.capacity - length
                kv.crop(length)
                kv.reserve(spare)  # the blocks the crop just gave back: it cannot fail

    def move_down(self, holding: Holding) -> Tier:
        """Move an idle holding one rung down now, as pressure would (device KV to host, or
        dropped if the host has no room; host KV dropped); returns its tier. For operators'
        tools and benchmarks: the manager moves sessions by itself under pressure."""
        with self._lock:
            if holding.pinned or holding.evicted:
                raise ValueError("only an idle session can be moved")
            if holding.kv is not None:
                self._move_kv_off_device(holding)
            elif holding.host is not None:
                with self._retiering(holding):
                    self._drop_host(holding)
                    self._count(demoted=1)
            return holding.tier

    def drop_kv(self, holding: Holding) -> None:
        """A failed turn's KV (it may hold part of the turn) goes; history and features stay."""
        with self._lock, self._retiering(holding):
            if holding.kv is not None:
                self._drop_kv(holding)
                self._count(demoted=1)

    # -- views -----------------------------------------------------------------------------
    def opening_bytes(self) -> int:
        """Device bytes held by openings not yet adopted as sessions (opens in flight)."""
        with self._lock:
            blocks = sum(h.device_blocks for h in self._holdings if h.label is None)
            return blocks * self.pool.bytes_per_block

    def held_bytes(self, holding: Holding) -> int:
        """Everything ``holding`` holds now: device blocks and its host copy."""
        with self._lock:
            host = 0 if holding.host is None else holding.host.nbytes
            return holding.device_blocks * self.pool.bytes_per_block + host

    def stats(self) -> MemoryStats:
        with self._lock:
            pool = self.pool
            used = pool.total_blocks - pool.free_blocks
            return MemoryStats(
                dict(self._sessions),
                {
                    Tier.KV: (used - self._feature_blocks) * pool.bytes_per_block,
                    Tier.HOST: self._host_bytes,
                    Tier.FEATURES: self._feature_blocks * pool.bytes_per_block,
                },
                self.budget,
                self._counters,
            )

    def check_integrity(self) -> set[str]:
        """Walk everything: every block owned once or free, bytes per tier equal to the sum
        over holdings, no holding in two tiers, budgets kept. Returns the adopted labels."""
        with self._lock:
            pool, owner = self.pool, {}
            sessions, host_bytes, feature_blocks = {t: 0 for t in Tier}, 0, 0
            for holding in self._holdings:
                _require(not holding.evicted, "an evicted holding is still held")
                _require(holding.kv is None or holding.host is None, "KV on device and host")
                blocks = list(holding.feature_blocks)
                blocks += [] if holding.kv is None else holding.kv.blocks
                for block in blocks:
                    _require(block not in owner, f"block {block} owned twice")
                    _require(not pool.is_free(block), f"block {block} owned and free")
                    owner[block] = holding
                feature_blocks += len(holding.feature_blocks)
                host_bytes += 0 if holding.host is None else holding.host.nbytes
                if holding.label is not None:
                    sessions[holding.tier] += 1
                _require(holding.pinned != (holding in self._idle), "pinned and idle disagree")
            free = sum(pool.is_free(b) for b in range(pool.total_blocks))
            _require(free == pool.free_blocks, "the free count is not the free map")
            _require(len(owner) + free == pool.total_blocks, "a block neither owned nor free")
            _require(feature_blocks == self._feature_blocks, "feature blocks miscounted")
            _require(host_bytes == self._host_bytes, "host bytes miscounted")
            _require(host_bytes <= self.budget.host_bytes, "host budget exceeded")
            _require(sessions == self._sessions, "sessions per tier miscounted")
            return {h.label for h in self._holdings if h.label is not None}

    # -- internals (the caller holds self._lock) -------------------------------------------
    def _make_room(self, needed: int) -> Shortfall | None:
        pool = self.pool
        if needed <= pool.free_blocks:
            return None
        idle = list(self._idle)
        movable = sum(h.device_blocks for h in idle)
        if needed > pool.free_blocks + movable:
            return Shortfall(
                f"the device memory for sessions is full: this needs {needed} blocks, "
                f"{pool.free_blocks} are free and idle sessions hold {movable}; retry shortly"
            )
        for holding in idle:  # device KV → host (or dropped), least recently used first
            if needed <= pool.free_blocks:
                return None
            if holding.kv is not None:
                self._move_kv_off_device(holding)
        for holding in idle:  # still short: whole sessions go, features and all
            if needed <= pool.free_blocks:
                return None
            self._evict(holding)
        return None

    def _move_kv_off_device(self, holding: Holding) -> None:
        kv, pool = holding.kv, self.pool
        written = kv.blocks[: blocks_for(kv.length, pool.block_tokens)]
        nbytes = len(written) * pool.bytes_per_block
        with self._retiering(holding):
            if written and self._host_room(nbytes, holding):
                holding.host = HostKV(self._copies.to_host(written), kv.length, nbytes)
                self._host_bytes += nbytes
                self._count(moved_to_host=1)
            else:
                self._count(demoted=1)
            self._drop_kv(holding)

    def _host_room(self, nbytes: int, newcomer: Holding) -> bool:
        """Make room on the host for ``nbytes`` by dropping host copies of sessions used
        before ``newcomer``; True if it fits."""
        budget = self.budget.host_bytes
        for holding in self._idle:
            if self._host_bytes + nbytes <= budget or holding is newcomer:
                break
            if holding.host is not None:
                with self._retiering(holding):
                    self._drop_host(holding)
                    self._count(demoted=1)
        return self._host_bytes + nbytes <= budget

    def _new_kv(self, holding: Holding, extra_tokens: int) -> None:
        """A device KV for the turn; a host copy, if any, comes back into its first blocks."""
        kv, host = self.pool.new_kv(), holding.host
        kv.reserve((0 if host is None else host.length) + extra_tokens)
        if host is not None:
            self._copies.to_device(kv.blocks[: host.data.shape[3]], host.data)
            kv.length = host.length
            self._drop_host(holding)
            self._count(restored=1)
        holding.kv = kv

    def _store_features(self, holding: Holding, features: torch.Tensor) -> None:
        pool = self.pool
        count = blocks_for(features.numel(), pool.block_numel)
        blocks = pool.allocate(count)
        data = torch.zeros(pool.blocks_shape(count), dtype=pool.kv.dtype, device=pool.kv.device)
        data.view(-1)[: features.numel()] = features.reshape(-1).to(data.dtype)
        pool.write_blocks(blocks, data)
        holding.feature_blocks = blocks
        holding.feature_shape = (features.shape[0], features.shape[1])
        self._feature_blocks += count

    def _evict(self, holding: Holding) -> None:
        label = holding.label
        self.release(holding)
        holding.evicted = True
        self._evicted.append(label)
        self._count(evicted=1)

    @staticmethod
    def _drop_kv(holding: Holding) -> None:
        if holding.kv is not None:
            holding.kv.free()
            holding.kv = None

    def _drop_host(self, holding: Holding) -> None:
        if holding.host is not None:
            self._host_bytes -= holding.host.nbytes
            holding.host = None

    @contextmanager
    def _retiering(self, holding: Holding) -> Iterator[None]:
        """Keep sessions per tier counted across a change of ``holding``."""
        before = holding.tier
        try:
            yield
        finally:
            if holding.label is not None and holding.tier is not before:
                self._sessions[before] -= 1
                self._sessions[holding.tier] += 1

    def _count(self, **increments: int) -> None:
        self._counters = self._counters.plus(**increments)


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise IntegrityError(problem)
