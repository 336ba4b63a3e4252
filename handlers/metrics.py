"""Session metrics for TorchServe's metrics endpoint (auto-detected: config.properties).

Gauges are set from the store's snapshot after every request and after every reaper sweep
that freed sessions; counters are emitted as the increase since the previous snapshot, so
the endpoint's totals match the store's. A worker emits a metric by printing a line that
TorchServe's frontend parses as it arrives, so the reaper's thread can publish too.

Latencies are in seconds: TorchServe 0.12 builds every Prometheus histogram with the client
library's default buckets (0.005 ... 10), which fit seconds; milliseconds would land in +Inf
(docs/design.md §Latency metrics in seconds).
"""

from __future__ import annotations

import threading

from ts.metrics.metric_type_enum import MetricTypes

from llava.engine import Answer
from llava.store import StoreCounters, StoreStats

# store counter → metric name
_COUNTERS = {
    "opened": "SessionsOpened",
    "closed": "SessionsClosed",
    "expired": "SessionsExpired",
    "demoted": "SessionsDemoted",
    "evicted": "SessionsEvicted",
}


class SessionMetrics:
    def __init__(self, metrics_cache):
        add = metrics_cache.add_metric_to_cache
        self._open = add("SessionsOpen", "count", ["Tier"], MetricTypes.GAUGE)
        self._bytes = add("SessionBytes", "bytes", ["Tier"], MetricTypes.GAUGE)
        self._latency = add("TurnLatencySeconds", "s", ["Tier"], MetricTypes.HISTOGRAM)
        self._ttft = add("TurnTimeToFirstTokenSeconds", "s", ["Tier"], MetricTypes.HISTOGRAM)
        self._new = add("TurnNewTokens", "count", [], MetricTypes.COUNTER)
        self._cached = add("TurnCachedTokens", "count", [], MetricTypes.COUNTER)
        self._counters = {
            name: add(metric, "count", [], MetricTypes.COUNTER)
            for name, metric in _COUNTERS.items()
        }
        self._last = StoreCounters()
        self._publishing = threading.Lock()  # requests and the reaper's thread both publish

    def turn(self, answer: Answer) -> None:
        tier = [answer.tier.value]
        self._latency.add_or_update(answer.total_s, tier)
        self._ttft.add_or_update(answer.ttft_s, tier)
        self._new.add_or_update(answer.new_tokens)
        self._cached.add_or_update(answer.cached_tokens)

    def store(self, stats: StoreStats) -> None:
        with self._publishing:
            self._store(stats)

    def _store(self, stats: StoreStats) -> None:
        for tier, count in stats.sessions_by_tier.items():
            self._open.add_or_update(count, [tier.value])
        for tier, nbytes in stats.bytes_by_tier.items():
            self._bytes.add_or_update(nbytes, [tier.value])
        for name, metric in self._counters.items():
            increase = getattr(stats.counters, name) - getattr(self._last, name)
            if increase:
                metric.add_or_update(increase)
        self._last = stats.counters
