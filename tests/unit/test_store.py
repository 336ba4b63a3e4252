"""SessionStore: TTL, close, remembered ids, turn order, and its hand-offs to the
memory manager (pin for a turn, release when gone, evictions learnt)."""

import logging
import math
import re
import threading

import pytest

from llava.errors import (
    InvalidRequest,
    NoCapacity,
    SessionBusy,
    SessionIdInUse,
    SessionNotFound,
    log_id,
)
from llava.kv.holding import Holding, Tier
from llava.sessions.store import (
    MIN_ID_BITS,
    SessionStore,
    full_session_id,
    id_bits,
    new_session_id,
)
from tests.memory_helpers import FakeClock, make_session, new_memory, new_store

SAGEMAKER_SESSION_ID = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")


@pytest.fixture
def clock():
    return FakeClock()


def test_ids_are_unique_and_match_sagemakers_pattern():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(SAGEMAKER_SESSION_ID.match(i) and len(i) <= 256 for i in ids)


def test_server_made_ids_are_128_random_bits_or_more():
    """22 characters drawn from 62 (log2(62) × 22 = 131 bits); every class among them, so each
    also counts 131 bits and is kept as it is when a sharded open checks it again."""
    assert 22 * math.log2(62) >= MIN_ID_BITS
    ids = [new_session_id() for _ in range(1000)]
    assert all(re.fullmatch(r"[A-Za-z0-9]{22}", i) for i in ids)
    assert all(id_bits(i) == 22 * math.log2(62) and full_session_id(i) == i for i in ids)
    assert len(set("".join(ids))) == 62  # the whole alphabet is drawn from


@pytest.mark.parametrize(
    "session_id, bits",
    [
        ("a", math.log2(26)),
        ("a-1", 2 * math.log2(36)),  # hyphens count nothing
        ("A--z--9", 3 * math.log2(62)),
        ("0123456789", 10 * math.log2(10)),
        ("6f1c2a4e-5b7d-4c8e-9f0a-1b2c3d4e5f60", 32 * math.log2(36)),  # a uuid: 165
    ],
)
def test_an_id_counts_its_characters_times_the_alphabet_its_classes_span(session_id, bits):
    assert id_bits(session_id) == pytest.approx(bits)


def test_a_short_chosen_id_gets_a_random_part_and_a_long_one_is_kept():
    short = [full_session_id("ticket-4711") for _ in range(100)]
    assert all(re.fullmatch(r"ticket-4711-[A-Za-z0-9]{22}", i) for i in short)
    assert len(set(short)) == 100  # random: guessing "ticket-4711" names none of them
    assert all(SAGEMAKER_SESSION_ID.match(i) and id_bits(i) >= MIN_ID_BITS for i in short)
    assert all(full_session_id(i) == i for i in short)  # a second check keeps it
    long = "ticket-" + "4711abcd" * 4  # 36 of [a-z0-9]: 186 bits
    assert full_session_id(long) == long
    assert re.fullmatch(r"[A-Za-z0-9]{22}", full_session_id(None))


def test_a_short_id_with_no_room_for_the_random_part_is_refused():
    hyphens = "a" + "-" * 240 + "b"  # 242 characters, 9.4 bits: 265 with the random part
    with pytest.raises(InvalidRequest) as err:
        full_session_id(hyphens)
    assert err.value.code == "INVALID_SESSION_ID" and "128 bits" in err.value.message
    assert "-" * 50 not in err.value.message  # the id is not echoed


def test_gone_ids_are_remembered_one_ttl_by_time_however_many(clock, monkeypatch):
    """More than REMEMBERED_GONE (10,000): every one is remembered until one TTL after it
    went; then the older ones are forgotten, down to the newest REMEMBERED_GONE."""
    monkeypatch.setattr("llava.sessions.persist.REMEMBERED_GONE", 1000)
    store = new_store(clock=clock, ttl_s=60)
    session = make_session(store.memory)
    store.add(session)
    assert store.close(session.session_id) is None
    others = [f"gone-{n}" for n in range(12_000)]
    for other in others:
        store.remember_gone(other, "SESSION_CLOSED")
    clock.now += 59
    store.reap()
    assert store.remembers(session.session_id) and store.remembers(others[0])
    with pytest.raises(SessionIdInUse, match="used recently"):
        store.check_id_free(session.session_id)
    clock.now += 2
    store.reap()
    assert not store.remembers(session.session_id) and not store.remembers(others[0])
    assert store.remembers(others[-1])  # a late caller of a recent one is still told why
    assert len(store._gone) == 1000  # noqa: SLF001 - the bound itself


