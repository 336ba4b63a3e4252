"""The shape of an image source, inline (base64) images, and URL schemes (no network)."""

from __future__ import annotations

import base64

import pytest
from PIL import Image

from llava.errors import ImageSourceNotAllowed, ImageTooLarge, InvalidRequest, NotAnImage
from llava.intake import IntakePolicy, load_image, parse_image_source
from tests.intake_servers import forbid_non_loopback, image_bytes

PNG = image_bytes(Image.new("RGB", (3, 2), (1, 2, 3)))
B64 = base64.b64encode(PNG).decode()


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch):
    forbid_non_loopback(monkeypatch)


@pytest.mark.parametrize(
    "obj",
    [{"url": "https://example.com/a.png"}, {"s3": "s3://my-bucket/a/b?c#d.png"}, {"b64": "AAAA"}],
)
def test_valid_shapes_are_returned_as_they_are(obj):
    assert parse_image_source(obj) is obj


@pytest.mark.parametrize(
    "obj",
    [
        None,
        "https://example.com/a.png",
        ["url", "https://example.com/a.png"],
        {},
        {"path": "/etc/passwd"},
        {"url": "https://example.com/a.png", "b64": "AAAA"},
        {"url": 3},
        {"url": ""},
        {"b64": None},
        {"url": "example.com/a.png"},
        {"url": "https://example.com/a b.png"},
        {"url": "https://example.com/\r\nX-Injected: 1"},
        {"url": "https://example.com/" + "a" * 9000},
        {"s3": "https://my-bucket.s3.amazonaws.com/key"},
        {"s3": "s3://my-bucket"},
        {"s3": "s3://my-bucket/"},
        {"s3": "s3://Bad_Bucket/key"},
        {"s3": "s3://" + "a" * 64 + "/key"},
        {"s3": "s3://my-bucket/" + "k" * 1025},
    ],
)
def test_malformed_sources_are_invalid_requests(obj):
    with pytest.raises(InvalidRequest):
        parse_image_source(obj)


def test_inline_base64_and_data_uri():
    for text in (B64, f"data:image/png;base64,{B64}", "\n".join([B64[:20], B64[20:]])):
        image = load_image({"b64": text})
        assert (image.mode, image.size) == ("RGB", (3, 2))


@pytest.mark.parametrize("text", ["not base64!", "AAA", "data:image/png,rawbytes"])
def test_bad_base64_is_an_invalid_request(text):
    with pytest.raises(InvalidRequest):
        load_image({"b64": text})


def test_inline_base64_of_a_non_image():
    with pytest.raises(NotAnImage):
        load_image({"b64": base64.b64encode(b"just text").decode()})


def test_inline_size_is_refused_before_decoding():
    with pytest.raises(ImageTooLarge, match=r"intake\.max_bytes"):
        load_image({"b64": "A" * 4000}, IntakePolicy(max_bytes=1000))


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://example.com/a.png",
        "gopher://127.0.0.1:6379/_FLUSHALL",
        f"data:image/png;base64,{B64}",
        "dict://127.0.0.1:11211/stats",
    ],
)
def test_only_http_schemes_are_fetched(url):
    with pytest.raises(ImageSourceNotAllowed, match=r"scheme .* not allowed.*intake\.schemes"):
        load_image({"url": url})


def test_schemes_can_be_narrowed_to_https():
    policy = IntakePolicy.from_mapping({"schemes": ["https"]})
    with pytest.raises(ImageSourceNotAllowed, match="scheme 'http'"):
        load_image({"url": "http://example.com/a.png"}, policy)


@pytest.mark.parametrize("url", ["http:///a.png", "http://example.com:99999/a.png"])
def test_urls_without_a_usable_host_are_invalid(url):
    with pytest.raises(InvalidRequest):
        load_image({"url": url})
