"""serving/emf.py: TorchServe's Prometheus text → CloudWatch EMF lines, on change and at the
interval, with a fake clock and scripted scrapes (the real endpoint and the real container's
stdout are in tests/container/test_container_image.py, the container tier). The latency
percentiles are checked from the handler's own metric calls (handlers/metrics.py, through
TorchServe's worker-side metric objects) to the Values/Counts CloudWatch would get."""

from __future__ import annotations

import json
import logging
import math
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving.emf import EmfReporter, endpoint_name, parse_prometheus

# What TorchServe 0.12's metrics endpoint printed for the handler's metrics (container run).
SCRAPE = """\
# HELP SessionsOpen Torchserve prometheus gauge metric with unit: count
# TYPE SessionsOpen gauge
SessionsOpen{{Tier="kv",Hostname="vm",}} {open}
SessionsOpen{{Tier="features",Hostname="vm",}} 0.0
SessionBytes{{Tier="kv",Hostname="vm",}} {nbytes}
SessionsOpened{{Hostname="vm",}} {opened}
TurnNewTokens{{Hostname="vm",}} {tokens}
TurnLatencySecondsBinned{{Tier="kv",Seconds="{bin}",Hostname="vm",}} {turns}
TurnLatencySeconds_bucket{{Tier="kv",Hostname="vm",le="0.5",}} {turns}
TurnLatencySeconds_count{{Tier="kv",Hostname="vm",}} {turns}
TurnLatencySeconds_sum{{Tier="kv",Hostname="vm",}} {latency}
ts_inference_requests_total{{model_name="llava",}} 9.0
"""

# What TorchServe 0.12 printed for three turns of the demo model (totalMs 222.51, 222.52,
# 73.89; ttftMs 114.07, 110.96, 72.41): the handler's bins as its frontend renders them.
TORCHSERVE_BINS = """\
TurnTimeToFirstTokenSecondsBinned{Tier="kv",Seconds="0.07079",Hostname="vm",} 1.0
TurnTimeToFirstTokenSecondsBinned{Tier="kv",Seconds="0.1122",Hostname="vm",} 2.0
TurnLatencySecondsBinned{Tier="kv",Seconds="0.07079",Hostname="vm",} 1.0
TurnLatencySecondsBinned{Tier="kv",Seconds="0.2239",Hostname="vm",} 2.0
"""


def scrape(open=0, nbytes=0, opened=0, tokens=0, turns=0, latency=0.0, bin="0.2239") -> str:  # noqa: A002
    return SCRAPE.format(
        open=open,
        nbytes=nbytes,
        opened=opened,
        tokens=tokens,
        turns=turns,
        latency=latency,
        bin=bin,
    )


class Script:
    """Scrapes in order (an OSError stands for TorchServe restarting) and a settable clock."""

    def __init__(self, *scrapes):
        self.scrapes, self.now, self.lines = list(scrapes), 1000.0, []

    def next(self) -> str:
        item = self.scrapes.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def reporter(self, interval_s: float = 60.0) -> EmfReporter:
        return EmfReporter(
            self.next,
            self.lines.append,
            "llava",
            interval_s,
            clock=lambda: self.now,
            endpoint="llava-chat",
            host="ip-10-0-1-17",
        )

    def documents(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]


class Frontend:
    """TorchServe's frontend in miniature: it reads the ``[METRICS]`` lines that TorchServe's own
    worker-side metric objects log and renders them as its metrics endpoint does (the format
    pinned by test_the_miniature_frontend_prints_what_torchserve_printed)."""

    LINE = re.compile(r"\[METRICS\](\w+)\.\w+:([^|]+)\|#([^|]*)\|#type:(\w+)\|")

    def __init__(self):
        import ts
        from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

        self.cache = MetricsCacheYamlImpl(str(Path(ts.__file__).parent / "configs/metrics.yaml"))
        self.series: dict[tuple[str, str], float] = {}  # (name, labels) → value
        self._handler = logging.Handler()
        self._handler.emit = lambda record: self.take(record.getMessage())
        self._logger = logging.getLogger("ts.metrics.caching_metric")
        self._logger.addHandler(self._handler)
        # setLevel, not the attribute: it clears the logger's cached answers, which an earlier
        # test's logging left saying INFO is off
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)

    def take(self, message: str) -> None:
        name, value, dimensions, kind = self.LINE.match(message).groups()
        pairs = (d.split(":", 1) for d in dimensions.split(",") if d)
        labels = "".join(f'{key}="{label}",' for key, label in pairs)
        if kind == "HISTOGRAM":
            self.series[(f"{name}_count", labels)] = (
                self.series.get((f"{name}_count", labels), 0) + 1.0
            )
            name = f"{name}_sum"
        before = 0.0 if kind == "GAUGE" else self.series.get((name, labels), 0.0)
        self.series[(name, labels)] = before + float(value)

    def text(self) -> str:
        return "".join(
            f'{name}{{{labels}Hostname="vm",}} {value}\n'
            for (name, labels), value in self.series.items()
        )


