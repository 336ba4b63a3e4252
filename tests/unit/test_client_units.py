"""The client's and the endpoint's pure parts: event-stream framing, JSON lines split anywhere,
image sources, error translation. botocore itself decodes what the endpoint encodes."""

from __future__ import annotations

import base64
import io
import json

import pytest
from botocore.eventstream import EventStreamBuffer
from botocore.exceptions import ClientError
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from llava_client import LlavaClient
from llava_client.errors import LlavaError, SessionGone, from_client_error
from llava_client.images import image_source
from llava_client.jsonlines import JsonLines
from llava_client.stream_order import stream_gap
from local_endpoint import eventstream
from serving.torchserve import free_ports
from tests.conftest import hypothesis_examples
from tests.endpoint_helpers import DUMMY_CREDENTIALS


def decode(stream: bytes) -> list:
    buffer = EventStreamBuffer()
    buffer.add_data(stream)
    return list(buffer)


@settings(max_examples=hypothesis_examples(100))  # 100: hypothesis's default
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
def test_botocore_decodes_payload_parts(payloads):
    messages = decode(b"".join(eventstream.payload_part(p) for p in payloads))
    assert [m.payload for m in messages] == payloads
    assert all(m.headers[":event-type"] == "PayloadPart" for m in messages)


def test_botocore_decodes_a_model_stream_error():
    (message,) = decode(eventstream.model_stream_error("broke", "ModelStreamError"))
    assert message.headers[":message-type"] == "exception"
    assert message.headers[":exception-type"] == "ModelStreamError"
    assert json.loads(message.payload) == {"Message": "broke", "ErrorCode": "ModelStreamError"}


LINES = st.lists(
    st.dictionaries(st.text(max_size=5), st.text(max_size=8) | st.integers(), max_size=3),
    min_size=1,
    max_size=6,
)


