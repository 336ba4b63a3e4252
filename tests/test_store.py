"""SessionStore policy: TTL, close, byte budget with LRU demotion, serialization, ids."""

import re
import threading

import pytest
import torch
from transformers import DynamicCache

from llava.errors import NoCapacity, SessionNotFound
from llava.session import Session, Tier
from llava.store import SessionStore, new_session_id

SAGEMAKER_SESSION_ID = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
KV_BYTES = 2 * 2 * 1 * 4 * 100 * 8 * 4  # layers × (k, v) × batch × heads × tokens × dim × fp32


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_session(tokens=100, feature_rows=10) -> Session:
    cache = DynamicCache()
    for layer in range(2):
        kv = torch.zeros(1, 4, tokens, 8)
        cache.update(kv, kv.clone(), layer)
    return Session(
        session_id=new_session_id(),
        token_ids=list(range(tokens)),
        image_features=torch.zeros(feature_rows, 8),
        cache=cache,
        last_used=0.0,
    )


@pytest.fixture
def clock():
    return FakeClock()


def test_session_bytes_are_counted_from_tensors():
    session = make_session()
    assert session.bytes_by_tier() == {Tier.KV: KV_BYTES, Tier.FEATURES: 10 * 8 * 4 + 100 * 8}


def test_ids_are_unique_and_match_sagemakers_pattern():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(SAGEMAKER_SESSION_ID.match(i) and len(i) <= 256 for i in ids)


def test_ttl_expiry_frees_the_session_and_its_bytes(clock):
    store = SessionStore(budget_bytes=10**9, ttl_s=60, clock=clock)
    session = make_session()
    store.add(session)
    assert store.stats().total_bytes == session.nbytes > 0
    clock.now += 59
    with store.use(session.session_id):
        pass  # a turn resets the idle timer
    clock.now += 61
    with pytest.raises(SessionNotFound) as err, store.use(session.session_id):
        pass
    assert err.value.code == "SESSION_EXPIRED"
    stats = store.stats()
    assert (stats.sessions, stats.total_bytes, stats.counters.expired) == (0, 0, 1)
    assert session.cache is None and session.image_features is None


def test_expires_at_moves_with_use(clock):
    store = SessionStore(budget_bytes=10**9, ttl_s=60, clock=clock, wall_clock=lambda: clock.now)
    session = make_session()
    store.add(session)
    first = store.expires_at(session)
    clock.now += 30
    with store.use(session.session_id):
        pass
    assert (store.expires_at(session) - first).total_seconds() == 30


def test_close_frees_and_later_use_says_closed(clock):
    store = SessionStore(budget_bytes=10**9, clock=clock)
    session = make_session()
    store.add(session)
    store.close(session.session_id)
    assert store.stats().total_bytes == 0 and store.stats().counters.closed == 1
    for operation in (store.close, lambda sid: store.use(sid).__enter__()):
        with pytest.raises(SessionNotFound) as err:
            operation(session.session_id)
        assert err.value.code == "SESSION_CLOSED"


def test_unknown_id_is_not_found(clock):
    store = SessionStore(budget_bytes=10**9, clock=clock)
    with pytest.raises(SessionNotFound) as err:
        store.close("no-such-session")
    assert err.value.code == "SESSION_NOT_FOUND"
    assert "open a new session" in err.value.message


def test_budget_demotes_least_recently_used_before_evicting(clock):
    one = make_session().nbytes
    store = SessionStore(budget_bytes=int(2.5 * one), clock=clock)
    a, b, c = make_session(), make_session(), make_session()
    for session in (a, b):
        store.add(session)
        clock.now += 1
    with store.use(a.session_id):
        pass  # b is now the least recently used
    clock.now += 1
    store.add(c)
    assert (a.tier, b.tier, c.tier) == (Tier.KV, Tier.FEATURES, Tier.KV)
    stats = store.stats()
    assert stats.total_bytes <= stats.budget_bytes
    assert stats.counters.demoted == 1 and stats.counters.evicted == 0
    assert len(store) == 3


def test_budget_evicts_only_when_everything_is_demoted(clock):
    one = make_session()
    warm_bytes = one.bytes_by_tier()[Tier.FEATURES]
    store = SessionStore(budget_bytes=2 * warm_bytes, clock=clock)
    sessions = [make_session() for _ in range(3)]
    for session in sessions:
        store.add(session)
        clock.now += 1
    assert sessions[0].session_id not in store
    assert all(s.tier is Tier.FEATURES for s in sessions[1:])
    assert store.stats().counters.evicted == 1
    with pytest.raises(SessionNotFound) as err:
        store.close(sessions[0].session_id)
    assert err.value.code == "SESSION_EVICTED"


def test_a_session_larger_than_the_budget_is_refused(clock):
    store = SessionStore(budget_bytes=100, clock=clock)
    with pytest.raises(NoCapacity):
        store.add(make_session())
    assert len(store) == 0


def test_a_session_in_a_turn_is_never_demoted(clock):
    store = SessionStore(budget_bytes=int(1.5 * make_session().nbytes), clock=clock)
    busy = make_session()
    store.add(busy)
    with store.use(busy.session_id):
        clock.now += 1
        store.add(make_session())  # over budget: only the newcomer may be demoted
        assert busy.tier is Tier.KV


def test_turns_of_one_session_are_serialized(clock):
    store = SessionStore(budget_bytes=10**9, clock=clock)
    session = make_session()
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
