"""The memory manager's audit (llava.kv.memory.MemoryManager.check_integrity): walk what every
holding holds and count it, so the manager can compare its books with the sum."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from llava.kv.holding import Holding, Tier
from llava.kv.pool import KVPool


class IntegrityError(AssertionError):
    """The manager's books disagree with what it holds (a bug, never a request's fault)."""


def require(condition: bool, problem: str) -> None:
    if not condition:
        raise IntegrityError(problem)


@dataclass(frozen=True)
class Walked:
    """What the holdings hold, summed: what the manager's books must say."""

    sessions_by_tier: dict[Tier, int]  # adopted holdings only
    host_bytes: int
    feature_blocks: int  # distinct pool blocks holding features
    labels: set[str]


def walk(pool: KVPool, holdings: Iterable[Holding], idle: Collection[Holding]) -> Walked:
    """Every block referenced exactly as often as block tables list it, or empty, or
    reclaimable; no published block written past; no holding in two tiers; pinned exactly
    when not idle. Returns the sums."""
    try:
        pool.check()
    except ValueError as e:
        raise IntegrityError(str(e)) from None
    references = dict.fromkeys(pool.aside, 1)  # the runner's (KVPool.set_aside)
    sessions, host_bytes, features, labels = {t: 0 for t in Tier}, 0, set(), set()
    for holding in holdings:
        require(not holding.evicted, "an evicted holding is still held")
        require(holding.kv is None or holding.host is None, "KV on device and host")
        kv_blocks = [] if holding.kv is None else holding.kv.blocks
        require(len(set(kv_blocks)) == len(kv_blocks), "a KV lists a block twice")
        require(not set(kv_blocks) & set(holding.feature_blocks), "a block is KV and features")
        for block in holding.device_blocks:
            references[block] = references.get(block, 0) + 1
        features.update(holding.feature_blocks)
        if holding.kv is not None:
            _check_kv(pool, holding)
        host_bytes += 0 if holding.host is None else holding.host.nbytes
        if holding.label is not None:
            sessions[holding.tier] += 1
            labels.add(holding.label)
        require(holding.pinned != (holding in idle), "pinned and idle disagree")
        require(holding.persisted or not holding.parked, "parked and not persisted")
    for block in range(pool.total_blocks):
        listed, counted = references.get(block, 0), pool.refs(block)
        require(listed == counted, f"block {block}: listed {listed}x, counted {counted}x")
    return Walked(sessions, host_bytes, len(features), labels)


def _check_kv(pool: KVPool, holding: Holding) -> None:
    """Its keys name its blocks, and no published block lies where it writes next."""
    kv = holding.kv
    full = kv.length // pool.block_tokens
    require(len(holding.block_keys) <= full, "keys for blocks not yet written")
    for index, block in enumerate(kv.blocks):
        key = pool.index.key_of(block)
        if index >= full:
            require(key is None, f"block {block} is published and written past")
        elif key is not None:
            require(key == holding.block_keys[index], f"block {block} has another's key")
