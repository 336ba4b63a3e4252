"""SageMaker's request size cap, checked before a request is sent.

InvokeEndpoint's ``Body`` is at most 6 MB (``llava_wire.MAX_REQUEST_BYTES``); SageMaker refuses
a larger one with a ``ValidationError``. An inline image
travels as base64 (4/3 of its size), so images over ~4.5 MB must go by URL or s3:// instead.
"""

from __future__ import annotations

import json

from llava_client.errors import LlavaError
from llava_wire import MAX_REQUEST_BYTES, REQUEST_TOO_LARGE


def request_body(body: dict) -> bytes:
    """``body`` as sent, or ``REQUEST_TOO_LARGE`` if SageMaker would refuse it."""
    payload = json.dumps(body).encode()
    if len(payload) > MAX_REQUEST_BYTES:
        raise LlavaError(
            REQUEST_TOO_LARGE,
            f"the request is {len(payload):,} bytes and SageMaker accepts at most "
            f"{MAX_REQUEST_BYTES:,} (6 MB) per call: pass the image by URL (https://...) or "
            "s3:// instead of inline",
        )
    return payload
