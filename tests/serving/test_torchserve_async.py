"""The worker in TorchServe 0.12's async mode, through a real TorchServe: many requests in
flight at once, and one test per measured async-mode bug that fails without its workaround
(docs/serving.md §The 0.12 async-mode bugs and their workarounds).

The instance here serves the demo model with ``responseTimeout: 1``, so any request slower than
a second would restart a worker that enforced it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from serving.front import Front
from serving.mar import build_mar
from serving.torchserve import TorchServeInstance
from tests.conftest import DEMO_MODEL_DIR, REPO, recognized_samples
from tests.intake_servers import LoopbackServer, image_bytes, respond
from tests.serving.test_torchserve_handler import (
    LOOPBACK_IMAGES,
    SESSION,
    ask,
    invoke,
    open_session,
)

pytestmark = pytest.mark.torchserve
RESPONSE_TIMEOUT_S = 1
WAIT_S = 60
LONG = {"max_new_tokens": 300, "min_new_tokens": 300}  # the demo model's context is 512
HOGS, ROUNDS, ROUND_S = 2, 3, 180  # the load test's CPU hogs, rounds, and bound on each


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ts-async")
    settings = yaml.safe_load((REPO / "model-config.yaml").read_text())
    settings["responseTimeout"] = RESPONSE_TIMEOUT_S
    config = tmp / "model-config.yaml"
    config.write_text(yaml.safe_dump(settings))
    build_mar(DEMO_MODEL_DIR, config=config, export_path=tmp / "store")
    instance = TorchServeInstance.on_free_ports(
        tmp, model_store=tmp / "store", env={"LLAVA_INTAKE": LOOPBACK_IMAGES}
    )
    instance.start(timeout=180)
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def images(demo_model):
    """Eight held-out images the demo model recognizes, on loopback (``samples[i]`` at
    ``/<i>.png``); tests add gated routes."""
    http = LoopbackServer()
    samples = recognized_samples(demo_model, 8, seed=90_000)
    for i, sample in enumerate(samples):
        http.routes[f"/{i}.png"] = respond(image_bytes(sample.image), headers=PNG)
    http.samples = samples
    yield http
    http.close()


PNG = {"Content-Type": "image/png"}


def gated(body: bytes, gate: threading.Event):
    """A route that answers only once ``gate`` is set (or WAIT_S passed)."""

    def route(handler, stopping):
        gate.wait(WAIT_S)
        respond(body, headers=PNG)(handler, stopping)

    return route


def stream(instance, session_id, question, parameters, on_first_line=None) -> list[dict]:
    """A streamed ask: every line, parsed (a line that does not parse fails the test)."""
    body = {"requestType": "SESSION", "inputs": question, "parameters": parameters}
    reply = invoke(instance, {**body, "stream": True}, session_id, stream=True)
    assert reply.status_code == 200, reply.text
    lines = []
    for raw in reply.iter_lines():
        if raw:
            lines.append(json.loads(raw))
            if len(lines) == 1 and on_first_line is not None:
                on_first_line()
    return lines


def check_stream(lines: list[dict], generated: int) -> None:
    """Every line arrived, in order (each carries its index; the final reply, the count of lines
    before it), and the chunks spell the answer: ``generated`` tokens, unless the turn ran past
    the engine's deadline (a loaded machine), which the final reply says."""
    *chunks, final = lines
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    assert "".join(c["token"]["text"] for c in chunks) == final["generation"]["text"]
    generation = final["generation"]
    assert len(chunks) == generation["generatedTokens"]
    if generation["finishReason"] != "deadline":
        assert generation["generatedTokens"] == generated


def wait_for(events: list[threading.Event]) -> None:
    for event in events:
        assert event.wait(WAIT_S), "a stream did not start"


