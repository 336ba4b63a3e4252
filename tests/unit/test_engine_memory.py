"""Session memory under the engine's policy (demo model): accounted bytes are the pool's
blocks (KV and features), sessions come and go with no growth, pressure moves idle sessions
down (device KV → host KV → features only → gone) before it refuses, and a turn restored
from the host answers exactly as one never moved (docs/engine/memory.md §Memory policy)."""

from __future__ import annotations

import random
import threading

import pytest

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import Busy, NoCapacity, SessionNotFound
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier

SHORT = {"max_new_tokens": 4}


def engine_with_blocks(demo_model, blocks: int, host_blocks: int = 0, **options) -> Engine:
    probe = Engine(demo_model, EngineConfig("-"), MemoryBudget(1 << 20))
    block = probe.memory.pool.bytes_per_block
    budget = MemoryBudget(blocks * block, host_blocks * block)
    return Engine(demo_model, EngineConfig("-"), budget, **options)


def held_blocks(engine: Engine) -> int:
    pool = engine.memory.pool
    return pool.total_blocks - pool.free_blocks


def test_accounted_bytes_are_the_blocks_the_pool_handed_out(demo_model):
    engine = Engine(demo_model, EngineConfig("-"), MemoryBudget(8 << 20))
    pool = engine.memory.pool
    # what the allocator holds is the device budget, to within one block
    assert (8 << 20) - pool.bytes_per_block < pool.allocated_bytes <= 8 << 20
    for sample in held_out_samples(5, seed=70_000):
        session_id = engine.open(sample.image).session_id
        engine.ask(session_id, "What color is the shape?", SHORT)
        by_tier = engine.stats().bytes_by_tier
        assert (
            by_tier[Tier.KV] + by_tier[Tier.FEATURES] == held_blocks(engine) * pool.bytes_per_block
        )
        assert by_tier[Tier.FEATURES] == (len(engine.store) * pool.bytes_per_block)  # 1 each
    assert pool.kv.untyped_storage().nbytes() == pool.allocated_bytes  # it never grew
    engine.check_integrity()


@pytest.mark.thorough
def test_a_thousand_short_sessions_from_many_threads_leave_nothing_behind(demo_model):
    engine = engine_with_blocks(demo_model, blocks=64)  # ~8 sessions' worth, 8 at a time
    images = [s.image for s in held_out_samples(4, seed=71_000)]
    failures: list[BaseException] = []

    def client(worker: int) -> None:
        try:
            for n in range(125):
                session_id = engine.open(images[(worker + n) % 4]).session_id
                engine.ask(session_id, "What shape is it?", SHORT)
                assert engine.close(session_id) is None
        except BaseException as error:  # collected: the assertion below names it
            failures.append(error)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert failures == []
    stats = engine.stats()
    assert (stats.sessions, stats.total_bytes, stats.store.closed) == (0, 0, 1000)
    assert engine.memory.pool.free_blocks == engine.memory.pool.total_blocks
    engine.check_integrity()


def test_pressure_demotes_the_least_recently_used_idle_session_first(demo_model):
    engine = engine_with_blocks(demo_model, blocks=22)  # no host tier
    samples = held_out_samples(3, seed=72_000)
    oldest, newer, asking = (engine.open(s.image).session_id for s in samples)
    assert engine.memory.pool.free_blocks < 8  # the next turn cannot fit as things are
    engine.ask(asking, "What color is the shape?", {"max_new_tokens": 100})
    assert engine.store.session(oldest).tier is Tier.FEATURES  # one tier down, not gone
    assert engine.store.session(newer).tier is Tier.KV
    assert len(engine.store) == 3 and engine.stats().memory.demoted == 1
    # the demoted session answers as before, re-prefilled from its features
    answer = engine.ask(oldest, "What color is the shape?", SHORT)
    assert answer.tier is Tier.FEATURES and answer.text == samples[0].color


def test_busy_only_when_moving_every_idle_session_would_not_help(demo_model):
    engine = engine_with_blocks(demo_model, blocks=23)
    samples = held_out_samples(3, seed=73_000)
    held, idle, asking = (engine.open(s.image).session_id for s in samples)
    pool, opening = engine.memory.pool, engine.store.session(asking).kv.length
    # 15 more blocks for the turn: more than the free blocks and the idle session's together
    # (5 free + 6), less than all of them with `held`'s too (+ 6)
    turn = {"max_new_tokens": 20 * pool.block_tokens - opening - 8}
    before = engine.stats()
    with engine.store.use(held), pytest.raises(Busy) as err:  # a turn elsewhere holds `held`
        engine.ask(asking, "What color is the shape?", turn)
    assert err.value.code == "KV_MEMORY_FULL" and err.value.retry_after_s > 0
    after = engine.stats()
    assert after.memory == before.memory  # nobody lost anything for it
    assert after.sessions_by_tier == before.sessions_by_tier
    answer = engine.ask(asking, "What color is the shape?", turn)  # now `held` can move
    assert answer.stop_reason in ("eos", "max_new_tokens")
    engine.check_integrity()