@pytest.fixture
def frontend():
    frontend = Frontend()
    yield frontend
    frontend.close()


def turn(metrics, total_s: float, ttft_s: float) -> None:
    from llava.kv.holding import Tier

    # What SessionMetrics.turn reads of the engine's Answer.
    metrics.turn(
        SimpleNamespace(tier=Tier.KV, total_s=total_s, ttft_s=ttft_s, new_tokens=5, cached_tokens=9)
    )


def percentile(values: list[float], counts: list[float], p: float) -> float:
    """The nearest-rank percentile of a Values/Counts distribution."""
    rank, seen = math.ceil(p / 100 * sum(counts)), 0.0
    for value, count in zip(values, counts, strict=True):
        seen += count
        if seen >= rank:
            return value
    raise AssertionError("rank past the distribution")


def test_engine_shards_are_summed_into_the_instances_totals():
    """A worker with two engine shards labels its books by Shard; EMF keeps Tier."""
    text = (
        'SessionsOpen{Shard="0",Tier="kv",Hostname="vm",} 1.0\n'
        'SessionsOpen{Shard="1",Tier="kv",Hostname="vm",} 2.0\n'
        'SessionsOpened{Shard="0",Hostname="vm",} 4.0\n'
        'SessionsOpened{Shard="1",Hostname="vm",} 3.0\n'
    )
    values = parse_prometheus(text)
    assert values == {("SessionsOpen", "kv", ""): 3.0, ("SessionsOpened", "", ""): 7.0}


def test_parse_keeps_our_metrics_per_tier_and_drops_torchserves_own():
    values = parse_prometheus(scrape(open=2, opened=5, turns=3, latency=1.5))
    assert values[("SessionsOpen", "kv", "")] == 2 and values[("SessionsOpen", "features", "")] == 0
    assert values[("SessionsOpened", "", "")] == 5
    assert values[("TurnLatencySeconds_count", "kv", "")] == 3
    assert values[("TurnLatencySeconds_sum", "kv", "")] == 1.5
    assert values[("TurnLatencySecondsBinned", "kv", "0.2239")] == 3
    assert not any(name.startswith(("ts_", "TurnLatencySeconds_bucket")) for name, _, _ in values)


def test_lines_are_emf_documents_with_their_dimensions():
    script = Script(scrape(open=1, nbytes=4096, opened=1, tokens=7, turns=2, latency=0.5))
    assert script.reporter().poll() == 3  # no tier, kv, features
    by_tier = {d.get("Tier", ""): d for d in script.documents()}
    kv = by_tier["kv"]
    (directive,) = kv["_aws"]["CloudWatchMetrics"]
    assert kv["_aws"]["Timestamp"] == 1_000_000
    assert directive["Namespace"] == "StatefulLlava"
    # the endpoint's metric (all its instances) and each instance's
    assert directive["Dimensions"] == [["Endpoint", "Tier"], ["Endpoint", "Host", "Tier"]]
    assert {m["Name"]: m["Unit"] for m in directive["Metrics"]} == {
        "SessionsOpen": "Count",
        "SessionBytes": "Bytes",
        "TurnLatencySeconds": "Seconds",
    }
    assert (kv["Endpoint"], kv["Host"], kv["Model"]) == ("llava-chat", "ip-10-0-1-17", "llava")
    assert (kv["SessionsOpen"], kv["SessionBytes"]) == (1, 4096)
    assert kv["TurnLatencySeconds"] == {  # both turns in the 0.2239 s bin
        "Values": [0.2239],
        "Counts": [2],
        "Max": 0.2239,
        "Min": 0.2239,
        "Count": 2,
        "Sum": 0.4478,
    }
    untiered = by_tier[""]
    dimensions = untiered["_aws"]["CloudWatchMetrics"][0]["Dimensions"]
    assert dimensions == [["Endpoint"], ["Endpoint", "Host"]] and "Tier" not in untiered
    assert (untiered["SessionsOpened"], untiered["TurnNewTokens"]) == (1, 7)
    for document in script.documents():  # every dimension a set names is in its line
        for names in document["_aws"]["CloudWatchMetrics"][0]["Dimensions"]:
            assert all(isinstance(document[name], str) for name in names)


def test_written_on_change_and_at_the_interval_with_increases_for_counters():
    script = Script(
        scrape(open=1, opened=1),  # first scrape: written
        scrape(open=1, opened=1),  # 1 s later, nothing changed: nothing
        scrape(open=2, opened=2),  # changed: written at once
        scrape(open=2, opened=2),  # the interval is up, unchanged: written again
        OSError("TorchServe restarting"),  # nothing, and no failure
        scrape(open=0, opened=1),  # restarted: its counter begins again at 0
    )
    reporter = script.reporter(interval_s=10)
    written = []
    for step in (0, 1, 1, 10, 1, 1):
        script.now += step
        written.append(reporter.poll())
    assert written == [3, 0, 3, 3, 0, 3]
    opened = [d["SessionsOpened"] for d in script.documents() if "SessionsOpened" in d]
    assert opened == [1, 1, 0, 1]  # increases; after the restart the new count is the increase
    assert sum(opened) == 3  # what CloudWatch adds up: every open counted once


