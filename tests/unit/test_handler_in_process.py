"""The handler's own answers, called in-process with TorchServe's Context (no frontend):
everything the handler can reach answers ``{"error": {"code", "message"}}``."""

from __future__ import annotations

import base64

import pytest

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.memory import MemoryBudget
from scripts.handler_harness import InProcessWorker
from tests.intake_servers import image_bytes

SESSION = "X-Amzn-SageMaker-Session-Id"


@pytest.fixture
def worker(demo_model):
    engine = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    worker = InProcessWorker(engine)
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


def test_an_id_in_use_is_refused_before_any_model_work(worker):
    b64 = base64.b64encode(image_bytes(held_out_samples(1)[0].image)).decode()
    body = {"requestType": "NEW_SESSION", "extSessionID": "conversation-1a2b3c4d"}
    first = worker.invoke({**body, "image": {"b64": b64}}, {SESSION: "NEW_SESSION"})
    assert first.status == 200 and first.json()["sessionId"] == "conversation-1a2b3c4d"
    assert first.headers[SESSION].startswith("conversation-1a2b3c4d; Expires=")
    vision_runs = []
    tower = worker.service.engine.shards[0].loaded.model.model.vision_tower
    hook = tower.register_forward_hook(lambda *_: vision_runs.append(1))
    try:
        again = worker.invoke({**body, "image": {"b64": b64}}, {SESSION: "NEW_SESSION"})
    finally:
        hook.remove()
    assert again.status == 400 and again.json()["error"]["code"] == "SESSION_ID_IN_USE"
    assert vision_runs == []


@pytest.mark.parametrize(
    "parameters, reason",
    [(None, "eos"), ({"max_new_tokens": 1, "min_new_tokens": 1}, "max_new_tokens")],
)
def test_the_answer_says_why_it_ended(worker, parameters, reason):
    session_id = open_session(worker)
    body = {"requestType": "SESSION", "inputs": "Hi", "parameters": parameters}
    reply = worker.invoke(body, {SESSION: session_id})
    assert reply.json()["generation"]["finishReason"] == reason


def test_a_cancelled_turn_stops_at_the_next_step_and_is_kept(worker, monkeypatch):
    """The first token cancels the session's turns in flight (what CANCEL_TURN does when the
    front sees a client hang up): the turn ends one step later, cut like max_new_tokens."""
    session_id = open_session(worker)
    cancelled = []
    ask = worker.service.engine.ask

    def ask_cancelled_at_the_first_token(session, question, parameters, on_token, **kwargs):
        def first_token_cancels(text, token_id):
            if not cancelled:
                cancelled.append(worker.service.turns.cancel(session_id))

        return ask(session, question, parameters, first_token_cancels, **kwargs)

    monkeypatch.setattr(worker.service.engine, "ask", ask_cancelled_at_the_first_token)
    long = {"max_new_tokens": 200, "min_new_tokens": 200}
    body = {"requestType": "SESSION", "inputs": "Hi", "parameters": long}
    generation = worker.invoke(body, {SESSION: session_id}).json()["generation"]
    assert cancelled == [1]
    assert generation["generatedTokens"] == 1 and generation["finished"] is False
    assert worker.service.turns.cancel(session_id) == 0  # nothing left in flight
    reply = worker.invoke({"requestType": "CANCEL_TURN"}, {SESSION: session_id})
    assert reply.json() == {"sessionId": session_id, "cancelledTurns": 0}


def test_usage_tier_says_where_the_turn_found_the_sessions_memory(demo_model):
    """kv (device), host (copied back), features (re-prefilled); gone is a 400."""
    block = 36_864  # the demo model's KV block: 16 tokens x 3 layers x K, V x 4 x 24 x fp32
    budget = MemoryBudget(device_bytes=22 * block, host_bytes=6 * block)
    worker = InProcessWorker(Engine(demo_model, EngineConfig(model_dir="-"), budget))
    assert worker.service.engine.shards[0].memory.pool.bytes_per_block == block
    try:
        images = [held_out_samples(1, seed=77_000 + n)[0].image for n in range(4)]
        ids = []
        for image in images[:3]:
            b64 = base64.b64encode(image_bytes(image)).decode()
            ids.append(worker.invoke({"requestType": "NEW_SESSION", "image": {"b64": b64}}))
        oldest, newer, asking = (reply.json()["sessionId"] for reply in ids)

        def ask(session_id, max_new_tokens=4):
            body = {"requestType": "SESSION", "inputs": "What color is the shape?"}
            body["parameters"] = {"max_new_tokens": max_new_tokens}
            return worker.invoke(body, {SESSION: session_id})

        # 13 more blocks: `oldest` goes to the host, then `newer` too, which drops the older
        # copy (the host holds one session)
        assert ask(asking, 200).json()["usage"]["tier"] == "kv"
        assert ask(oldest).json()["usage"]["tier"] == "features"
        assert ask(newer).json()["usage"]["tier"] == "host"
        memory = worker.service.engine.shards[0].stats().memory
        assert (memory.moved_to_host, memory.demoted, memory.restored) == (2, 1, 1)
    finally:
        worker.stop()


def test_an_open_on_a_held_image_says_what_it_reused_and_runs_no_vision_tower(worker):
    b64 = base64.b64encode(image_bytes(held_out_samples(1)[0].image)).decode()
    body = {"requestType": "NEW_SESSION", "image": {"b64": b64}, "system": "Be brief."}
    first = worker.invoke(body).json()
    assert first["usage"] == {"newTokens": first["prefillTokens"], "cachedTokens": 0}
    vision_runs = []
    tower = worker.service.engine.shards[0].loaded.model.model.vision_tower
    hook = tower.register_forward_hook(lambda *_: vision_runs.append(1))
    try:
        second = worker.invoke(body).json()
    finally:
        hook.remove()
    usage = second["usage"]
    assert usage["cachedTokens"] > 0 and vision_runs == []
    assert usage["newTokens"] == second["prefillTokens"] == 0  # nothing computed at all


@pytest.mark.parametrize("system", [7, "x" * 8001], ids=["not-a-string", "too-long"])
def test_a_bad_system_prompt_is_a_400_naming_it(worker, system):
    reply = worker.invoke({"requestType": "NEW_SESSION", "system": system})
    assert reply.status == 400 and "system" in reply.json()["error"]["message"]
    assert open_session(worker)  # the worker serves on
