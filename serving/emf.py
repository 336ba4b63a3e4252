"""The session metrics as CloudWatch embedded metric format (EMF) lines on the container's stdout.

SageMaker sends a container's stdout to CloudWatch Logs, and CloudWatch Logs turns each EMF line
(a JSON object whose ``_aws`` member names the metrics in it) into metrics: so the worker's
session metrics, which TorchServe exposes only on its loopback Prometheus endpoint, reach where
SageMaker users look without an agent (docs/container.md §Metrics on stdout (EMF)).

The endpoint is read every ``poll_s``; lines are written when a value changed since the last
lines, and at least every ``interval_s`` even when nothing did. One line per dimension set:
``{"Model": ...}`` for the counters, ``{"Model", "Tier": ...}`` for what is per tier.

- gauges (sessions and bytes held): the current value;
- counters (sessions opened, closed, ..., tokens): the increase since the previous lines (a
  TorchServe restart starts them from zero again: the new value is the increase);
- latency histograms: the mean over the turns since the previous lines, when there were any.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

NAMESPACE = "StatefulLlava"
GAUGES = {"SessionsOpen": "Count", "SessionBytes": "Bytes"}
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
        "AttentionFallbacks",  # the worker degraded: flex attention failed, sdpa serves
        "GraphCaptureFailures",  # decode graph buckets left eager
    )
}
HISTOGRAMS = {"TurnLatencySeconds": "Seconds", "TurnTimeToFirstTokenSeconds": "Seconds"}

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Key = tuple[str, str]  # (metric name, tier or "")


def parse_prometheus(text: str) -> dict[Key, float]:
    """Our metrics from Prometheus text, summed per (name, Tier label). Histograms become
    ``<name>_sum`` and ``<name>_count``; a counter's ``_total`` suffix is dropped."""
    values: dict[Key, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        name = name.removesuffix("_total")
        base = name.rsplit("_", 1)[0] if name.endswith(("_sum", "_count")) else name
        if name not in GAUGES and name not in COUNTERS and base not in HISTOGRAMS:
            continue
        tier = dict(_LABEL.findall(labels or "")).get("Tier", "")
        try:
            values[(name, tier)] = values.get((name, tier), 0.0) + float(value)
        except ValueError:
            continue
    return values


@dataclass
class EmfReporter:
    """Turns successive scrapes into EMF lines; ``poll`` does one step (tests call it)."""

    scrape: Callable[[], str]  # the Prometheus text; raises OSError while TorchServe is down
    write: Callable[[str], None]  # one line, without its newline
    model: str
    interval_s: float = 60.0
    namespace: str = NAMESPACE
    clock: Callable[[], float] = time.time
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
        by_tier: dict[str, dict[str, tuple[float, str]]] = {}
        for (name, tier), value in now.items():
            if name in GAUGES:
                by_tier.setdefault(tier, {})[name] = (value, GAUGES[name])
            elif name in COUNTERS:
                by_tier.setdefault(tier, {})[name] = (
                    _increase(value, before.get((name, tier))),
                    COUNTERS[name],
                )
        for name, unit in HISTOGRAMS.items():
            for tier in {t for (n, t) in now if n == f"{name}_count"}:
                count, total = (
                    _increase(
                        now.get((f"{name}_{part}", tier), 0.0), before.get((f"{name}_{part}", tier))
                    )
                    for part in ("count", "sum")
                )
                if count > 0:
                    by_tier.setdefault(tier, {})[name] = (total / count, unit)
        return [self._line(tier, metrics, at) for tier, metrics in sorted(by_tier.items())]

    def _line(self, tier: str, metrics: dict[str, tuple[float, str]], at: float) -> str:
        dimensions = {"Model": self.model} | ({"Tier": tier} if tier else {})
        directive = {
            "Namespace": self.namespace,
            "Dimensions": [list(dimensions)],
            "Metrics": [
                {"Name": name, "Unit": unit} for name, (_, unit) in sorted(metrics.items())
            ],
        }
        document = {
            "_aws": {"Timestamp": int(at * 1000), "CloudWatchMetrics": [directive]},
            **dimensions,
            **{name: value for name, (value, _) in sorted(metrics.items())},
        }
        return json.dumps(document, separators=(",", ":"))


def _increase(value: float, before: float | None) -> float:
    """A counter's increase; a counter that went down was restarted from zero."""
    if before is None or value < before:
        return value
    return value - before
