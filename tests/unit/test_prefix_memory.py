"""Shared prefixes in the memory manager alone (a small real pool, no model): blocks referenced
by every session on a prefix and counted once, read-only, kept reusable after their last
session lets go until their room is needed, and the books after thousands of random operations
under pressure (docs/engine/memory.md §Shared prefixes)."""

from __future__ import annotations

import random

import pytest
import torch

from llava.errors import SessionNotFound
from llava.kv.holding import NewImage, Tier
from llava.kv.memory import MemoryManager
from llava.kv.prefix import block_keys
from llava.sessions.session import Session
from tests.memory_helpers import BLOCK_TOKENS, FEATURE_HIDDEN, FakeClock, new_memory, new_store
from tests.memory_helpers import write as write_own

IMAGE_TOKEN = -1


def family(index: int, blocks: int) -> tuple[list[int], list[bytes]]:
    """A prefix of ``blocks`` full blocks (its ids and content keys) that sessions share."""
    ids = [1000 * index + i for i in range(blocks * BLOCK_TOKENS)]
    return ids, block_keys(ids, BLOCK_TOKENS, [], IMAGE_TOKEN)


def fill(memory: MemoryManager, holding, upto: int, value: float) -> None:
    """As a prefill would: write ``value`` at the positions from the KV's length to ``upto``."""
    kv = holding.kv
    if upto > kv.length:
        memory.pool.kv[..., kv.slots(kv.length, upto), :] = value
        kv.length = upto


def values(memory: MemoryManager, holding) -> torch.Tensor:
    """The first element each written position holds (one value per token)."""
    kv = holding.kv
    return memory.pool.kv[0, 0, 0, kv.slots(0, kv.length), 0]


def open_on(memory: MemoryManager, keys: list[bytes], own: int, prefix_value: float, value: float):
    """An opening on a shared prefix: what is published is reused, the rest written."""
    holding = memory.hold()
    prefix_tokens = len(keys) * BLOCK_TOKENS
    assert memory.start(holding, prefix_tokens + own, prefix=keys) is None
    fill(memory, holding, prefix_tokens, prefix_value)
    fill(memory, holding, prefix_tokens + own, value)
    memory.publish(holding, keys)
    return holding


def test_a_second_session_on_a_prefix_references_its_blocks_and_counts_them_once():
    memory = new_memory(blocks=20)
    _, keys = family(0, 3)
    first = open_on(memory, keys, own=1, prefix_value=7.0, value=1.0)
    used = memory.pool.total_blocks - memory.pool.free_blocks
    second = open_on(memory, keys, own=1, prefix_value=-1.0, value=2.0)  # -1: never written
    assert second.kv.blocks[:3] == first.kv.blocks[:3]
    assert memory.pool.total_blocks - memory.pool.free_blocks == used + 1  # its own block only
    assert values(memory, second).tolist() == [7.0] * 6 + [2.0]
    counters = memory.stats().counters
    assert (counters.prefix_hits, counters.prefix_tokens) == (1, 3 * BLOCK_TOKENS)
    memory.check_integrity()


def test_a_prefix_outlives_its_sessions_until_its_room_is_needed():
    memory = new_memory(blocks=6)
    _, keys = family(0, 2)
    memory.release(open_on(memory, keys, own=0, prefix_value=5.0, value=0.0))
    assert memory.pool.free_blocks == 6  # free room, still found by its keys
    again = open_on(memory, keys, own=0, prefix_value=-1.0, value=0.0)
    assert values(memory, again).tolist() == [5.0] * 4
    memory.release(again)
    other = memory.hold()
    assert memory.start(other, 6 * BLOCK_TOKENS) is None  # needs every block: reclaimed
    memory.release(other)
    assert memory.pool.match(keys) == []
    memory.check_integrity()


def test_a_crop_inside_a_shared_block_keeps_it_whole_and_writes_elsewhere():
    memory = new_memory(blocks=20)
    _, keys = family(0, 2)
    owner = open_on(memory, keys, own=1, prefix_value=3.0, value=1.0)
    other = open_on(memory, keys, own=1, prefix_value=-1.0, value=2.0)
    assert memory.crop(other, 3) == 2  # 3 ends inside the second shared block: it goes
    assert memory.grow(other, 2) is None
    fill(memory, other, 4, 9.0)
    assert values(memory, owner).tolist() == [3.0] * 4 + [1.0]  # the owner's KV is intact
    assert values(memory, other).tolist() == [3.0, 3.0, 9.0, 9.0]
    memory.check_integrity()


def test_moving_a_sharer_down_frees_only_what_no_one_else_needs():
    memory = new_memory(blocks=20)
    _, keys = family(0, 3)
    owner = open_on(memory, keys, own=1, prefix_value=4.0, value=1.0)
    memory.unpin(owner)
    sharer = open_on(memory, keys, own=1, prefix_value=-1.0, value=2.0)
    memory.unpin(sharer)
    free = memory.pool.free_blocks
    assert memory.move_down(owner) is Tier.FEATURES
    assert memory.pool.free_blocks == free + 1  # its own block; the shared three stay
    assert values(memory, sharer).tolist() == [4.0] * 6 + [2.0]
    memory.pin(owner)
    assert memory.start(owner, 7, prefix=keys) is None  # back on the blocks it computed
    assert owner.kv.length == 6 and owner.block_keys == keys
    memory.check_integrity()


