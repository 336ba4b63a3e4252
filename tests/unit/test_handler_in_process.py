"""The handler's own answers, called in-process with TorchServe's Context (no frontend):
everything the handler can reach answers ``{"error": {"code", "message"}}``."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import threading

import pytest
import torch

from demo_model.synthetic import held_out_samples
from handlers.llava_handler import ENGINE_LOST_EXIT_CODE, LlavaHandler
from handlers.service import LlavaService
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from scripts.handler_harness import InProcessWorker, Reply
from tests.conftest import recognized_samples
from tests.intake_servers import LoopbackServer, image_bytes, respond
from tests.unit.test_reaper import wait_until

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


LONG_ID = "conversation-1a2b3c4d5e6f7a8b9c0d1e2f"  # 36 of [a-z0-9]: 186 bits, kept as it is


def test_an_id_in_use_is_refused_before_any_model_work(worker):
    b64 = base64.b64encode(image_bytes(held_out_samples(1)[0].image)).decode()
    body = {"requestType": "NEW_SESSION", "extSessionID": LONG_ID}
    first = worker.invoke({**body, "image": {"b64": b64}}, {SESSION: "NEW_SESSION"})
    assert first.status == 200 and first.json()["sessionId"] == LONG_ID
    assert first.headers[SESSION].startswith(f"{LONG_ID}; Expires=")
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
    body = {"requestType": "NEW_SESSION", "image": {"b64": b64}}  # the operator's system prompt
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


def test_tenants_from_the_custom_attributes_header_share_nothing(worker):
    b64 = base64.b64encode(image_bytes(held_out_samples(1)[0].image)).decode()
    body = {"requestType": "NEW_SESSION", "image": {"b64": b64}}

    def cached(attributes: str) -> int:
        reply = worker.invoke(body, {"X-Amzn-SageMaker-Custom-Attributes": attributes})
        assert reply.status == 200, reply.text
        return reply.json()["usage"]["cachedTokens"]

    assert cached("tenant=acme") == cached("trace=7; tenant=globex") == 0
    assert cached("tenant=acme") > 0
    refused = worker.invoke(body, {"X-Amzn-SageMaker-Custom-Attributes": "tenant="})
    assert refused.status == 400
    assert "X-Amzn-SageMaker-Custom-Attributes" in refused.json()["error"]["message"]


@pytest.mark.parametrize("system", [7, "x" * 8001], ids=["not-a-string", "too-long"])
def test_a_bad_system_prompt_is_a_400_naming_it(worker, system):
    reply = worker.invoke({"requestType": "NEW_SESSION", "system": system})
    assert reply.status == 400 and "system" in reply.json()["error"]["message"]
    assert open_session(worker)  # the worker serves on


@pytest.fixture
def handler(worker, monkeypatch):
    """The TorchServe entry point, initialized over ``worker``'s service (no model load)."""
    monkeypatch.setattr(LlavaService, "from_context", lambda context: worker.service)
    handler = LlavaHandler()
    handler.initialize(worker.context)
    yield handler
    handler.pool.shutdown()


async def handle(handler, worker, body, headers=None) -> Reply:
    """One request through ``LlavaHandler.handle``, with a context of its own."""
    context = worker.request_context(headers)
    (final,) = await handler.handle([{"body": body}], context)
    status, _phrase = context.get_response_status(0)
    return Reply(status, context.get_response_headers(0), final)


def request_threads() -> int:
    return sum(thread.name.startswith("request_") for thread in threading.enumerate())


def test_a_request_past_max_requests_in_flight_is_a_503_at_once_taking_no_thread(
    handler, worker, monkeypatch
):
    """64 requests held in their threads; the 65th is refused on the event loop while they
    are still held, and once they are answered the next request is served."""
    limit = worker.service.config.max_requests_in_flight
    entered, release = threading.Semaphore(0), threading.Event()

    def held_close(session_id):
        entered.release()
        assert release.wait(30)
        return None

    monkeypatch.setattr(worker.service.engine, "close", held_close)

    async def scenario():
        close = {"requestType": "CLOSE_SESSION"}
        held = [
            asyncio.create_task(handle(handler, worker, close, {SESSION: f"s-{n}"}))
            for n in range(limit)
        ]
        for _ in range(limit):
            assert await asyncio.to_thread(entered.acquire, timeout=30)
        threads = request_threads()
        refused = await handle(handler, worker, {"requestType": "NEW_SESSION"})
        assert not release.is_set() and request_threads() == threads  # no thread, no wait
        release.set()
        answered = await asyncio.gather(*held)
        return refused, answered, await handle(handler, worker, {"requestType": "NEW_SESSION"})

    refused, answered, later = asyncio.run(scenario())
    assert limit == 64  # the default
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "OVERLOADED"
    assert "max_requests_in_flight" in refused.json()["error"]["message"]
    assert {reply.status for reply in answered} == {200}
    assert later.status == 200 and handler.in_flight == 0


