"""Session metrics for TorchServe's metrics endpoint (auto-detected: config.properties).

Gauges (sessions and bytes per tier: kv, host, features; the memory budgets) are set from the
engine's snapshot after every request and after every reaper sweep
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

from llava.engine import Answer, EngineStats

# (registry or memory counters, counter) → metric name
_COUNTERS = {
    ("store", "opened"): "SessionsOpened",
    ("store", "closed"): "SessionsClosed",
    ("store", "expired"): "SessionsExpired",
    ("memory", "moved_to_host"): "SessionsMovedToHost",
    ("memory", "restored"): "SessionsRestoredFromHost",
    ("memory", "demoted"): "SessionsDemoted",
    ("memory", "evicted"): "SessionsEvicted",
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
        self._budget = add("MemoryBudgetBytes", "bytes", ["Memory"], MetricTypes.GAUGE)
        self._counters = {
            key: add(metric, "count", [], MetricTypes.COUNTER) for key, metric in _COUNTERS.items()
        }
        self._last: dict[tuple[str, str], int] = {}
        self._publishing = threading.Lock()  # requests and the reaper's thread both publish

    def turn(self, answer: Answer) -> None:
        tier = [answer.tier.value]
        self._latency.add_or_update(answer.total_s, tier)
        self._ttft.add_or_update(answer.ttft_s, tier)
        self._new.add_or_update(answer.new_tokens)
        self._cached.add_or_update(answer.cached_tokens)

    def store(self, stats: EngineStats) -> None:
        with self._publishing:
            self._store(stats)

    def _store(self, stats: EngineStats) -> None:
        for tier, count in stats.sessions_by_tier.items():
            self._open.add_or_update(count, [tier.value])
        for tier, nbytes in stats.bytes_by_tier.items():
            self._bytes.add_or_update(nbytes, [tier.value])
        budget = stats.budget
        for memory, nbytes in (
            ("device", budget.device_bytes),
            ("headroom", budget.headroom_bytes),
            ("host", budget.host_bytes),
        ):
            self._budget.add_or_update(nbytes, [memory])
        for key, metric in self._counters.items():
            value = getattr(getattr(stats, key[0]), key[1])
            increase = value - self._last.get(key, 0)
            if increase:
                metric.add_or_update(increase)
            self._last[key] = value
