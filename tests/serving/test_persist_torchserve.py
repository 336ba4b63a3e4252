"""Sessions outlive their worker, through a real TorchServe
(docs/engine/sessions.md §Persistent tier).

The container's arrangement, in-process: a TorchServe instance whose worker has a persistent
tier in a temporary directory, supervised (serving/supervisor.py restarts the instance when
its worker dies), behind the container's front (serving/front.py). The worker is SIGKILLed
with 16 sessions open and two turns in flight.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time

import pytest
import requests

from demo_model.synthetic import held_out_samples
from llava_client import LlavaClient
from llava_client.errors import LlavaError
from local_endpoint.launcher import LocalEndpoint
from serving.front import Front
from serving.mar import build_mar
from serving.supervisor import Supervisor
from serving.torchserve import TorchServeInstance, free_ports
from tests.conftest import DEMO_MODEL_DIR, REPO
from tests.endpoint_helpers import ENDPOINT
from tests.intake_servers import image_bytes

pytestmark = pytest.mark.torchserve
MAR = REPO / "model-store" / "llava.mar"
SESSION = "X-Amzn-SageMaker-Session-Id"
QUESTIONS = ["What shape is it?", "And its color?", "Say that again.", "What color is the shape?"]
SESSIONS = 16
# A long answer (eos suppressed), so that the turn is still running when the worker dies.
LONG = {"max_new_tokens": 300, "min_new_tokens": 300}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(front URL, instance, supervisor), the instance's worker persisting sessions."""
    if not MAR.exists():
        build_mar(DEMO_MODEL_DIR)
    root = tmp_path_factory.mktemp("persist-ts")
    instance = TorchServeInstance.on_free_ports(
        root, model_store=MAR.parent, env={"LLAVA_PERSIST_DIR": str(root / "sessions")}
    )
    supervisor = Supervisor(instance, start_timeout_s=180)
    supervisor.start()
    front = Front(
        ("127.0.0.1", free_ports(1)[0]),
        ("127.0.0.1", instance.inference_port),
        supervisor.ready,
        upstream_auth=lambda: instance.auth_headers("inference"),
    )
    threading.Thread(target=front.serve_forever, daemon=True).start()
    stop = threading.Event()
    watching = supervisor.watch_in_thread(stop)
    yield f"http://127.0.0.1:{front.server_port}", instance, supervisor
    stop.set()
    watching.join(timeout=10)
    front.shutdown()
    instance.stop()


def invoke(url, body, session_id=None, **kwargs):
    headers = {"Content-Type": "application/json"} | ({SESSION: session_id} if session_id else {})
    return requests.post(f"{url}/invocations", json=body, headers=headers, timeout=60, **kwargs)


def open_session(url, image) -> str:
    b64 = base64.b64encode(image_bytes(image)).decode()
    reply = invoke(url, {"requestType": "NEW_SESSION", "image": {"b64": b64}}, "NEW_SESSION")
    assert reply.status_code == 200, reply.text
    return reply.json()["sessionId"]


def ask(url, session_id, question, **parameters):
    body = {"requestType": "SESSION", "inputs": question} | (
        {"parameters": parameters} if parameters else {}
    )
    return invoke(url, body, session_id)


