"""Session ids as SageMaker spells them, checked alike by the container and the local endpoint.

Standard library only: the local endpoint (no torch) imports it too.
"""

from __future__ import annotations

import re

MAX_CHARS = 256
_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")  # botocore's SessionId pattern


def is_valid(value: str) -> bool:
    """1-256 letters, digits and single or repeated inner hyphens."""
    return len(value) <= MAX_CHARS and _PATTERN.match(value) is not None


def refusal(value: str, where: str) -> str | None:
    """Why ``value`` (found in ``where``) is not a session id, in a message that says what to
    send instead and repeats none of a long input; None for a valid id."""
    bare, _, suffix = (part.strip() for part in value.partition(";"))
    if suffix.lower().startswith("expires=") and is_valid(bare):  # the open's header sent back
        return (
            f"{where} carries the '; Expires=...' suffix of the open reply's header: drop "
            f"the suffix and send the id alone ({bare!r})"
        )
    if not is_valid(value):
        return (
            f"{where}: a session id is 1-256 letters, digits and single or repeated inner hyphens"
        )
    return None