def test_features_of_one_image_are_held_once():
    memory = new_memory(blocks=20)
    features = torch.randn(40, FEATURE_HIDDEN)  # 2 blocks
    first = memory.hold()
    assert memory.start(first, 1, images=[NewImage(b"image", features)]) is None
    second = memory.hold()
    assert memory.image_shape(b"image") == (40, FEATURE_HIDDEN)
    assert memory.start(second, 1, images=[NewImage(b"image")]) is None  # nothing to store
    assert second.feature_blocks == first.feature_blocks
    assert torch.equal(memory.features(second), features)
    assert memory.image_shape(b"another image") is None
    assert memory.stats().bytes_by_tier[Tier.FEATURES] == 2 * memory.pool.bytes_per_block
    memory.release(first)
    assert torch.equal(memory.features(second), features)
    memory.check_integrity()


@pytest.mark.parametrize(
    "operations",
    [
        pytest.param(3_000, id="3k", marks=pytest.mark.thorough),  # seconds: test_memory.py's
        pytest.param(10_000, marks=pytest.mark.thorough),  # 1,000 random operations stay fast
    ],
)
def test_the_books_hold_with_shared_prefixes_under_random_pressure(operations):
    """Sessions of three prefix families open, ask (restores, recomputes on the shared prefix,
    crops into shared blocks, grows), close and expire at random on a small device and host
    budget; every position keeps its prefix's or its own value throughout."""
    rng = random.Random(37)
    clock = FakeClock()
    store = new_store(blocks=24, host_blocks=12, ttl_s=60, clock=clock)
    memory = store.memory
    families = [family(f, rng.randint(1, 4)) for f in range(3)]
    sessions: dict[str, tuple[int, int, float]] = {}  # id → (family, image, own value)
    asked = shortfalls = 0

    def check(session) -> None:
        f, image, own = sessions[session.session_id]
        prefix_tokens = len(families[f][1]) * BLOCK_TOKENS
        expected = [float(f + 1)] * prefix_tokens + [own] * (session.kv.length - prefix_tokens)
        assert values(memory, session.holding).tolist() == expected[: session.kv.length]
        assert bool((memory.features(session.holding) == 50 + image).all())

    for step in range(operations):
        clock.now += rng.random()
        op = rng.choices(("open", "ask", "close", "expire"), (3, 8, 1, 0.2))[0]
        live = [sid for sid in sessions if sid in store]
        if op == "open" or not live:
            f = rng.randrange(3)
            ids, keys = families[f]
            image = rng.randrange(8)  # 2 blocks of features, held once per image
            holding, key = memory.hold(), b"image %d" % image
            features = None
            if memory.image_shape(key) is None:
                features = torch.full((40, FEATURE_HIDDEN), float(50 + image))
            own = rng.randint(1, 6)
            new_image = NewImage(key, features)
            if memory.start(holding, len(ids) + own, prefix=keys, images=[new_image]) is not None:
                memory.release(holding)
                shortfalls += 1
                continue
            fill(memory, holding, len(ids), float(f + 1))
            fill(memory, holding, len(ids) + own, float(100 + step))
            memory.publish(holding, keys)
            session = Session(f"s{step}", ids, holding)
            store.add(session)
            sessions[session.session_id] = (f, image, float(100 + step))
        elif op == "ask":
            try:
                session = store.begin_turn(rng.choice(live))
            except SessionNotFound:
                continue
            try:
                f, _, own = sessions[session.session_id]
                ids, keys = families[f]
                holding = session.holding
                if session.tier is Tier.HOST and memory.restore(holding) is not None:
                    shortfalls += 1
                    continue
                if holding.kv is None:  # recomputed: on the prefix, if still published
                    if memory.start(holding, len(ids) + 8, prefix=keys) is not None:
                        shortfalls += 1
                        continue
                else:
                    check(session)
                    memory.crop(holding, rng.randint(0, holding.kv.length))
                    if memory.grow(holding, len(ids) + 8) is not None:
                        shortfalls += 1
                        continue
                fill(memory, holding, len(ids), float(f + 1))  # what a crop took of the prefix
                write_own(memory, session, rng.randint(1, 8), own)
                memory.publish(holding, keys)
                check(session)
                memory.crop(holding, holding.kv.length)
                asked += 1
            finally:
                store.end_turn(session)
        elif op == "close":
            store.close(rng.choice(live))
        else:
            clock.now += 61
            store.reap()
        if step % 250 == 0:
            store.check_integrity()
    store.check_integrity()
    counters = memory.stats().counters
    assert counters.prefix_hits > operations // 20 and counters.evicted > 0, counters
    assert counters.feature_hits > operations // 20, counters
    assert counters.moved_to_host > 0 and counters.restored > 0, counters
    assert asked > operations // 10, (asked, shortfalls)


def test_a_blocks_key_names_every_image_whose_tokens_it_holds():
    """Blocks of 2: [text, a] [a, a] [b, text] [b, b] [text, text] with images a (3 tokens) and
    b (3): changing b changes the keys from the first block holding its tokens on, not before;
    a prompt showing more image tokens than its images hold is refused."""
    ids = [5, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 6, IMAGE_TOKEN, IMAGE_TOKEN, 7, 8]
    keys = block_keys(ids, BLOCK_TOKENS, [(b"a", 3), (b"b", 3)], IMAGE_TOKEN)
    other_b = block_keys(ids, BLOCK_TOKENS, [(b"a", 3), (b"c", 3)], IMAGE_TOKEN)
    assert keys[:2] == other_b[:2]
    assert all(x != y for x, y in zip(keys[2:], other_b[2:], strict=True))
    assert keys[:1] != block_keys(ids, BLOCK_TOKENS, [(b"z", 3), (b"b", 3)], IMAGE_TOKEN)[:1]
    # keys grown from known ones count the image tokens already behind them
    assert block_keys(ids, BLOCK_TOKENS, [(b"a", 3), (b"b", 3)], IMAGE_TOKEN, keys[:3]) == keys
    with pytest.raises(ValueError, match="more image tokens"):
        block_keys(ids, BLOCK_TOKENS, [(b"a", 3)], IMAGE_TOKEN)
