"""Property: whatever a caller sends, intake answers with a typed error or an RGB image.

Arbitrary JSON goes to ``parse_image_source``; arbitrary text, arbitrary bytes and mutated
real images go through the inline (b64) path and the decoder. No network is involved.
"""

from __future__ import annotations

import base64
import contextlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from llava.errors import EngineError
from llava.intake import IntakePolicy, decode_image, load_image, parse_image_source
from tests.conftest import hypothesis_examples
from tests.intake_servers import image_bytes
from tests.strategies import json_values

# Small pixel limit: a mutated header may claim a big image, and decoding it is not the point.
POLICY = IntakePolicy(max_pixels=200_000, max_bytes=64 * 1024)
PROPERTY = settings(
    max_examples=hypothesis_examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_seed = Image.new("RGBA", (12, 9), (200, 100, 50, 128))
SEEDS = [
    image_bytes(_seed, "PNG"),
    image_bytes(_seed.convert("RGB"), "JPEG"),
    image_bytes(_seed.convert("P"), "GIF"),
    image_bytes(_seed, "WEBP"),
    image_bytes(_seed.convert("RGB"), "BMP"),
]

source_like = st.dictionaries(
    st.sampled_from(["url", "s3", "b64", "URL", ""]),
    json_values | st.text(max_size=80).map(lambda t: "s3://" + t) | st.just("s3://b-1/k"),
    max_size=3,
)


@st.composite
def mutated_images(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(0, 6))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


def assert_typed_or_rgb(call):
    try:
        image = call()
    except EngineError:
        return
    assert image.mode == "RGB"


@PROPERTY
@given(json_values | source_like)
def test_parse_image_source_never_raises_untyped(obj):
    with contextlib.suppress(EngineError):
        parse_image_source(obj)


@PROPERTY
@given(st.text(max_size=200) | st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode()))
def test_inline_text_is_typed_error_or_image(text):
    assert_typed_or_rgb(lambda: load_image({"b64": text}, POLICY))


@PROPERTY
@given(st.binary(max_size=400) | mutated_images())
def test_decode_is_typed_error_or_image(data):
    assert_typed_or_rgb(lambda: decode_image(data, POLICY))
    assert_typed_or_rgb(lambda: load_image({"b64": base64.b64encode(data).decode()}, POLICY))
