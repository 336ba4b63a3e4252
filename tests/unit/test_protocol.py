"""The wire contract without TorchServe: request parsing, session ids, the error table."""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.errors import STATUS_BY_ERROR, error_response
from handlers.protocol import (
    ACCEPTED_KEYS,
    SESSION_HEADER,
    AskSession,
    CancelTurn,
    CloseSession,
    OpenSession,
    parse_request,
    session_header_value,
)
from llava import errors
from llava.errors import EngineError, InvalidRequest
from llava.sampling.params import GenerationParams
from tests.conftest import hypothesis_examples
from tests.seed_client import LlavaChatSession
from tests.strategies import json_values

SID = "3f2a-9b7c-0d1e"


def error_code(body, headers=None) -> str:
    with pytest.raises(InvalidRequest) as err:
        parse_request(body, headers or {})
    return err.value.code


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"},
        {"x-amzn-sagemaker-session-id": "NEW_SESSION"},
    ],
)
def test_open_with_or_without_the_new_session_header(headers):
    request = parse_request({"requestType": "NEW_SESSION"}, headers)
    assert request == OpenSession(image=None)


def test_open_carries_the_sessions_system_prompt_to_the_engine():
    request = parse_request({"requestType": "NEW_SESSION", "system": "Be brief."}, {})
    assert request == OpenSession(image=None, system="Be brief.")


ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"


@pytest.mark.parametrize(
    ("value", "tenant"),
    [
        ("tenant=acme", "acme"),
        ("trace=7; Tenant = acme-eu ,other=x", "acme-eu"),  # any order, spaces, any case
        ("tenant=a=b", "a=b"),
        ("trace=7,,;", None),
        ("", None),
    ],
)
def test_the_tenant_is_read_from_the_custom_attributes_header(value, tenant):
    request = parse_request({"requestType": "NEW_SESSION"}, {ATTRIBUTES.lower(): value})
    assert request == OpenSession(image=None, tenant=tenant)


@pytest.mark.parametrize(
    "value",
    [
        "tenant",
        "tenant=",
        "tenant= ;x=1",
        "tenant=a;tenant=a",
        "tenant=caf\u00e9",
        "tenant=a\n",
        "tenant=" + "x" * 1018,  # 1,025 characters
        b"tenant=\xff",
    ],
)
def test_a_malformed_custom_attributes_header_is_a_400_naming_it(value):
    with pytest.raises(InvalidRequest, match=ATTRIBUTES) as err:
        parse_request({"requestType": "NEW_SESSION"}, {ATTRIBUTES: value})
    assert error_response(err.value).status == 400


def test_the_custom_attributes_header_is_read_on_an_open_only():
    headers = {SESSION_HEADER: SID, ATTRIBUTES: "tenant="}  # malformed, and not read
    assert parse_request({"requestType": "CLOSE_SESSION"}, headers) == CloseSession(SID)


def test_open_keeps_a_well_formed_image_source():
    source = {"url": "https://example.com/cat.png"}
    request = parse_request(json.dumps({"requestType": "NEW_SESSION", "image": source}), {})
    assert isinstance(request, OpenSession) and request.image == source


@pytest.mark.parametrize(
    "name",
    ["X-Amzn-SageMaker-Session-Id", "x-amzn-sagemaker-session-id", "X-AMZN-SAGEMAKER-SESSION-ID"],
)
def test_ask_reads_the_session_header_case_insensitively(name):
    body = {"requestType": "SESSION", "inputs": "What shape is it?", "parameters": {"top_k": 3}}
    request = parse_request(body, {name: SID})
    assert request == AskSession(SID, "What shape is it?", {"top_k": 3}, stream=False)


def test_the_seeds_client_shapes_are_accepted():
    body = {
        "requestType": "SESSION",
        "inputs": "Hi",
        "extSessionID": SID,
        "sampling_params": {"max_new_tokens": 4},
        "stream": True,
    }
    assert parse_request(body, {}) == AskSession(SID, "Hi", {"max_new_tokens": 4}, True)
    close = {"requestType": "CLOSE_SESSION", "extSessionID": SID}
    assert parse_request(close, {}) == CloseSession(SID)


class RecordingRuntime:
    """Stands in for boto3's sagemaker-runtime client to capture what the seeds' client sends
    (its real calls against our endpoint: tests/serving/test_seed_client.py)."""

    def __init__(self):
        self.calls = []

    def invoke_endpoint(self, **call):
        self.calls.append(call)
        return {"Body": io.BytesIO(b'{"generation": {"text": "a cross"}}')}