@settings(max_examples=hypothesis_examples(100))
@given(LINES, st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_json_lines_survive_any_split(objects, cuts):
    """Splits fall anywhere: inside a line, inside a multi-byte UTF-8 character, on a newline."""
    stream = b"".join(json.dumps(o, ensure_ascii=False).encode() + b"\n" for o in objects)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    parser, seen = JsonLines(), []
    for start, end in zip(bounds, bounds[1:], strict=False):
        seen.extend(parser.feed(stream[start:end]))
    parser.close()
    assert seen == objects


def test_a_stream_cut_inside_a_line_is_an_error():
    parser = JsonLines()
    assert list(parser.feed(b'{"token": {"text": "gr')) == []
    with pytest.raises(ValueError, match="inside a line"):
        parser.close()


def test_image_sources():
    assert image_source(None) is None
    assert image_source("https://x.example/a.png") == {"url": "https://x.example/a.png"}
    assert image_source("s3://bucket/key.png") == {"s3": "s3://bucket/key.png"}
    assert base64.b64decode(image_source(b"\x89PNG")["b64"]) == b"\x89PNG"
    png = base64.b64decode(image_source(Image.new("RGB", (4, 4), "red"))["b64"])
    assert Image.open(io.BytesIO(png)).getpixel((0, 0)) == (255, 0, 0)
    with pytest.raises(ValueError, match="pathlib.Path"):
        image_source("cat.png")
    with pytest.raises(TypeError):
        image_source(3.5)


def test_a_request_over_sagemakers_6_mb_is_refused_before_it_is_sent():
    """Nothing listens at the endpoint URL: a request that went out would fail to connect."""
    nowhere = f"http://127.0.0.1:{free_ports(1)[0]}"
    client = LlavaClient("x", endpoint_url=nowhere, **DUMMY_CREDENTIALS)
    with pytest.raises(LlavaError) as raised:
        client.open(b"\xff" * (4_800_000))  # 6.4 MB as base64
    assert raised.value.code == "REQUEST_TOO_LARGE"
    assert "URL" in raised.value.message and "s3://" in raised.value.message
    assert "6,291,456" in raised.value.message


@pytest.mark.parametrize("how", ["ask", "ask_stream"])
def test_an_ask_with_an_inline_image_over_sagemakers_6_mb_is_refused_before_it_is_sent(how):
    """A turn's image counts toward the same cap as an open's: nothing is sent (nothing
    listens at the endpoint URL), and the session's history is untouched."""
    nowhere = f"http://127.0.0.1:{free_ports(1)[0]}"
    chat = LlavaClient("x", endpoint_url=nowhere, **DUMMY_CREDENTIALS).attach("s-1")
    with pytest.raises(LlavaError) as raised:
        if how == "ask":
            chat.ask("And this one?", image=b"\xff" * 4_800_000)  # 6.4 MB as base64
        else:
            list(chat.ask_stream("And this one?", image=b"\xff" * 4_800_000))
    assert raised.value.code == "REQUEST_TOO_LARGE" and "6,291,456" in raised.value.message
    assert chat.history == []


def client_error(code: str, status: int, **fields) -> ClientError:
    """The parsed response botocore builds from an error reply (as the endpoint tests show)."""
    response = {
        "Error": {"Code": code, "Message": f"{code} message"},
        "ResponseMetadata": {"HTTPStatusCode": status},
        **fields,
    }
    return ClientError(response, "InvokeEndpoint")


@pytest.mark.parametrize(
    "code, gone",
    [("SESSION_NOT_FOUND", True), ("SESSION_EXPIRED", True), ("IMAGE_TOO_LARGE", False)],
)
def test_model_errors_carry_the_containers_code(code, gone):
    body = json.dumps({"error": {"code": code, "message": "why"}})
    status = 400 if gone else 413
    error = from_client_error(
        client_error("ModelError", 424, OriginalStatusCode=status, OriginalMessage=body),
        with_session=True,
    )
    assert (error.code, error.message, error.status) == (code, "why", status)
    assert isinstance(error, SessionGone) == gone


def test_a_model_error_in_another_shape_keeps_the_original_message():
    original = '{"code": 507, "type": "InternalServerException", "message": "Worker died."}'
    error = from_client_error(
        client_error("ModelError", 424, OriginalStatusCode=507, OriginalMessage=original), True
    )
    assert (error.code, error.status) == ("ModelError", 507) and "Worker died" in error.message


def test_validation_errors_about_a_session_mean_it_is_gone():
    unknown = client_error("ValidationError", 400)
    unknown.response["Error"]["Message"] = "Session abc does not exist"
    assert isinstance(from_client_error(unknown, with_session=True), SessionGone)
    assert not isinstance(from_client_error(unknown, with_session=False), SessionGone)
    other = from_client_error(client_error("ValidationError", 400), with_session=True)
    assert type(other) is LlavaError and other.code == "ValidationError"


def test_a_503_says_when_to_retry_from_the_body_or_the_header():
    busy = json.dumps({"error": {"code": "KV_MEMORY_FULL", "message": "m", "retryAfterS": 1.5}})
    wrapped = client_error("ModelError", 424, OriginalStatusCode=503, OriginalMessage=busy)
    assert from_client_error(wrapped, with_session=True).retry_after_s == 1.5
    direct = client_error("ServiceUnavailable", 503)
    direct.response["ResponseMetadata"]["HTTPHeaders"] = {"retry-after": "2"}
    assert from_client_error(direct, with_session=True).retry_after_s == 2.0
    not_ready = json.dumps({"error": {"code": "NOT_READY", "message": "restarting"}})
    wrapped = client_error("ModelError", 424, OriginalStatusCode=503, OriginalMessage=not_ready)
    assert from_client_error(wrapped, with_session=False).retry_after_s is None  # no wait named


@pytest.mark.parametrize(
    "line, received, gap",
    [
        ({"seq": 3}, 3, None),
        ({"seq": 5}, 3, "2 line(s) of the stream never arrived (from line 3)"),
        ({"seq": 2}, 3, "line 2 of the stream arrived again, or out of order, after 3 lines"),
        ({}, 0, "line 0 of the stream carries no sequence number (None)"),
    ],
    ids=["in order", "skipped", "repeated", "unnumbered"],
)
def test_a_streamed_lines_number_shows_what_was_lost_before_it(line, received, gap):
    assert stream_gap(line, received) == gap