def test_log_lines_name_a_session_by_a_keyed_hash_of_its_id(clock, caplog):
    session_id = new_session_id()
    tag = log_id(session_id)
    assert re.fullmatch(r"[0-9a-f]{12}", tag) and tag == log_id(session_id)
    assert log_id(session_id + "x") != tag
    store = new_store(clock=clock)
    session = make_session(store.memory, session_id=session_id)
    store.add(session)
    with caplog.at_level(logging.DEBUG), store.use(session_id) as held:
        store.lose(held, "its parked state is unreadable")
    assert tag in caplog.text and session_id not in caplog.text


def test_one_ask_in_flight_per_session_the_next_is_refused_at_once(clock):
    store = new_store(clock=clock, max_waiting_asks=0)
    first, other = make_session(store.memory), make_session(store.memory)
    store.add(first)
    store.add(other)
    with store.asking(first.session_id):
        with pytest.raises(SessionBusy) as err, store.asking(first.session_id):
            pass
        assert err.value.code == "SESSION_BUSY"
        with store.asking(other.session_id):  # other sessions are not held up
            pass
        assert store.close(other.session_id) is None  # a close is not an ask
    with store.asking(first.session_id):  # answered: the next ask goes
        pass


def test_max_waiting_asks_may_wait_and_one_more_is_refused(clock):
    store = new_store(clock=clock, max_waiting_asks=2)
    session = make_session(store.memory)
    store.add(session)
    ask = session.session_id
    with store.asking(ask), store.asking(ask):  # the one in flight and one waiting
        with store.asking(ask), pytest.raises(SessionBusy, match="2 waiting"), store.asking(ask):
            pass  # the third was the second waiting one: a fourth is refused
        with store.asking(ask):  # the third went: room for one again
            pass


def test_an_ask_of_a_gone_session_says_why_not_busy(clock):
    store = new_store(clock=clock)
    session = make_session(store.memory)
    store.add(session)
    store.close(session.session_id)
    with pytest.raises(SessionNotFound) as err, store.asking(session.session_id):
        pass
    assert err.value.code == "SESSION_CLOSED"


def open_within_limit(store: SessionStore, **session) -> object:
    """As the engine opens: a place held while it is prefilled, then added."""
    with store.opening():
        opened = make_session(store.memory, **session)
        store.add(opened)
    return opened


def test_past_max_sessions_the_lru_idle_text_only_session_is_evicted(clock, caplog):
    store = new_store(clock=clock, max_sessions=3)
    oldest_text = open_within_limit(store, feature_rows=0)
    clock.now += 1
    image = open_within_limit(store)  # features: an image session
    clock.now += 1
    newer_text = open_within_limit(store, feature_rows=0)
    clock.now += 1
    with store.use(image.session_id):
        pass  # the image session is the most recent now: still not a candidate
    evicted = store.memory.stats().counters.evicted
    with caplog.at_level(logging.INFO):
        newest = open_within_limit(store, feature_rows=0)
    assert [s.session_id in store for s in (oldest_text, image, newer_text, newest)] == [
        False,
        True,
        True,
        True,
    ]
    assert store.memory.stats().counters.evicted == evicted + 1
    with pytest.raises(SessionNotFound) as err, store.use(oldest_text.session_id):
        pass
    assert err.value.code == "SESSION_EVICTED"
    assert log_id(oldest_text.session_id) in caplog.text
    assert oldest_text.session_id not in caplog.text
    store.check_integrity()


def test_past_max_sessions_with_no_idle_text_only_session_an_open_is_refused(clock):
    store = new_store(clock=clock, max_sessions=3)
    image = open_within_limit(store)
    in_turn = open_within_limit(store, feature_rows=0)
    asked = open_within_limit(store, feature_rows=0)
    with (
        store.use(in_turn.session_id),  # in a turn
        store.asking(asked.session_id),  # an ask in flight, perhaps waiting for its turn
        pytest.raises(NoCapacity) as err,
        store.opening(),
    ):
        pass
    assert err.value.code == "NO_CAPACITY" and "max_sessions (3)" in err.value.message
    assert all(s.session_id in store for s in (image, in_turn, asked))
    open_within_limit(store, feature_rows=0)  # idle again: the least recently used goes
    assert asked.session_id not in store and in_turn.session_id in store  # its turn was last


