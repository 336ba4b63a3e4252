"""Download an image from S3 with the server's own credentials, bytes and time capped.

Access denied is reported as ``ImageFetchFailed`` (424), like a missing key: the source is
well-formed and allowed by policy, the fetch itself failed. Only ``intake.s3_buckets``
refusals are ``ImageSourceNotAllowed``. The deadline is checked between chunks here (the
server is S3, not the caller's); each read is bounded by the read timeout.
"""

from __future__ import annotations

import re

from llava.errors import ImageFetchFailed, ImageSourceNotAllowed, InvalidRequest

from .limits import Deadline, read_capped, too_large
from .policy import IntakePolicy

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_DENIED = {"AccessDenied", "AllAccessDisabled", "403"}


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` → (bucket, key); the key is taken verbatim (it may hold ? and #)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not _BUCKET.match(bucket) or not key:
        raise InvalidRequest(f"image s3 must look like s3://bucket/key, got {uri[:120]!r}")
    if len(key.encode()) > 1024:
        raise InvalidRequest("image s3 key is longer than S3's 1024-byte limit")
    return bucket, key


def fetch_s3(uri: str, policy: IntakePolicy) -> bytes:
    bucket, key = parse_s3_uri(uri)
    if policy.s3_buckets and bucket not in policy.s3_buckets:
        raise ImageSourceNotAllowed(
            f"bucket {bucket} is not in intake.s3_buckets; add it there to permit it"
        )
    boto3, botocore = _sdk()
    deadline = Deadline(policy.deadline_s)
    try:
        response = _client(boto3, botocore, policy).get_object(Bucket=bucket, Key=key)
        with response["Body"] as stream:
            if response["ContentLength"] > policy.max_bytes:
                raise too_large(uri, policy.max_bytes)
            return read_capped(stream.read, policy.max_bytes, deadline, uri)
    except botocore.exceptions.ClientError as e:
        raise _client_error(uri, e) from e
    except (botocore.exceptions.BotoCoreError, OSError) as e:
        deadline.check(uri)
        raise ImageFetchFailed(f"cannot fetch {uri}: {e}") from e


def _sdk():
    """boto3 and botocore, imported when an s3:// image arrives: the engine runs without them
    (a GPU machine, a laptop with no AWS use); a missing SDK is the operator's to install."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as e:
        raise ImageFetchFailed(
            f"cannot fetch s3:// images: {e.name} is not installed on the server; "
            "pip install boto3, or send the image as url or b64"
        ) from e
    return boto3, botocore


def _client(boto3, botocore, policy: IntakePolicy):
    # A fresh boto3 session per fetch (~0.1 s): boto3 sessions are not thread-safe, and this
    # picks up the current credentials. Retries are capped so that they fit the deadline.
    config = botocore.config.Config(
        connect_timeout=policy.connect_timeout_s,
        read_timeout=policy.read_timeout_s,
        retries={"total_max_attempts": 2, "mode": "standard"},
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=policy.s3_endpoint_url, region_name=policy.s3_region, config=config
    )


def _client_error(uri: str, error) -> ImageFetchFailed:
    """``error``: a botocore ClientError."""
    code = str(error.response.get("Error", {}).get("Code", ""))
    if code in _NOT_FOUND:
        return ImageFetchFailed(f"{uri} not found ({code}); check the bucket and key")
    if code in _DENIED:
        return ImageFetchFailed(
            f"access to {uri} denied ({code}); grant s3:GetObject on it to the server's role"
        )
    return ImageFetchFailed(
        f"cannot fetch {uri}: S3 error {code or 'unknown'}; check the server's S3 credentials"
    )
