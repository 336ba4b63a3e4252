"""SessionStore policy: TTL, close, byte budget with LRU demotion, serialization, ids."""

import re
import threading

import pytest
import torch
from transformers import LlamaConfig

from llava.errors import NoCapacity, SessionIdInUse, SessionNotFound
from llava.kv_pool import KVPool
from llava.session import Session, Tier
from llava.store import SessionStore, new_session_id

SAGEMAKER_SESSION_ID = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
KV_BYTES = 2 * 2 * 1 * 4 * 100 * 8 * 4  # layers × (k, v) × batch × heads × tokens × dim × fp32
# Sessions' KV lives in a pool of 2-token blocks: 100 and 150 tokens fill whole blocks.
TEXT_CONFIG = LlamaConfig(
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, hidden_size=32, head_dim=8
)
POOL = KVPool(TEXT_CONFIG, budget_bytes=1 << 26, device="cpu", dtype=torch.float32, block_tokens=2)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_session(tokens=100, feature_rows=10, session_id=None) -> Session:
    kv = POOL.new_kv()
    kv.reserve(tokens)
    kv.length = tokens  # as if a step had written them
    return Session(
        session_id=session_id or new_session_id(),
        token_ids=list(range(tokens)),
        image_features=torch.zeros(feature_rows, 8),
        kv=kv,
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
    assert session.kv is None and session.image_features is None


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
    with pytest.raises(SessionNotFound) as err, store.use(session.session_id):
        pass
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
    with pytest.raises(SessionNotFound) as err, store.use(sessions[0].session_id):
        pass
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


def test_a_client_chosen_id_is_adopted(clock):
    store = SessionStore(budget_bytes=10**9, clock=clock)
    store.add(make_session(session_id="conversation-1a2b3c4d"))
    with store.use("conversation-1a2b3c4d") as session:
        assert session.session_id == "conversation-1a2b3c4d"


def gone_three_ways(clock) -> tuple[SessionStore, dict[str, Session]]:
    """A store (budget: two demoted sessions) whose sessions went every way there is."""
    warm_bytes = make_session().bytes_by_tier()[Tier.FEATURES]
    store = SessionStore(budget_bytes=2 * warm_bytes, ttl_s=60, clock=clock)
    went = {reason: make_session() for reason in ("expired", "closed", "evicted", "live")}
    store.add(went["expired"])
    clock.now += 61  # the next call sweeps it
    store.add(went["closed"])
    assert store.close(went["closed"].session_id) is None  # closed now
    for session in (went["evicted"], make_session(), went["live"]):
        store.add(session)  # the third is over budget even demoted: the first goes
    assert [s.session_id in store for s in went.values()] == [False, False, False, True]
    return store, went


def test_a_live_or_remembered_id_is_never_taken_twice(clock):
    store, went = gone_three_ways(clock)
    opened = store.stats().counters.opened
    for taken in went.values():
        with pytest.raises(SessionIdInUse) as err:
            store.add(make_session(session_id=taken.session_id))
        assert err.value.code == "SESSION_ID_IN_USE" and taken.session_id in err.value.message
    assert store.stats().counters.opened == opened


def test_close_is_idempotent_for_every_way_a_session_goes(clock):
    store, went = gone_three_ways(clock)
    for reason in ("expired", "closed", "evicted"):
        assert store.close(went[reason].session_id) == f"SESSION_{reason.upper()}"
    assert store.stats().counters.closed == 1  # only the real close counts
    with pytest.raises(SessionNotFound) as err:
        store.close("never-seen-here")
    assert err.value.code == "SESSION_NOT_FOUND"


def walk(store) -> tuple[dict, dict]:
    """Sessions and bytes per tier counted the slow way, from every session's tensors."""
    sessions, nbytes = {t: 0 for t in Tier}, {t: 0 for t in Tier}
    for session in store._sessions.values():
        sessions[session.tier] += 1
        for tier, n in session.bytes_by_tier().items():
            nbytes[tier] += n
    return sessions, nbytes


def test_kept_totals_match_a_full_walk_after_every_change(clock):
    store = SessionStore(budget_bytes=int(3.5 * make_session().nbytes), ttl_s=60, clock=clock)

    def check():
        stats = store.stats()
        assert (stats.sessions_by_tier, stats.bytes_by_tier) == walk(store)

    sessions = [make_session() for _ in range(3)]
    for session in sessions:
        store.add(session)
        check()
    with store.use(sessions[0].session_id) as session:  # a turn grows the cache and history
        store.reserve(session.kv, 50)
        session.token_ids += list(range(50))
    check()
    with store.use(sessions[1].session_id) as session:  # a failed turn demotes its own session
        store.demote(session)
    check()
    store.add(make_session())  # over budget: the least recently used is demoted
    check()
    assert store.stats().counters.demoted == 1
    store.close(sessions[0].session_id)
    check()
    clock.now += 61
    assert store.reap() == 3
    check()
    assert store.stats().total_bytes == 0 and len(store) == 0


def test_reap_frees_expired_sessions_and_keeps_fresh_ones(clock):
    store = SessionStore(budget_bytes=10**9, ttl_s=60, clock=clock)
    old, fresh = make_session(), make_session()
    store.add(old)
    clock.now += 30
    store.add(fresh)
    clock.now += 31
    assert store.reap() == 1
    assert old.session_id not in store and fresh.session_id in store
    assert store.stats().counters.expired == 1


def test_a_request_measures_only_its_own_session(clock, monkeypatch):
    """Per-request cost must not grow with the sessions held: a turn and the stats after it
    measure the one session that changed, not all of them."""
    store = SessionStore(budget_bytes=10**9, clock=clock)
    sessions = [make_session(tokens=4) for _ in range(200)]
    for session in sessions:
        store.add(session)
    measured = []
    original = Session.bytes_by_tier
    monkeypatch.setattr(
        Session, "bytes_by_tier", lambda self: measured.append(self) or original(self)
    )
    with store.use(sessions[7].session_id):
        pass
    store.stats()
    assert measured == [sessions[7]]
