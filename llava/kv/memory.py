"""MemoryManager: the one owner of every byte a session holds, on the device and on the host.

A session's memory, hot to cold: device KV, a host copy, features only, parked (the persistent
tier alone holds it), gone; image features live in pool blocks too, so the pool *is* the
device budget, and shared blocks count once (docs/engine/memory.md §Memory policy, §Shared
prefixes). One verb per moment of a turn, called by the session's lease (llava.sessions.lease)
alone: ``restore``, ``start``, ``grow``, then ``crop`` and ``publish``, or ``drop_kv``. Each
makes room down the one ladder (``_make_room``) or returns a ``Shortfall``, taking nothing.
This module keeps the ladder and the books; the feature store (llava.kv.features), the host
tier (llava.kv.host_tier) and the audit (llava.kv.integrity) are their own. One lock guards
them all, taken after the store's (llava.sessions.store), which it never calls: evictions
reach the store through ``drain_evicted``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from llava.counters import Counters
from llava.errors import NoCapacity, log_id
from llava.kv.budget import MemoryBudget, blocks_for
from llava.kv.features import FeatureStore, Shared
from llava.kv.holding import HeldImage, Holding, NewImage, Tier
from llava.kv.host_tier import HostTier
from llava.kv.integrity import require, walk
from llava.kv.pool import KVPool, SessionKV

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # a turn lasts seconds: by then running turns have ended and are idle


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


class MemoryManager:
    def __init__(self, pool: KVPool, budget: MemoryBudget):
        if pool.total_blocks * pool.bytes_per_block > budget.device_bytes:
            raise ValueError("the pool is larger than the device budget")
        self.pool = pool
        self.budget = budget
        self._host = HostTier(pool, budget.host_bytes)
        self._features = FeatureStore(pool)
        self._lock = threading.RLock()
        self._holdings: set[Holding] = set()
        self._idle: OrderedDict[Holding, None] = OrderedDict()  # unpinned, least recent first
        self._evicted: list[str] = []  # labels the store has not heard of yet
        self._sessions = {tier: 0 for tier in Tier}  # adopted holdings per tier
        self._counters = MemoryCounters()

    # -- a holding's life ------------------------------------------------------------------
    def hold(self) -> Holding:
        """A new, empty, pinned holding (an opening's); ``adopt`` or ``release`` it."""
        holding = Holding()
        with self._lock:
            self._holdings.add(holding)
        return holding

    def hold_parked(self, images: Sequence[tuple[bytes | None, tuple[int, int]]]) -> Holding:
        """A new pinned holding of a session adopted from the persistent tier: parked
        (nothing in memory; tier FEATURES without an image); its next turn brings it back.
        ``images``: each image's content key (None: not shared) and features' shape."""
        holding = self.hold()
        holding.images = [HeldImage(key, shape) for key, shape in images]
        holding.persisted = True
        return holding

    def mark_persisted(self, holding: Holding, persisted: bool) -> None:
        """Whether the persistent tier holds the session (else it is evicted, not parked)."""
        with self._lock:
            holding.persisted = persisted

    def image_shape(self, image_key: bytes) -> tuple[int, int] | None:
        """The shape of the features of the image with this content key, if the pool holds
        them (None: it does not)."""
        with self._lock:
            return self._features.shape(image_key)

    def share_features(self, holding: Holding) -> bool:
        """Give a parked holding's images the features the pool holds for them (referenced or
        reclaimable), nothing computed or copied: True if none is parked now."""
        with self._lock, self._retiering(holding):  # a parked one may be parked no more
            for image in holding.images:
                if not image.blocks and image.key is not None:
                    found = self._features.share(image.key)
                    if found is not None:
                        image.blocks = found[0]
                        self._count(feature_hits=1)
            return not holding.parked

    def drop_images(self, holding: Holding, images: Sequence[HeldImage]) -> None:
        """The session holds these images no more (a failed turn's new one, or those of the
        turns a rewind dropped): their features' references go."""
        with self._lock, self._retiering(holding):
            for image in images:
                self._features.let_go(image.blocks)
                holding.images.remove(image)

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

    # -- a turn's reservations (the engine loop's thread): each makes room (``_make_room``;
    # ``may_drop`` False: only free host room), returns a Shortfall (taking nothing) if that
    # is not enough, and raises NoCapacity if the whole pool never could.
    def restore(self, holding: Holding, may_drop: bool = True) -> Shortfall | None:
        """Its host copy back on the device, exactly: on the published blocks of its own
        first keys where they are still in the pool, copied into new blocks past them."""
        with self._lock:
            if holding.kv is not None or holding.host is None:
                raise ValueError("only a host copy is restored")
            return self._start(holding, holding.host.length, holding.block_keys, (), (), may_drop)

    def start(
        self,
        holding: Holding,
        tokens: int,
        prefix: list[bytes] = (),
        features: Sequence[torch.Tensor | None] = (),
        images: Sequence[NewImage] = (),
        may_drop: bool = True,
    ) -> Shortfall | None:
        """A new device KV with room for ``tokens`` tokens, on the longest published run of
        ``prefix`` (the content keys of the ids it will hold; ``holding.kv.length`` says how
        much). ``features``: those of its images, one per image, stored for every parked one
        (a parked image's must be given); ``images``: new images it holds from now on, in
        the order its prompt shows them."""
        with self._lock:
            if holding.kv is not None or holding.host is not None:
                raise ValueError("a holding with KV grows or is restored; it does not start")
            return self._start(holding, tokens, list(prefix), features, images, may_drop)

    def grow(
        self,
        holding: Holding,
        extra_tokens: int,
        images: Sequence[NewImage] = (),
        may_drop: bool = True,
    ) -> Shortfall | None:
        """Room for ``extra_tokens`` more tokens in its device KV; ``images``: new images it
        holds from now on."""
        with self._lock:
            kv = holding.kv
            shared = self._share_new(images)
            needed = self.pool.blocks_needed(kv, extra_tokens) + self._to_store(images)
            total = kv.length + extra_tokens
            shortfall = self._room_for(holding, None, needed, total, may_drop, shared)
            if shortfall is not None:
                return shortfall
            kv.reserve(extra_tokens)
            self._add_new(holding, images, shared)  # its tier stays KV
            return None

    def publish(self, holding: Holding, keys: list[bytes]) -> None:
        """Its full blocks become reusable under ``keys``, their content keys as committed
        now (llava.kv.prefix.block_keys), by the sessions the keys' salts allow."""
        with self._lock:
            kv = holding.kv
            full = kv.length // self.pool.block_tokens
            for index in range(len(holding.block_keys), min(full, len(keys))):
                self.pool.publish(kv.blocks[index], keys[index])
            holding.block_keys = list(keys[:full])

    def features(
        self, holding: Holding, images: Sequence[HeldImage] | None = None
    ) -> torch.Tensor | None:
        """The features of ``images`` (default: all of the session's), one after the other,
        read out of their blocks (a temporary tensor); None without any image."""
        with self._lock:
            images = holding.images if images is None else images
            if not images:
                return None
            parts = [self._features.read(image.blocks, image.shape) for image in images]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

    def image_features(self, image_key: bytes) -> torch.Tensor | None:
        """A host copy of the features the pool holds for this image (None: it holds none),
        referenced while they are read so that no one reuses their blocks meanwhile."""
        with self._lock:
            found = self._features.share(image_key)
        if found is None:
            return None
        try:
            return self._features.read(*found).to("cpu")
        finally:
            with self._lock:
                self._features.let_go(found[0])

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
        """Move an idle holding one rung down now, as pressure would; returns its tier (for
        tools and benchmarks: pressure moves sessions by itself)."""
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
            blocks = sum(len(h.device_blocks) for h in self._holdings if h.label is None)
            return blocks * self.pool.bytes_per_block

    def held_bytes(self, holding: Holding) -> int:
        """Everything ``holding`` holds now: device blocks and its host copy."""
        with self._lock:
            host = 0 if holding.host is None else holding.host.nbytes
            return len(holding.device_blocks) * self.pool.bytes_per_block + host

    def stats(self) -> MemoryStats:
        with self._lock:
            pool = self.pool
            used = pool.total_blocks - pool.free_blocks
            return MemoryStats(
                dict(self._sessions),
                {
                    Tier.KV: (used - self._features.blocks) * pool.bytes_per_block,
                    Tier.HOST: self._host.bytes,
                    Tier.FEATURES: self._features.blocks * pool.bytes_per_block,
                },
                self.budget,
                self._counters,
            )

    def check_integrity(self) -> set[str]:
        """Raise IntegrityError unless the books (sessions per tier, host bytes, feature
        blocks) equal what the holdings hold (llava.kv.integrity.walk) and the budgets are
        kept. Returns the adopted labels."""
        with self._lock:
            walked = walk(self.pool, self._holdings, self._idle)
            require(walked.feature_blocks == self._features.blocks, "feature blocks miscounted")
            require(walked.host_bytes == self._host.bytes, "host bytes miscounted")
            require(walked.host_bytes <= self.budget.host_bytes, "host budget exceeded")
            require(walked.sessions_by_tier == self._sessions, "sessions per tier miscounted")
            return walked.labels

    # -- internals (the caller holds self._lock) -------------------------------------------
    def _start(
        self,
        holding: Holding,
        total: int,
        prefix: list[bytes],
        features: Sequence[torch.Tensor | None],
        images: Sequence[NewImage],
        may_drop: bool,
    ) -> Shortfall | None:
        # shared blocks are taken first, so the room made for the rest cannot reclaim them
        given = dict(enumerate(features))  # one per image, or none when nothing is parked
        parked = [(held, given.get(i)) for i, held in enumerate(holding.images) if not held.blocks]
        if any(f is None for _, f in parked):
            raise ValueError("a parked session's features must come back with it")
        shared = self._share_new(images)
        kv = self.pool.new_kv()
        kv.attach(self.pool.match(prefix))
        needed = blocks_for(total, self.pool.block_tokens) - len(kv.blocks)
        needed += sum(self._features.blocks_for(f) for _, f in parked)
        needed += self._to_store(images)
        shortfall = self._room_for(holding, kv, needed, total, may_drop, shared)
        if shortfall is not None:
            return shortfall
        with self._retiering(holding):
            for held, f in parked:
                held.blocks = self._features.store(held.key, f)[0]
            self._add_new(holding, images, shared)
            self._start_kv(holding, kv, total, prefix)
        return None

    def _room_for(
        self,
        holding: Holding,
        new_kv: SessionKV | None,
        needed: int,
        total: int,
        may_drop: bool,
        shared: Sequence[Shared | None] = (),
    ) -> Shortfall | None:
        """Make room for ``needed`` more blocks (``_make_room``); on a Shortfall, or when the
        whole pool never could (NoCapacity, raised), ``new_kv``'s shared blocks and the
        ``shared`` references of new images (``_share_new``) go back."""
        held = len(holding.device_blocks) + (0 if new_kv is None else len(new_kv.blocks))
        try:
            if needed + held > self.pool.total_blocks:
                raise NoCapacity(
                    f"this session needs {total} tokens of KV and its images, "
                    "more than the server's whole device memory for sessions holds "
                    f"({self.pool.total_blocks * self.pool.block_tokens} tokens); "
                    "lower max_new_tokens or open a new session"
                )
            shortfall = self._make_room(needed, may_drop)
        except BaseException:
            self._give_back_new(new_kv, shared)
            raise
        if shortfall is not None:
            self._give_back_new(new_kv, shared)
        return shortfall

    def _share_new(self, images: Sequence[NewImage]) -> list[Shared | None]:
        """A reference to each new image's features the pool holds (FeatureStore.share_new),
        taken before any room is made. An image shown twice among them is stored once: the
        later ones share the first one's blocks (``_add_new``)."""
        shared, seen = [], set()
        for image in images:
            repeated = image.key is not None and image.key in seen
            shared.append(None if repeated else self._features.share_new(image))
            seen.add(image.key)
        return shared

    def _to_store(self, images: Sequence[NewImage]) -> int:
        """The blocks the new images' features take where they are not shared."""
        stored, total = set(), 0
        for image in images:
            if image.key is None or image.key not in stored:
                total += self._features.to_store(image)
            stored.add(image.key)
        return total

    def _add_new(
        self, holding: Holding, images: Sequence[NewImage], shared: Sequence[Shared | None]
    ) -> None:
        """The new images join the holding, on shared blocks or stored now (once each)."""
        for image, found in zip(images, shared, strict=True):
            if found is None and image.key is not None:
                found = self._features.share(image.key)  # stored just now for an earlier one
            holding.images.append(self._features.held(image, found))
            if found is not None:
                self._count(feature_hits=1)

    def _give_back_new(self, new_kv: SessionKV | None, shared: Sequence[Shared | None]) -> None:
        if new_kv is not None:
            new_kv.free()
        for found in shared:
            if found is not None:
                self._features.let_go(found[0])

    def _movable(self, idle: list[Holding]) -> int:
        """Blocks that moving every idle holding off the device would free: those that only
        idle holdings reference (a block shared with a pinned one stays)."""
        references: dict[int, int] = {}
        for holding in idle:
            for block in holding.device_blocks:
                references[block] = references.get(block, 0) + 1
        return sum(count == self.pool.refs(block) for block, count in references.items())

    def _make_room(self, needed: int, may_drop: bool) -> Shortfall | None:
        """Free device blocks for ``needed``, moving idle sessions (least recently used
        first) down the one ladder (docs/engine/memory.md §Memory policy): 1. device KV to
        free host room; 2. nothing more while ``may_drop`` is False (the caller waits for
        running turns); 3. device KV off (older host copies dropped, else the KV dropped);
        4. sessions parked; 5. sessions no tier can keep evicted, each logged. Nobody moves
        when even all of that would not make the room (a Shortfall)."""
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

    def _move_kv_to_free_host(self, holding: Holding) -> None:  # step 1: no one dropped
        if holding.kv is not None and self._host.fits(self._host.copy_bytes(holding.kv)):
            self._move_kv_off_device(holding)

    def _move_kv_off_device(self, holding: Holding) -> None:
        kv = holding.kv
        if kv is None:
            return
        nbytes = self._host.copy_bytes(kv)
        with self._retiering(holding):
            if nbytes and self._host_room(nbytes, holding):
                holding.host = self._host.copy_out(kv)
                self._count(moved_to_host=1)
            else:
                self._count(demoted=1)
            self._drop_kv(holding)

    def _host_room(self, nbytes: int, newcomer: Holding) -> bool:
        """Make room on the host for ``nbytes`` by dropping host copies of sessions used
        before ``newcomer``; True if it fits."""
        for holding in self._idle:
            if self._host.fits(nbytes) or holding is newcomer:
                break
            if holding.host is not None:
                with self._retiering(holding):
                    self._drop_host(holding)
                    self._count(demoted=1)
        return self._host.fits(nbytes)

    def _start_kv(self, holding: Holding, kv: SessionKV, total: int, prefix: list[bytes]) -> None:
        """The holding's new device KV, on ``kv``'s shared blocks, with room for ``total``
        tokens; a host copy comes back into the blocks past the shared ones."""
        shared = len(kv.blocks)
        if shared:
            self._count(prefix_hits=1, prefix_tokens=kv.length)
        kv.reserve(total - kv.length)
        if holding.host is not None:
            self._host.copy_back(holding.host, kv, shared)
            holding.host = None
            self._count(restored=1)
        else:
            holding.block_keys = list(prefix[:shared])
        holding.kv = kv

    def _park(self, holding: Holding) -> None:
        """All it holds in memory goes; its next turn reads it back (the persistent tier)."""
        with self._retiering(holding):
            self._drop_kv(holding)
            self._drop_host(holding)
            self._drop_features(holding)
        self._count(parked=1)

    def _evict_for_room(self, holding: Holding) -> None:  # step 5, if it frees anything
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
        for image in holding.images:
            self._features.let_go(image.blocks)
            image.blocks = []

    @staticmethod
    def _drop_kv(holding: Holding) -> None:
        if holding.kv is not None:
            holding.kv.free()
            holding.kv = None

    def _drop_host(self, holding: Holding) -> None:
        if holding.host is not None:
            self._host.drop(holding.host)
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
