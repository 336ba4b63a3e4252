"""The session metrics as CloudWatch embedded metric format (EMF) lines on the container's stdout.

SageMaker sends a container's stdout to CloudWatch Logs, and CloudWatch Logs turns each EMF line
(a JSON object whose ``_aws`` member names the metrics in it) into metrics: so the worker's
session metrics, which TorchServe exposes only on its loopback Prometheus endpoint, reach where
SageMaker users look without an agent (docs/container.md §Metrics on stdout (EMF)).

The endpoint is read every ``poll_s``; lines are written when a value changed since the last
lines, and at least every ``interval_s`` even when nothing did. One line per tier (and one for
what has none), each under two dimension sets: ``Endpoint`` (the endpoint's totals and
percentiles over all its instances) and ``Endpoint, Host`` (one instance), with ``Tier`` added
to both where the line has one (docs/serving.md §CloudWatch dimensions and percentiles).

- gauges (sessions and bytes held): the current value;
- counters (sessions opened, closed, ..., tokens): the increase since the previous lines (a
  TorchServe restart starts them from zero again: the new value is the increase);
- latencies: the turns since the previous lines as EMF ``Values``/``Counts`` (CloudWatch
  computes percentiles from them), when there were any: the handler's latency bins, each value
  within 6 % of the turns it stands for.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

NAMESPACE = "StatefulLlava"
# The endpoint's name, which a container cannot learn from SageMaker: deploy/endpoint.py sets it.
ENDPOINT_ENV = "SERVE_ENDPOINT_NAME"
LOCAL_ENDPOINT = "local"  # unset: a container run outside deploy (the container tier, by hand)
_ENDPOINT_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*")  # SageMaker's EndpointName rule
# DurableLagSeconds stays per shard on TorchServe's endpoint: a sum over shards means nothing
GAUGES = {"SessionsOpen": "Count", "SessionBytes": "Bytes", "DurablePendingSessions": "Count"}
COUNTERS = {
    name: "Count"
    for name in (
        "SessionsOpened",
        "SessionsClosed",
        "SessionsExpired",
        "SessionsDemoted",
        "SessionsEvicted",  # lost: no tier could keep them
        "SessionsParked",  # moved to the persistent tier alone; back on their next turn
        "TurnNewTokens",
        "TurnCachedTokens",
        "PrefixHits",  # opens and recomputes that started on blocks other sessions computed
        "PrefixCachedTokens",
        "ImageFeatureHits",  # opens on an image whose features were held: no vision tower
        "AttentionFallbacks",  # the worker degraded: the paged attention failed, sdpa serves
        "GraphCaptureFailures",  # decode graph buckets left eager
        "CompileFallbacks",  # the compiled layer pieces failed: they run eagerly
        "DeviceOutOfMemory",  # steps or vision-tower runs answered KV_MEMORY_FULL: headroom short
        "DurableRecordWrites",  # the durable store's write-behind (docs/engine/sessions.md)
        "DurableFeatureWrites",
        "DurableRecordDeletes",
        "DurableStoreFailures",  # writes or deletes the store failed, each retried
    )
}
HISTOGRAMS = {"TurnLatencySeconds": "Seconds", "TurnTimeToFirstTokenSeconds": "Seconds"}
BINNED = "Binned"  # <histogram>Binned{Tier, Seconds}: turns per latency bin (handlers/metrics.py)

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Key = tuple[str, str, str]  # (metric name, tier or "", latency bin or "")


def endpoint_name(environ: Mapping[str, str]) -> str:
    """The ``Endpoint`` dimension: ``SERVE_ENDPOINT_NAME``, else ``local``; ValueError, naming
    the variable, for a value SageMaker would not take as an endpoint name."""
    name = environ.get(ENDPOINT_ENV, LOCAL_ENDPOINT)
    if len(name) > 63 or not _ENDPOINT_NAME.fullmatch(name):
        raise ValueError(
            f"bad {ENDPOINT_ENV}: {name!r} is not a SageMaker endpoint name (1 to 63 letters, "
            "digits and hyphens, starting and ending with a letter or digit)"
        )
    return name


def parse_prometheus(text: str) -> dict[Key, float]:
    """Our metrics from Prometheus text, summed per (name, Tier label, Seconds label).
    Histograms become ``<name>_sum`` and ``<name>_count``; a counter's ``_total`` suffix is
    dropped."""
    values: dict[Key, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        name = name.removesuffix("_total")
        base = name.rsplit("_", 1)[0] if name.endswith(("_sum", "_count")) else name
        if (
            name not in GAUGES
            and name not in COUNTERS
            and base not in HISTOGRAMS
            and name.removesuffix(BINNED) not in HISTOGRAMS
        ):
            continue
        found = dict(_LABEL.findall(labels or ""))
        key = (name, found.get("Tier", ""), found.get("Seconds", ""))
        try:
            values[key] = values.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return values


@dataclass
class EmfReporter:
    """Turns successive scrapes into EMF lines; ``poll`` does one step (tests call it)."""

    scrape: Callable[[], str]  # the Prometheus text; raises OSError while TorchServe is down
    write: Callable[[str], None]  # one line, without its newline
    model: str  # a property of every line, not a dimension: an endpoint serves one model
    interval_s: float = 60.0
    namespace: str = NAMESPACE
    clock: Callable[[], float] = time.time
    endpoint: str = LOCAL_ENDPOINT  # the container passes SERVE_ENDPOINT_NAME's, checked at start
    host: str = field(default_factory=socket.gethostname)  # TorchServe's Hostname label too
    _last: dict[Key, float] | None = field(default=None, init=False)
    _last_at: float = field(default=0.0, init=False)

    def poll(self) -> int:
        """Scrape once and write lines if anything changed or the interval is up; return how
        many lines were written."""
        try:
            now_values = parse_prometheus(self.scrape())
        except (OSError, http.client.HTTPException):
            return 0  # TorchServe is (re)starting (refused, or a reply cut short): nothing yet
        now = self.clock()
        unchanged = self._last is not None and now_values == self._last
        if unchanged and now - self._last_at < self.interval_s:
            return 0
        lines = self._lines(now_values, self._last or {}, now)
        for line in lines:
            self.write(line)
        self._last, self._last_at = now_values, now
        return len(lines)

    def run(self, stop: threading.Event, poll_s: float = 1.0) -> None:
        while not stop.wait(poll_s):
            self.poll()

    def _lines(self, now: dict[Key, float], before: dict[Key, float], at: float) -> list[str]:
        by_tier: dict[str, dict[str, tuple[float | dict, str]]] = {}
        for (name, tier, _), value in now.items():
            if name in GAUGES:
                by_tier.setdefault(tier, {})[name] = (value, GAUGES[name])
            elif name in COUNTERS:
                by_tier.setdefault(tier, {})[name] = (
                    _increase(value, before.get((name, tier, ""))),
                    COUNTERS[name],
                )
        for name, unit in HISTOGRAMS.items():
            for tier in {t for (n, t, _) in now if n in (f"{name}_count", name + BINNED)}:
                if (latencies := _latencies(name, tier, now, before)) is not None:
                    by_tier.setdefault(tier, {})[name] = (latencies, unit)
        return [self._line(tier, metrics, at) for tier, metrics in sorted(by_tier.items())]

    def _line(self, tier: str, metrics: dict[str, tuple[float | dict, str]], at: float) -> str:
        tiered = {"Tier": tier} if tier else {}
        directive = {
            "Namespace": self.namespace,
            # Two sets, each a metric of its own in CloudWatch (and billed so): the endpoint's,
            # and each instance's.
            "Dimensions": [["Endpoint", *tiered], ["Endpoint", "Host", *tiered]],
            "Metrics": [
                {"Name": name, "Unit": unit} for name, (_, unit) in sorted(metrics.items())
            ],
        }
        document = {
            "_aws": {"Timestamp": int(at * 1000), "CloudWatchMetrics": [directive]},
            "Endpoint": self.endpoint,
            "Host": self.host,
            **tiered,
            "Model": self.model,
            **{name: value for name, (value, _) in sorted(metrics.items())},
        }
        return json.dumps(document, separators=(",", ":"))


def _latencies(
    name: str, tier: str, now: dict[Key, float], before: dict[Key, float]
) -> dict | None:
    """The turns since the previous lines as an EMF distribution, or None when there were none.
    All of it from the handler's bins (at most 100 values, EMF's limit for one metric in one
    line): one counter per bin, so no scrape sees a turn half published."""

    def increase(key: Key) -> float:
        return _increase(now.get(key, 0.0), before.get(key))

    bins = [key for key in now if key[0] == name + BINNED and key[1] == tier]
    if bins:
        counts = {float(key[2]): increase(key) for key in bins}
    else:  # a .mar archived before the bins: its histogram's mean stands for its turns
        count, total = (increase((f"{name}_{part}", tier, "")) for part in ("count", "sum"))
        counts = {total / count: count} if count > 0 else {}
    values = sorted(value for value, n in counts.items() if n > 0)
    if not values:
        return None
    return {
        "Values": values,
        "Counts": [counts[value] for value in values],
        "Max": values[-1],
        "Min": values[0],
        "Count": sum(counts[value] for value in values),
        "Sum": sum(value * counts[value] for value in values),
    }


def _increase(value: float, before: float | None) -> float:
    """A counter's increase; a counter that went down was restarted from zero."""
    if before is None or value < before:
        return value
    return value - before