def test_every_request_the_seeds_client_sends_is_accepted_verbatim():
    client = LlavaChatSession("llava", endpoint_url="http://127.0.0.1:1")
    client.runtime = RecordingRuntime()
    client.start("https://example.com/cat.png")
    client.ask("What shape is it?", max_new_token=12)
    client.end()
    opened, asked, closed = (
        parse_request(call["Body"], {SESSION_HEADER: call["SessionId"]})
        for call in client.runtime.calls
    )
    assert opened == OpenSession({"url": "https://example.com/cat.png"}, client.session_id)
    sid = client.session_id
    assert asked == AskSession(sid, "What shape is it?", {"max_new_token": 12}, stream=False)
    assert closed == CloseSession(sid)


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ({"requestType": "NEW_SESSION", "imgae": {"url": "https://x.test/a.png"}}, "'imgae'"),
        ({"requestType": "NEW_SESSION", "max_new_tokens": 5}, "'max_new_tokens'"),
        ({"requestType": "SESSION", "inputs": "Hi", "images": [{"b64": "AA=="}]}, "'images'"),
        ({"requestType": "SESSION", "inputs": "Hi", "temperature": 0.7}, "'temperature'"),
        ({"requestType": "CLOSE_SESSION", "inputs": "Hi"}, "'inputs'"),
        ({"requestType": "CANCEL_TURN", "stream": True}, "'stream'"),
    ],
)
def test_a_key_the_request_type_does_not_take_is_a_400_naming_it_and_the_accepted_ones(
    body, refused
):
    with pytest.raises(InvalidRequest) as err:
        parse_request(body, {SESSION_HEADER: SID} if body["requestType"] != "NEW_SESSION" else {})
    assert err.value.code == "UNKNOWN_KEY" and STATUS_BY_ERROR[InvalidRequest] == 400
    accepted = ", ".join(ACCEPTED_KEYS[body["requestType"]])
    assert f"does not take {refused}" in err.value.message
    assert err.value.message.endswith(f"it takes {accepted}")


@pytest.mark.parametrize(
    "source",
    [
        {"url": "https://example.com/dog.png"},
        {"s3": "s3://bucket/images/dog.png"},
        {"b64": "iVBORw0KGgo="},
        {"b64": "data:image/png;base64,iVBORw0KGgo="},
    ],
    ids=["url", "s3", "b64", "data-uri"],
)
def test_an_image_sent_with_a_question_goes_to_the_turn_as_an_opens_would(source):
    body = {"requestType": "SESSION", "inputs": "And this one?", "image": source}
    request = parse_request(body, {SESSION_HEADER: SID})
    assert request == AskSession(SID, "And this one?", None, False, image=source)
    opened = parse_request({"requestType": "NEW_SESSION", "image": source}, {})
    assert opened.image == request.image
    streamed = parse_request({**body, "stream": True, "rewind_turns": 1}, {SESSION_HEADER: SID})
    assert (streamed.image, streamed.stream, streamed.rewind_turns) == (source, True, 1)


def test_a_question_without_an_image_or_with_a_null_one_adds_none():
    for body in ({"inputs": "Hi"}, {"inputs": "Hi", "image": None}):
        request = parse_request({"requestType": "SESSION", **body}, {SESSION_HEADER: SID})
        assert request.image is None


@pytest.mark.parametrize(
    "source",
    [
        "https://example.com/dog.png",  # a bare string, not a source object
        {},
        {"url": "https://a.test/x.png", "b64": "AA=="},  # two sources
        {"file": "/etc/passwd"},
        {"url": ""},
        {"url": 5},
        {"url": "relative/dog.png"},
        {"url": "https://example.com/a dog.png"},
        {"url": "https://example.com/" + "a" * 9000},
        {"s3": "https://bucket/key"},
        {"s3": "s3://bucket-only"},
        [{"b64": "AA=="}],
    ],
)
def test_a_bad_image_source_on_a_question_is_refused_as_an_open_refuses_it(source):
    """The intake's own check (llava.intake.parse_image_source), its code and words, before
    anything is fetched or the session is touched."""
    body = {"requestType": "SESSION", "inputs": "And this one?", "image": source}
    with pytest.raises(EngineError) as on_a_turn:
        parse_request(body, {SESSION_HEADER: SID})
    with pytest.raises(EngineError) as on_an_open:
        parse_request({"requestType": "NEW_SESSION", "image": source}, {})
    assert type(on_a_turn.value) is type(on_an_open.value)
    assert (on_a_turn.value.code, on_a_turn.value.message) == (
        on_an_open.value.code,
        on_an_open.value.message,
    )
    assert on_a_turn.value.code == "INVALID_REQUEST" and "image" in on_a_turn.value.message
    assert error_response(on_a_turn.value).status == 400