def test_a_short_chosen_id_gets_a_random_part_and_the_reply_names_the_full_id(worker):
    """'x' counts 4.7 bits: the session opens as 'x-' and 22 random letters and digits, named
    in the body and both session headers; a second open of 'x' is not refused (no oracle)."""
    body = {"requestType": "NEW_SESSION", "extSessionID": "x"}
    first = worker.invoke(body, {SESSION: "NEW_SESSION"})
    full = first.json()["sessionId"]
    assert first.status == 200 and re.fullmatch(r"x-[A-Za-z0-9]{22}", full)
    expected = f"{full}; Expires={first.json()['expiresAt']}"
    assert first.headers[SESSION] == first.headers["X-Amzn-SageMaker-New-Session-Id"] == expected
    again = worker.invoke(body, {SESSION: "NEW_SESSION"})
    assert again.status == 200 and again.json()["sessionId"] not in ("x", full)
    asked = worker.invoke({"requestType": "SESSION", "inputs": "Hi"}, {SESSION: "x"})
    assert asked.json()["error"]["code"] == "SESSION_NOT_FOUND"
    answered = worker.invoke({"requestType": "SESSION", "inputs": "Hi"}, {SESSION: full})
    assert answered.status == 200


def test_a_second_ask_while_one_is_in_flight_is_a_409_at_once(worker, monkeypatch):
    """max_waiting_asks 0: an ask of a session whose ask is still generating is refused at
    once (SESSION_BUSY), from inside that ask's first token, so it cannot have waited for it;
    a CANCEL_TURN then is not an ask, and the next ask is answered."""
    for shard in worker.service.engine.shards:
        monkeypatch.setattr(shard.store, "max_waiting_asks", 0)
    session_id = open_session(worker)
    ask, during = worker.service.engine.ask, {}

    def ask_that_asks_again(session, question, parameters, on_token, **kwargs):
        def first_token_asks_again(text, token_id):
            if not during:
                during["ask"] = worker.invoke(
                    {"requestType": "SESSION", "inputs": "Hi"}, {SESSION: session_id}
                )
                during["cancel"] = worker.invoke(
                    {"requestType": "CANCEL_TURN"}, {SESSION: session_id}
                )

        return ask(session, question, parameters, first_token_asks_again, **kwargs)

    monkeypatch.setattr(worker.service.engine, "ask", ask_that_asks_again)
    long = {"max_new_tokens": 20, "min_new_tokens": 20}
    first = worker.invoke(
        {"requestType": "SESSION", "inputs": "Hi", "parameters": long}, {SESSION: session_id}
    )
    assert first.status == 200
    assert during["ask"].status == 409
    assert during["ask"].json()["error"]["code"] == "SESSION_BUSY"
    assert during["cancel"].status == 200 and during["cancel"].json()["cancelledTurns"] == 1
    monkeypatch.undo()
    later = worker.invoke({"requestType": "SESSION", "inputs": "Hi"}, {SESSION: session_id})
    assert later.status == 200


def test_a_lost_device_ends_the_worker_through_the_hook_initialize_registers(
    handler, worker, monkeypatch
):
    """Left alone, a worker whose CUDA context is poisoned answers 500 for ever while /ping
    says 200: the hook ends the process (nonzero), for the supervisor to restart."""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    session_id = open_session(worker)

    def device_assert(batch):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(worker.service.engine.shards[0].runner, "next_ids", device_assert)
    reply = worker.invoke({"requestType": "SESSION", "inputs": "Hi"}, {SESSION: session_id})
    assert reply.status == 500 and reply.json()["error"]["code"] == "SHARD_FAILED"
    wait_until(lambda: exits, 10, "the hook to end the worker")
    assert exits == [ENGINE_LOST_EXIT_CODE] and ENGINE_LOST_EXIT_CODE != 0


def inline(image) -> dict:
    return {"b64": base64.b64encode(image_bytes(image)).decode()}


def ask_about(worker, session_id, question, image=None, **body):
    body = {"requestType": "SESSION", "inputs": question, **body}
    body["parameters"] = {"max_new_tokens": 8}
    if image is not None:
        body["image"] = image
    return worker.invoke(body, {SESSION: session_id})


def open_on(worker, image) -> dict:
    reply = worker.invoke({"requestType": "NEW_SESSION", "image": inline(image)})
    assert reply.status == 200, reply.text
    return reply.json()