def test_opens_in_progress_count_against_max_sessions(clock):
    store = new_store(clock=clock, max_sessions=1)
    with store.opening(), pytest.raises(NoCapacity), store.opening():
        pass
    open_within_limit(store, feature_rows=0)


def test_ttl_expiry_frees_the_session_and_its_memory(clock):
    store = new_store(clock=clock, ttl_s=60)
    session = make_session(store.memory)
    store.add(session)
    assert store.memory.stats().bytes_by_tier[Tier.KV] > 0
    clock.now += 59
    with store.use(session.session_id):
        pass  # a turn resets the idle timer
    clock.now += 61
    with pytest.raises(SessionNotFound) as err, store.use(session.session_id):
        pass
    assert err.value.code == "SESSION_EXPIRED"
    stats = store.memory.stats()
    assert (sum(stats.sessions_by_tier.values()), sum(stats.bytes_by_tier.values())) == (0, 0)
    assert store.counters().expired == 1
    assert session.kv is None and session.holding.feature_blocks == []
    store.check_integrity()


def test_expires_at_moves_with_use(clock):
    store = SessionStore(new_memory(), ttl_s=60, clock=clock, wall_clock=lambda: clock.now)
    session = make_session(store.memory)
    store.add(session)
    first = store.expires_at(session)
    clock.now += 30
    with store.use(session.session_id):
        pass
    assert (store.expires_at(session) - first).total_seconds() == 30


def test_close_frees_and_later_use_says_closed(clock):
    store = new_store(clock=clock)
    session = make_session(store.memory)
    store.add(session)
    store.close(session.session_id)
    assert sum(store.memory.stats().bytes_by_tier.values()) == 0
    assert store.counters().closed == 1
    with pytest.raises(SessionNotFound) as err, store.use(session.session_id):
        pass
    assert err.value.code == "SESSION_CLOSED"


def test_unknown_id_is_not_found(clock):
    store = new_store(clock=clock)
    with pytest.raises(SessionNotFound) as err:
        store.close("no-such-session")
    assert err.value.code == "SESSION_NOT_FOUND"
    assert "open a new session" in err.value.message


def test_a_session_in_a_turn_is_pinned_and_never_moved(clock):
    store = new_store(clock=clock, blocks=2 * 51)  # two sessions of 50 KV blocks + 1 feature block
    busy = make_session(store.memory)
    store.add(busy)
    with store.use(busy.session_id):
        clock.now += 1
        idle = make_session(store.memory)
        store.add(idle)
        newcomer = store.memory.hold()
        # room for it means moving someone: only the idle session may go down
        assert store.memory.start(newcomer, 100) is None
        assert busy.tier is Tier.KV and idle.tier is Tier.FEATURES
    store.memory.release(newcomer)
    store.check_integrity()


