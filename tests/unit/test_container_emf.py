"""serving/emf.py: TorchServe's Prometheus text → CloudWatch EMF lines, on change and at the
interval, with a fake clock and scripted scrapes (the real endpoint and the real container's
stdout are in tests/container/test_container_image.py, the container tier)."""

from __future__ import annotations

import json

from serving.emf import EmfReporter, parse_prometheus

# What TorchServe 0.12's metrics endpoint printed for the handler's metrics (container run).
SCRAPE = """\
# HELP SessionsOpen Torchserve prometheus gauge metric with unit: count
# TYPE SessionsOpen gauge
SessionsOpen{{Tier="kv",Hostname="vm",}} {open}
SessionsOpen{{Tier="features",Hostname="vm",}} 0.0
SessionBytes{{Tier="kv",Hostname="vm",}} {nbytes}
SessionsOpened{{Hostname="vm",}} {opened}
TurnNewTokens{{Hostname="vm",}} {tokens}
TurnLatencySeconds_bucket{{Tier="kv",Hostname="vm",le="0.5",}} {turns}
TurnLatencySeconds_count{{Tier="kv",Hostname="vm",}} {turns}
TurnLatencySeconds_sum{{Tier="kv",Hostname="vm",}} {latency}
ts_inference_requests_total{{model_name="llava",}} 9.0
"""


def scrape(open=0, nbytes=0, opened=0, tokens=0, turns=0, latency=0.0) -> str:  # noqa: A002
    return SCRAPE.format(
        open=open, nbytes=nbytes, opened=opened, tokens=tokens, turns=turns, latency=latency
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
            self.next, self.lines.append, "llava", interval_s, clock=lambda: self.now
        )

    def documents(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]


def test_engine_shards_are_summed_into_the_instances_totals():
    """A worker with two engine shards labels its books by Shard; EMF keeps Model and Tier."""
    text = (
        'SessionsOpen{Shard="0",Tier="kv",Hostname="vm",} 1.0\n'
        'SessionsOpen{Shard="1",Tier="kv",Hostname="vm",} 2.0\n'
        'SessionsOpened{Shard="0",Hostname="vm",} 4.0\n'
        'SessionsOpened{Shard="1",Hostname="vm",} 3.0\n'
    )
    values = parse_prometheus(text)
    assert values == {("SessionsOpen", "kv"): 3.0, ("SessionsOpened", ""): 7.0}


def test_parse_keeps_our_metrics_per_tier_and_drops_torchserves_own():
    values = parse_prometheus(scrape(open=2, opened=5, turns=3, latency=1.5))
    assert values[("SessionsOpen", "kv")] == 2 and values[("SessionsOpen", "features")] == 0
    assert values[("SessionsOpened", "")] == 5
    assert values[("TurnLatencySeconds_count", "kv")] == 3
    assert values[("TurnLatencySeconds_sum", "kv")] == 1.5
    assert not any(name.startswith(("ts_", "TurnLatencySeconds_bucket")) for name, _ in values)


def test_lines_are_emf_documents_with_their_dimensions():
    script = Script(scrape(open=1, nbytes=4096, opened=1, tokens=7, turns=2, latency=0.5))
    assert script.reporter().poll() == 3  # no tier, kv, features
    by_tier = {d.get("Tier", ""): d for d in script.documents()}
    kv = by_tier["kv"]
    (directive,) = kv["_aws"]["CloudWatchMetrics"]
    assert kv["_aws"]["Timestamp"] == 1_000_000
    assert directive["Namespace"] == "StatefulLlava"
    assert directive["Dimensions"] == [["Model", "Tier"]]
    assert {m["Name"]: m["Unit"] for m in directive["Metrics"]} == {
        "SessionsOpen": "Count",
        "SessionBytes": "Bytes",
        "TurnLatencySeconds": "Seconds",
    }
    assert (kv["Model"], kv["SessionsOpen"], kv["SessionBytes"]) == ("llava", 1, 4096)
    assert kv["TurnLatencySeconds"] == 0.25  # the mean of the two turns
    untiered = by_tier[""]
    assert untiered["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["Model"]]
    assert (untiered["SessionsOpened"], untiered["TurnNewTokens"]) == (1, 7)


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
