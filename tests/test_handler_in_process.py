"""The handler's own answers, called in-process with TorchServe's Context (no frontend):
everything the handler can reach answers ``{"error": {"code", "message"}}``."""

from __future__ import annotations

import base64

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.store import SessionStore
from llava.synthetic import held_out_samples
from scripts.handler_harness import InProcessWorker
from tests.intake_servers import image_bytes

SESSION = "X-Amzn-SageMaker-Session-Id"


@pytest.fixture
def worker(demo_model):
    store = SessionStore(budget_bytes=1 << 30)
    worker = InProcessWorker(Engine(demo_model, store, EngineConfig(model_dir="-")))
    yield worker
    worker.stop()


def open_session(worker) -> str:
    reply = worker.invoke({"requestType": "NEW_SESSION"})
    assert reply.status == 200, reply.text
    return reply.json()["sessionId"]


def test_a_failure_to_publish_metrics_does_not_fail_the_request(worker, monkeypatch):
    def broken(*args):
        raise OSError("stdout closed")

    monkeypatch.setattr(worker.service.metrics, "store", broken)
    monkeypatch.setattr(worker.service.metrics, "turn", broken)
    session_id = open_session(worker)
    reply = worker.invoke({"requestType": "SESSION", "inputs": "Hi"}, {SESSION: session_id})
    assert reply.status == 200 and reply.json()["generation"]["finished"] in (True, False)


def test_a_bug_in_the_engine_is_a_json_500(worker, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("internal detail")

    monkeypatch.setattr(worker.service.engine, "ask", broken)
    session_id = open_session(worker)
    reply = worker.invoke({"requestType": "SESSION", "inputs": "Hi"}, {SESSION: session_id})
    assert reply.status == 500
    assert reply.json()["error"]["code"] == "INTERNAL_ERROR"
    assert reply.headers["content-type"] == "application/json"


@pytest.mark.parametrize("body", [None, b"", b"null", b"\xff", {"requestType": ["x"]}, [1]])
def test_any_body_gets_a_json_answer(worker, body):
    reply = worker.invoke(body)
    assert reply.status == 400
    assert set(reply.json()["error"]) == {"code", "message"}


def test_an_id_in_use_is_refused_before_any_model_work(worker, monkeypatch):
    b64 = base64.b64encode(image_bytes(held_out_samples(1)[0].image)).decode()
    body = {"requestType": "NEW_SESSION", "extSessionID": "conversation-1a2b3c4d"}
    first = worker.invoke({**body, "image": {"b64": b64}}, {SESSION: "NEW_SESSION"})
    assert first.status == 200 and first.json()["sessionId"] == "conversation-1a2b3c4d"
    assert first.headers[SESSION].startswith("conversation-1a2b3c4d; Expires=")
    vision_runs = []
    monkeypatch.setattr(worker.service.engine, "_image_features", vision_runs.append)
    again = worker.invoke({**body, "image": {"b64": b64}}, {SESSION: "NEW_SESSION"})
    assert again.status == 400 and again.json()["error"]["code"] == "SESSION_ID_IN_USE"
    assert vision_runs == []