def test_a_second_image_on_a_turn_is_answered_and_counted_in_usage(worker, demo_model):
    first, second, third = recognized_samples(demo_model, 3, seed=52_000)
    opened = open_on(worker, first.image)
    session_id, per_image = opened["sessionId"], opened["imageTokens"]
    plain = ask_about(worker, session_id, "What color is the shape?").json()
    assert (plain["usage"]["imageTokens"], plain["usage"]["images"]) == (0, 1)
    reply = ask_about(worker, session_id, "And this one? What color is it?", inline(second.image))
    assert reply.status == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["imageTokens"] == per_image > 0 and usage["images"] == 2
    assert usage["newTokens"] > usage["imageTokens"]  # the question's tokens too
    assert reply.json()["turns"] == 2 and reply.json()["generation"]["text"]
    # streamed: the last line is the reply, with the same usage fields
    streamed = ask_about(worker, session_id, "And this one?", inline(third.image), stream=True)
    last = json.loads(streamed.text.splitlines()[-1])
    assert (last["usage"]["imageTokens"], last["usage"]["images"], last["turns"]) == (
        per_image,
        3,
        3,
    )
    after = ask_about(worker, session_id, "What shape is it?").json()
    assert (after["usage"]["imageTokens"], after["usage"]["images"]) == (0, 3)


def test_an_image_past_max_images_per_session_is_a_400_and_the_session_answers_on(
    worker, demo_model
):
    """The default allows 4 images a session, the open's included: the 5th is refused with
    TOO_MANY_IMAGES before the vision tower sees it, and the session answers the next question
    as if that turn had not been sent."""
    images = [sample.image for sample in held_out_samples(5, seed=52_100)]
    assert worker.service.config.max_images_per_session == 4
    session_id = open_on(worker, images[0])["sessionId"]
    for n, image in enumerate(images[1:4], start=2):
        reply = ask_about(worker, session_id, "And this one?", inline(image))
        assert reply.status == 200 and reply.json()["usage"]["images"] == n, reply.text
    vision_runs = []
    tower = worker.service.engine.shards[0].loaded.model.model.vision_tower
    hook = tower.register_forward_hook(lambda *_: vision_runs.append(1))
    try:
        refused = ask_about(worker, session_id, "And this one?", inline(images[4]))
    finally:
        hook.remove()
    assert refused.status == 400, refused.text
    assert refused.json()["error"]["code"] == "TOO_MANY_IMAGES" and vision_runs == []
    answered = ask_about(worker, session_id, "What color is the shape?")
    assert answered.status == 200, answered.text
    assert answered.json()["turns"] == 4 and answered.json()["usage"]["images"] == 4


@pytest.fixture
def image_server():
    server = LoopbackServer()
    server.routes["/text.png"] = respond(b"plain text, no image", 200)
    yield server
    server.close()


@pytest.mark.parametrize(
    ("source", "status", "code"),
    [
        (lambda http: {"url": http.url("/missing.png")}, 424, "IMAGE_FETCH_FAILED"),
        (lambda http: {"url": http.url("/text.png")}, 415, "NOT_AN_IMAGE"),
        (lambda http: {"url": "http://10.255.255.1/x.png"}, 403, "IMAGE_SOURCE_NOT_ALLOWED"),
        (lambda http: {"b64": base64.b64encode(b"\xff" * 64).decode()}, 415, "NOT_AN_IMAGE"),
        (lambda http: {"b64": "not base64 at all!"}, 400, "INVALID_REQUEST"),
    ],
    ids=["404", "not-an-image", "private-address", "inline-garbage", "bad-base64"],
)
def test_a_turn_whose_image_fetch_fails_leaves_the_session_as_it_was(
    demo_model, image_server, source, status, code
):
    """The intake's own 4xx, and no half turn: the next question is answered as in a twin
    session that never got the failed turn (same text, same turn count, one image)."""
    engine = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    worker = InProcessWorker(engine, intake={"allow": ["127.0.0.1"]})
    try:
        image = held_out_samples(1, seed=52_200)[0].image
        session_id, twin = open_on(worker, image)["sessionId"], open_on(worker, image)["sessionId"]
        for sid in (session_id, twin):
            assert ask_about(worker, sid, "What shape is it?").status == 200
        failed = ask_about(worker, session_id, "And this one?", source(image_server))
        assert (failed.status, failed.json()["error"]["code"]) == (status, code), failed.text
        answers = [ask_about(worker, sid, "And its color?").json() for sid in (session_id, twin)]
        assert answers[0]["turns"] == answers[1]["turns"] == 2
        assert answers[0]["usage"]["images"] == 1
        assert answers[0]["generation"]["text"] == answers[1]["generation"]["text"]
    finally:
        worker.stop()
