"""The memory manager alone (a small real pool, no model): features inside the device
budget, the demotion order device KV → host KV → features only → gone, exact restores,
shortfalls as values, and its books after 10,000 random operations
(docs/engine/memory.md §Memory policy)."""

from __future__ import annotations

import random

import pytest
import torch

from llava.errors import NoCapacity, SessionNotFound
from llava.kv.holding import NewImage, Tier
from llava.kv.memory import MemoryManager, Shortfall
from tests.memory_helpers import (
    FEATURE_HIDDEN,
    FakeClock,
    make_session,
    new_memory,
    new_store,
    write,
)


def holds_value(memory: MemoryManager, session, value: float) -> bool:
    """Every written KV position and every feature of the session hold ``value``."""
    kv = session.kv
    written = memory.pool.kv[..., kv.slots(0, kv.length), :]
    features = memory.features(session.holding)
    features_ok = features is None or bool((features == value).all())
    return bool((written == value).all()) and features_ok


def test_features_live_in_pool_blocks_and_come_back_exactly():
    memory = new_memory(blocks=8)
    holding = memory.hold()
    features = torch.randn(40, FEATURE_HIDDEN)  # 320 elements: 2 blocks of 256
    assert memory.start(holding, 3, images=[NewImage(None, features)]) is None
    assert len(holding.feature_blocks) == 2
    assert torch.equal(memory.features(holding), features)
    stats = memory.stats()
    block = memory.pool.bytes_per_block
    assert stats.bytes_by_tier == {Tier.KV: 2 * block, Tier.HOST: 0, Tier.FEATURES: 2 * block}
    memory.release(holding)
    assert memory.pool.free_blocks == memory.pool.total_blocks


def test_features_only_sessions_fill_the_device_budget_and_never_exceed_it():
    clock = FakeClock()
    store = new_store(blocks=20, clock=clock)
    memory = store.memory
    budget = memory.budget.device_bytes
    opened = []
    for n in range(40):  # each: 1 KV block + 2 feature blocks; features alone fill it twice
        clock.now += 1
        session = make_session(memory, tokens=2, feature_rows=64, value=float(n))
        store.add(session)
        opened.append(session)
        stats = memory.stats()
        assert stats.bytes_by_tier[Tier.KV] + stats.bytes_by_tier[Tier.FEATURES] <= budget
        assert memory.pool.allocated_bytes <= budget
        store.check_integrity()
    live = [s for s in opened if s.session_id in store]
    assert memory.stats().counters.evicted == 40 - len(live) > 0
    assert sum(s.tier is Tier.FEATURES for s in live) >= len(live) - 1  # KV went first
    for session in live:  # nobody's features were overwritten by anyone else's
        n = opened.index(session)
        assert bool((memory.features(session.holding) == float(n)).all())


def test_demotion_order_is_device_then_host_then_features_then_gone():
    clock = FakeClock()
    store = new_store(blocks=20, host_blocks=5, clock=clock)  # host: one session's 5 KV blocks
    memory = store.memory
    a, b, c = (make_session(memory, tokens=10, feature_rows=10, value=v) for v in (1, 2, 3))
    for session in (a, b, c):  # 6 blocks each (5 KV + 1 feature): 18 of 20
        clock.now += 1
        store.add(session)
    newcomer = memory.hold()
    assert memory.start(newcomer, 10) is None  # 5 blocks: `a`'s KV goes to the host
    assert (a.tier, b.tier, c.tier) == (Tier.HOST, Tier.KV, Tier.KV)
    memory.release(newcomer)
    newcomer = memory.hold()
    assert memory.start(newcomer, 20) is None  # 10 blocks: `b` to host drops `a`'s copy
    assert (a.tier, b.tier, c.tier) == (Tier.FEATURES, Tier.HOST, Tier.KV)
    memory.release(newcomer)
    newcomer = memory.hold()
    assert memory.start(newcomer, 36) is None  # 18 blocks: all KV off, then `a` goes whole
    assert a.session_id not in store and (b.tier, c.tier) == (Tier.FEATURES, Tier.HOST)
    counters = memory.stats().counters
    assert (counters.moved_to_host, counters.demoted, counters.evicted) == (3, 2, 1)
    memory.release(newcomer)
    store.check_integrity()


