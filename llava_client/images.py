"""The ``image`` of an open, or of a turn that adds one, from whatever the caller has."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any


def image_source(image: Any) -> dict | None:
    """A URL (``http(s)://``) or ``s3://`` string is fetched by the container; bytes, a file
    path or a PIL image travel inline (base64); ``None``: no image (an open's: a text-only
    session)."""
    if image is None:
        return None
    if isinstance(image, str):
        if image.startswith(("http://", "https://")):
            return {"url": image}
        if image.startswith("s3://"):
            return {"s3": image}
        raise ValueError(
            f"a string image must be an http(s):// or s3:// URL, not {image[:40]!r} "
            "(pass a pathlib.Path for a local file)"
        )
    if isinstance(image, Path):
        image = image.read_bytes()
    elif hasattr(image, "save"):  # a PIL image; duck-typed so PIL is not a requirement
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        image = buffer.getvalue()
    if isinstance(image, bytes | bytearray):
        return {"b64": base64.b64encode(image).decode("ascii")}
    raise TypeError(f"cannot send an image of type {type(image).__name__}")