def test_a_bad_request_amid_concurrent_streams_fails_alone(server, images):
    """0.12: an exception leaving handle() fails every request in flight."""
    sessions = [open_session(server, images.url(f"/{i}.png")) for i in range(4)]
    started = [threading.Event() for _ in sessions]
    with ThreadPoolExecutor(len(sessions)) as pool:
        streams = [
            pool.submit(stream, server, s, "What shape is it?", LONG, started[i].set)
            for i, s in enumerate(sessions)
        ]
        wait_for(started)
        bad = [
            invoke(server, b"{not json", "NEW_SESSION"),
            ask(server, "0000-unknown-0000", "What shape is it?"),
            ask(server, sessions[0], "What shape is it?", parameters={"temperature": "hot"}),
        ]
        for reply in streams:
            check_stream(reply.result(timeout=WAIT_S), LONG["max_new_tokens"])
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert [r.json()["error"]["code"] for r in bad] == [
        "INVALID_REQUEST",
        "SESSION_NOT_FOUND",
        "INVALID_REQUEST",
    ]


def live_jobs(instance) -> int:
    """Live org.pytorch.serve.job.RestJob objects in the frontend, after a full GC."""
    histogram = subprocess.run(
        ["jcmd", str(instance.java_pid()), "GC.class_histogram"],
        capture_output=True,
        text=True,
        check=True,
        timeout=WAIT_S,
    ).stdout
    rows = [line.split() for line in histogram.splitlines()]
    return sum(int(row[1]) for row in rows if row[-1:] == ["org.pytorch.serve.job.RestJob"])


@pytest.mark.skipif(shutil.which("jcmd") is None, reason="needs the JDK's jcmd")
def test_plain_replies_leave_the_frontends_job_table(server):
    """0.12 keeps a job until a reply marked "end of stream"; a plain 200 never is, and its
    request (body included) stays in the frontend's memory for ever."""
    before = live_jobs(server)
    for _ in range(40):
        session_id = invoke(server, {"requestType": "NEW_SESSION"}).json()["sessionId"]
        assert ask(server, session_id, "Hi").status_code == 200
        assert invoke(server, {"requestType": "CLOSE_SESSION"}, session_id).status_code == 200
    assert live_jobs(server) - before < 10  # 120 requests: without the workaround, >= 120


def test_concurrent_long_streams_arrive_intact(server, images):
    """0.12 writes chunks and final replies from two threads with no lock: frames interleave
    (handlers/worker_socket.py); each stream's lines are all there, numbered in order."""
    sessions = [open_session(server, images.url(f"/{i % 8}.png")) for i in range(16)]
    with ThreadPoolExecutor(len(sessions)) as pool:
        replies = [pool.submit(stream, server, s, "What color is it?", LONG) for s in sessions]
        for reply in replies:
            check_stream(reply.result(timeout=3 * WAIT_S), LONG["max_new_tokens"])


@pytest.mark.thorough
def test_streams_beside_cpu_hogs_arrive_whole_round_after_round(server, images):
    """A stream never loses a token: rounds of 16 streams x 300 tokens while two processes
    spin on the CPU (on CI such load once made it look as if chunks were lost: the turns had
    run past the engine's deadline, docs/wire.md §Streaming). Each round is bounded."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        for _ in range(ROUNDS):
            sessions = [open_session(server, images.url(f"/{i % 8}.png")) for i in range(16)]
            started = time.monotonic()
            with ThreadPoolExecutor(len(sessions)) as pool:
                replies = [pool.submit(stream, server, s, "What color?", LONG) for s in sessions]
                for reply in replies:
                    check_stream(reply.result(timeout=ROUND_S), LONG["max_new_tokens"])
            assert time.monotonic() - started < ROUND_S
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=30)


def test_a_request_slower_than_response_timeout_keeps_the_worker(server, images):
    """0.12 does not enforce responseTimeout in async mode (a sync worker would be killed);
    the engine's turn deadline bounds a turn instead."""
    gate = threading.Event()
    images.routes["/slow-response.png"] = gated(image_bytes(images.samples[0].image), gate)
    worker = server.worker_pid()
    start = time.monotonic()
    timer = threading.Timer(RESPONSE_TIMEOUT_S + 2, gate.set)  # the image arrives late
    timer.start()
    session_id = open_session(server, images.url("/slow-response.png"))
    assert time.monotonic() - start > RESPONSE_TIMEOUT_S + 1
    assert server.worker_pid() == worker
    reply = ask(server, session_id, "What shape is it?")
    assert reply.json()["generation"]["text"] == images.samples[0].shape


