"""KV memory under the engine's policy (demo model): accounted bytes are the pool's blocks,
sessions come and go with no growth, and pressure demotes idle sessions before it refuses
(docs/design.md §Memory policy)."""

from __future__ import annotations

import threading

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import Busy, NoCapacity
from llava.session import Tier
from llava.store import SessionStore
from llava.synthetic import held_out_samples

SHORT = {"max_new_tokens": 4}


def engine_with_blocks(demo_model, blocks: int, **options) -> Engine:
    probe = Engine(demo_model, SessionStore(budget_bytes=1 << 20), EngineConfig("-"))
    budget = blocks * probe.pool.bytes_per_block
    return Engine(demo_model, SessionStore(budget_bytes=budget), EngineConfig("-"), **options)


def held_blocks(engine: Engine) -> int:
    return engine.pool.total_blocks - engine.pool.free_blocks


def test_accounted_kv_bytes_are_the_blocks_the_pool_handed_out(demo_model):
    engine = Engine(demo_model, SessionStore(budget_bytes=8 << 20), EngineConfig("-"))
    pool = engine.pool
    # what the allocator holds is the budget, to within one block
    assert engine.store.budget_bytes - pool.bytes_per_block < pool.allocated_bytes
    assert pool.allocated_bytes <= engine.store.budget_bytes
    for sample in held_out_samples(5, seed=70_000):
        session_id = engine.open(sample.image).session_id
        engine.ask(session_id, "What color is the shape?", SHORT)
        stats = engine.stats()
        assert stats.bytes_by_tier[Tier.KV] == held_blocks(engine) * pool.bytes_per_block > 0
    pool_view = pool.kv.untyped_storage().nbytes()
    assert pool_view == pool.allocated_bytes  # it never grew


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
    assert (stats.sessions, stats.total_bytes, stats.counters.closed) == (0, 0, 1000)
    assert engine.pool.free_blocks == engine.pool.total_blocks


def test_pressure_demotes_the_least_recently_used_idle_session_first(demo_model):
    engine = engine_with_blocks(demo_model, blocks=20)
    samples = held_out_samples(3, seed=72_000)
    oldest, newer, asking = (engine.open(s.image).session_id for s in samples)
    per_session = engine.store._sessions[asking].kv.nbytes // engine.pool.bytes_per_block
    assert engine.pool.free_blocks < per_session + 8  # the next turn cannot fit as things are
    engine.ask(asking, "What color is the shape?", {"max_new_tokens": 100})
    sessions = engine.store._sessions
    assert sessions[oldest].tier is Tier.FEATURES  # one tier down, not gone
    assert sessions[newer].tier is Tier.KV
    assert len(engine.store) == 3 and engine.stats().counters.demoted == 1
    # the demoted session answers as before, re-prefilled from its features
    answer = engine.ask(oldest, "What color is the shape?", SHORT)
    assert answer.tier is Tier.FEATURES and answer.text == samples[0].color


def test_busy_only_when_demoting_every_idle_session_would_not_help(demo_model):
    engine = engine_with_blocks(demo_model, blocks=20)
    samples = held_out_samples(3, seed=73_000)
    held, idle, asking = (engine.open(s.image).session_id for s in samples)
    pool, opening = engine.pool, engine.store._sessions[asking].kv.length
    # 17 of the 20 blocks (a short question adds 1..16 tokens to the opening): more than the
    # free blocks and the idle session's together, less than all of them with `held`'s too
    turn = {"max_new_tokens": 17 * pool.block_tokens - opening - 8}
    before = engine.stats()
    with engine.store.use(held), pytest.raises(Busy) as err:  # a turn elsewhere holds `held`
        engine.ask(asking, "What color is the shape?", turn)
    assert err.value.code == "KV_MEMORY_FULL" and err.value.retry_after_s > 0
    after = engine.stats()
    assert after.counters.demoted == before.counters.demoted  # nobody lost anything for it
    assert after.sessions_by_tier == before.sessions_by_tier
    answer = engine.ask(asking, "What color is the shape?", turn)  # now `held` can be demoted
    assert answer.stop_reason in ("eos", "max_new_tokens") and idle in engine.store


def test_a_turn_larger_than_the_whole_pool_is_refused_for_good(demo_model):
    engine = engine_with_blocks(demo_model, blocks=20)
    session_id = engine.open(held_out_samples(1, seed=73_500)[0].image).session_id
    too_long = {"max_new_tokens": 20 * engine.pool.block_tokens}
    with pytest.raises(NoCapacity) as err:
        engine.ask(session_id, "What color is the shape?", too_long)
    assert not isinstance(err.value, Busy) and "lower max_new_tokens" in err.value.message
    assert engine.stats().counters.demoted == 0
    assert engine.ask(session_id, "What color is the shape?", SHORT).stop_reason == "eos"


def test_a_turn_short_of_memory_waits_for_a_running_turn_instead_of_busy(demo_model):
    engine = engine_with_blocks(demo_model, blocks=20)
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
    assert engine.store._sessions[first].tier is Tier.FEATURES
    assert engine.stats().counters.demoted == 1
