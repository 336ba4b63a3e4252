"""The handler in a real TorchServe process, serving the .mar that `make mar` builds.

Loopback only: TorchServe binds 127.0.0.1 on free ports, images come from a loopback HTTP
server (allowed through LLAVA_INTAKE, since the default policy refuses loopback).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
import uuid
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests

from demo_model.synthetic import held_out_samples
from serving import torchserve
from serving.mar import build_mar
from serving.supervisor import Supervisor
from serving.torchserve import TorchServeInstance
from tests.conftest import DEMO_MODEL_DIR, REPO
from tests.intake_servers import LoopbackServer, image_bytes, respond

pytestmark = pytest.mark.torchserve
SESSION = "X-Amzn-SageMaker-Session-Id"
MAR = REPO / "model-store" / "llava.mar"
LOOPBACK_IMAGES = json.dumps({"allow": ["127.0.0.1"]})


def start_instance(tmp: Path, **env: str) -> TorchServeInstance:
    if not MAR.exists():  # `make test` builds it with `make mar`; a bare pytest run may not
        build_mar(DEMO_MODEL_DIR)
    instance = TorchServeInstance.on_free_ports(
        tmp,
        model_store=MAR.parent,
        env={"LLAVA_INTAKE": LOOPBACK_IMAGES, **env},
    )
    instance.start(timeout=180)
    return instance


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    instance = start_instance(tmp_path_factory.mktemp("ts"))
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def images():
    """Two held-out images that differ in colour and in shape, served on loopback."""
    samples = [s for s in held_out_samples(60, seed=90_000)]
    a = samples[0]
    b = next(s for s in samples if s.color != a.color and s.shape != a.shape)
    http = LoopbackServer()
    for name, sample in (("a", a), ("b", b)):
        http.routes[f"/{name}.png"] = respond(
            image_bytes(sample.image), headers={"Content-Type": "image/png"}
        )
    yield {"a": (http.url("/a.png"), a), "b": (http.url("/b.png"), b)}
    http.close()


def invoke(instance, body, session_id=None, path="/invocations", **kwargs):
    headers = {"Content-Type": "application/json", **instance.auth_headers("inference")}
    if session_id is not None:
        headers[SESSION] = session_id
    data = body if isinstance(body, bytes) else json.dumps(body)
    return requests.post(
        instance.inference_url + path, data=data, headers=headers, timeout=60, **kwargs
    )


def open_session(instance, url) -> str:
    reply = invoke(instance, {"requestType": "NEW_SESSION", "image": {"url": url}}, "NEW_SESSION")
    assert reply.status_code == 200, reply.text
    return reply.json()["sessionId"]


def ask(instance, session_id, question, **extra):
    return invoke(instance, {"requestType": "SESSION", "inputs": question, **extra}, session_id)


def test_open_ask_three_times_close_over_invocations(server, images):
    url, truth = images["a"]
    opened = invoke(server, {"requestType": "NEW_SESSION", "image": {"url": url}}, "NEW_SESSION")
    assert opened.status_code == 200, opened.text
    session_id = opened.json()["sessionId"]
    expected = f"{session_id}; Expires={opened.json()['expiresAt']}"
    assert opened.headers[SESSION] == expected
    assert opened.headers["X-Amzn-SageMaker-New-Session-Id"] == expected
    answers = []
    for question in ("What color is the shape?", "And its shape?", "Say that again."):
        reply = ask(server, session_id, question)
        assert reply.status_code == 200, reply.text
        answers.append(reply.json())
    assert [a["generation"]["text"] for a in answers] == [truth.color, truth.shape, truth.shape]
    usage = [a["usage"] for a in answers]
    assert all(u["tier"] == "kv" and u["cachedTokens"] > 0 for u in usage)
    assert usage[1]["cachedTokens"] > usage[0]["cachedTokens"]
    closed = invoke(server, {"requestType": "CLOSE_SESSION"}, session_id)
    assert closed.status_code == 200
    assert closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session_id
    gone = ask(server, session_id, "What shape is it?")
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "SESSION_CLOSED"


def test_predictions_path_and_inline_image_work_too(server, images):
    truth = images["b"][1]
    b64 = base64.b64encode(image_bytes(truth.image)).decode()
    reply = invoke(
        server, {"requestType": "NEW_SESSION", "image": {"b64": b64}}, path="/predictions/llava"
    )
    assert reply.status_code == 200, reply.text
    session_id = reply.json()["sessionId"]
    answer = ask(server, session_id, "What shape is it?")
    assert answer.json()["generation"]["text"] == truth.shape


def test_interleaved_sessions_answer_about_their_own_image(server, images):
    sessions = {name: open_session(server, url) for name, (url, _) in images.items()}
    for question, attribute in [
        ("What shape is it?", "shape"),
        ("And its color?", "color"),
        ("Say that again.", "color"),
    ]:
        for name, session_id in sessions.items():
            reply = ask(server, session_id, question)
            assert reply.json()["generation"]["text"] == getattr(images[name][1], attribute)


@pytest.mark.parametrize(
    "body, session, code",
    [
        (b"{not json", "NEW_SESSION", "INVALID_REQUEST"),
        ({"requestType": "SESSION"}, "SID", "INVALID_REQUEST"),
        ({"requestType": "SESSION", "inputs": ""}, "SID", "INVALID_REQUEST"),
        ({"requestType": "TELEPORT"}, "SID", "UNKNOWN_REQUEST_TYPE"),
        (
            {"requestType": "SESSION", "inputs": "Hi", "parameters": {"max_new_tokens": -1}},
            "SID",
            "INVALID_REQUEST",
        ),
        (
            {"requestType": "SESSION", "inputs": "Hi", "parameters": {"temperature": "hot"}},
            "SID",
            "INVALID_REQUEST",
        ),
        ({"requestType": "SESSION", "inputs": "Hi"}, "0000-unknown-0000", "SESSION_NOT_FOUND"),
        ({"requestType": "CLOSE_SESSION"}, "0000-unknown-0000", "SESSION_NOT_FOUND"),
        ({"inputs": "What shape is it?"}, None, "INPUTS_WITHOUT_SESSION"),
        ({"requestType": "NEW_SESSION", "inputs": "Hi"}, "NEW_SESSION", "INPUTS_WITHOUT_SESSION"),
        (
            {"requestType": "SESSION", "inputs": "Hi", "parameters": {"max_length": 3}},
            "SID",
            "INVALID_REQUEST",
        ),
        (
            {"requestType": "SESSION", "inputs": "Hi"},
            "SID; Expires=2030-01-01T00:00:00Z",
            "INVALID_SESSION_ID",
        ),
        ({"requestType": "NEW_SESSION", "extSessionID": "SID"}, "NEW_SESSION", "SESSION_ID_IN_USE"),
        (
            {"requestType": "NEW_SESSION", "image": {"url": "file:///etc/passwd"}},
            None,
            "IMAGE_SOURCE_NOT_ALLOWED",
        ),
    ],
)
def test_bad_requests_get_400_class_json_and_harm_no_one(server, images, body, session, code):
    url, truth = images["a"]
    bystander = open_session(server, url)
    worker = server.worker_pid()
    target = None if session is None else session.replace("SID", bystander)
    if isinstance(body, dict) and body.get("extSessionID") == "SID":
        body = {**body, "extSessionID": bystander}  # an open that asks for a live id
    reply = invoke(server, body, target)
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["code"] == code and reply.json()["error"]["message"]
    assert server.worker_pid() == worker
    assert ask(server, bystander, "What color is the shape?").json()["generation"]["text"] == (
        truth.color
    )


def test_streamed_chunks_arrive_before_the_answer_is_done(server, images):
    session_id = open_session(server, images["a"][0])
    params = {"max_new_tokens": 120, "min_new_tokens": 120}
    plain = ask(server, session_id, "What shape is it?", parameters=params).json()
    other = open_session(server, images["a"][0])
    start = time.perf_counter()
    reply = invoke(
        server,
        {
            "requestType": "SESSION",
            "inputs": "What shape is it?",
            "parameters": params,
            "stream": True,
        },
        other,
        stream=True,
    )
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("application/jsonlines")
    arrivals, lines = [], []
    for line in reply.iter_lines():
        if line:
            arrivals.append(time.perf_counter() - start)
            lines.append(json.loads(line))
    chunks, final = lines[:-1], lines[-1]
    assert len(chunks) == plain["generation"]["generatedTokens"] == 120  # one chunk per token
    assert "".join(c["token"]["text"] for c in chunks) == plain["generation"]["text"]
    assert final["generation"] == plain["generation"]
    # the first token was read while most of the answer was still being generated
    assert arrivals[0] < 0.5 * arrivals[-1]


def test_streaming_errors_before_the_first_chunk_keep_their_status(server):
    reply = invoke(
        server,
        {"requestType": "SESSION", "inputs": "Hi", "stream": True},
        "0000-unknown-0000",
        stream=True,
    )
    assert reply.status_code == 400
    assert reply.headers["Content-Type"].split(";")[0] == "application/json"
    assert reply.json()["error"]["code"] == "SESSION_NOT_FOUND"


def test_session_metrics_reach_the_metrics_endpoint(server, images):
    session_id = open_session(server, images["a"][0])
    ask(server, session_id, "What shape is it?")
    open_session(server, images["a"][0])  # the image held: its features and prefix shared
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    for name in (
        "SessionsOpen",
        "SessionBytes",
        "TurnNewTokens",
        "TurnCachedTokens",
        "SessionsOpened",
        "TurnLatency",
        "MemoryBudgetBytes",
        "PrefixHits",
        "PrefixCachedTokens",
        "ImageFeatureHits",
    ):
        assert name in text, name
    for tier in ("kv", "host", "features"):  # every tier is published, held or not
        assert any(
            line.startswith("SessionBytes{") and f'Tier="{tier}"' in line
            for line in text.splitlines()
        ), tier
    assert any(  # parked sessions are counted; they hold no memory
        line.startswith("SessionsOpen{") and 'Tier="persisted"' in line
        for line in text.splitlines()
    )


def test_one_worker_with_two_shards_serves_sessions_on_both(tmp_path, images):
    """LLAVA_DEVICE=cpu,cpu: the worker builds two engine shards (the path of a two-GPU
    instance); sessions are placed on both, each answers about its own image, and the
    metrics say which shard holds what."""
    instance = start_instance(
        tmp_path, LLAVA_DEVICE="cpu,cpu", LLAVA_SESSION_BUDGET_BYTES=str(256 << 20)
    )
    try:
        sessions = {name: open_session(instance, url) for name, (url, _) in images.items()}
        for question, attribute in [("What shape is it?", "shape"), ("And its color?", "color")]:
            for name, session_id in sessions.items():
                reply = ask(instance, session_id, question)
                assert reply.json()["generation"]["text"] == getattr(images[name][1], attribute)
        text = requests.get(f"http://127.0.0.1:{instance.metrics_port}/metrics", timeout=10).text

        def shard_value(name: str, shard: str, *labels: str) -> float:
            wanted = (f'Shard="{shard}"', *labels)
            lines = [
                line
                for line in text.splitlines()
                if line.startswith(name + "{") and all(label in line for label in wanted)
            ]
            assert len(lines) == 1, (name, shard, lines)
            return float(lines[0].rsplit(" ", 1)[1])

        for shard in ("0", "1"):
            assert shard_value("SessionsOpen", shard, 'Tier="kv"') == 1  # one session each
            assert shard_value("ShardReady", shard) == 1
            assert shard_value("MemoryBudgetBytes", shard, 'Memory="device"') == 256 << 20
    finally:
        instance.stop()


def metric_total(instance, prefix: str, missing_ok: bool = False) -> float:
    """A metric summed over its label sets (tiers), from the Prometheus metrics text."""
    text = requests.get(f"http://127.0.0.1:{instance.metrics_port}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert lines or missing_ok, f"no {prefix} metric yet"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def sessions_open(instance) -> float:
    """Sessions held by the worker, summed over tiers."""
    return metric_total(instance, "SessionsOpen{")


@pytest.mark.parametrize(
    "image",
    [
        {"url": "http://169.254.169.254/latest/meta-data/"},
        {"b64": "aGVsbG8gd29ybGQ="},
        {"url": "http://127.0.0.1:9/nothing-listens-here.png"},
    ],
    ids=["metadata-address", "not-an-image", "fetch-failed"],
)
def test_a_failed_open_leaves_nothing_behind(server, images, image):
    open_session(server, images["a"][0])  # at least one session, so the gauge exists
    before = sessions_open(server)
    reply = invoke(server, {"requestType": "NEW_SESSION", "image": image}, "NEW_SESSION")
    assert reply.status_code in (403, 415, 424), reply.text
    assert SESSION not in reply.headers and "X-Amzn-SageMaker-New-Session-Id" not in reply.headers
    invoke(server, {"requestType": "SESSION", "inputs": "x"}, "0000-refresh-gauges")
    assert sessions_open(server) == before


def test_the_served_mar_is_the_one_make_mar_built(server):
    manifest = json.loads(zipfile.ZipFile(MAR).read("MAR-INF/MANIFEST.json"))
    extracted = list((server.tmp_dir / "models").glob("*/MAR-INF/MANIFEST.json"))
    assert len(extracted) == 1
    assert json.loads(extracted[0].read_text()) == manifest


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.fixture(scope="module")
def short_ttl_server(tmp_path_factory):
    instance = start_instance(tmp_path_factory.mktemp("ts-ttl"), LLAVA_SESSION_TTL_S="2")
    yield instance
    instance.stop()


def test_an_expired_session_gets_400_expired(short_ttl_server, images):
    session_id = open_session(short_ttl_server, images["a"][0])
    answer = ask(short_ttl_server, session_id, "What shape is it?")
    assert answer.status_code == 200
    # Any turn would reset the idle timer, so wait out the expiry the server announced.
    expires = datetime.strptime(answer.json()["expiresAt"], "%Y-%m-%dT%H:%M:%SZ")
    expires = expires.replace(tzinfo=UTC) + timedelta(seconds=1)  # announced to the second
    wait_until(lambda: datetime.now(UTC) > expires, timeout=10, what="the announced expiry")
    reply = ask(short_ttl_server, session_id, "What shape is it?")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "SESSION_EXPIRED"


def test_a_killed_worker_loses_its_sessions_cleanly(short_ttl_server, images, capsys):
    """TorchServe 0.12 never makes a restarted async worker READY again (`status` says the
    worker died), so the supervisor restarts the whole instance (serving/supervisor.py): same
    ports, sessions gone (a clean 400), new sessions served."""
    url, truth = images["b"]
    session_id = open_session(short_ttl_server, url)
    supervisor, stop, logged = Supervisor(short_ttl_server), threading.Event(), []
    supervisor.log = logged.append
    old = supervisor.adopt()
    killed_at = time.monotonic()
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: not supervisor.ready(), timeout=10, what="the kill seen")
    status = torchserve.main(
        ["status", "--instance-dir", str(short_ttl_server.root), "--model-store", str(MAR.parent)]
        + ["--management-port", str(short_ttl_server.management_port)]
    )
    assert status == 1 and f"worker {old} died" in capsys.readouterr().out
    watching = supervisor.watch_in_thread(stop)
    try:
        new = wait_until(
            lambda: supervisor.ready() and short_ttl_server.worker_pid(),
            timeout=120,
            what="a restarted READY worker",
        )
        with capsys.disabled():
            print(f"killed worker: READY again after {time.monotonic() - killed_at:.1f} s {logged}")
    finally:
        stop.set()
        watching.join(timeout=10)
    assert new != old and len(supervisor.restarts) == 1
    reply = ask(short_ttl_server, session_id, "What shape is it?")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "SESSION_NOT_FOUND"
    fresh = open_session(short_ttl_server, url)
    assert ask(short_ttl_server, fresh, "What shape is it?").json()["generation"]["text"] == (
        truth.shape
    )
    assert short_ttl_server.worker_pid() == new  # served, no crash loop


# -- sessions and protocol -------------------------------------------------------------------


def test_the_seeds_client_opens_with_its_own_id_and_uses_it(server, images):
    url, truth = images["a"]
    own_id = f"conversation-{uuid.uuid4().hex}"  # 128 bits or more: kept as it is
    opened = invoke(
        server,
        {"requestType": "NEW_SESSION", "extSessionID": own_id, "image": {"url": url}},
        "NEW_SESSION",
    )
    assert opened.status_code == 200, opened.text
    assert opened.json()["sessionId"] == own_id
    expected = f"{own_id}; Expires={opened.json()['expiresAt']}"
    assert opened.headers[SESSION] == opened.headers["X-Amzn-SageMaker-New-Session-Id"] == expected
    answer = invoke(
        server,
        {
            "requestType": "SESSION",
            "inputs": "What shape is it?",
            "sampling_params": {"max_new_token": 64},
        },
        own_id,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["generation"]["text"] == truth.shape
    assert invoke(server, {"requestType": "CLOSE_SESSION"}, own_id).status_code == 200
    again = invoke(server, {"requestType": "NEW_SESSION", "extSessionID": own_id}, "NEW_SESSION")
    assert again.status_code == 400 and again.json()["error"]["code"] == "SESSION_ID_IN_USE"


def test_close_is_idempotent_and_always_names_the_closed_id(server):
    session_id = invoke(server, {"requestType": "NEW_SESSION"}).json()["sessionId"]
    for already_gone in (None, "SESSION_CLOSED"):
        closed = invoke(server, {"requestType": "CLOSE_SESSION"}, session_id)
        assert closed.status_code == 200, closed.text
        assert closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session_id
        assert closed.json()["alreadyGone"] == already_gone


def latency_histogram(instance) -> dict[str, float]:
    """TurnLatencySeconds summed over label sets: {"count", "sum", "le=<bound>", ...}."""
    text = requests.get(f"http://127.0.0.1:{instance.metrics_port}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("TurnLatencySeconds_"):
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("TurnLatencySeconds_bucket"):
            key = "le=" + name.split('le="', 1)[1].split('"', 1)[0]
        else:
            key = name.split("{", 1)[0].removeprefix("TurnLatencySeconds_")
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def test_turn_latency_lands_in_a_finite_bucket_in_seconds(server, images):
    """TorchServe's histograms have the default buckets 0.005 ... 10: a turn in milliseconds
    (here over 10) would land in +Inf only."""
    session_id = open_session(server, images["a"][0])
    params = {"max_new_tokens": 120, "min_new_tokens": 120}
    ask(server, session_id, "What shape is it?")  # the histogram exists from here on
    before = latency_histogram(server)
    reply = ask(server, session_id, "What shape is it?", parameters=params).json()
    after = latency_histogram(server)
    seconds = reply["timing"]["totalMs"] / 1000
    assert seconds > 0.010  # in milliseconds this turn would be past the last finite bucket
    assert after["count"] - before["count"] == 1
    assert after["sum"] - before["sum"] == pytest.approx(seconds, abs=0.001)
    assert after["le=10.0"] - before["le=10.0"] == 1


def test_the_reaper_frees_expired_sessions_with_no_request(short_ttl_server, images):
    """TTL 2 s, so the reaper sweeps every second; nothing is sent to the model meanwhile."""
    session_id = open_session(short_ttl_server, images["a"][0])
    assert sessions_open(short_ttl_server) >= 1
    expired_before = metric_total(short_ttl_server, "SessionsExpired{", missing_ok=True)
    wait_until(
        lambda: (
            sessions_open(short_ttl_server) == 0
            and metric_total(short_ttl_server, "SessionBytes{") == 0
        ),
        timeout=15,
        what="the gauges to show no session, with no request arriving",
    )
    assert metric_total(short_ttl_server, "SessionsExpired{") > expired_before
    closed = invoke(short_ttl_server, {"requestType": "CLOSE_SESSION"}, session_id)
    assert closed.status_code == 200 and closed.json()["alreadyGone"] == "SESSION_EXPIRED"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"data": b""},
        {"data": b"null", "headers": {"Content-Type": "application/json"}},
        {"data": b"hello", "headers": {"Content-Type": "text/plain"}},
        {"data": {"requestType": "NEW_SESSION"}},  # form-encoded
        {"files": {"requestType": (None, "NEW_SESSION")}},  # multipart
    ],
    ids=["empty", "null", "text", "form", "multipart"],
)
def test_whatever_reaches_the_handler_is_answered_in_json(server, kwargs):
    kwargs["headers"] = {**kwargs.get("headers", {}), **server.auth_headers("inference")}
    reply = requests.post(server.inference_url + "/invocations", timeout=60, **kwargs)
    assert reply.status_code == 400
    assert reply.headers["Content-Type"].split(";")[0] == "application/json"
    assert set(reply.json()["error"]) == {"code", "message"}


def test_a_body_over_the_frontends_limit_is_refused_by_torchserve_itself(server):
    """Documented in docs/wire.md §Errors that are ours, and TorchServe's own answers: TorchServe's
    frontend answers this one, with an empty body, before the handler sees it (max_request_size, 32
    MiB in config.properties)."""
    reply = requests.post(
        server.inference_url + "/invocations",
        data=b" " * (32 * 1024 * 1024 + 1),
        headers=server.auth_headers("inference"),
        timeout=60,
    )
    assert (reply.status_code, reply.text) == (413, "")


@pytest.mark.parametrize(
    "body, to_session, said",
    [
        (b'{"requestType": "SESSION", "inputs": "What \\ud800 color?"}', True, "'inputs'"),
        (b'{"requestType": "NEW_SESSION", "system": "Be \\ud800 brief."}', False, "'system'"),
        (
            b'{"requestType": "SESSION", "inputs": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
            True,
            "nests deeper than 32",
        ),
    ],
    ids=["surrogate-in-inputs", "surrogate-in-system", "nested-10000-deep"],
)
def test_text_that_is_not_utf8_and_a_deep_body_are_a_400_and_harm_no_one(
    server, images, body, to_session, said
):
    """TorchServe's worker json-decodes the body first: the escape "\\ud800" becomes a str
    with a lone surrogate (the tokenizer raised on it: a 500), and a 10,000-deep body raises
    RecursionError there, so the handler gets its bytes (and raised it again: a 500)."""
    url, truth = images["a"]
    session = open_session(server, url)
    worker = server.worker_pid()
    reply = invoke(server, body, session if to_session else "NEW_SESSION")
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "INVALID_REQUEST" and said in error["message"], error
    assert server.worker_pid() == worker
    answer = ask(server, session, "What color is the shape?").json()
    assert answer["generation"]["text"] == truth.color
