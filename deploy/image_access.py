"""Which S3 images the endpoint may fetch: the container's ``intake.s3_buckets`` setting and
the IAM policy its role needs for them, both from one list of ``bucket`` or ``bucket/prefix``
entries (``--s3-images``).

The engine fetches only what the setting lists (empty: no ``s3://`` image at all), and the
role should read no more than that: the setting is the engine's check, the policy AWS's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

INTAKE_ENV = "LLAVA_INTAKE"  # the engine's intake settings, JSON, merged key by key


def check_entries(entries: Sequence[str]) -> None:
    for entry in entries:
        if not entry or entry.startswith(("s3://", "/")):
            raise ValueError(f"--s3-images wants bucket or bucket/prefix, not {entry!r}")


def intake_environment(entries: Sequence[str], environment: Mapping[str, str]) -> dict[str, str]:
    """``LLAVA_INTAKE`` with ``s3_buckets`` set to ``entries``, keeping whatever else an
    ``--env LLAVA_INTAKE=...`` says; empty ``entries`` leave the environment as it is."""
    if not entries:
        return {}
    try:
        intake = json.loads(environment.get(INTAKE_ENV, "{}"))
    except ValueError:
        intake = None
    if not isinstance(intake, dict):
        raise ValueError(f"{INTAKE_ENV} must be a JSON object to add --s3-images to it")
    if "s3_buckets" in intake:
        raise ValueError(f"give the buckets once: --s3-images or {INTAKE_ENV}'s s3_buckets")
    return {INTAKE_ENV: json.dumps({**intake, "s3_buckets": list(entries)})}


def read_policy(entries: Sequence[str]) -> dict:
    """The IAM policy that lets the role read exactly the listed images (s3:GetObject only:
    no listing, so the role cannot enumerate keys either)."""
    if not entries:
        raise ValueError("give the images' places: --s3-images bucket[/prefix], repeatable")
    check_entries(entries)
    resources = []
    for entry in entries:
        bucket, _, prefix = entry.partition("/")
        prefix = prefix.strip("/")
        resources.append(f"arn:aws:s3:::{bucket}/{prefix + '/' if prefix else ''}*")
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "LlavaImages",
                "Effect": "Allow",
                "Action": "s3:GetObject",
                "Resource": resources,
            }
        ],
    }