def test_a_rewind_goes_to_the_engine_as_sent():
    body = {"requestType": "SESSION", "inputs": "Hi", "rewind_turns": 2}
    request = parse_request(body, {SESSION_HEADER: SID})
    assert request == AskSession(SID, "Hi", None, False, rewind_turns=2)


def test_cancel_turn_names_the_session_like_close():
    cancel = {"requestType": "CANCEL_TURN"}
    assert parse_request(cancel, {"X-Amzn-SageMaker-Session-Id": SID}) == CancelTurn(SID)
    with pytest.raises(InvalidRequest) as err:
        parse_request(cancel, {})
    assert err.value.code == "MISSING_SESSION_ID"


def test_without_request_type_the_header_decides():
    assert parse_request({}, {}) == OpenSession(None)
    ask = parse_request({"inputs": "Hi"}, {"X-Amzn-SageMaker-Session-Id": SID})
    assert isinstance(ask, AskSession) and ask.session_id == SID


@pytest.mark.parametrize("header", [{}, {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"}])
def test_an_open_adopts_the_clients_own_id(header):
    """The seeds' client opens with its own id in 'extSessionID' and uses it from then on."""
    body = {"requestType": "NEW_SESSION", "extSessionID": "conversation-1a2b3c4d"}
    assert parse_request(body, header) == OpenSession(None, "conversation-1a2b3c4d")


@pytest.mark.parametrize(
    "body, headers",
    [
        ({"inputs": "What shape is it?"}, {}),
        ({"requestType": "NEW_SESSION", "inputs": "What shape is it?"}, {}),
        ({"requestType": "NEW_SESSION", "parameters": {"max_new_tokens": 3}}, {}),
        (
            {"requestType": "NEW_SESSION", "inputs": "Hi", "extSessionID": SID},
            {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"},
        ),
    ],
)
def test_an_open_that_carries_a_question_is_refused_with_what_to_send(body, headers):
    """An open answers nothing: rather than drop the question, say how to ask it."""
    with pytest.raises(InvalidRequest) as err:
        parse_request(body, headers)
    assert err.value.code == "INPUTS_WITHOUT_SESSION"
    assert '"requestType": "SESSION"' in err.value.message


@pytest.mark.parametrize("where", ["header", "body"])
def test_an_id_sent_back_with_its_expires_suffix_is_told_to_drop_it(where):
    value = f"{SID}; Expires=2026-11-22T21:05:07Z"
    body = {"requestType": "SESSION", "inputs": "Hi"}
    headers = {}
    if where == "header":
        headers["X-Amzn-SageMaker-Session-Id"] = value
    else:
        body["extSessionID"] = value
    with pytest.raises(InvalidRequest) as err:
        parse_request(body, headers)
    assert err.value.code == "INVALID_SESSION_ID"
    assert "drop the suffix" in err.value.message and repr(SID) in err.value.message


@pytest.mark.parametrize(
    "body, headers, code",
    [
        (b"{not json", {}, "INVALID_REQUEST"),
        (b"\xff\xfe", {}, "INVALID_REQUEST"),
        ("[1, 2]", {}, "INVALID_REQUEST"),
        ({"requestType": "RESET"}, {"X-Amzn-SageMaker-Session-Id": SID}, "UNKNOWN_REQUEST_TYPE"),
        ({"requestType": "SESSION", "inputs": "Hi"}, {}, "MISSING_SESSION_ID"),
        (
            {"requestType": "CLOSE_SESSION"},
            {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"},
            "MISSING_SESSION_ID",
        ),
        ({"requestType": "SESSION"}, {"X-Amzn-SageMaker-Session-Id": SID}, "INVALID_REQUEST"),
        (
            {"requestType": "SESSION", "inputs": "Hi", "stream": "yes"},
            {"X-Amzn-SageMaker-Session-Id": SID},
            "INVALID_REQUEST",
        ),
        (
            {"requestType": "SESSION", "inputs": "Hi", "parameters": {}, "sampling_params": {}},
            {"X-Amzn-SageMaker-Session-Id": SID},
            "INVALID_REQUEST",
        ),
        ({"requestType": "NEW_SESSION"}, {"X-Amzn-SageMaker-Session-Id": SID}, "INVALID_REQUEST"),
        (
            {"requestType": "SESSION", "inputs": "Hi"},
            {"X-Amzn-SageMaker-Session-Id": "a--"},
            "INVALID_SESSION_ID",
        ),
        (
            {"requestType": "SESSION", "inputs": "Hi"},
            {"X-Amzn-SageMaker-Session-Id": "a" * 257},
            "INVALID_SESSION_ID",
        ),
        (
            {"requestType": "SESSION", "inputs": "Hi", "extSessionID": "other"},
            {"X-Amzn-SageMaker-Session-Id": SID},
            "INVALID_SESSION_ID",
        ),
        ({"requestType": "SESSION", "inputs": "Hi", "extSessionID": 5}, {}, "INVALID_SESSION_ID"),
        ({"requestType": "NEW_SESSION", "extSessionID": "a--"}, {}, "INVALID_SESSION_ID"),
        (
            {"requestType": "CLOSE_SESSION"},
            {"X-Amzn-SageMaker-Session-Id": "a;b"},
            "INVALID_SESSION_ID",
        ),
        ({"requestType": "NEW_SESSION", "extSessionID": "x" * 257}, {}, "INVALID_SESSION_ID"),
    ],
)
def test_malformed_requests_get_a_clear_code(body, headers, code):
    assert error_code(body, headers) == code


def test_session_header_value_matches_botocores_new_session_id_shape():
    value = session_header_value(SID, datetime(2026, 11, 22, 21, 5, 7, tzinfo=UTC))
    assert value == f"{SID}; Expires=2026-11-22T21:05:07Z"
    assert re.fullmatch(r"^\S+;\sExpires=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", value)


EXPECTED_STATUS = {
    errors.InvalidRequest: 400,
    errors.SessionNotFound: 400,
    errors.ImageSourceNotAllowed: 403,
    errors.ImageTooLarge: 413,
    errors.NotAnImage: 415,
    errors.ImageFetchFailed: 424,
    errors.NoCapacity: 503,
}


@pytest.mark.parametrize("cls, status", EXPECTED_STATUS.items(), ids=lambda v: str(v))
def test_every_engine_error_maps_to_its_status_with_a_json_body(cls, status):
    reply = error_response(cls("what to change"))
    assert reply.status == status
    assert reply.payload == {"error": {"code": cls.code, "message": "what to change"}}
    assert reply.headers == {}


@pytest.mark.parametrize("retry_after_s, header", [(0.2, "1"), (2.0, "2"), (2.5, "3")])
def test_busy_is_a_503_with_retry_after_in_whole_seconds(retry_after_s, header):
    reply = error_response(errors.Busy("the KV pool is full", retry_after_s=retry_after_s))
    assert (reply.status, reply.headers) == (503, {"Retry-After": header})
    assert reply.payload["error"] == {
        "code": "KV_MEMORY_FULL",
        "message": "the KV pool is full",
        "retryAfterS": retry_after_s,
    }


def test_every_engine_error_class_is_in_the_table():
    subclasses = set(EngineError.__subclasses__())
    assert subclasses == set(STATUS_BY_ERROR)


def test_a_bug_is_a_500_that_names_no_internals():
    reply = error_response(KeyError("secret internal detail"))
    assert reply.status == 500 and "secret" not in reply.payload["error"]["message"]


request_like = st.fixed_dictionaries(
    {},
    optional={
        "requestType": st.sampled_from(["NEW_SESSION", "SESSION", "CLOSE_SESSION", "X"])
        | json_values,
        "inputs": json_values,
        "image": json_values | st.dictionaries(st.sampled_from(["url", "s3", "b64"]), json_values),
        "parameters": json_values,
        "extSessionID": st.text(max_size=40) | json_values,
        "stream": json_values,
    },
)
headers_like = st.dictionaries(
    st.sampled_from(["X-Amzn-SageMaker-Session-Id", "x-amzn-sagemaker-session-id", "Other"]),
    st.text(max_size=60) | st.just("NEW_SESSION") | st.just(SID),
    max_size=2,
)


@settings(max_examples=hypothesis_examples(300), deadline=None)
@given(body=json_values | request_like | st.binary(max_size=200), headers=headers_like)
def test_arbitrary_input_is_a_request_or_a_typed_error(body, headers):
    try:
        request = parse_request(body, headers)
    except EngineError as err:
        assert err.code and err.message
    else:
        assert isinstance(request, OpenSession | AskSession | CloseSession | CancelTurn)


LONG = "a" * 10_000


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"requestType": "SESSION"}, {SESSION_HEADER: LONG}),  # a 10,000-character session id
        ({"requestType": LONG}, {}),
        (
            {"requestType": "SESSION", "inputs": "hi", "parameters": {LONG: 1}},
            {SESSION_HEADER: SID},
        ),
        ({"extSessionID": LONG}, {}),
    ],
)
def test_no_error_repeats_more_than_a_bounded_piece_of_its_input(body, headers):
    try:
        request = parse_request(json.dumps(body), headers)
        GenerationParams.from_mapping(
            request.parameters, default_max_new_tokens=64, max_new_tokens_limit=512
        )
    except EngineError as e:
        message = error_response(e).payload["error"]["message"]
    else:
        raise AssertionError("accepted")
    assert LONG[:200] not in message and len(message) < 600


@pytest.mark.parametrize("name", ["max_new_tokens", "temperature", "do_sample"])
def test_a_parameter_value_is_repeated_bounded(name):
    with pytest.raises(InvalidRequest) as raised:
        GenerationParams.from_mapping(
            {name: [LONG]}, default_max_new_tokens=64, max_new_tokens_limit=512
        )
    assert LONG[:200] not in raised.value.message and "10,0" in raised.value.message


def deep_body(depth: int) -> str:
    """An ask whose 'inputs' is ``depth`` lists deep, as JSON text."""
    return '{"requestType": "SESSION", "inputs": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize(
    "body, headers, field",
    [
        ('{"requestType": "SESSION", "inputs": "hi \\ud800"}', {SESSION_HEADER: SID}, "'inputs'"),
        ('{"requestType": "NEW_SESSION", "system": "\\udfff be terse"}', {}, "'system'"),
        ('{"requestType": "NEW_SESSION", "image": {"url": "http://x/\\ud800"}}', {}, "'image'"),
        ('{"requestType": "NEW_SESSION", "\\ud800": 1}', {}, "'\\ud800'"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(body, headers, field):
    """TorchServe json-decodes the escape "\\ud800" into a str that encodes as no UTF-8 (the
    tokenizer raised TypeError on it, a 500 that counted against the shard)."""
    for sent in (body, json.loads(body)):  # as bytes it could not parse, and as it parsed them
        with pytest.raises(InvalidRequest) as err:
            parse_request(sent, headers)
        assert err.value.code == "INVALID_REQUEST"
        assert err.value.message.startswith(f"{field} is not UTF-8 text")
        assert error_response(err.value).status == 400


@pytest.mark.parametrize("depth", [33, 900, 10_000])
def test_a_body_nested_too_deeply_is_a_400(depth):
    """10,000 deep: json.loads raises RecursionError (TorchServe's own parse then hands the
    bytes over); 900 deep it parses, and nothing after may recurse through it."""
    body = deep_body(depth)
    for sent in (body, body.encode()):
        with pytest.raises(InvalidRequest) as err:
            parse_request(sent, {SESSION_HEADER: SID})
        assert err.value.code == "INVALID_REQUEST" and "nests deeper than 32" in err.value.message
    if depth < 1000:  # what TorchServe's json.loads hands over when it could parse it
        with pytest.raises(InvalidRequest, match="'inputs' nests deeper than 32"):
            parse_request(json.loads(body), {SESSION_HEADER: SID})


def test_a_body_nested_to_the_bound_is_parsed():
    request = parse_request(deep_body(31), {SESSION_HEADER: SID})
    assert isinstance(request, AskSession)  # the engine refuses a list as the question


def test_a_resume_takes_no_image_or_system():
    resume = {"requestType": "NEW_SESSION", "resumeFrom": SID}
    assert parse_request(resume, {}).resume_from == SID
    for extra in ({"image": {"url": "https://example.com/a.png"}}, {"system": "Be brief."}):
        with pytest.raises(InvalidRequest, match="leave out"):
            parse_request({**resume, **extra}, {})
    with pytest.raises(InvalidRequest) as bad:
        parse_request({**resume, "resumeFrom": "../etc"}, {})
    assert bad.value.code == "INVALID_SESSION_ID"