def test_sessions_the_persistent_tier_holds_are_parked_and_only_the_others_evicted():
    clock = FakeClock()
    store = new_store(blocks=20, clock=clock)  # no host tier
    memory = store.memory
    old, kept, newer = (
        make_session(memory, tokens=10, feature_rows=10, value=v) for v in (1, 2, 3)
    )
    for session in (old, kept, newer):  # 6 blocks each (5 KV + 1 feature): 18 of 20
        clock.now += 1
        store.add(session)
    for session in (kept, newer):
        memory.mark_persisted(session.holding, True)
    newcomer = memory.hold()
    assert memory.start(newcomer, 36) is None  # 18 blocks: all KV off, then one feature block
    # the least recently used session the persistent tier holds is parked; `old` is older,
    # but evicting it would lose it
    assert (old.tier, kept.tier, newer.tier) == (Tier.FEATURES, Tier.PERSISTED, Tier.FEATURES)
    memory.release(newcomer)
    newcomer = memory.hold()
    assert memory.start(newcomer, 40) is None  # the whole pool: `newer` parked, `old` evicted
    assert old.session_id not in store and (kept.tier, newer.tier) == (Tier.PERSISTED,) * 2
    counters = memory.stats().counters
    assert (counters.demoted, counters.parked, counters.evicted) == (3, 2, 1)
    memory.release(newcomer)
    store.check_integrity()
    with store.use(kept.session_id) as session:  # its features come back from the tier
        with pytest.raises(ValueError, match="parked"):
            memory.start(session.holding, 4)
        assert (
            memory.start(session.holding, 4, features=[torch.full((10, FEATURE_HIDDEN), 2.0)])
            is None
        )
        assert session.tier is Tier.KV and holds_value(memory, session, 2.0)
    store.check_integrity()


def test_a_caller_that_may_not_drop_gets_only_free_host_room_and_waits():
    """While running turns may still free room (``may_drop`` False), idle KV only moves to
    free host room; nothing is dropped, parked or evicted, and the caller gets a Shortfall."""
    clock = FakeClock()
    store = new_store(blocks=20, host_blocks=5, clock=clock)  # host: one session's 5 KV blocks
    memory = store.memory
    sessions = [make_session(memory, tokens=10, feature_rows=10, value=v) for v in (1, 2, 3)]
    for session in sessions:
        clock.now += 1
        store.add(session)
        memory.mark_persisted(session.holding, True)
    newcomer = memory.hold()
    assert isinstance(memory.start(newcomer, 20, may_drop=False), Shortfall)  # 10 blocks
    assert [s.tier for s in sessions] == [Tier.HOST, Tier.KV, Tier.KV]  # 2 + 5 free: short
    counters = memory.stats().counters
    assert (counters.demoted, counters.parked, counters.evicted) == (0, 0, 0)
    assert memory.start(newcomer, 20, may_drop=True) is None  # `b`'s KV goes to the host
    assert [s.tier for s in sessions] == [Tier.FEATURES, Tier.HOST, Tier.KV]
    memory.release(newcomer)
    store.check_integrity()


def test_a_host_copy_comes_back_exactly_into_other_blocks():
    store = new_store(blocks=12, host_blocks=10)
    memory = store.memory
    kept = make_session(memory, tokens=9, feature_rows=0)
    memory.pool.kv[..., kept.kv.slots(0, 9), :] = torch.randn(2, 2, 4, 9, 8)
    written = memory.pool.kv[..., kept.kv.slots(0, 9), :].clone()
    store.add(kept)
    blocks_before = list(kept.kv.blocks)
    squatter = memory.hold()
    assert memory.start(squatter, 2 * 12) is None  # the whole pool: `kept` goes to host
    assert kept.tier is Tier.HOST
    memory.pool.kv.fill_(7.0)
    memory.release(squatter)
    filler = memory.hold()
    assert memory.start(filler, 2) is None  # takes its old first block
    with store.use(kept.session_id) as session:
        assert memory.restore(session.holding) is None
        assert session.tier is Tier.KV and session.kv.length == 9
        assert session.kv.blocks != blocks_before
        assert torch.equal(memory.pool.kv[..., session.kv.slots(0, 9), :], written)
    assert memory.stats().counters.restored == 1
    memory.release(filler)
    store.check_integrity()


def test_a_shortfall_is_a_value_and_moves_nobody():
    store = new_store(blocks=10, host_blocks=10)
    memory = store.memory
    # 4 blocks each: 3 of KV, 1 of features
    idle, busy = make_session(memory, tokens=6), make_session(memory, tokens=6)
    store.add(idle)
    store.add(busy)
    with store.use(busy.session_id):
        asking = memory.hold()
        shortfall = memory.start(asking, 2 * 7)  # 7 blocks: 2 free + 4 idle are not enough
        assert isinstance(shortfall, Shortfall) and "retry" in shortfall.message
        assert idle.tier is Tier.KV and memory.stats().counters == type(memory.stats().counters)()
        assert memory.start(asking, 2 * 5) is None  # 5 blocks: the idle one's KV moves
        assert idle.tier is Tier.HOST
        memory.release(asking)
    with pytest.raises(NoCapacity):
        memory.start(memory.hold(), 2 * 11)  # more than the whole pool: never
    store.check_integrity()


