"""The chat-completions API through the handler, in process (no frontend): OpenAI's reply and
chunk shapes, sessions by SageMaker's header, refusals in OpenAI's error shape, CLOSE, stop
sequences. Through TorchServe and the openai package: tests/serving/test_openai_client.py."""

from __future__ import annotations

import base64
import json

import pytest

from demo_model.synthetic import held_out_samples
from handlers.chat_protocol import parse_chat
from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import InvalidRequest
from llava.kv.budget import MemoryBudget
from llava.sampling.stop_text import StopText
from scripts.handler_harness import InProcessWorker
from tests.intake_servers import image_bytes

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def worker(demo_model):
    engine = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    worker = InProcessWorker(engine)
    yield worker
    worker.stop()
    engine.stop()


@pytest.fixture(scope="module")
def data_url():
    encoded = base64.b64encode(image_bytes(held_out_samples(1)[0].image)).decode()
    return f"data:image/png;base64,{encoded}"


def user(text: str, url: str | None = None) -> dict:
    if url is None:
        return {"role": "user", "content": text}
    image = {"type": "image_url", "image_url": {"url": url}}
    return {"role": "user", "content": [{"type": "text", "text": text}, image]}


def chat(worker, messages, headers=None, **fields):
    return worker.invoke({"model": "mine", "messages": messages, **GREEDY, **fields}, headers)


def events(text: str) -> list:
    """The server-sent events' data, [DONE] as a string."""
    assert text.endswith("\n\n")
    datas = [block.removeprefix("data: ") for block in text.strip().split("\n\n")]
    return [data if data == "[DONE]" else json.loads(data) for data in datas]


def test_a_stateless_answer_is_a_chat_completion(worker, data_url):
    reply = chat(worker, [user("What is this?", data_url)])
    assert reply.status == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion" and body["model"] == "mine"
    assert body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "session_id" not in body and SESSION not in reply.headers


def test_a_session_opens_answers_and_continues(worker, data_url):
    first = chat(worker, [user("What is this?", data_url)], {SESSION: "NEW_SESSION"})
    assert first.status == 200, first.text
    session_id = first.json()["session_id"]
    assert first.headers[SESSION].startswith(f"{session_id}; Expires=")
    assert first.headers[NEW_SESSION_ID] == first.headers[SESSION]
    answer = first.json()["choices"][0]["message"]["content"]
    messages = [user("What is this?", data_url), {"role": "assistant", "content": answer}]
    follow = chat(worker, [*messages, user("What color?")], {SESSION: session_id})
    assert follow.status == 200, follow.text
    usage = follow.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2
    closed = worker.invoke({"requestType": "CLOSE"}, {SESSION: session_id})
    assert closed.status == 200 and closed.json()["closed"] is True
    gone = chat(worker, [*messages, user("What color?")], {SESSION: session_id})
    assert gone.status == 400 and gone.json()["error"]["code"] == "SESSION_CLOSED"
    assert gone.json()["error"]["type"] == "invalid_request_error"


def test_a_streamed_answer_is_chunks_ending_with_done(worker, data_url):
    whole = chat(worker, [user("What is this?", data_url)]).json()
    reply = chat(
        worker,
        [user("What is this?", data_url)],
        stream=True,
        stream_options={"include_usage": True},
    )
    assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
    *chunks, usage, done = events(reply.text)
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("logprobs", True),
        ("response_format", {"type": "json_object"}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("frobnicate", 1),
    ],
)
def test_what_the_engine_does_not_do_is_refused_naming_the_field(worker, field, value):
    reply = chat(worker, [user("Hi")], **{field: value})
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_fields_pass(worker):
    reply = chat(worker, [user("Hi")], n=1, logprobs=False, tools=[], user="someone")
    assert reply.status == 200, reply.text


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "assistant", "content": "Hello"}],
        [user("Hi"), user("Again")],
        [user("Hi"), {"role": "assistant", "content": "Hello"}],
        [{"role": "tool", "content": "x"}],
        [user("Hi"), {"role": "system", "content": "late"}],
    ],
)
def test_a_conversation_out_of_order_is_refused(worker, messages):
    reply = chat(worker, messages)
    assert reply.status == 400 and reply.json()["error"]["param"].startswith("messages")


def test_images_are_shown_before_the_text_and_named_by_their_source(data_url):
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]
    body = parse_chat({"messages": [{"role": "user", "content": content}]})
    (turn,) = body.turns
    assert turn.question == "Compare" and len(turn.images) == 1
    assert turn.images[0].source == {"b64": data_url.partition(",")[2]}
    again = parse_chat({"messages": [{"role": "user", "content": list(reversed(content))}]})
    assert again.turns[0].images[0].ref == turn.images[0].ref
    with pytest.raises(InvalidRequest):
        parse_chat({"messages": [user("Hi", "data:text/plain;base64,aGk=")]})


def test_stop_sequences_end_the_text_before_them(worker, data_url):
    whole = chat(worker, [user("What is this?", data_url)], max_tokens=12).json()
    text = whole["choices"][0]["message"]["content"]
    assert len(text) > 2, "the demo model's answer is too short to cut"
    stop = text[2:4]
    cut = chat(worker, [user("What is this?", data_url)], max_tokens=12, stop=[stop]).json()
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    streamed = chat(
        worker, [user("What is this?", data_url)], max_tokens=12, stop=stop, stream=True
    )
    chunks = events(streamed.text)[:-1]
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        == text[: text.index(stop)]
    )


def test_stop_text_holds_back_only_what_may_begin_a_stop():
    stop = StopText(("END",))
    assert [stop.push(chunk) for chunk in ("ab", "cE", "N", "x", "yE", "ND", "z")] == [
        "ab",
        "c",
        "",
        "ENx",
        "y",
        "",
        "",
    ]
    assert stop.stopped and stop.text == "abcENxy"
    free = StopText(("END",))
    assert free.push("aE") == "a" and free.flush() == "E" and free.text == "aE"


def test_a_streamed_open_announces_its_id_in_the_streams_head(worker, data_url):
    reply = chat(worker, [user("What is this?", data_url)], {SESSION: "NEW_SESSION"}, stream=True)
    assert reply.status == 200, reply.text
    # headers set after the first chunk are lost in TorchServe: the id is chosen first
    head = reply.head
    session_id = head[SESSION].partition(";")[0]
    assert head[NEW_SESSION_ID] == head[SESSION]
    assert (
        worker.invoke({"requestType": "CLOSE"}, {SESSION: session_id}).json()["alreadyGone"] is None
    )