def test_no_turns_means_no_latency_value():
    script = Script(scrape(turns=2, latency=1.0), scrape(turns=2, latency=1.0, open=1))
    reporter = script.reporter()
    reporter.poll()
    reporter.poll()
    latest_kv = [d for d in script.documents() if d.get("Tier") == "kv"][-1]
    assert "TurnLatencySeconds" not in latest_kv and latest_kv["SessionsOpen"] == 1


def test_the_miniature_frontend_prints_what_torchserve_printed(frontend):
    from handlers.metrics import SessionMetrics

    metrics = SessionMetrics(frontend.cache)
    for total_ms, ttft_ms in ((222.51, 114.07), (222.52, 110.96), (73.89, 72.41)):
        turn(metrics, total_ms / 1000, ttft_ms / 1000)
    printed = set(frontend.text().splitlines())
    assert set(TORCHSERVE_BINS.splitlines()) <= printed
    assert 'TurnLatencySeconds_count{Tier="kv",Hostname="vm",} 3.0' in printed


def test_latency_percentiles_match_the_recorded_turns(frontend):
    """Turns from 50 ms to 40 s, through the handler's metric calls: the Values/Counts of the
    EMF line give every percentile, and the sum, within 6 % (the bins' width), and the count."""
    from handlers.metrics import SessionMetrics

    metrics, rng = SessionMetrics(frontend.cache), random.Random(7)
    reporter = EmfReporter(
        frontend.text, (lines := []).append, "llava", endpoint="llava-chat", host="h"
    )
    batches = []
    for size in (500, 80):  # the second line holds only the turns since the first
        batch = [math.exp(rng.uniform(math.log(0.05), math.log(40.0))) for _ in range(size)]
        for total_s in batch:
            turn(metrics, total_s, total_s / 4)
        reporter.poll()
        batches.append(batch)

    kv = [json.loads(line) for line in lines if '"Tier":"kv"' in line]
    assert len(kv) == 2
    for document, batch in zip(kv, batches, strict=True):
        for name, recorded in (
            ("TurnLatencySeconds", batch),
            ("TurnTimeToFirstTokenSeconds", [s / 4 for s in batch]),
        ):
            latencies = document[name]
            values, counts = latencies["Values"], latencies["Counts"]
            assert len(values) <= 100 and values == sorted(values)  # EMF's limit per metric
            assert sum(counts) == latencies["Count"] == len(recorded)
            assert latencies["Sum"] == pytest.approx(sum(recorded), rel=0.06)
            for p in (50, 90, 99, 100):
                truth = sorted(recorded)[math.ceil(p / 100 * len(recorded)) - 1]
                assert percentile(values, counts, p) == pytest.approx(truth, rel=0.06), (name, p)


def test_a_handler_without_bins_gives_its_mean():
    """A .mar archived before the bins: the histogram's mean stands for its turns."""
    old = scrape(turns=4, latency=2.0).replace("TurnLatencySecondsBinned", "SomethingElse")
    script = Script(old)
    script.reporter().poll()
    (kv,) = [d for d in script.documents() if d.get("Tier") == "kv"]
    assert kv["TurnLatencySeconds"]["Values"] == [0.5]
    assert kv["TurnLatencySeconds"]["Counts"] == [4] and kv["TurnLatencySeconds"]["Sum"] == 2


def test_the_handlers_bins_are_at_most_100_and_within_6_percent():
    from handlers.metrics import latency_bin

    seconds = [10 ** (i / 2000) for i in range(-6000, 3900)]  # 1 ms to 89 s
    assert max(abs(float(latency_bin(s)) / s - 1) for s in seconds) < 0.06
    everything = [*seconds, 0.0, 1e-9, 60.0, 1e6]
    assert len({latency_bin(s) for s in everything}) == 100


def test_the_endpoint_name_comes_from_serve_endpoint_name():
    assert endpoint_name({}) == "local"  # outside deploy: the container tier, a run by hand
    assert endpoint_name({"SERVE_ENDPOINT_NAME": "llava-chat-2"}) == "llava-chat-2"
    assert endpoint_name({"SERVE_ENDPOINT_NAME": "a" * 63}) == "a" * 63


@pytest.mark.parametrize("bad", ["", "llava chat", "-llava", "llava-", "llava_chat", "a" * 64])
def test_a_bad_endpoint_name_fails_naming_the_variable(bad):
    with pytest.raises(ValueError, match="^bad SERVE_ENDPOINT_NAME: .* is not a SageMaker"):
        endpoint_name({"SERVE_ENDPOINT_NAME": bad})