def test_a_turns_new_image_is_all_or_nothing():
    """Growing with a new image takes its shared reference before room is made (so making it
    cannot reclaim the features) and gives it back on a Shortfall: nothing taken."""
    store = new_store(blocks=12)
    memory = store.memory
    owner = make_session(memory, tokens=4, feature_rows=0)  # 2 blocks
    image = torch.full((40, FEATURE_HIDDEN), 7.0)  # 2 blocks
    assert memory.grow(owner.holding, 2, images=[NewImage(b"picture", image)]) is None
    store.add(owner)
    busy = make_session(memory, tokens=8, feature_rows=0)  # 4 blocks, pinned
    with store.use(owner.session_id) as session:
        before = memory.pool.free_blocks
        refs = [memory.pool.refs(b) for b in session.holding.images[0].blocks]
        # the same image again and more tokens than the pool has free: a Shortfall
        shortfall = memory.grow(session.holding, 2 * 6, images=[NewImage(b"picture")])
        assert isinstance(shortfall, Shortfall) and len(session.holding.images) == 1
        assert [memory.pool.refs(b) for b in session.holding.images[0].blocks] == refs
        assert memory.pool.free_blocks == before
        assert memory.grow(session.holding, 2, images=[NewImage(b"picture")]) is None
        assert torch.equal(memory.features(session.holding, session.holding.images[1:]), image)
        memory.drop_images(session.holding, session.holding.images[1:])
        assert [memory.pool.refs(b) for b in session.holding.images[0].blocks] == refs
    memory.release(busy.holding)
    store.check_integrity()


# Random walks (seconds): make test-fast keeps each rung alone (the tests above). The shorter
# run reaches every rung but the last: at this budget whole sessions are first evicted only
# after more than 4,000 operations.
@pytest.mark.thorough
@pytest.mark.parametrize(
    ("operations", "rungs"),
    [
        (1_000, ("moved_to_host", "restored", "demoted")),
        (10_000, ("moved_to_host", "restored", "demoted", "evicted")),
    ],
)
def test_the_books_hold_after_thousands_of_random_operations(operations, rungs):
    """Open, ask (restores, crops, grows), close and expire at random under a small device
    and host budget; every session's KV and features keep their own value throughout."""
    rng = random.Random(24)
    clock = FakeClock()
    store = new_store(blocks=40, host_blocks=15, ttl_s=60, clock=clock)
    memory = store.memory
    values: dict[str, float] = {}
    outcomes = {"shortfall": 0, "gone": 0, "restored": 0, "asked": 0}
    for step in range(operations):
        clock.now += rng.random()
        op = rng.choices(("open", "ask", "close", "expire"), (3, 8, 1, 0.2))[0]
        live = [sid for sid in values if sid in store]
        if op == "open" or not live:
            value = float(step + 1)
            try:
                session = make_session(
                    memory, rng.randint(1, 12), rng.choice((0, 10, 64)), value=value
                )
            except AssertionError:  # the reservation fell short: nobody was moved
                outcomes["shortfall"] += 1
                continue
            store.add(session)
            values[session.session_id] = value
        elif op == "ask":
            session_id = rng.choice(live)
            try:
                session = store.begin_turn(session_id)
            except SessionNotFound:
                outcomes["gone"] += 1
                continue
            try:
                value, holding = values[session_id], session.holding
                if session.tier is Tier.HOST:
                    if memory.restore(holding) is not None:
                        outcomes["shortfall"] += 1
                        continue
                    outcomes["restored"] += 1
                if session.kv is not None:
                    assert holds_value(memory, session, value), "a session's KV changed"
                    memory.crop(holding, rng.randint(0, session.kv.length))
                extra = rng.randint(1, 8)
                reserve = memory.start if session.kv is None else memory.grow
                if reserve(holding, extra) is not None:
                    outcomes["shortfall"] += 1
                    continue
                write(memory, session, extra - rng.randint(0, extra - 1), value)
                assert holds_value(memory, session, value), "a session's KV changed"
                memory.crop(holding, session.kv.length)
                outcomes["asked"] += 1
            finally:
                store.end_turn(session)
        elif op == "close":
            store.close(rng.choice(live))
        else:
            clock.now += 61
            store.reap()
        if step % 500 == 0:
            store.check_integrity()
    store.check_integrity()
    counters = memory.stats().counters
    assert all(getattr(counters, rung) > 0 for rung in rungs), counters
    assert outcomes["asked"] > operations // 10, outcomes
    assert outcomes["restored"] > operations // 100, outcomes
