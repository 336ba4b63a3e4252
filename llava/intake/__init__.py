"""Image intake: turn a request's image source into an RGB image, safely by default.

A source is a JSON object with exactly one key: ``{"url": "https://..."}``,
``{"s3": "s3://bucket/key"}`` or ``{"b64": "<base64>"}`` (a ``data:`` URI is accepted in
``b64`` too). Every refusal is a typed ``llava.errors.EngineError`` whose message says what to
change; the limits and the network policy are an ``IntakePolicy``.
"""

from __future__ import annotations

import base64
import binascii
from urllib.parse import urlsplit

from PIL import Image

from llava.errors import ImageTooLarge, InvalidRequest

from .decode import decode_image
from .fetch_http import fetch_http
from .fetch_s3 import fetch_s3, parse_s3_uri
from .policy import IntakePolicy

__all__ = ["IntakePolicy", "decode_image", "load_image", "parse_image_source"]

_KINDS = ("url", "s3", "b64")
_MAX_URL_CHARS = 8192


def parse_image_source(obj: object) -> dict[str, str]:
    """Check the shape of a request's ``image`` value (no I/O, no policy) and return it.

    Raises ``InvalidRequest`` if it is not exactly one of the three source objects.
    """
    if not isinstance(obj, dict) or len(obj) != 1 or next(iter(obj)) not in _KINDS:
        raise InvalidRequest(
            'image must be a JSON object with exactly one of "url", "s3" or "b64", '
            f"got {_describe(obj)}"
        )
    kind, value = next(iter(obj.items()))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f'image "{kind}" must be a non-empty string')
    if kind == "url":
        _check_url_shape(value)
    elif kind == "s3":
        parse_s3_uri(value)
    return obj


def load_image(
    source: object, policy: IntakePolicy | None = None, fit: int | None = None
) -> Image.Image:
    """Fetch (or decode inline) and decode the image ``source`` names, under ``policy``;
    ``fit``: the side the model resizes to (``decode_image``)."""
    policy = policy or IntakePolicy()
    ((kind, value),) = parse_image_source(source).items()
    if kind == "url":
        data = fetch_http(value, policy)
    elif kind == "s3":
        data = fetch_s3(value, policy)
    else:
        data = _decode_b64(value, policy.max_bytes)
    return decode_image(data, policy, fit)


def _check_url_shape(url: str) -> None:
    if len(url) > _MAX_URL_CHARS:
        raise InvalidRequest(f"image url is longer than {_MAX_URL_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise InvalidRequest("image url must not contain whitespace or control characters")
    if not urlsplit(url).scheme:
        raise InvalidRequest("image url must be absolute, e.g. https://host/image.png")


def _decode_b64(text: str, max_bytes: int) -> bytes:
    if text.startswith("data:"):
        header, _, text = text.partition(",")
        if not header.endswith(";base64"):
            raise InvalidRequest('image "b64" data: URI must be base64 (data:image/png;base64,...)')
    text = "".join(text.split())  # MIME-style line breaks are common
    if len(text) > (max_bytes + 2) // 3 * 4:  # refuse before decoding
        raise ImageTooLarge(
            f"inline image is larger than {max_bytes} bytes; send a smaller image, "
            f"use url/s3, or raise intake.max_bytes"
        )
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f'image "b64" is not valid base64 ({e})') from e


def _describe(obj: object) -> str:
    if isinstance(obj, dict):
        return f"keys {sorted(map(str, obj))[:5]}" if obj else "an empty object"
    return type(obj).__name__