def test_a_slow_image_delays_only_its_own_open(server, images):
    """While one open waits for its image (held until the end), other sessions' turns run."""
    gate = threading.Event()
    images.routes["/slow.png"] = gated(image_bytes(images.samples[1].image), gate)
    others = [open_session(server, images.url(f"/{i}.png")) for i in (2, 3)]
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(open_session, server, images.url("/slow.png"))
        deadline = time.monotonic() + WAIT_S
        while "/slow.png" not in images.paths:  # the worker is fetching it now
            assert time.monotonic() < deadline, "the slow image was never requested"
            time.sleep(0.05)
        for _ in range(3):
            for i, session_id in zip((2, 3), others, strict=True):
                reply = ask(server, session_id, "What shape is it?")
                assert reply.json()["generation"]["text"] == images.samples[i].shape
        assert not slow.done()  # those turns did not wait for it
        gate.set()
        session_id = slow.result(timeout=WAIT_S)
    reply = ask(server, session_id, "What color is the shape?")
    assert reply.json()["generation"]["text"] == images.samples[1].color


def test_eight_clients_in_parallel_keep_their_own_conversations(server, images):
    def conversation(i: int) -> list[str]:
        session_id = open_session(server, images.url(f"/{i}.png"))
        questions = ("What color is the shape?", "And its shape?", "Say that again.")
        return [ask(server, session_id, q).json()["generation"]["text"] for q in questions]

    with ThreadPoolExecutor(8) as pool:
        transcripts = list(pool.map(conversation, range(8)))
    for sample, transcript in zip(images.samples, transcripts, strict=True):
        assert transcript == [sample.color, sample.shape, sample.shape]


@pytest.fixture
def front(server):
    upstream = ("127.0.0.1", server.inference_port)
    httpd = Front(
        ("127.0.0.1", 0),
        upstream,
        ready=lambda: True,
        upstream_auth=lambda: server.auth_headers("inference"),
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address
    httpd.shutdown()
    httpd.server_close()


def prompt_tokens(reply: requests.Response) -> int:
    usage = reply.json()["usage"]
    return usage["newTokens"] + usage["cachedTokens"]


def test_a_client_hanging_up_mid_stream_stops_its_turn(server, front, images):
    """0.12 never tells the worker; the front sees the socket close and sends CANCEL_TURN.
    The turn is kept like a max_new_tokens cut, so the next turn's prompt shows its length."""
    url = images.url("/4.png")
    reference, cut = open_session(server, url), open_session(server, url)
    stream(server, reference, "What shape is it?", LONG)
    body = json.dumps(
        {
            "requestType": "SESSION",
            "inputs": "What shape is it?",
            "parameters": LONG,
            "stream": True,
        }
    ).encode()
    client = socket.create_connection(front, timeout=WAIT_S)
    client.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: front\r\nContent-Type: application/json\r\n"
        b"%s: %s\r\nContent-Length: %d\r\n\r\n%s"
        % (SESSION.encode(), cut.encode(), len(body), body)
    )
    received = b""
    while b'"token"' not in received:  # streaming has begun (bounded by the socket timeout)
        piece = client.recv(4096)
        assert piece, "the front closed the stream"
        received += piece
    client.close()
    full = prompt_tokens(ask(server, reference, "And its color?"))
    after_cut = prompt_tokens(ask(server, cut, "And its color?"))  # waits for the cut turn
    assert after_cut < full - LONG["max_new_tokens"] // 2


def test_a_plain_reply_reaches_the_caller_whole_with_a_length(server, front):
    """TorchServe now sends every 200 chunked (one chunk, then an empty final reply); the
    container's front gives SageMaker a sized body."""
    direct = invoke(server, {"requestType": "NEW_SESSION"})
    assert direct.headers.get("Transfer-Encoding") == "chunked"
    host, port = front
    reply = requests.post(
        f"http://{host}:{port}/invocations", json={"requestType": "NEW_SESSION"}, timeout=WAIT_S
    )
    assert reply.status_code == 200 and reply.json()["sessionId"]
    assert reply.headers["Content-Length"] == str(len(reply.content))
    assert "Transfer-Encoding" not in reply.headers
