"""The reaper frees expired sessions with no request arriving, within a bounded delay."""

from __future__ import annotations

import threading
import time

import pytest

from llava.sessions.reaper import Reaper, reap_period_s
from llava.sessions.store import SessionStore
from tests.memory_helpers import FakeClock, make_session, new_memory


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("ttl, period", [(1200, 60), (60, 3), (20, 1), (2, 1), (0.1, 1)])
def test_the_period_is_five_percent_of_the_ttl_and_at_least_a_second(ttl, period):
    assert reap_period_s(ttl) == pytest.approx(period)


@pytest.fixture
def store():
    clock = FakeClock()
    store = SessionStore(new_memory(), ttl_s=60, clock=clock)
    store.clock = clock
    return store


def test_expired_sessions_are_freed_with_no_store_call(store):
    """The store's clock is fake; the reaper's timer is real (a short period for the test)."""
    expiring, fresh = make_session(store.memory), make_session(store.memory)
    store.add(expiring)
    store.clock.now += 30
    store.add(fresh)
    reaped = []
    reaper = Reaper(store, on_reap=reaped.append, period_s=0.02).start()
    try:
        store.clock.now += 31  # only `expiring` is past its TTL now
        wait_until(lambda: reaped, timeout=5, what="a sweep that freed the expired session")
        assert reaped == [1]
        assert expiring.session_id not in store and fresh.session_id in store
        assert expiring.kv is None and expiring.holding.feature_blocks == []  # memory let go
    finally:
        reaper.stop()


def test_a_failing_callback_does_not_end_the_reaping(store):
    calls = []

    def flaky(count):
        calls.append(count)
        if len(calls) == 1:
            raise RuntimeError("metrics backend hiccup")

    reaper = Reaper(store, on_reap=flaky, period_s=0.02).start()
    try:
        for _ in range(2):
            store.add(make_session(store.memory))
            store.clock.now += 61
            seen = len(calls)
            wait_until(lambda n=seen: len(calls) > n, timeout=5, what="the next sweep")
        assert calls == [1, 1] and len(store) == 0
    finally:
        reaper.stop()


def test_stop_ends_the_thread(store):
    reaper = Reaper(store, period_s=0.02).start()
    reaper.stop(timeout=5)
    assert not any(t.name == "session-reaper" and t.is_alive() for t in threading.enumerate())