def test_turns_of_one_session_are_serialized(clock):
    store = new_store(clock=clock)
    session = make_session(store.memory)
    store.add(session)
    inside, overlap = threading.Semaphore(1), []

    def turn():
        for _ in range(50):
            with store.use(session.session_id):
                overlap.append(not inside.acquire(blocking=False))
                inside.release()

    threads = [threading.Thread(target=turn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(overlap) == 200 and not any(overlap)

    # The loop above rarely overlaps even without a lock: here the first turn holds the
    # session until the second has tried to enter, and the second must not get in meanwhile.
    first_inside, second_trying, second_inside = (threading.Event() for _ in range(3))
    order = []

    def first():
        with store.use(session.session_id):
            order.append("first in")
            first_inside.set()
            assert second_trying.wait(timeout=10)
            # a turn that got in would have within this window; a blocked one cannot
            order.append(f"second in meanwhile: {second_inside.wait(timeout=0.3)}")
            order.append("first out")

    def second():
        assert first_inside.wait(timeout=10)
        second_trying.set()
        with store.use(session.session_id):
            order.append("second in")
            second_inside.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert order == ["first in", "second in meanwhile: False", "first out", "second in"]


def test_a_client_chosen_id_is_adopted(clock):
    store = new_store(clock=clock)
    store.add(make_session(store.memory, session_id="conversation-1a2b3c4d"))
    with store.use("conversation-1a2b3c4d") as session:
        assert session.session_id == "conversation-1a2b3c4d"


def gone_three_ways(clock) -> tuple[SessionStore, dict]:
    """A store (device memory for three sessions, no host tier) whose sessions went every
    way there is."""
    store = new_store(clock=clock, blocks=9, ttl_s=60)

    def small():  # 1 KV block + 2 feature blocks
        return make_session(store.memory, tokens=2, feature_rows=64)

    went = {reason: small() for reason in ("expired", "closed", "evicted")}
    store.add(went["expired"])
    clock.now += 61  # the next call sweeps it
    store.add(went["closed"])
    assert store.close(went["closed"].session_id) is None  # closed now
    store.add(went["evicted"])
    for _ in range(10):  # more, until the least recently used one has to go whole
        clock.now += 1
        went["live"] = small()
        store.add(went["live"])
        if went["evicted"].session_id not in store:
            break
    assert [s.session_id in store for s in went.values()] == [False, False, False, True]
    return store, went


def test_an_evicted_session_says_so(clock):
    store, went = gone_three_ways(clock)
    with pytest.raises(SessionNotFound) as err, store.use(went["evicted"].session_id):
        pass
    assert err.value.code == "SESSION_EVICTED"
    assert store.memory.stats().counters.evicted >= 1
    store.check_integrity()


def test_a_session_evicted_after_its_ttl_ran_out_says_expired(clock):
    """The manager evicts the least recently used idle session, which may be one already past
    its TTL that no sweep has reached: it expired first, and says so."""
    store = new_store(clock=clock, blocks=9, ttl_s=60)
    idle = make_session(store.memory, tokens=2, feature_rows=64)  # 3 of the 9 blocks
    store.add(idle)
    clock.now += 61  # past its TTL; no store call has swept it yet
    newcomers = [make_session(store.memory, tokens=2, feature_rows=64) for _ in range(3)]
    assert store.memory.stats().counters.evicted == 1  # the third newcomer needed its blocks
    with pytest.raises(SessionNotFound) as err, store.use(idle.session_id):
        pass
    assert err.value.code == "SESSION_EXPIRED"
    assert store.counters().expired == 1
    for session in newcomers:
        store.add(session)
    store.check_integrity()


def test_a_live_or_remembered_id_is_never_taken_twice(clock):
    store, went = gone_three_ways(clock)
    opened = store.counters().opened
    for taken in went.values():
        with pytest.raises(SessionIdInUse) as err:
            store.add(make_session(store.memory, tokens=2, session_id=taken.session_id))
        assert err.value.code == "SESSION_ID_IN_USE" and taken.session_id in err.value.message
    assert store.counters().opened == opened


def test_close_is_idempotent_for_every_way_a_session_goes(clock):
    store, went = gone_three_ways(clock)
    for reason in ("expired", "closed", "evicted"):
        assert store.close(went[reason].session_id) == f"SESSION_{reason.upper()}"
    assert store.counters().closed == 1  # only the real close counts
    with pytest.raises(SessionNotFound) as err:
        store.close("never-seen-here")
    assert err.value.code == "SESSION_NOT_FOUND"


def test_reap_frees_expired_sessions_and_keeps_fresh_ones(clock):
    store = new_store(clock=clock, ttl_s=60)
    old, fresh = make_session(store.memory), make_session(store.memory)
    store.add(old)
    clock.now += 30
    store.add(fresh)
    clock.now += 31
    assert store.reap() == 1
    assert old.session_id not in store and fresh.session_id in store
    assert store.counters().expired == 1
    store.check_integrity()


def test_a_request_touches_only_its_own_session(clock, monkeypatch):
    """Per-request cost must not grow with the sessions held: a turn and the stats after it
    look at the one session's holding, not all of them."""
    store = new_store(clock=clock)
    sessions = [make_session(store.memory, tokens=4) for _ in range(200)]
    for session in sessions:
        store.add(session)
    looked_at = []
    original = Holding.tier
    monkeypatch.setattr(
        Holding, "tier", property(lambda h: looked_at.append(h) or original.fget(h))
    )
    with store.use(sessions[7].session_id):
        pass
    store.counters()
    store.memory.stats()
    assert set(looked_at) <= {sessions[7].holding}