def test_a_turn_larger_than_the_whole_pool_is_refused_for_good(demo_model):
    engine = engine_with_blocks(demo_model, blocks=20)
    session_id = engine.open(held_out_samples(1, seed=73_500)[0].image).session_id
    too_long = {"max_new_tokens": 20 * engine.memory.pool.block_tokens}
    with pytest.raises(NoCapacity) as err:
        engine.ask(session_id, "What color is the shape?", too_long)
    assert not isinstance(err.value, Busy) and "lower max_new_tokens" in err.value.message
    assert engine.stats().memory.demoted == 0
    assert engine.ask(session_id, "What color is the shape?", SHORT).stop_reason == "eos"


def test_a_turn_short_of_memory_waits_for_a_running_turn_instead_of_busy(demo_model):
    engine = engine_with_blocks(demo_model, blocks=22)
    first, second = (engine.open(s.image).session_id for s in held_out_samples(2, seed=74_000))
    long = {"max_new_tokens": 100, "min_new_tokens": 100}
    streaming = threading.Event()
    answers = {}

    def first_turn():
        question = "What is in the picture?"
        answers["first"] = engine.ask(first, question, long, lambda *_: streaming.set())

    thread = threading.Thread(target=first_turn)
    thread.start()
    assert streaming.wait(timeout=60)
    # both cannot hold 100 new tokens at once: this one waits, then demotes the first (idle)
    answers["second"] = engine.ask(second, "What is in the picture?", long)
    thread.join(timeout=60)
    assert [len(answers[k].token_ids) for k in ("first", "second")] == [100, 100]
    assert engine.store.session(first).tier is Tier.FEATURES
    assert engine.stats().memory.demoted == 1


def test_a_turn_restored_from_the_host_says_so_and_reuses_its_cache(demo_model):
    engine = engine_with_blocks(demo_model, blocks=22, host_blocks=50)
    samples = held_out_samples(3, seed=75_000)
    oldest, _newer, asking = (engine.open(s.image).session_id for s in samples)
    engine.ask(asking, "What color is the shape?", {"max_new_tokens": 100})
    assert engine.store.session(oldest).tier is Tier.HOST
    answer = engine.ask(oldest, "What color is the shape?", SHORT)
    assert answer.tier is Tier.HOST and answer.cached_tokens > 0
    assert answer.text == samples[0].color
    counters = engine.stats().memory
    assert (counters.moved_to_host, counters.restored, counters.demoted) == (1, 1, 0)
    engine.check_integrity()


QUESTIONS = ("What color is the shape?", "And its shape?", "What is in the picture?")


# A random walk (seconds). make test-fast keeps each move alone, answering as never moved:
# test_a_turn_restored_from_the_host_says_so_and_reuses_its_cache, test_engine.py's
# test_answer_after_demotion_to_features_is_unchanged, test_parking.py's
# test_without_the_persistent_tier_the_same_sessions_are_evicted_and_told_so; and many sessions
# under pressure: test_prefix_sharing.py's test_shared_sessions_under_memory_pressure_answer_alike.
@pytest.mark.thorough
@pytest.mark.parametrize("turns", [80, 150])
def test_answers_under_random_pressure_equal_answers_never_moved(demo_model, turns):
    """Many sessions, turns in random order: a tight engine (sessions go to the host, to
    features, and away) answers every turn of a surviving session exactly as an engine with
    room for everyone does."""
    rng = random.Random(2024)
    roomy = Engine(demo_model, EngineConfig("-"), MemoryBudget(64 << 20))
    tight = engine_with_blocks(demo_model, blocks=30, host_blocks=25)
    samples = held_out_samples(40, seed=76_000)

    def open_pair(index: int) -> tuple[str, str]:
        image = samples[index % len(samples)].image
        return roomy.open(image).session_id, tight.open(image).session_id

    pairs = [open_pair(i) for i in range(6)]
    tiers, gone = [], 0
    for _ in range(turns):
        if rng.random() < 0.2:  # newcomers: features pile up until someone must go
            pairs.append(open_pair(len(pairs)))
        index = rng.randrange(len(pairs))
        question = rng.choice(QUESTIONS)
        params = {"max_new_tokens": rng.randint(1, 12)}
        roomy_id, tight_id = pairs[index]
        try:
            answer = tight.ask(tight_id, question, params)
        except SessionNotFound as err:
            assert err.code == "SESSION_EVICTED"
            gone += 1
            pairs[index] = open_pair(index)
            continue
        expected = roomy.ask(roomy_id, question, params)
        assert answer.token_ids == expected.token_ids
        tiers.append(answer.tier)
    assert {Tier.KV, Tier.HOST, Tier.FEATURES} <= set(tiers), tiers
    assert gone > 0
    tight.check_integrity()


def test_a_debug_engine_checks_its_books_whenever_it_goes_idle(demo_model, caplog):
    config = EngineConfig("-", check_memory_when_idle=True)
    engine = Engine(demo_model, config, MemoryBudget(1 << 22))
    session_id = engine.open(held_out_samples(1, seed=78_000)[0].image).session_id
    engine.ask(session_id, "What color is the shape?", SHORT)
    assert "idle check failed" not in caplog.text
    # a block handed back behind the manager's back: the next idle check says so
    engine.memory.pool.give_back(engine.store.session(session_id).kv.blocks[:1])
    engine.ask(session_id, "And its shape?", SHORT)
    engine.loop.call(lambda: None)  # one more pass: the loop went idle after the turn
    assert "idle check failed" in caplog.text and "block 0: listed 1x, counted 0x" in caplog.text