def text(reply) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["generation"]["text"]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def test_sessions_survive_a_killed_worker_and_turns_in_flight_get_a_retryable_503(served):
    url, instance, supervisor = served
    image = held_out_samples(1, seed=91_000)[0].image
    control = open_session(url, image)
    expected = [text(ask(url, control, q)) for q in QUESTIONS]

    sessions = [open_session(url, image) for _ in range(SESSIONS)]
    for session_id in sessions:
        replies = [ask(url, session_id, q) for q in QUESTIONS[:3]]
        assert [text(reply) for reply in replies] == expected[:3]
    expires_before = replies[-1].json()["expiresAt"]  # of the last session's third turn
    in_flight: dict[str, object] = {}
    first_chunk = threading.Event()

    def streamed():
        body = {"requestType": "SESSION", "inputs": QUESTIONS[3], "parameters": LONG}
        body["stream"] = True
        with invoke(url, body, sessions[-1], stream=True) as reply:
            lines = []
            for line in reply.iter_lines():
                lines.append(json.loads(line))
                first_chunk.set()
            in_flight["stream"] = (reply.status_code, lines)

    def whole():
        in_flight["whole"] = ask(url, sessions[-2], QUESTIONS[3], **LONG)

    threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
    for thread in threads:
        thread.start()
    assert first_chunk.wait(30), "the streamed turn never started"
    worker = instance.worker_pid()
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=60)

    # the turns in flight: a 503 that says when to retry; a stream that says it broke
    whole_reply = in_flight["whole"]
    assert whole_reply.status_code == 503, whole_reply.text
    assert whole_reply.json()["error"]["code"] == "TURN_INTERRUPTED"
    assert int(whole_reply.headers["Retry-After"]) >= 1
    status, lines = in_flight["stream"]
    assert status == 200 and "token" in lines[0]
    assert lines[-1]["error"]["code"] == "TURN_INTERRUPTED"

    # meanwhile: refused at once, with a wait
    meanwhile = ask(url, sessions[0], QUESTIONS[3])
    if meanwhile.status_code != 200:  # (unless the restart already finished)
        assert meanwhile.status_code == 503 and "Retry-After" in meanwhile.headers

    def answered():
        reply = ask(url, sessions[0], QUESTIONS[3])
        return reply if reply.status_code == 200 else None

    first = wait_until(answered, timeout=180, what="a surviving session answered again")
    recovered_s = time.monotonic() - killed_at
    assert instance.worker_pid() not in (None, worker)
    assert first.json()["generation"]["text"] == expected[3]
    assert first.json()["usage"]["tier"] == "persisted"  # adopted parked: features read back
    assert first.json()["expiresAt"] >= expires_before  # the adopted kept and renewed it
    # every session continues where it was: the two interrupted ones from their last commit
    for session_id in sessions[1:]:
        assert text(ask(url, session_id, QUESTIONS[3])) == expected[3]
    print(f"kill -> first answered turn on a surviving session: {recovered_s:.1f} s")


def test_the_client_goes_on_through_the_local_endpoint_without_replaying(tmp_path):
    """make endpoint's arrangement (local_endpoint/launcher.py: supervised instances, each with
    its own directory under LLAVA_PERSIST_DIR) and real boto3 through llava_client: a turn
    cut by the worker's death is sent again once and answered; nothing is replayed."""
    if not MAR.exists():
        build_mar(DEMO_MODEL_DIR)
    endpoint = LocalEndpoint(
        tmp_path / "endpoint",
        1,
        port=free_ports(1)[0],
        env={"LLAVA_PERSIST_DIR": str(tmp_path / "sessions")},
    )
    endpoint.start(timeout=180)
    try:
        assert (tmp_path / "sessions" / "instance-0").is_dir()  # the instance's own directory
        client = LlavaClient(
            ENDPOINT, runtime=endpoint.runtime(), busy_retries=40, max_retry_wait_s=2.0
        )
        image = image_bytes(held_out_samples(1, seed=91_000)[0].image)
        with client.open(image) as control:
            expected = [control.ask(q).text for q in QUESTIONS]
        streamed, whole = client.open(image), client.open(image)
        for chat in (streamed, whole):
            assert [chat.ask(q).text for q in QUESTIONS[:3]] == expected[:3]
        worker = endpoint.instances_started[0].worker_pid()
        outcome: dict[str, object] = {}
        whole_turn = threading.Thread(
            target=lambda: outcome.update(whole=whole.ask(QUESTIONS[3], **LONG))
        )
        whole_turn.start()
        with pytest.raises(LlavaError) as broken:
            for _text in streamed.ask_stream(QUESTIONS[3], **LONG):
                if worker is not None:
                    os.kill(worker, signal.SIGKILL)  # at its first text
                    worker = None
        assert broken.value.code == "TURN_INTERRUPTED"
        whole_turn.join(timeout=240)
        # the interrupted whole turn was sent again and answered after the restart
        assert outcome["whole"].reply["generation"]["generatedTokens"] == LONG["max_new_tokens"]
        assert streamed.ask(QUESTIONS[3]).text == expected[3]  # from its last committed turn
        assert streamed.recoveries == whole.recoveries == 0 and client.busy_retried >= 1
    finally:
        endpoint.stop()
