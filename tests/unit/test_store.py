"""SessionStore: TTL, close, remembered ids, turn order, and its hand-offs to the
memory manager (pin for a turn, release when gone, evictions learnt)."""

import re
import threading

import pytest

from llava.errors import SessionIdInUse, SessionNotFound
from llava.kv.memory import Holding, Tier
from llava.sessions.store import SessionStore, new_session_id
from tests.memory_helpers import FakeClock, make_session, new_memory, new_store

SAGEMAKER_SESSION_ID = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")


@pytest.fixture
def clock():
    return FakeClock()


def test_ids_are_unique_and_match_sagemakers_pattern():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(SAGEMAKER_SESSION_ID.match(i) and len(i) <= 256 for i in ids)


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
        assert store.memory.reserve(newcomer, 100) is None
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
