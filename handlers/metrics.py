"""Session metrics for TorchServe's metrics endpoint (auto-detected: config.properties).

Gauges (sessions per tier: kv, host, features, persisted; bytes per tier of memory; the memory
budgets; each shard's readiness and requests in flight) are set from every engine shard's
snapshot after every request and after every reaper sweep that freed sessions; counters are
emitted as the increase since the previous snapshot, so the endpoint's totals match the stores'.
What comes from a shard's snapshot carries a ``Shard`` dimension (its index); summed over it,
the worker's totals (docs/engine/scheduling.md §Engine shards). A worker emits a metric by
printing a line that TorchServe's frontend parses as it arrives, so the reaper's thread can
publish too.

Latencies are in seconds: TorchServe 0.12 builds every Prometheus histogram with the client
library's default buckets (0.005 ... 10), which fit seconds; milliseconds would land in +Inf
(docs/serving.md §Latency metrics in seconds). Past 10 s those buckets say nothing, so each turn
is also counted in a ``...Binned`` counter under its latency rounded to 20 steps a decade: the
container's percentiles come from those (serving/emf.py).
"""

from __future__ import annotations

import math
import threading

from ts.metrics.metric_type_enum import MetricTypes

from llava.engine import Answer
from llava.shards import ShardStats

# (store, memory or runner counters, counter) → metric name
_COUNTERS = {
    ("store", "opened"): "SessionsOpened",
    ("store", "closed"): "SessionsClosed",
    ("store", "expired"): "SessionsExpired",
    ("memory", "moved_to_host"): "SessionsMovedToHost",
    ("memory", "restored"): "SessionsRestoredFromHost",
    ("memory", "demoted"): "SessionsDemoted",
    ("memory", "evicted"): "SessionsEvicted",
    ("memory", "parked"): "SessionsParked",
    ("memory", "prefix_hits"): "PrefixHits",
    ("memory", "prefix_tokens"): "PrefixCachedTokens",
    ("memory", "feature_hits"): "ImageFeatureHits",
    ("runner", "attention_fallbacks"): "AttentionFallbacks",
    ("runner", "graph_capture_failures"): "GraphCaptureFailures",
    ("runner", "compile_fallbacks"): "CompileFallbacks",
    ("runner", "device_out_of_memory"): "DeviceOutOfMemory",
    ("durable", "writes"): "DurableRecordWrites",
    ("durable", "feature_writes"): "DurableFeatureWrites",
    ("durable", "deletes"): "DurableRecordDeletes",
    ("durable", "failures"): "DurableStoreFailures",
}

# Latency bins: 10^(k/20) s for k in -60..39 (1 ms to 89 s), each within 6 % of what it holds.
# At most 100 values: what one EMF line may carry for one metric.
_BIN_STEPS = 20
_BIN_RANGE = (-60, 39)


def latency_bin(seconds: float) -> str:
    """The ``Seconds`` label of the bin that holds ``seconds`` (clamped to the range)."""
    step = round(_BIN_STEPS * math.log10(max(seconds, 1e-3)))
    step = min(max(step, _BIN_RANGE[0]), _BIN_RANGE[1])
    return f"{10 ** (step / _BIN_STEPS):.4g}"


class SessionMetrics:
    def __init__(self, metrics_cache):
        add = metrics_cache.add_metric_to_cache
        self._open = add("SessionsOpen", "count", ["Shard", "Tier"], MetricTypes.GAUGE)
        self._bytes = add("SessionBytes", "bytes", ["Shard", "Tier"], MetricTypes.GAUGE)
        self._ready = add("ShardReady", "count", ["Shard"], MetricTypes.GAUGE)
        self._in_flight = add("ShardRequestsInFlight", "count", ["Shard"], MetricTypes.GAUGE)
        self._latency = add("TurnLatencySeconds", "s", ["Tier"], MetricTypes.HISTOGRAM)
        self._ttft = add("TurnTimeToFirstTokenSeconds", "s", ["Tier"], MetricTypes.HISTOGRAM)
        self._latency_bins = add(
            "TurnLatencySecondsBinned", "count", ["Tier", "Seconds"], MetricTypes.COUNTER
        )
        self._ttft_bins = add(
            "TurnTimeToFirstTokenSecondsBinned", "count", ["Tier", "Seconds"], MetricTypes.COUNTER
        )
        self._new = add("TurnNewTokens", "count", [], MetricTypes.COUNTER)
        self._cached = add("TurnCachedTokens", "count", [], MetricTypes.COUNTER)
        self._budget = add("MemoryBudgetBytes", "bytes", ["Shard", "Memory"], MetricTypes.GAUGE)
        # the durable store's write-behind: sessions not written yet, and the oldest one's wait
        self._durable_pending = add("DurablePendingSessions", "count", ["Shard"], MetricTypes.GAUGE)
        self._durable_lag = add("DurableLagSeconds", "s", ["Shard"], MetricTypes.GAUGE)
        self._counters = {
            key: add(metric, "count", ["Shard"], MetricTypes.COUNTER)
            for key, metric in _COUNTERS.items()
        }
        self._last: dict[tuple[int, str, str], int] = {}
        self._publishing = threading.Lock()  # requests and the reaper's thread both publish

    def turn(self, answer: Answer) -> None:
        tier = [answer.tier.value]
        self._latency.add_or_update(answer.total_s, tier)
        self._ttft.add_or_update(answer.ttft_s, tier)
        self._latency_bins.add_or_update(1, [*tier, latency_bin(answer.total_s)])
        self._ttft_bins.add_or_update(1, [*tier, latency_bin(answer.ttft_s)])
        self._new.add_or_update(answer.new_tokens)
        self._cached.add_or_update(answer.cached_tokens)

    def store(self, shards: list[ShardStats]) -> None:
        with self._publishing:
            for shard in shards:
                self._shard(shard)

    def _shard(self, shard: ShardStats) -> None:
        dim = str(shard.shard)
        self._ready.add_or_update(int(shard.ready), [dim])
        self._in_flight.add_or_update(shard.in_flight, [dim])
        stats = shard.engine
        for tier, count in stats.sessions_by_tier.items():
            self._open.add_or_update(count, [dim, tier.value])
        for tier, nbytes in stats.bytes_by_tier.items():
            self._bytes.add_or_update(nbytes, [dim, tier.value])
        budget = stats.budget
        for memory, nbytes in (
            ("device", budget.device_bytes),
            ("headroom", budget.headroom_bytes),
            ("host", budget.host_bytes),
        ):
            self._budget.add_or_update(nbytes, [dim, memory])
        self._durable_pending.add_or_update(stats.durable.pending, [dim])
        self._durable_lag.add_or_update(stats.durable.lag_s, [dim])
        for key, metric in self._counters.items():
            value = getattr(getattr(stats, key[0]), key[1])
            increase = value - self._last.get((shard.shard, *key), 0)
            if increase:
                metric.add_or_update(increase, [dim])
            self._last[(shard.shard, *key)] = value
