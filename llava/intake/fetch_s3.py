"""Download an image from S3 with the server's own credentials, bytes and time capped.

Only buckets and key prefixes that ``intake.s3_buckets`` lists are fetched (empty: none), and
that is checked before any network call; a refusal is ``ImageSourceNotAllowed``. Every S3
error answer (no such key, no such bucket, access denied, anything else) is the same
``ImageFetchFailed``, with no S3 error code in it, so a caller cannot probe which buckets and
keys exist; the code is logged for the operator. The deadline is checked between chunks here
(the server is S3, not the caller's); each read is bounded by the read timeout.
"""

from __future__ import annotations

import logging

from llava.errors import ImageFetchFailed, ImageSourceNotAllowed, InvalidRequest

from .limits import Deadline, read_capped, too_large
from .policy import S3_BUCKET, IntakePolicy

logger = logging.getLogger(__name__)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` → (bucket, key); the key is taken verbatim (it may hold ? and #)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not S3_BUCKET.match(bucket) or not key:
        raise InvalidRequest(f"image s3 must look like s3://bucket/key, got {uri[:120]!r}")
    if len(key.encode()) > 1024:
        raise InvalidRequest("image s3 key is longer than S3's 1024-byte limit")
    return bucket, key


def fetch_s3(uri: str, policy: IntakePolicy) -> bytes:
    bucket, key = parse_s3_uri(uri)
    if not policy.s3_buckets:
        raise ImageSourceNotAllowed(
            "s3:// images are off: intake.s3_buckets is empty; list the bucket (or "
            "bucket/prefix) there to permit it"
        )
    if not policy.s3_permits(bucket, key):
        raise ImageSourceNotAllowed(
            f"this key of bucket {bucket} is under no intake.s3_buckets entry; add the "
            "bucket (or bucket/prefix) there to permit it"
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
    """``error``: a botocore ClientError. One answer whatever S3 said: missing and denied
    objects must look alike to the caller."""
    code = error.response.get("Error", {}).get("Code", "unknown")
    logger.warning("s3 image %s: S3 error %s", uri, code)
    return ImageFetchFailed(
        f"cannot fetch {uri}: it does not exist or the server may not read it; check the key "
        "and that the server's role has s3:GetObject on it"
    )
