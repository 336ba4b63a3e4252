"""Frees expired sessions on a timer, so an idle server does not hold their memory.

Without it, expiry happens only at the next store call: a server nobody calls keeps every
expired session's KV cache, and gauges published per request stay stale forever
(docs/engine/sessions.md §Expiry without traffic (the reaper)).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)

MIN_PERIOD_S = 1.0
TTL_FRACTION = 0.05


def reap_period_s(ttl_s: float) -> float:
    """An expired session is freed at most this long after its expiry: 5 % of the TTL, ≥ 1 s."""
    return max(MIN_PERIOD_S, TTL_FRACTION * ttl_s)


class Reapable(Protocol):
    """What the reaper sweeps: a SessionStore, or every shard's (llava.shards.ShardedEngine)."""

    ttl_s: float

    def reap(self) -> int: ...


class Reaper:
    """A daemon thread calling ``store.reap()`` every ``period_s``; ``on_reap(count)`` runs
    after a sweep that removed sessions (the handler republishes its gauges there)."""

    def __init__(
        self,
        store: Reapable,
        on_reap: Callable[[int], None] | None = None,
        period_s: float | None = None,
    ):
        self.store = store
        self.on_reap = on_reap
        self.period_s = reap_period_s(store.ttl_s) if period_s is None else period_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-reaper", daemon=True)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            try:
                reaped = self.store.reap()
                if reaped and self.on_reap is not None:
                    self.on_reap(reaped)
            except Exception:  # a failed sweep or callback must not end the reaping
                logger.exception("session reaper: sweep failed; retrying next period")
