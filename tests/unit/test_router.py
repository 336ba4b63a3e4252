"""The local endpoint's placement and its books of lost sessions (local_endpoint/router.py).

Pure bookkeeping, no HTTP: the end-to-end checks through real TorchServe instances are in
tests/test_local_endpoint.py.
"""

from __future__ import annotations

import threading
from collections import Counter

from local_endpoint.router import Backend, Loss, Router


def two_instances() -> Router:
    return Router(
        [
            Backend("instance-0", "http://a", ready=lambda: True),
            Backend("instance-1", "http://b", ready=lambda: True),
        ]
    )


def test_opens_in_flight_count_so_simultaneous_opens_spread():
    """24 opens placed at the same moment, none answered yet: 12 on each instance (placement
    once counted only bound sessions, so all 24 went to the first)."""
    router, chosen, go = two_instances(), [], threading.Barrier(24, timeout=10)

    def open_one():
        go.wait(10)
        chosen.append(router.place())

    threads = [threading.Thread(target=open_one) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert Counter(b.name for b in chosen) == {"instance-0": 12, "instance-1": 12}
    for i, backend in enumerate(chosen):  # answered: the in-flight count becomes sessions
        router.bind(f"s{i}", backend)
        router.placed(backend)
    assert [(len(b.sessions), b.placing) for b in router.backends] == [(12, 0), (12, 0)]


def test_a_dead_instance_s_sessions_are_lost_each_told_the_whole_count():
    router = two_instances()
    zero, one = router.backends
    for i in range(12):
        router.bind(f"a{i}", zero)
    router.bind("b0", one)
    router.mark_dead(zero)
    router.mark_dead(zero)  # a second request noticing the same death loses nothing more
    assert {router.lost(f"a{i}") for i in range(12)} == {Loss("instance-0", 12)}
    assert router.for_session("a0") is None and router.for_session("b0") is one
    assert router.lost("b0") is None and router.lost("never-opened") is None
    router.unbind("a0")  # closed by its client: no longer reported as lost
    assert router.lost("a0") is None and router.lost("a1") == Loss("instance-0", 12)
