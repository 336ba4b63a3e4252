"""The OpenAI Python SDK, unmodified, against the local endpoint's chat-completions route
(``/endpoints/<name>/openai/v1/chat/completions``) over two real TorchServe instances.

Every answer is greedy and compared with the same conversation through the requestType
protocol (boto3's ``invoke_endpoint``: an open with the first image, then one ask a turn, the
second image in its turn's ask), whichever way the SDK sends it: whole or streamed, stateless
or in a session opened with ``NEW_SESSION`` and continued by its id in
``X-Amzn-SageMaker-Session-Id``. The client resends the whole conversation every turn, as an
OpenAI client does; the session reuses what it already holds. Images: the first by an
``http://`` URL on a loopback server (the endpoint's intake allows 127.0.0.1, as in the other
endpoint tests), a later one inline as a ``data:`` URL.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import openai
import pytest

from llava_wire import CLOSE, CLOSE_SESSION
from tests.endpoint_helpers import ENDPOINT, endpoint_fixture, images_fixture
from tests.intake_servers import image_bytes

pytestmark = pytest.mark.torchserve

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_REPLY = "x-amzn-sagemaker-new-session-id"
INSTANCE = "x-local-endpoint-instance"
MAX_TOKENS = 16
# (question, image) per user turn: "url" the first image by its loopback URL, "data" the
# second inline. "Say that again." needs the conversation so far (docs/demo-model.md §What it
# knows).
CONVERSATION = [
    ("What shape is it?", "url"),
    ("And its color?", None),
    ("And this one? What shape is it?", "data"),
    ("Say that again.", None),
    ("What color is the shape?", None),
]


endpoint = endpoint_fixture("openai-endpoint", instances=2)


images = images_fixture(2)


@pytest.fixture(scope="module")
def rt(endpoint):
    return endpoint.runtime()


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(
        base_url=f"{endpoint.url}/endpoints/{ENDPOINT}/openai/v1",
        api_key="unused",  # the local endpoint checks no credential
        max_retries=0,  # every status is seen
        timeout=120,
    )


@dataclass
class Sources:
    url: str  # the first image on the loopback server
    b64: str  # the second, inline

    def openai_url(self, kind: str) -> str:
        return self.url if kind == "url" else f"data:image/png;base64,{self.b64}"

    def wire(self, kind: str) -> dict:
        return {"url": self.url} if kind == "url" else {"b64": self.b64}


@pytest.fixture(scope="module")
def sources(images):
    return Sources(images.url(0), base64.b64encode(image_bytes(images.samples[1].image)).decode())


def invoke(rt, session_id, body):
    kwargs = {"SessionId": session_id} if session_id else {}
    reply = rt.invoke_endpoint(
        EndpointName=ENDPOINT, ContentType="application/json", Body=json.dumps(body), **kwargs
    )
    return reply, json.loads(reply["Body"].read())


def through_requesttype(rt, sources, turns) -> list[dict]:
    """Each turn's ``generation`` through the requestType protocol, with ``promptTokens`` (the
    turn's prompt: its new and cached tokens): the first turn's image opens the session, every
    later image goes in its own turn's ask."""
    (_, first_image), *_ = turns
    opened, _ = invoke(
        rt, "NEW_SESSION", {"requestType": "NEW_SESSION", "image": sources.wire(first_image)}
    )
    session_id = opened["NewSessionId"].split(";")[0]
    generations = []
    for turn, (question, image) in enumerate(turns):
        body = {"requestType": "SESSION", "inputs": question}
        body["parameters"] = {"max_new_tokens": MAX_TOKENS}
        if image and turn > 0:
            body["image"] = sources.wire(image)
        reply = invoke(rt, session_id, body)[1]
        usage = reply["usage"]
        generations.append(
            {**reply["generation"], "promptTokens": usage["newTokens"] + usage["cachedTokens"]}
        )
    invoke(rt, session_id, {"requestType": CLOSE_SESSION})
    return generations


@pytest.fixture(scope="module")
def reference(rt, sources, images):
    generations = through_requesttype(rt, sources, CONVERSATION)
    truth = images.samples[0]
    assert [g["text"] for g in generations[:2]] == [truth.shape, truth.color]
    return generations


def user(sources, question, image=None) -> dict:
    if image is None:
        return {"role": "user", "content": question}
    picture = {"type": "image_url", "image_url": {"url": sources.openai_url(image)}}
    return {"role": "user", "content": [picture, {"type": "text", "text": question}]}


@dataclass
class Reply:
    text: str
    usage: object  # the SDK's CompletionUsage
    finish_reason: str
    headers: dict
    body_session_id: str | None  # the reply body's session_id (None when streamed)


def complete(client, messages, *, stream: bool, session_id: str | None = None) -> Reply:
    """One chat completion (greedy), read through the SDK's raw-response wrapper so the
    reply's headers (the new session's id) can be read."""
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    raw = client.chat.completions.with_raw_response.create(
        model="llava",
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=stream,
        extra_headers={SESSION: session_id} if session_id else None,
        **extra,
    )
    headers = {name.lower(): value for name, value in raw.headers.items()}
    parsed = raw.parse()
    if not stream:
        choice = parsed.choices[0]
        assert choice.message.role == "assistant" and parsed.object == "chat.completion"
        body_id = (parsed.model_extra or {}).get("session_id")
        return Reply(choice.message.content, parsed.usage, choice.finish_reason, headers, body_id)
    chunks = list(parsed)
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert deltas[0].delta.role == "assistant"
    pieces = [d.delta.content for d in deltas if d.delta.content]
    finish = [d.finish_reason for d in deltas if d.finish_reason]
    (usage,) = [chunk.usage for chunk in chunks if chunk.usage]  # include_usage: its own chunk
    assert not chunks[-1].choices and chunks[-1].usage  # the usage chunk comes last
    assert len(finish) == 1 and deltas[-1].finish_reason  # on the last choice chunk only
    return Reply("".join(pieces), usage, finish[0], headers, None)


