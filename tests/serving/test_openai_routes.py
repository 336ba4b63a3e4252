"""The OpenAI chat-completions routes over real TorchServe instances, in plain HTTP: the
container front's ``POST /v1/chat/completions`` (serving/front.py, in-process over one of the
endpoint's instances) and the local endpoint's ``/endpoints/{name}/openai/v1/chat/completions``
(local_endpoint/server.py) over two. (What each route does against stand-ins, a stream cut
short and a caller hanging up included: tests/unit/test_openai_routing.py; the real ``openai``
package: tests/serving/test_openai_client.py.)
"""

from __future__ import annotations

import json

import pytest
import requests

from serving.front import Front
from tests import loopback
from tests.endpoint_helpers import ENDPOINT, endpoint_fixture, images_fixture

pytestmark = pytest.mark.torchserve
WAIT_S = 120
SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION = "X-Amzn-SageMaker-New-Session-Id"
INSTANCE = "X-Local-Endpoint-Instance"


endpoint = endpoint_fixture("openai-endpoint", instances=2)


images = images_fixture(2)


@pytest.fixture(scope="module")
def front(endpoint):
    """The container's front, over the endpoint's first instance (no TorchServe of its own)."""
    instance = endpoint.instances_started[0]
    front = Front(
        ("127.0.0.1", 0),
        ("127.0.0.1", instance.inference_port),
        ready=lambda: True,
        upstream_auth=lambda: instance.auth_headers("inference"),
    )
    with loopback.serving(front) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"


@pytest.fixture(scope="module")
def openai_url(endpoint):
    return f"{endpoint.url}/endpoints/{ENDPOINT}/openai/v1/chat/completions"


def question(url: str | None, text: str) -> dict:
    parts = [{"type": "text", "text": text}]
    if url is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {"role": "user", "content": parts}


def chat(url: str, messages: list, session: str | None = None, **fields) -> requests.Response:
    body = {"model": "llava", "messages": messages, **fields}
    headers = {SESSION: session} if session else {}
    return requests.post(url, json=body, headers=headers, timeout=WAIT_S, stream=True)


def text_of(reply: requests.Response) -> str:
    """The answer of a whole reply, or of a stream's events (which must end with ``[DONE]``)."""
    assert reply.status_code == 200, reply.text
    if reply.headers["Content-Type"].startswith("application/json"):
        completion = reply.json()
        assert completion["object"] == "chat.completion"
        return completion["choices"][0]["message"]["content"]
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    data = [line.removeprefix(b"data: ") for line in reply.iter_lines() if line]
    assert data[-1] == b"[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def session_of(reply: requests.Response) -> str:
    return reply.headers[NEW_SESSION].split(";")[0]


@pytest.mark.parametrize("route", ["front", "openai_url"])
def test_a_chat_body_is_answered_whole_and_streamed(request, route, images):
    """Stateless (no session header): the worker's chat.completion, and its event stream."""
    url = request.getfixturevalue(route)
    truth = images.samples[0]
    messages = [question(images.url(0), "What color is the shape?")]
    assert text_of(chat(url, messages)) == truth.color
    assert text_of(chat(url, messages, stream=True)) == truth.color


@pytest.mark.parametrize("route", ["front", "openai_url"])
def test_the_workers_refusal_comes_back_as_it_is(request, route, images):
    """A 400 in OpenAI's shape naming the field, not wrapped as SageMaker wraps an invocation's."""
    reply = chat(request.getfixturevalue(route), [question(None, "Hello?")], n=2)
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["param"]) == (400, "UNSUPPORTED_FIELD", "n")


def test_new_sessions_stick_to_the_instance_that_opened_them(endpoint, openai_url, images):
    """Two opens land on the two instances; each id's later turns, whole and streamed, go to
    its own; ``CLOSE`` through boto3 drops the binding, so the id is then unknown to the
    endpoint, which answers it without asking a container."""
    first = [question(images.url(i), "What color is the shape?") for i in range(2)]
    opened = [chat(openai_url, [message], "NEW_SESSION") for message in first]
    assert {reply.headers[INSTANCE] for reply in opened} == {"instance-0", "instance-1"}
    for i, reply in enumerate(opened):
        assert text_of(reply) == images.samples[i].color
        assert reply.json()["session_id"] == session_of(reply)
    for stream in (False, True):
        for i, reply in enumerate(opened):
            messages = [
                first[i],
                {"role": "assistant", "content": images.samples[i].color},
                question(None, "What shape is it?"),
            ]
            again = chat(openai_url, messages, session_of(reply), stream=stream)
            assert again.headers[INSTANCE] == reply.headers[INSTANCE]
            assert text_of(again) == images.samples[i].shape
    rt = endpoint.runtime()
    for reply in opened:
        session_id = session_of(reply)
        closed = rt.invoke_endpoint(
            EndpointName=ENDPOINT, SessionId=session_id, Body=json.dumps({"requestType": "CLOSE"})
        )
        assert closed["ClosedSessionId"] == session_id
        gone = chat(openai_url, first[:1], session_id)
        assert INSTANCE not in gone.headers  # answered by the endpoint: no container asked
        assert (gone.status_code, gone.json()["error"]["code"]) == (400, "SESSION_NOT_FOUND")


def test_a_streamed_open_announces_its_id_and_sticks(endpoint, openai_url, images):
    """The id of a session opened by a stream is in the stream's headers, so the endpoint can
    bind it before the first event."""
    message = question(images.url(1), "What shape is it?")
    opened = chat(openai_url, [message], "NEW_SESSION", stream=True)
    assert opened.headers["Content-Type"].startswith("text/event-stream")
    session_id = session_of(opened)
    assert text_of(opened) == images.samples[1].shape
    messages = [
        message,
        {"role": "assistant", "content": images.samples[1].shape},
        question(None, "What color is the shape?"),
    ]
    again = chat(openai_url, messages, session_id)
    assert again.headers[INSTANCE] == opened.headers[INSTANCE]
    assert text_of(again) == images.samples[1].color
    close = json.dumps({"requestType": "CLOSE"})
    endpoint.runtime().invoke_endpoint(EndpointName=ENDPOINT, SessionId=session_id, Body=close)
