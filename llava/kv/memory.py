"""MemoryManager: the one owner of every byte a session holds, on the device and on the host.

A session's memory, hot to cold (docs/engine/memory.md §Memory policy):
- ``KV``: its KV in blocks of the device pool; a turn prefills only its new tokens.
- ``HOST``: its KV copied to host memory (pinned on CUDA); the next turn copies it back and
  answers exactly as it would have on device.
- ``FEATURES``: its KV dropped; the next turn re-prefills the history from the features.
- ``PERSISTED`` (parked): nothing in memory; the persistent tier (llava.sessions.persist) holds
  its features and history, and its next turn reads them back and re-prefills, exactly.
- gone: evicted whole, only when no tier can keep it; its id then answers SESSION_EVICTED.
Image features live in pool blocks too, so the pool *is* the device budget: KV and features
together can never exceed it; activations and graphs get the stated headroom beside it.

Prefixes are shared (docs/engine/memory.md §Shared prefixes): a new device KV starts on the
published blocks of the longest prefix it has in common with what any session computed, as
far as its keys let it find them (llava.kv.prefix), and an image's features are held once for
every session on that image. A shared block counts once; moving a session down lets go of its
references, so a block leaves the device only when no session there needs it, and even then
stays reusable until its room is needed.

One lock guards the pool's block map, the host bytes and every holding. Under device pressure
a reservation moves the least recently used idle sessions down, in one order
(``_make_room``; docs/engine/memory.md §Memory policy): device KV to free host room; then, once
the caller may no longer wait for running turns, device KV off (older host copies dropped to
make room, else the KV dropped), sessions parked, and only sessions that cannot be parked
evicted. A reservation that could not fit even so returns a ``Shortfall`` value (the loop waits
or answers Busy) and nobody loses anything for it. The store (llava.sessions.store) pins a
session for its turn and learns of evictions from ``drain_evicted``; the manager never calls
the store (lock order: store, then memory).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from llava.counters import Counters
from llava.errors import NoCapacity, log_id
from llava.kv.host_copies import HostCopies
from llava.kv.pool import KVPool, SessionKV
from llava.kv.prefix import feature_keys

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # a turn lasts seconds: by then running turns have ended and are idle


class Tier(enum.Enum):
    """Where a session's KV is (the reply's ``usage.tier`` for the turn that found it)."""

    KV = "kv"  # device
    HOST = "host"
    FEATURES = "features"
    PERSISTED = "persisted"  # parked: in the persistent tier only


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
    """A reservation that cannot be met now; nothing was taken and nobody lost anything
    (at most idle KV was copied to free host room)."""

    message: str
    retry_after_s: float = RETRY_AFTER_S


@dataclass(frozen=True)
class MemoryCounters(Counters):
    moved_to_host: int = 0  # device KV copied to host
    restored: int = 0  # host KV copied back for a turn
    demoted: int = 0  # KV dropped (from device or host): the next turn re-prefills
    evicted: int = 0  # whole sessions removed to free device memory (no tier could keep them)
    parked: int = 0  # sessions whose features left the device (the persistent tier keeps them)
    prefix_hits: int = 0  # device KVs started on blocks another session computed
    prefix_tokens: int = 0  # tokens of those blocks (not computed again)
    feature_hits: int = 0  # sessions given an image's features held already


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
    def device_blocks(self) -> int:
        return len(self.feature_blocks) + (0 if self.kv is None else len(self.kv.blocks))


class MemoryManager:
    def __init__(self, pool: KVPool, budget: MemoryBudget):
        if pool.total_blocks * pool.bytes_per_block > budget.device_bytes:
            raise ValueError("the pool is larger than the device budget")
        self.pool = pool
        self.budget = budget
        self._copies = HostCopies(pool)
        self._lock = threading.RLock()
        self._holdings: set[Holding] = set()
        self._idle: OrderedDict[Holding, None] = OrderedDict()  # unpinned, least recent first
        self._evicted: list[str] = []  # labels the store has not heard of yet
        self._sessions = {tier: 0 for tier in Tier}  # adopted holdings per tier
        self._feature_blocks = 0  # distinct pool blocks holding features
        self._feature_shapes: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # by image key
        self._host_bytes = 0
        self._counters = MemoryCounters()

    @classmethod
    def for_model(cls, text_config, budget: MemoryBudget, device, dtype) -> MemoryManager:
        return cls(KVPool(text_config, budget.device_bytes, device, dtype), budget)

    # -- a holding's life ------------------------------------------------------------------
    def hold(self, image_key: bytes | None = None) -> Holding:
        """A new, empty, pinned holding (an opening's); ``adopt`` or ``release`` it.
        ``image_key``: its image's content key, under which its features and prefix are
        shared (None: nothing shared)."""
        holding = Holding(image_key)
        with self._lock:
            self._holdings.add(holding)
        return holding

    def hold_parked(
        self, feature_shape: tuple[int, int] | None, image_key: bytes | None = None
    ) -> Holding:
        """A new pinned holding of a session the persistent tier keeps, adopted after a
        restart: parked (features of ``feature_shape`` on disk, nothing in memory; tier
        FEATURES for a session without an image); its next turn brings them back."""
        holding = self.hold(image_key)
        holding.feature_shape = feature_shape
        holding.persisted = True
        return holding

    def mark_persisted(self, holding: Holding, persisted: bool) -> None:
        """Whether the persistent tier now holds the session's features and history (a
        session it does not hold is evicted, not parked, when its room is needed)."""
        with self._lock:
            holding.persisted = persisted

    def holds_image(self, image_key: bytes) -> bool:
        """Whether the features of the image with this content key are in the pool."""
        with self._lock:
            return self._held_features(image_key) is not None

    def share_features(self, holding: Holding) -> bool:
        """Give a holding without features those of its image, if the pool holds them
        (referenced or reclaimable): True if it now has them, nothing computed or copied."""
        key = holding.image_key
        with self._lock:
            blocks = None if key is None or holding.feature_blocks else self._held_features(key)
            if blocks is None:
                return False
            shape = self._feature_shapes[key]
            self._feature_blocks += sum(self.pool.refs(b) == 0 for b in blocks)
            self.pool.share(blocks)
            self._feature_shapes.move_to_end(key)
            with self._retiering(holding):  # a parked one is parked no more
                holding.feature_blocks, holding.feature_shape = blocks, shape
            self._count(feature_hits=1)
            return True

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
                self._drop_features(holding)
            self._holdings.discard(holding)
            self._idle.pop(holding, None)
            if holding.label is not None:
                self._sessions[holding.tier] -= 1

    def evict(self, holding: Holding) -> None:
        """Remove it whole, as pressure would when no tier can keep it (a session whose
        parked state cannot be read back); its label goes to ``drain_evicted``."""
        with self._lock:
            if holding in self._holdings:
                self._evict(holding)

    def drain_evicted(self) -> list[str]:
        with self._lock:
            evicted, self._evicted = self._evicted, []
            return evicted

    # -- reservations (the engine loop's thread) -------------------------------------------
    def reserve(
        self,
        holding: Holding,
        extra_tokens: int,
        features: torch.Tensor | None = None,
        prefix: list[bytes] = (),
        may_drop: bool = True,
    ) -> Shortfall | None:
        """Device blocks for ``extra_tokens`` more KV tokens (a host copy comes back first)
        and, with ``features``, for the session's image features, stored now (a parked
        holding's must be given, read back from the persistent tier). A holding with
        no KV on the device starts on the longest run of ``prefix`` (the content keys of the
        ids it is about to hold: llava.kv.prefix) that is published; its host copy's own keys
        serve for that when it comes back; ``holding.kv.length`` then says what is there.
        Moves idle sessions down to make room (``_make_room``; ``may_drop`` False: only to free
        host room, the caller waiting for running turns rather than dropping anything);
        returns a Shortfall (taking nothing) if that is not enough; raises NoCapacity if the
        whole pool never could."""
        with self._lock:
            if holding.kv is not None:
                kv, new_kv = holding.kv, None
                total = kv.length + extra_tokens
                needed = self.pool.blocks_needed(kv, extra_tokens)
            else:
                host = holding.host
                total = (0 if host is None else host.length) + extra_tokens
                # shared blocks are taken first, so the room made below cannot reclaim them
                kv = new_kv = self.pool.new_kv()
                kv.attach(self.pool.match(holding.block_keys if host else list(prefix)))
                needed = blocks_for(total, self.pool.block_tokens) - len(kv.blocks)
            if features is not None and not holding.feature_blocks:
                needed += blocks_for(features.numel(), self.pool.block_numel)
            elif holding.parked:
                raise ValueError("a parked session's features must come back with it")
            else:
                features = None
            problem = self._never_fits(holding, new_kv, needed, total)
            shortfall = None if problem else self._make_room(needed, may_drop)
            if problem or shortfall:
                if new_kv is not None:
                    new_kv.free()
                if problem:
                    raise problem
                return shortfall
            with self._retiering(holding):
                if features is not None:
                    self._store_features(holding, features)
                if new_kv is None:
                    kv.reserve(extra_tokens)
                else:
                    self._start_kv(holding, new_kv, total, prefix)
            return None

    def publish(self, holding: Holding, keys: list[bytes]) -> None:
        """``keys``: the content keys of the full blocks of the holding's KV as committed now
        (llava.kv.prefix.block_keys): its blocks become reusable by any session that looks up
        the same keys (those the keys' salts allow: llava.kv.prefix)."""
        with self._lock:
            kv = holding.kv
            full = kv.length // self.pool.block_tokens
            for index in range(len(holding.block_keys), min(full, len(keys))):
                self.pool.publish(kv.blocks[index], keys[index])
            holding.block_keys = list(keys[:full])

    def features(self, holding: Holding) -> torch.Tensor | None:
        """The session's image features, read out of their blocks (a temporary tensor)."""
        with self._lock:
            if holding.feature_shape is None:
                return None
            rows, hidden = holding.feature_shape
            data = self.pool.read_blocks(holding.feature_blocks)
        return data.view(-1)[: rows * hidden].view(rows, hidden)

    def crop(self, holding: Holding, length: int) -> int:
        """Keep the first ``length`` KV tokens; whole blocks past them go back to the pool.
        Returns the length kept: less where ``length`` ends inside a shared block
        (llava.kv.pool.SessionKV.crop)."""
        with self._lock:
            kept = holding.kv.crop(length)
            del holding.block_keys[kept // self.pool.block_tokens :]
            return kept

    def rewind(self, holding: Holding, length: int) -> None:
        """Forget what a failed step wrote past ``length``, keeping the blocks reserved."""
        with self._lock:
            kv = holding.kv
            if kv.length > length:
                spare = kv.capacity - length
                self.crop(holding, length)  # past every shared block: all of it is kept
                kv.reserve(spare)  # the blocks the crop just gave back: it cannot fail

    def move_down(self, holding: Holding) -> Tier:
        """Move an idle holding one rung down now, as pressure would (device KV to host, or
        dropped if the host has no room; host KV dropped; features parked if the persistent
        tier holds them); returns its tier. For operators' tools and benchmarks: the manager
        moves sessions by itself under pressure."""
        with self._lock:
            if holding.pinned or holding.evicted:
                raise ValueError("only an idle session can be moved")
            if holding.kv is not None:
                self._move_kv_off_device(holding)
            elif holding.host is not None:
                with self._retiering(holding):
                    self._drop_host(holding)
                    self._count(demoted=1)
            elif holding.persisted and holding.feature_blocks:
                self._park(holding)
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
        """Walk everything: every block referenced exactly as often as block tables list it,
        or empty, or reclaimable; no published block written past; bytes per tier equal to
        the sum over holdings; no holding in two tiers; budgets kept. Returns the adopted
        labels."""
        with self._lock:
            pool = self.pool
            try:
                pool.check()
            except ValueError as e:
                raise IntegrityError(str(e)) from None
            references = dict.fromkeys(pool.aside, 1)  # the runner's (KVPool.set_aside)
            sessions, host_bytes, features = {t: 0 for t in Tier}, 0, set()
            for holding in self._holdings:
                _require(not holding.evicted, "an evicted holding is still held")
                _require(holding.kv is None or holding.host is None, "KV on device and host")
                blocks = _device_blocks(holding)
                _require(len(set(blocks)) == len(blocks), "a holding lists a block twice")
                for block in blocks:
                    references[block] = references.get(block, 0) + 1
                features.update(holding.feature_blocks)
                if holding.kv is not None:
                    self._check_kv(holding)
                host_bytes += 0 if holding.host is None else holding.host.nbytes
                if holding.label is not None:
                    sessions[holding.tier] += 1
                _require(holding.pinned != (holding in self._idle), "pinned and idle disagree")
                _require(holding.persisted or not holding.parked, "parked and not persisted")
            for block in range(pool.total_blocks):
                listed, counted = references.get(block, 0), pool.refs(block)
                _require(listed == counted, f"block {block}: listed {listed}x, counted {counted}x")
            _require(len(features) == self._feature_blocks, "feature blocks miscounted")
            _require(host_bytes == self._host_bytes, "host bytes miscounted")
            _require(host_bytes <= self.budget.host_bytes, "host budget exceeded")
            _require(sessions == self._sessions, "sessions per tier miscounted")
            return {h.label for h in self._holdings if h.label is not None}

    def _check_kv(self, holding: Holding) -> None:
        """Its keys name its blocks, and no published block lies where it writes next."""
        kv, pool = holding.kv, self.pool
        full = kv.length // pool.block_tokens
        _require(len(holding.block_keys) <= full, "keys for blocks not yet written")
        for index, block in enumerate(kv.blocks):
            key = pool.index.key_of(block)
            if index >= full:
                _require(key is None, f"block {block} is published and written past")
            elif key is not None:
                _require(key == holding.block_keys[index], f"block {block} has another's key")

    # -- internals (the caller holds self._lock) -------------------------------------------
    def _held_features(self, image_key: bytes) -> list[int] | None:
        """The blocks of an image's features, if all are still in the pool."""
        shape = self._feature_shapes.get(image_key)
        if shape is None:
            return None
        count = blocks_for(shape[0] * shape[1], self.pool.block_numel)
        blocks = self.pool.match(feature_keys(image_key, count))
        if len(blocks) < count:  # some were reclaimed: the rest go the same way
            del self._feature_shapes[image_key]
            return None
        return blocks

    def _never_fits(
        self, holding: Holding, new_kv: SessionKV | None, needed: int, total: int
    ) -> NoCapacity | None:
        held = holding.device_blocks + (0 if new_kv is None else len(new_kv.blocks))
        if needed + held <= self.pool.total_blocks:
            return None
        pool = self.pool
        return NoCapacity(
            f"this session needs {total} tokens of KV and its image, "
            "more than the server's whole device memory for sessions holds "
            f"({pool.total_blocks * pool.block_tokens} tokens); "
            "lower max_new_tokens or open a new session"
        )

    def _movable(self, idle: list[Holding]) -> int:
        """Blocks that moving every idle holding off the device would free: those that only
        idle holdings reference (a block shared with a pinned one stays)."""
        references: dict[int, int] = {}
        for holding in idle:
            for block in _device_blocks(holding):
                references[block] = references.get(block, 0) + 1
        return sum(count == self.pool.refs(block) for block, count in references.items())

    def _make_room(self, needed: int, may_drop: bool) -> Shortfall | None:
        """Free device blocks for ``needed``, moving idle sessions (least recently used
        first) down in this order, the one policy (docs/engine/memory.md §Memory policy):

        1. device KV to the host tier, while it has free room (restored exactly, by a copy);
        2. nothing more while ``may_drop`` is False: the caller waits for running turns,
           whose KV becomes movable as they end (bounded by the wait_for_room_s setting);
        3. device KV off: to the host, dropping older host copies, or dropped (recomputed
           from the features);
        4. sessions parked: their features leave the device (the persistent tier holds them);
        5. sessions no tier can keep evicted, each logged with why.

        Nobody moves when even all of that would not make the room (a Shortfall)."""
        pool = self.pool
        if needed <= pool.free_blocks:
            return None
        idle = list(self._idle)
        movable = self._movable(idle)
        if needed > pool.free_blocks + movable:
            return Shortfall(
                f"the device memory for sessions is full: this needs {needed} blocks, "
                f"{pool.free_blocks} are free and idle sessions hold {movable}; retry shortly"
            )
        steps = [(h, self._move_kv_to_free_host) for h in idle if h.kv is not None]
        if may_drop:
            steps += [(h, self._move_kv_off_device) for h in idle if h.kv is not None]
            steps += [(h, self._park) for h in idle if h.persisted and h.feature_blocks]
            steps += [(h, self._evict_for_room) for h in idle if not h.persisted]
        for holding, move in steps:  # each step leaves its holding held: none is evicted twice
            if needed <= pool.free_blocks:
                return None
            move(holding)
        if needed <= pool.free_blocks:
            return None
        return Shortfall(
            f"the device memory for sessions is full: this needs {needed} blocks, "
            f"{pool.free_blocks} are free; waiting for running turns to end"
        )

    def _move_kv_to_free_host(self, holding: Holding) -> None:
        """Step 1 of ``_make_room``: only if the host tier has room without dropping anyone."""
        if holding.kv is None:
            return
        nbytes = len(self._written_blocks(holding.kv)) * self.pool.bytes_per_block
        if self._host_bytes + nbytes <= self.budget.host_bytes:
            self._move_kv_off_device(holding)

    def _move_kv_off_device(self, holding: Holding) -> None:
        kv, pool = holding.kv, self.pool
        if kv is None:
            return
        written = self._written_blocks(kv)
        nbytes = len(written) * pool.bytes_per_block
        with self._retiering(holding):
            if written and self._host_room(nbytes, holding):
                holding.host = HostKV(self._copies.to_host(written), kv.length, nbytes)
                self._host_bytes += nbytes
                self._count(moved_to_host=1)
            else:
                self._count(demoted=1)
            self._drop_kv(holding)

    def _written_blocks(self, kv: SessionKV) -> list[int]:
        """The blocks holding its written tokens: what a host copy takes."""
        return kv.blocks[: blocks_for(kv.length, self.pool.block_tokens)]

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

    def _start_kv(self, holding: Holding, kv: SessionKV, total: int, prefix: list[bytes]) -> None:
        """The holding's new device KV, on ``kv``'s shared blocks, with room for ``total``
        tokens; a host copy comes back into the blocks past the shared ones."""
        shared, host = len(kv.blocks), holding.host
        if shared:
            self._count(prefix_hits=1, prefix_tokens=kv.length)
        kv.reserve(total - kv.length)
        if host is not None:
            written = host.data.shape[1]
            self._copies.to_device(host.data, kv.blocks[shared:written], skip=shared)
            kv.length = host.length
            self._drop_host(holding)
            self._count(restored=1)
        else:
            holding.block_keys = list(prefix[:shared])
        holding.kv = kv

    def _store_features(self, holding: Holding, features: torch.Tensor) -> None:
        """Features in new pool blocks, published under the holding's image key (if any)."""
        pool = self.pool
        count = blocks_for(features.numel(), pool.block_numel)
        blocks = pool.allocate(count)
        data = torch.zeros(pool.blocks_shape(count), dtype=pool.kv.dtype, device=pool.kv.device)
        data.view(-1)[: features.numel()] = features.reshape(-1).to(data.dtype)
        pool.write_blocks(blocks, data)
        holding.feature_blocks = blocks
        holding.feature_shape = (features.shape[0], features.shape[1])
        self._feature_blocks += count
        key = holding.image_key
        if key is not None:
            for block, block_key in zip(blocks, feature_keys(key, count), strict=True):
                pool.publish(block, block_key)
            self._feature_shapes[key] = holding.feature_shape
            self._feature_shapes.move_to_end(key)
            while len(self._feature_shapes) > pool.total_blocks:  # more than could be held
                self._feature_shapes.popitem(last=False)

    def _park(self, holding: Holding) -> None:
        """Everything it holds in memory goes; the persistent tier keeps its features and
        history, and its next turn brings them back (``reserve`` with its features)."""
        with self._retiering(holding):
            self._drop_kv(holding)
            self._drop_host(holding)
            self._drop_features(holding)
        self._count(parked=1)

    def _evict_for_room(self, holding: Holding) -> None:
        """Step 5 of ``_make_room``: a session no tier can keep goes, if that frees anything."""
        if holding.device_blocks:
            logger.warning(
                "session %s evicted to free device memory: the persistent tier does not hold "
                "it (off, full, or its write failed)",
                log_id(holding.label),
            )
            self._evict(holding)

    def _evict(self, holding: Holding) -> None:
        label = holding.label
        self.release(holding)
        holding.evicted = True
        self._evicted.append(label)
        self._count(evicted=1)

    def _drop_features(self, holding: Holding) -> None:
        """Its references to its features' blocks go (a block no one references is free, and
        stays reusable under its image's key until its room is needed)."""
        blocks = holding.feature_blocks
        self._feature_blocks -= sum(self.pool.refs(b) == 1 for b in blocks)
        self.pool.give_back(blocks)
        holding.feature_blocks = []

    @staticmethod
    def _drop_kv(holding: Holding) -> None:
        if holding.kv is not None:
            holding.kv.free()
            holding.kv = None

    def _drop_host(self, holding: Holding) -> None:
        if holding.host is not None:
            self._host_bytes -= holding.host.nbytes
            self._copies.release(holding.host.data)
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


def _device_blocks(holding: Holding) -> list[int]:
    return holding.feature_blocks + ([] if holding.kv is None else holding.kv.blocks)


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise IntegrityError(problem)