def new_session_id(reply: Reply) -> str:
    announced = reply.headers.get(NEW_SESSION_REPLY) or reply.headers[SESSION.lower()]
    session_id, _, expires = announced.partition(";")
    assert expires.strip().startswith("Expires=")
    return session_id


def converse(client, sources, turns, *, stream: bool, session: bool):
    """The conversation as an OpenAI client holds it, resent whole each turn; with a session,
    the first call opens it (``NEW_SESSION``) and the later ones name it."""
    messages, replies, session_id = [], [], None
    for question, image in turns:
        messages.append(user(sources, question, image))
        sent = (session_id or "NEW_SESSION") if session else None
        reply = complete(client, messages, stream=stream, session_id=sent)
        if session and session_id is None:
            session_id = new_session_id(reply)
        messages.append({"role": "assistant", "content": reply.text})
        replies.append(reply)
    return replies, session_id, messages


@pytest.mark.parametrize("session", [False, True], ids=["stateless", "session"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_conversation_through_the_sdk_is_token_equal_to_the_requesttype_protocol(
    client, rt, sources, reference, stream, session
):
    replies, session_id, _ = converse(client, sources, CONVERSATION, stream=stream, session=session)
    assert [r.text for r in replies] == [g["text"] for g in reference]
    assert [r.usage.completion_tokens for r in replies] == [g["generatedTokens"] for g in reference]
    assert [r.usage.prompt_tokens for r in replies] == [g["promptTokens"] for g in reference]
    for reply in replies:
        usage = reply.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert reply.finish_reason in ("stop", "length")
    if not session:
        assert session_id is None
        assert all(NEW_SESSION_REPLY not in r.headers for r in replies)
        assert all(r.body_session_id is None for r in replies)
        return
    # one session throughout: the same instance answered, and every later turn found the
    # conversation so far in its cache
    assert len({r.headers[INSTANCE] for r in replies}) == 1
    assert all(NEW_SESSION_REPLY not in r.headers for r in replies[1:])
    if not stream:
        assert {r.body_session_id for r in replies} == {session_id}
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert all(c > 0 for c in cached[1:]), cached
    # more cached each turn: the earlier turns are never prefilled again
    assert cached[1:] == sorted(cached[1:]), cached
    closed, body = invoke(rt, session_id, {"requestType": CLOSE_SESSION})
    assert closed["ClosedSessionId"] == session_id and body["alreadyGone"] is None


def test_an_edited_earlier_message_rewinds_the_session_to_it(client, rt, sources, images):
    """A chat UI's edit: the client sends the conversation up to an earlier user message,
    changed. The session drops what came after it and answers as a conversation that had
    the edit from the start does; the turn after goes on from the edit."""
    original = [("What color is the shape?", "url"), ("And its shape?", None)]
    original.append(("Say that again.", None))
    replies, session_id, messages = converse(client, sources, original, stream=False, session=True)
    truth = images.samples[0]
    assert [r.text for r in replies] == [truth.color, truth.shape, truth.shape]

    edited = [original[0], ("Say that again.", None), ("And its shape?", None)]
    expected = [g["text"] for g in through_requesttype(rt, sources, edited)]
    assert expected == [truth.color, truth.color, truth.shape]  # the edit changes the answer
    history = [*messages[:2], user(sources, "Say that again.")]  # the second message, edited
    answer = complete(client, history, stream=False, session_id=session_id)
    assert answer.text == expected[1]
    assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the first turn was kept
    assert answer.body_session_id == session_id  # the same session, no new one
    history += [{"role": "assistant", "content": answer.text}, user(sources, "And its shape?")]
    streamed = complete(client, history, stream=True, session_id=session_id)
    assert streamed.text == expected[2]

    # a history the session never held (an answer the client rewrote) is taken as given:
    # the session answers as a stateless call given the same messages does
    rewritten = [*history[:3], {"role": "assistant", "content": "red"}, history[4]]
    in_session = complete(client, rewritten, stream=False, session_id=session_id)
    assert in_session.text == complete(client, rewritten, stream=False).text
    invoke(rt, session_id, {"requestType": CLOSE_SESSION})


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        (
            "tools",
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        ),
        ("logprobs", True),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_what_the_route_does_not_support_is_a_bad_request_naming_the_field(
    client, sources, field, value
):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="llava",
            messages=[user(sources, "What shape is it?", "url")],
            max_tokens=MAX_TOKENS,
            **{field: value},
        )
    error = raised.value
    assert error.status_code == 400
    assert error.param == field and field in error.message
    assert error.code == "UNSUPPORTED_FIELD"


def test_a_session_opened_through_the_sdk_is_closed_by_requesttype_close(client, rt, sources):
    first = [user(sources, "What shape is it?", "url")]
    opened = complete(client, first, stream=False, session_id="NEW_SESSION")
    session_id = new_session_id(opened)
    closed, body = invoke(rt, session_id, {"requestType": CLOSE})  # CLOSE_SESSION's alias
    assert closed["ClosedSessionId"] == session_id
    assert body["sessionId"] == session_id and body["closed"] is True
    assert body["alreadyGone"] is None
    again = [*first, {"role": "assistant", "content": opened.text}, user(sources, "Say it again.")]
    with pytest.raises(openai.APIStatusError) as gone:  # the endpoint forgot the id
        complete(client, again, stream=False, session_id=session_id)
    assert gone.value.status_code == 400 and session_id in gone.value.message
